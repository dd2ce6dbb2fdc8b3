"""`parallelize(model, plan, group)`: swap a model's layers for tensor-parallel ones in place.

A plan maps module-name patterns to a style; `*` stands for any run of characters within
one dotted component (`blocks.*.mlp.fc` names the fc of every block, not of nested ones):

    "colwise"     nn.Linear -> ColumnParallelLinear   (or Colwise(chunks=3, heads=12) for QKV)
    "rowwise"     nn.Linear -> RowParallelLinear      (or Rowwise(input_is_parallel=False))
    "vocab"       nn.Embedding -> VocabParallelEmbedding
    "vocab_loss"  nn.CrossEntropyLoss -> VocabParallelCrossEntropy (after a colwise head)
    "headwise"    a module applied to each head with weights all heads share (Qwen3's
                  per-head q_norm and k_norm): whole on every rank, its gradients summed
    "shared"      nn.Identity -> SharedAcrossGroup: an activation every rank's heads read
                  whole (latent attention's rotary key part), its gradient summed

A headwise module's gradient on a rank comes from that rank's heads only; a hook sums it
over the group as backward reaches it (`sum_headwise_grads`: parallelize hooks the
parameters it finds allocated; a model built in split form is hooked once allocated).

Each new layer receives this rank's block of the original weights, so the parallelized
model computes the same function. Parameters shared between layers (tied embeddings) stay
shared when both are split the same way. Everything else stays replicated; the tensor-parallel
group's first rank broadcasts the whole model first, so replicas start identical. A frozen
parameter stays frozen, and a LoRA-adapted layer's adapter is split with it
(dtrain.tensor_parallel.adapted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from dtrain import comm
from dtrain.adapters.lora import LoRALinear
from dtrain.data_parallel.agreement import broadcast_state
from dtrain.errors import ConfigError
from dtrain.split import Split
from dtrain.tensor_parallel.adapted import split_adapter
from dtrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SharedAcrossGroup,
    VocabParallelEmbedding,
)
from dtrain.tensor_parallel.loss import VocabParallelCrossEntropy
from dtrain.tensor_parallel.summed import SumOverGroup

_M = TypeVar("_M", bound=nn.Module)


def _expect(name: str, module: nn.Module, kind: type[_M], style: str) -> _M:
    """`module`, which must be a `kind`."""
    if not isinstance(module, kind):
        raise ConfigError(f"plan: {name} is {type(module).__name__}, but {style!r} applies to "
                          f"{kind.__name__}")
    return module


def _refuse(name: str, style: str, what: str) -> None:
    raise ConfigError(f"plan: {name} uses {what}, which {style!r} does not support")


@dataclass(frozen=True)
class Colwise:
    """Split an nn.Linear's output features.

    `chunks`: the output is that many fused parts (3 for a QKV projection), each split on
    its own. `heads`: each part is that many attention heads, which must not be cut.
    `gather_output`: return the whole output instead of this rank's block.
    """

    gather_output: bool = False
    chunks: int = 1
    heads: int = 0

    def build(self, name: str, module: nn.Module, group: comm.Group,
              algorithm: str) -> nn.Module:
        module = _expect(name, module, nn.Linear, "colwise")
        if self.heads and self.heads % group.size:
            raise ConfigError(f"tp={group.size} does not divide the {self.heads} attention heads "
                              f"of {name}: choose a tensor-parallel degree that divides "
                              f"{self.heads}")
        return ColumnParallelLinear(module.in_features, module.out_features,
                                    bias=module.bias is not None,
                                    gather_output=self.gather_output, group=group,
                                    chunks=self.chunks, algorithm=algorithm,
                                    device=module.weight.device, dtype=module.weight.dtype)


@dataclass(frozen=True)
class Rowwise:
    """Split an nn.Linear's input features; `input_is_parallel=False` splits a whole input."""

    input_is_parallel: bool = True

    def build(self, name: str, module: nn.Module, group: comm.Group,
              algorithm: str) -> nn.Module:
        module = _expect(name, module, nn.Linear, "rowwise")
        return RowParallelLinear(module.in_features, module.out_features,
                                 bias=module.bias is not None,
                                 input_is_parallel=self.input_is_parallel, group=group,
                                 algorithm=algorithm, device=module.weight.device,
                                 dtype=module.weight.dtype)


@dataclass(frozen=True)
class Vocab:
    """Split an nn.Embedding's rows (the vocabulary)."""

    def build(self, name: str, module: nn.Module, group: comm.Group,
              algorithm: str) -> nn.Module:
        module = _expect(name, module, nn.Embedding, "vocab")
        if module.max_norm is not None or module.sparse:
            _refuse(name, "vocab", "max_norm or sparse gradients")
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim,
                                      padding_idx=module.padding_idx, group=group,
                                      algorithm=algorithm, device=module.weight.device,
                                      dtype=module.weight.dtype)


@dataclass(frozen=True)
class Headwise:
    """Keep a module whole on every rank of a module applied to each attention head with
    weights every head shares (Qwen3's q_norm and k_norm): each rank applies it to its own
    heads, so its gradients are summed over the group (the module's `headwise` hook)."""

    def build(self, name: str, module: nn.Module, group: comm.Group,
              algorithm: str) -> nn.Module:
        # a plain attribute of the module (its gradient hook), not a submodule
        module.headwise = SumOverGroup(group, algorithm)  # type: ignore[assignment]
        return module


@dataclass(frozen=True)
class Shared:
    """Replace an nn.Identity marking an activation every rank's heads read whole (latent
    attention's `share_rope`) by a SharedAcrossGroup, which sums its gradient over the
    group."""

    def build(self, name: str, module: nn.Module, group: comm.Group,
              algorithm: str) -> nn.Module:
        _expect(name, module, nn.Identity, "shared")
        return SharedAcrossGroup(group, algorithm)


