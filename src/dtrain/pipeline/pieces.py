"""A language model cut into pipeline pieces by its blocks (dtrain.models.Stages).

A piece holds the model's own submodules under their own dotted names (`blocks.3` stays
`blocks.3`, `hf.model.layers.5` stays `hf.model.layers.5`), so a piece's state_dict is a
slice of the model's. The first piece also holds the input part (embeddings), the last the
output part (final norm, head). A weight the two share (a head tied to the token
embedding) is named by `tied_weights` (on one rank, the V placement's first, given a twin
in the output part), so the Pipeline sums its gradients there as autograd does for one
shared weight. Under a chunked loss (dtrain.models.chunked_loss) the last piece hands
the loss its final hidden states, not its logits (`hidden_for_loss`). A loss the blocks
compute on the way (a mixture of experts' load balancing) is added by each piece for its own
blocks (`extra_loss_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import torch
from torch import nn

from dtrain import comm
from dtrain.errors import ConfigError
from dtrain.models.chunked_loss import ChunkableLM, chunked_loss
from dtrain.models.moe import moe_layers
from dtrain.models.stages import Stages
from dtrain.pipeline.partition import balanced_sizes, stage_sizes

Tie = tuple[nn.Parameter, "int | nn.Parameter"]
"""A tied parameter and where its other holder is: a rank of the pipeline group, or on
this rank (the V placement holds both ends) the parameter it is a twin of."""


def _place(root: nn.Module, dotted: str, module: nn.Module) -> None:
    """Put `module` at `dotted` inside `root`, making plain containers on the way."""
    *path, leaf = dotted.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    root.add_module(leaf, module)


class Ahead(NamedTuple):
    """What the last piece of a model predicting ahead (multi-token prediction) needs of a
    micro-batch besides its hidden states: its token ids, its next-token targets, and its
    loss's weight (`dtrain.models.rows.weighted`; None: the micro-batches' mean, which the
    pipeline applies after)."""

    tokens: torch.Tensor
    targets: torch.Tensor
    weight: float | None


class Piece(nn.Module):
    """Consecutive blocks of a model, with its input part (first piece) or output part
    (last piece); runs them through the model's own `stage_*` methods."""

    def __init__(self, model: Stages, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        inputs, blocks_name, outputs = model.stage_parts()
        for name in (inputs if first else []) + (outputs if last else []):
            _place(self, name, model.get_submodule(name))
        every = model.get_submodule(blocks_name)
        self.held_blocks = [every[i] for i in blocks]
        _place(self, blocks_name, nn.ModuleDict({str(i): every[i] for i in blocks}))
        self._model = (model,)  # a tuple: the whole model is not a submodule of the piece
        self.ahead_loss: torch.Tensor | None = None
        """The last forward's loss of predictions ahead (given `ahead`), else None."""

    @property
    def hidden_for_loss(self) -> bool:
        """Whether this is the last piece of a model whose loss is computed chunk by chunk
        from the final hidden states (dtrain.models.chunked_loss): the pipeline asks it
        for those (`forward(hidden=True)`) and `loss_of` applies the head."""
        return self.last and bool(getattr(self._model[0], "loss_chunk", 0))

    @property
    def predicts_ahead(self) -> bool:
        """Whether this is the last piece of a model with multi-token prediction
        (`StagedLM.predicts_ahead`): the pipeline gives it the micro-batch's token ids and
        targets (`forward(ahead=...)`) and adds `ahead_loss` to its loss."""
        return self.last and bool(getattr(self._model[0], "predicts_ahead", False))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                hidden: bool = False, ahead: Ahead | None = None) -> torch.Tensor:
        """The piece's stages on `x` (token ids into the first piece, hidden states into
        the others); `positions`: the micro-batch's packed documents, which every piece's
        blocks need (dtrain.models.rows); `hidden`: the last piece returns the final
        hidden states (after the output norm) instead of the logits, for a chunked loss;
        `ahead`: the last piece of a model predicting ahead also computes that loss, kept
        in `ahead_loss` (inside the forward, where a wrapper holds the parameters: ZeRO-3).

        Raises:
            ConfigError: packed documents for a model that cannot take them.
        """
        model = self._model[0]
        use = getattr(model, "use_documents", None)
        if use is not None:
            use(positions)
        elif positions is not None:
            raise ConfigError(f"{type(model).__name__} takes no packed documents: give it "
                              "use_documents(positions), or use data.packing = \"stream\"")
        if self.first:
            x = model.stage_in(x)
        for block in self.held_blocks:
            x = model.stage_block(block, x)
        if not self.last:
            return x
        self.ahead_loss = None
        if ahead is not None and self.training:
            self.ahead_loss = model.ahead_loss(ahead.tokens, x, ahead.targets, ahead.weight)
        if hidden:
            return cast(ChunkableLM, model).final_hidden(x)
        return model.stage_out(x)


def _blocks(model: nn.Module) -> nn.ModuleList:
    if not isinstance(model, Stages):
        raise ConfigError(f"{type(model).__name__} does not say how to cut it into pipeline "
                          "stages: give it stage_parts, stage_in, stage_block and stage_out "
                          "(dtrain.models.Stages)")
    return model.get_submodule(model.stage_parts()[1])


def cut(model: nn.Module, parts: int, balance: str | Sequence[int] = "params") -> list[Piece]:
    """Cut `model` into `parts` pieces of consecutive blocks (pp x virtual stages).

    `balance`: "params" (the blocks' parameters), "auto" (the parameters of the input
    part counted on the first stage and of the output part on the last too: a
    vocabulary-sized embedding and head weigh as the blocks they outweigh, so those stages
    take fewer blocks), "time" or explicit sizes (dtrain.pipeline.partition.stage_sizes).

    Raises:
        ConfigError: the model is not a `Stages`, more pieces than blocks, or explicit
            sizes that do not fit.
    """
    blocks = list(_blocks(model))
    if balance == "auto":
        inputs, _, outputs = model.stage_parts()

        def params(names: Sequence[str], skip: set[int]) -> float:
            return float(sum(p.numel() for n in names for p in model.get_submodule(n)
                             .parameters() if id(p) not in skip))

        first = params(inputs, set())
        tied = {id(p) for n in inputs for p in model.get_submodule(n).parameters()}
        costs = [float(sum(p.numel() for p in b.parameters())) for b in blocks]
        sizes = balanced_sizes(costs, parts, first, params(outputs, tied if parts == 1
                                                           else set()))
    else:
        sizes = stage_sizes(blocks, parts, balance)
    pieces, start = [], 0
    for i, size in enumerate(sizes):
        pieces.append(Piece(model, range(start, start + size), i == 0, i == parts - 1))
        start += size
    return pieces


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the last piece's output."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def piece_in(wrapper: nn.Module) -> Piece | None:
    """The Piece `wrapper` is, or holds as `.module` (DataParallel, ZeRO), at any depth;
    None if none."""
    while not isinstance(wrapper, Piece):
        inner = getattr(wrapper, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        wrapper = inner
    return wrapper


def hidden_for_loss(piece: nn.Module) -> bool:
    """Whether `piece` (a Piece, or a wrapper holding one) is a last piece that gives the
    loss its final hidden states (`Piece.hidden_for_loss`)."""
    found = piece_in(piece)
    return found is not None and found.hidden_for_loss


def loss_of(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of `model` as it computes it (its `loss_fn` module, vocab-parallel once
    tensor parallelism has replaced it), for the last piece's output: its logits, or
    under the chunked loss (`model.loss_chunk`, dtrain.models.chunked_loss) its final
    hidden states, which the loss takes through the head chunk by chunk; `lm_loss` for a
    model without one."""
    if getattr(model, "loss_chunk", 0):
        return lambda hidden, targets: chunked_loss(model, hidden, targets)
    loss_fn = getattr(model, "loss_fn", None)
    if loss_fn is None:
        return lm_loss

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return loss


ExtraLoss = Callable[[int], torch.Tensor | None]
"""Chunk -> the share of the model's extra loss its piece's blocks computed in their last
forward (None: none)."""


def extra_loss_of(model: nn.Module, mine: Sequence[nn.Module]) -> ExtraLoss | None:
    """What each of this rank's pieces `mine` (by chunk) adds to the loss of `model` on
    the way: its MoE layers' share of the model's load-balancing loss
    (dtrain.models.moe.aux_loss, the mean over all the model's MoE layers, so a piece's
    share is the sum of its layers' over their total). None when the model has no MoE
    layer."""
    layers = len(moe_layers(model))
    if not layers:
        return None

    def share(chunk: int) -> torch.Tensor | None:
        losses = [m.aux_loss for m in moe_layers(mine[chunk]) if m.aux_loss is not None]
        return torch.stack(losses).sum() / layers if losses else None

    return share


def tied_weights(model: nn.Module, mine: Sequence[Piece], group: comm.GroupLike = None
                 ) -> list[Tie]:
    """The pairs for `Pipeline(tied=...)`: each parameter both the input part (first stage)
    and the output part (last stage) hold, with the other holder's rank when those are
    different ranks. When this rank holds both (the V placement puts stages 0 and 2pp-1
    on rank 0) the output part gets a twin of each such parameter, an equal copy of its
    own (its pieces are then trained by wrappers of their own, each holding its
    parameters), paired with the original: the Pipeline sums their gradients as autograd
    would sum the shared one's, and their updates stay bitwise equal."""
    g = comm.resolve(group)
    if g.size == 1:
        return []
    inputs, _, outputs = model.stage_parts()
    ids_in = {id(p): p for n in inputs for p in model.get_submodule(n).parameters()}
    shared = [p for n in outputs for p in model.get_submodule(n).parameters() if id(p) in ids_in]
    first, last = any(p.first for p in mine), any(p.last for p in mine)
    if first and last:
        return [(_twin(model, outputs, p), p) for p in shared]
    pairs: list[Tie] = []
    if first:
        pairs += [(p, g.size - 1) for p in shared]
    if last:
        pairs += [(p, 0) for p in shared]
    return pairs


def counted_elsewhere(tied: Sequence[Tie], rank: int) -> set[int]:
    """Ids of the tied parameters whose gradient another holder counts (and whose value
    it writes): the copy on the later stage, a later rank's or a twin on `rank`."""
    return {id(p) for p, peer in tied if isinstance(peer, nn.Parameter) or peer < rank}


def twins(tied: Sequence[Tie]) -> dict[int, nn.Parameter]:
    """id of each twin -> the parameter it copies (see `tied_weights`)."""
    return {id(p): peer for p, peer in tied if isinstance(peer, nn.Parameter)}


def _twin(model: nn.Module, parts: Sequence[str], param: nn.Parameter) -> nn.Parameter:
    """A copy of `param` put in its place wherever the modules `parts` of `model` hold it."""
    twin = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
    for part in parts:
        for module in model.get_submodule(part).modules():
            for name, held in list(module.named_parameters(recurse=False)):
                if held is param:
                    setattr(module, name, twin)
    return twin