def sum_headwise_grads(model: nn.Module) -> None:
    """Hook the allocated parameters of `model`'s headwise modules so that their gradients
    are summed over the tensor-parallel group: parallelize does it for parameters that
    have memory; a model built in split form (dtrain.models.init) needs it once allocated
    (dtrain.layouts calls it), as allocation makes new tensors that have no hooks."""
    for module in model.modules():
        hook = getattr(module, "headwise", None)
        if isinstance(hook, SumOverGroup):
            for p in module.parameters():
                if p.requires_grad and not p.is_meta:
                    p.register_hook(hook)


@dataclass(frozen=True)
class VocabLoss:
    """Replace nn.CrossEntropyLoss by the vocab-parallel loss (logits split by a colwise
    head whose output is not gathered)."""

    def build(self, name: str, module: nn.Module, group: comm.Group,
              algorithm: str) -> nn.Module:
        module = _expect(name, module, nn.CrossEntropyLoss, "vocab_loss")
        if module.weight is not None or module.label_smoothing:
            _refuse(name, "vocab_loss", "class weights or label smoothing")
        return VocabParallelCrossEntropy(group, module.ignore_index, module.reduction,
                                         algorithm)


Style = Colwise | Rowwise | Vocab | VocabLoss | Headwise | Shared
STYLES: dict[str, Style] = {"colwise": Colwise(), "rowwise": Rowwise(), "vocab": Vocab(),
                            "vocab_loss": VocabLoss(), "headwise": Headwise(),
                            "shared": Shared()}


def _style(pattern: str, value: Style | str) -> Style:
    if isinstance(value, str):
        if value not in STYLES:
            raise ConfigError(f"plan: {pattern!r}: unknown style {value!r}; use one of "
                              f"{', '.join(STYLES)}")
        return STYLES[value]
    if not isinstance(value, Style):
        raise ConfigError(f"plan: {pattern!r}: {value!r} is not a style")
    return value


def matches(model: nn.Module, plan: dict[str, Style | str]) -> list[tuple[str, Style]]:
    """(module name, style) for every module a pattern names; each pattern names one at least."""
    names = [name for name, _ in model.named_modules() if name]
    chosen: dict[str, str] = {}
    for pattern in plan:
        regex = re.compile(re.escape(pattern).replace(r"\*", "[^.]*"))
        hits = [n for n in names if regex.fullmatch(n)]
        if not hits:
            raise ConfigError(f"plan: {pattern!r} matches no module of "
                              f"{type(model).__name__}")
        for name in hits:
            if name in chosen:
                raise ConfigError(f"plan: {name} is matched by both {chosen[name]!r} and "
                                  f"{pattern!r}")
            chosen[name] = pattern
    return [(name, _style(pattern, plan[pattern])) for name, pattern in chosen.items()]


def _build(name: str, old: nn.Module, style: Style, group: comm.Group,
           algorithm: str) -> nn.Module:
    try:
        new = style.build(name, old, group, algorithm)
    except ConfigError as exc:
        if name in str(exc):
            raise
        raise ConfigError(f"{name}: {exc}") from None
    return split_adapter(new, old, group, algorithm) if isinstance(old, LoRALinear) else new


@torch.no_grad()
def parallelize(model: nn.Module, plan: dict[str, Style | str], group: comm.GroupLike = None,
                algorithm: str = "auto") -> nn.Module:
    """Replace the modules `plan` names by tensor-parallel ones holding this rank's blocks.

    Args:
        model: the whole model, built the same way on every rank of `group`.
        plan: module-name pattern -> style ("colwise", "rowwise", "vocab", "vocab_loss",
            or a Colwise/Rowwise/Vocab/VocabLoss with options).
        group: the tensor-parallel group (`mesh.group("tp")`); default the world.
        algorithm: the dtrain.comm algorithm of the layers' collectives.

    Returns `model`, changed in place. Every rank of `group` must call it.

    Raises:
        ConfigError: a pattern matches nothing or a module of the wrong kind, or the group
            size does not divide a layer's features, heads or vocabulary.
    """
    g = comm.resolve(group)
    targets = matches(model, plan)
    for name, style in targets:  # every error before any communication
        _build(name, model.get_submodule(name), style, g, algorithm)
    if g.size > 1:
        broadcast_state(model, g, algorithm)
    shared: dict[int, tuple[Split, nn.Parameter, str, torch.Tensor]] = {}
    for name, style in targets:
        old = model.get_submodule(name)
        new = _build(name, old, style, g, algorithm)
        for pname, param in list(new.named_parameters()):  # an adapter's A and B too
            whole = old.get_parameter(pname)
            param.requires_grad_(whole.requires_grad)  # a frozen base stays frozen
            within, _, leaf = pname.rpartition(".")
            owner = new.get_submodule(within)
            splits = getattr(owner, "splits", {})
            if leaf not in splits:  # replicated (a row-parallel bias)
                param.copy_(whole)
                continue
            split = splits[leaf]
            if id(whole) in shared:
                first_split, kept, first, _ = shared[id(whole)]
                if first_split != split:
                    raise ConfigError(f"plan: {name}.{pname} is tied to {first} but split "
                                      "differently; give both the same style")
                setattr(owner, leaf, kept)
                continue
            param.copy_(split.shard(whole, g.rank, g.size))
            shared[id(whole)] = (split, param, f"{name}.{pname}", whole)  # whole: keeps ids unique
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in shared:
            raise ConfigError(f"plan: {name} is tied to {shared[id(param)][2]}, which the plan "
                              f"splits: add {name.rpartition('.')[0]} to the plan")
    if g.size > 1:
        sum_headwise_grads(model)
    return model
