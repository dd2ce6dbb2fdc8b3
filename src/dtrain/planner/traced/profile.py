"""What a model costs before any layout: its parameters, and the memory one micro-batch
needs with each choice of activation recomputation, traced on fake tensors.

The planner never allocates the model. It builds it under `FakeTensorMode` (tensors with
shapes and dtypes but no data), runs one forward and backward of a micro-batch, and
counts live bytes op by op (dtrain.planner.traced.tracker), with the same kernels a CPU run would
pick. It does so once per recomputation mode (`[memory] recompute`:
"none", "selective", "full"), with dtrain.models.recompute applied to the traced model as
dtrain.layouts would apply it. For dtrain's GPT and Llama (any model cut by `Stages`,
built from a `[model]` section) the trace is of a 2-block model; the figures per block
carry over to any depth (`Activations`, one per mode):

- `embed`: activations the embedding leaves for backward;
- `block`: those one transformer block leaves (its output included);
- `head`: those of the final norm, the head and the loss (the logits, mostly);
- `peak_extra`: how far backward rises above what forward left, at its peak (with
  recomputation: a recomputed block's activations, made again); `head_extra` the same
  before backward reaches the last block (the logits' gradients), `tail_extra` after;
- `block_extra`: the same for one block alone (a pipeline stage without the head).

Each is an `Activation`: bytes every tensor-parallel rank holds whole, bytes split across
tp ranks (attention heads, the MLP's hidden layer, the vocabulary's logits), and bytes
sequence parallelism divides over tp (norms, dropouts, residuals), told apart by where
they are made (dtrain.planner.traced.trace). The extras are `Peak`s, a few such: every moment no
other exceeds in every kind, since which moment is highest depends on how tp and
sequence parallelism divide the kinds.

The profile also lists the parameter tensors (`ParamTensor`: of the input part, of one
block, of the output part), which say what a rank draws at once while a layout builds it
(dtrain.planner.traced.construction).

A mixture-of-experts Llama is traced with every traced block a MoE block: its parameter
tensors are the real ones (every expert, whole on each tp rank as dtrain keeps them; the
routed experts' stacked tensors are marked `expert` and counted apart, in
`Params.experts`, since ep divides them and not the rest), its activations those of a
dense stand-in whose MLP is as wide as the k routed experts and the shared ones a token
passes through (the routing's token counts depend on the data, which fake tensors do not
have). So a model whose MoE blocks are not all of them is counted as if they were, and the
router's and the dispatch's tensors are left out.

Under context parallelism (cp ranks splitting every sequence, dtrain.context_parallel)
every rank runs the whole model on its 2 of the sequence's 2 x cp chunks, so the profile
of a cp layout is traced on a rank's `block_size / cp` tokens of each sequence, with the
method's attention (`Profile.cp`, `Profile.cp_method`) over a group whose messages move
nothing (dtrain.planner.traced.context): every activation, from the embedding to the
logits, is a rank's own, and so are the other ranks' keys and values the method holds and
the ring's scores, block by block.

A user's model (`module:factory`) is traced whole: the planner then offers data-parallel
layouts (dp, ZeRO) only, since tensor and pipeline parallelism need a plan and pieces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from dtrain.adapters import AdapterConfig, built
from dtrain.context_parallel.chunks import check_length
from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig
from dtrain.models.custom import load_factory
from dtrain.models.gpt import GPTConfig
from dtrain.models.llama import llama_ffn_hidden
from dtrain.planner.planned import RECOMPUTE
from dtrain.planner.shape import ModelShape
from dtrain.planner.traced.context import traced_context
from dtrain.planner.traced.trace import SEQ, Marks, watch

TRACED_BLOCKS = 2


@dataclass(frozen=True)
class Activation:
    """Bytes of one micro-batch's tensors: held whole on every tp rank, split over tp, or
    whole unless sequence parallelism divides them over tp (`seq`)."""

    whole: int = 0
    split: int = 0
    seq: int = 0

    def per_rank(self, tp: int, sequence_parallel: bool = False) -> float:
        return self.whole + self.split / tp + (self.seq / tp if sequence_parallel else self.seq)

    def __add__(self, other: Activation) -> Activation:
        return Activation(*(a + b for a, b in zip(self.fields(), other.fields(), strict=True)))

    def __sub__(self, other: Activation) -> Activation:
        return Activation(*(a - b for a, b in zip(self.fields(), other.fields(), strict=True)))

    def __mul__(self, k: float) -> Activation:
        return Activation(*(int(a * k) for a in self.fields()))

    def fields(self) -> tuple[int, int, int]:
        return self.whole, self.split, self.seq


@dataclass(frozen=True)
class Peak:
    """The most a stretch of the trace holds: the moments no other one exceeds in every
    kind, since which is highest depends on how tp and sequence parallelism divide them."""

    points: tuple[Activation, ...] = (Activation(),)

    def per_rank(self, tp: int, sequence_parallel: bool = False) -> float:
        return max(p.per_rank(tp, sequence_parallel) for p in self.points)

    def __sub__(self, other: Activation) -> Peak:
        return Peak(tuple(p - other for p in self.points))


@dataclass(frozen=True)
class Activations:
    """One micro-batch's activation figures with one recomputation mode (module doc)."""

    embed: Activation
    block: Activation
    head: Activation
    peak_extra: Peak
    block_extra: Peak
    head_extra: Peak = Peak()
    tail_extra: Peak = Peak()


@dataclass(frozen=True)
class Params:
    """Parameter elements: what tp divides (`split`), what every tp rank keeps (`whole`),
    and the routed experts of MoE blocks (`experts`), whole on every tp rank and divided
    by ep (dtrain.models.moe.Experts)."""

    whole: int = 0
    split: int = 0
    experts: int = 0

    @property
    def total(self) -> int:
        return self.whole + self.split + self.experts

    def per_rank(self, tp: int, ep: int = 1) -> float:
        """Elements a rank holds at tensor-parallel degree `tp` and expert-parallel `ep`."""
        return self.whole + self.split / tp + self.experts / ep

    def __add__(self, other: Params) -> Params:
        return Params(self.whole + other.whole, self.split + other.split,
                      self.experts + other.experts)

    def __mul__(self, k: int) -> Params:
        return Params(self.whole * k, self.split * k, self.experts * k)


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: its part ("embed", "block": one block's, "head"), elements,
    elements per row (dimension 0), whether tp divides it, whether it is the input
    part's, shared with the output part (a tied head), whether it stacks a MoE layer's
    routed experts (`expert`: ep divides it along dimension 0), and whether it trains (a
    LoRA run's frozen base does not: no gradient, no optimizer state)."""

    part: str
    numel: int
    row: int
    split: bool
    tied: bool = False
    expert: bool = False
    trained: bool = True

    def per_rank(self, tp: int, ep: int = 1) -> float:
        """Elements a rank holds of this tensor at degrees `tp` and `ep`."""
        return self.numel / (tp if self.split else 1) / (ep if self.expert else 1)


@dataclass(frozen=True)
class Profile:
    """A model's parameters and one micro-batch's activation memory per recomputation mode
    (see the module doc).

    `shape` is the model's (dtrain.planner.shape), `tied` the elements of the weights the
    first and last pipeline stage share (a tied head). `cp` is the context-parallel degree
    traced, attending by `cp_method`: each sequence's `seq_len / cp` tokens a rank holds
    (`width` is theirs).

    For a user's model (`shape` None) the whole model counts as its embedding:
    `params_embed` and each mode's `embed` hold everything, the block and head figures are
    zero and `n_layer` is 0; it has the modes its model allows.
    """

    name: str
    micro_batch: int
    seq_len: int
    width: int  # bytes of one stage-to-stage activation of one sequence (a rank's tokens)
    params_embed: Params  # the first stage's input part (token, position embeddings)
    params_block: Params
    params_head: Params  # the last stage's output part, less what it shares with the first
    modes: dict[str, Activations]
    tensors: tuple[ParamTensor, ...] = ()
    shape: ModelShape | None = None
    tied: int = 0
    replicated_block: int = 0  # parameter tensors per block that tp keeps whole
    cp: int = 1
    cp_method: str = "ring"
    reference: bool = False  # DPO: a reference forward, without gradient, per micro-batch
    base_bytes: int = 4  # bytes of a frozen parameter (LoRA's base_dtype = "bfloat16": 2)

    @property
    def n_layer(self) -> int:
        return self.shape.layers if self.shape else 0

    @property
    def params(self) -> Params:
        return self.params_embed + self.params_block * self.n_layer + self.params_head

    def trained(self, part: str) -> Params:
        """The parameters of `part` ("embed", "block": one block's, "head") that train:
        all of them but a frozen base's (LoRA)."""
        if all(t.trained for t in self.tensors):
            return {"embed": self.params_embed, "block": self.params_block,
                    "head": self.params_head}[part]
        return _params(tuple(t for t in self.tensors if t.trained), part)

    @property
    def trained_share(self) -> float:
        """The share of the block's matrices' elements that train (1 without adapters):
        backward computes weight gradients for them alone."""
        block = self.params_block.total
        return self.trained("block").total / block if block else 1.0

    def activations(self, recompute: str = "none") -> Activations:
        """The figures with `recompute` ("none", "selective", "full").

        Raises:
            ConfigError: the model has nothing that mode recomputes.
        """
        if recompute not in self.modes:
            raise ConfigError(f"{self.name}: recompute = {recompute!r} recomputes "
                              f"nothing of this model: plan {', '.join(self.modes)}")
        return self.modes[recompute]

    def tp_degrees(self, devices: int) -> list[int]:
        """Tensor-parallel degrees this model can use on `devices` (dividing the heads and
        the vocabulary)."""
        if self.shape is None:
            return [1]
        counts = (self.shape.heads, self.shape.kv_heads, self.shape.vocab)
        return [t for t in range(1, devices + 1)
                if devices % t == 0 and all(c % t == 0 for c in counts)]

    def sequence_parallel(self, tp: int, cp: int = 1) -> bool:
        """Whether sequence parallelism can run at `tp` and context-parallel degree `cp`
        (dtrain's GPT and Llama without experts or MTP modules, a rank's tokens of each
        sequence dividing by tp)."""
        return tp > 1 and self.shape is not None and not self.shape.experts and \
            not self.shape.mtp_depth and (self.shape.seq // cp) % tp == 0

    def context_degrees(self, devices: int) -> list[int]:
        """Context-parallel degrees for `devices` ranks: 1, and each cp > 1 dividing them
        with the sequence cutting into 2 x cp chunks (dtrain's GPT and Llama without
        dropout, as the config allows)."""
        if self.shape is None or self.shape.dropout:
            return [1]
        return [c for c in range(1, devices + 1)
                if devices % c == 0 and (c == 1 or self.shape.seq % (2 * c) == 0)]

    def context_methods(self, tp: int, cp: int, methods: tuple[str, ...]) -> list[str]:
        """Those of `methods` (dtrain.context_parallel.METHODS) a layout of degrees `tp`
        and `cp` > 1 can run: "alltoall" splits each rank's query and key/value heads over
        cp."""
        shape = self.shape
        heads = (shape.heads // tp, shape.kv_heads // tp) if shape is not None else (0,)
        return [m for m in methods if m != "alltoall" or all(h % cp == 0 for h in heads)]

    def expert_degrees(self, dp: int) -> list[int]:
        """Expert-parallel degrees a layout of `dp` data-parallel ranks can take (those
        dividing dp and the experts; 1 alone for a model without experts)."""
        return self.shape.expert_degrees(dp) if self.shape is not None else [1]


def _param_tensors(model: nn.Module, styles: dict) -> tuple[ParamTensor, ...]:
    """The parameter tensors of a model cut by `Stages` (one block's), by part; tp divides
    a colwise layer's weight and bias, a rowwise layer's weight, and an embedding's rows;
    ep the stacked tensors of a MoE layer's `Experts`."""
    from dtrain.models.moe import Experts
    from dtrain.tensor_parallel.parallelize import Colwise, Rowwise, Vocab

    inputs, blocks, outputs = model.stage_parts()
    parts = [("embed", n) for n in inputs] + [("block", f"{blocks}.0")] + \
        [("head", n) for n in outputs]
    first = {id(p) for n in inputs for p in model.get_submodule(n).parameters()}
    found = []
    for part, prefix in parts:
        for name, p in model.get_submodule(prefix).named_parameters():
            owner, _, kind = f"{prefix}.{name}".rpartition(".")
            style = styles.get(owner)
            split = isinstance(style, Colwise) or (isinstance(style, Vocab | Rowwise)
                                                   and kind == "weight")
            expert = isinstance(model.get_submodule(owner), Experts)
            found.append(ParamTensor(part, p.numel(), p.numel() // max(p.shape[0], 1)
                                     if p.dim() else 1, split, part == "head" and id(p) in first,
                                     expert, p.requires_grad))
    return tuple(found)


def _params(tensors: tuple[ParamTensor, ...], part: str) -> Params:
    mine = [t for t in tensors if t.part == part and not t.tied]
    return Params(sum(t.numel for t in mine if not t.split and not t.expert),
                  sum(t.numel for t in mine if t.split),
                  sum(t.numel for t in mine if t.expert))


def _trace_stages(cfg: ModelConfig, b: int, mode: str, cp: int = 1,
                  cp_method: str = "ring") -> Activations:
    """One micro-batch of `cfg`'s model (2 blocks) forward and backward, with `mode`'s
    recomputation; then one block alone. With `cp` > 1, a context-parallel rank's: its
    tokens of each sequence, attending by `cp_method`. Call it under FakeTensorMode."""
    from dtrain import models
    from dtrain.models import context, recompute
    from dtrain.tensor_parallel.parallelize import matches
    from dtrain.tensor_parallel.plan_of import plan_of

    model = models.build(cfg)
    if cp > 1:
        context.apply(model, traced_context(cp, cp_method))
    inputs, blocks_name, _ = model.stage_parts()
    blocks = model.get_submodule(blocks_name)
    for p in model.parameters():  # gradients are model state, counted by the layout
        p.grad = torch.zeros_like(p)
    state = [t for p in model.parameters() for t in (p, p.grad)]
    marks = Marks(held=state)
    watch(model, dict(matches(model, plan_of(model))), marks, model.get_submodule(inputs[-1]))
    recompute.recompute_mode(model, mode)
    blocks[0].register_forward_pre_hook(lambda *_: marks.mark("embed"))
    for i, block in enumerate(blocks):
        block.register_forward_hook(lambda *_, i=i: marks.mark(f"block{i}"))
    tail: list[int] = []  # where backward reaches the last block
    blocks[-1].register_full_backward_pre_hook(lambda *_: tail.append(len(marks.tracker.series)))
    s = cfg.block_size // cp
    x = torch.randint(0, cfg.vocab_size, (b, s))
    with marks.tracker:
        loss = model(x, x)[1]  # the logits go, as in training
        marks.mark("forward")
        start = marks.start_backward()
        loss.backward()
    at = {k: Activation(*v) for k, v in marks.at.items()}
    peak_extra = _peak(marks.peaks_since(start)) - at["forward"]
    head_extra = _peak(marks.peaks_since(start, tail[0])) - at["forward"]
    tail_extra = _peak(marks.peaks_since(tail[0])) - at["forward"]

    h = torch.randn(b, s, cfg.n_embd, requires_grad=True)
    marks.restart(SEQ, state)
    with marks.tracker:
        out = model.stage_block(blocks[0], h)
        marks.mark("forward")
        start = marks.start_backward()
        out.backward(torch.ones_like(out))
    block_extra = _peak(marks.peaks_since(start)) - Activation(*marks.at["forward"])
    last = f"block{TRACED_BLOCKS - 1}"
    return Activations(embed=at["embed"], block=at[last] - at[f"block{TRACED_BLOCKS - 2}"],
                       head=at["forward"] - at[last], peak_extra=peak_extra,
                       block_extra=block_extra, head_extra=head_extra, tail_extra=tail_extra)


def _peak(points: list[tuple[int, ...]]) -> Peak:
    return Peak(tuple(Activation(*p) for p in points))


def model_config(cfg: GPTConfig | ModelConfig) -> ModelConfig:
    """The `[model]` section of a GPTConfig (a ModelConfig as it is)."""
    if isinstance(cfg, ModelConfig):
        return cfg
    return ModelConfig(arch="gpt", vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                       n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                       dropout=cfg.dropout)


def profile_gpt(cfg: GPTConfig, micro_batch: int, modes: tuple[str, ...] = RECOMPUTE,
                cp: int = 1, cp_method: str = "ring") -> Profile:
    """Trace dtrain's GPT (2 blocks stand for all) on one micro-batch of full sequences
    (a cp rank's share of them: `profile_model`)."""
    return profile_model(model_config(cfg), micro_batch, modes, cp, cp_method)


def profile_model(cfg: ModelConfig, micro_batch: int, modes: tuple[str, ...] = RECOMPUTE,
                  cp: int = 1, cp_method: str = "ring", adapter: AdapterConfig | None = None,
                  reference: bool = False) -> Profile:
    """Trace the built-in model of a resolved `[model]` section (arch gpt or llama; 2
    blocks stand for all) on one micro-batch of full sequences, once per recomputation
    mode in `modes`; with `cp` > 1, of a context-parallel rank's `block_size / cp` tokens
    of each, attending by `cp_method` (see the module doc). With `adapter`'s LoRA, the
    base is frozen (its parameters counted without gradients or optimizer state; the
    adapters counted whole on every tp rank, a slight overcount); `reference`: DPO's
    reference forward runs beside each micro-batch's (its time; its activations are
    not kept).

    Raises:
        ConfigError: another arch (trace it with `profile_factory`); a sequence that does
            not cut into 2 x cp chunks, a model with dropout under cp, heads "alltoall"
            cannot split over cp.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtrain.tensor_parallel.parallelize import matches
    from dtrain.tensor_parallel.plan_of import plan_of

    if cfg.arch not in ("gpt", "llama"):
        raise ConfigError(f"the planner traces dtrain's GPT and Llama, not model.arch = "
                          f"{cfg.arch!r}: plan another model with --model MODULE:FACTORY")
    check_length(cfg.block_size, cp, "model.block_size")
    if cp > 1 and cfg.dropout:
        raise ConfigError(f"cp = {cp} with model.dropout = {cfg.dropout}: attention dropout "
                          "is not split over the chunks; set model.dropout = 0")
    traced = dataclasses.replace(cfg, n_layer=TRACED_BLOCKS,
                                 moe_layers="all" if cfg.n_experts else cfg.moe_layers)
    with FakeTensorMode():
        model = built(traced, adapter or AdapterConfig())
        tensors = _param_tensors(model, dict(matches(model, plan_of(model))))
        figures = {mode: _trace_stages(_dense_stand_in(traced), micro_batch, mode, cp,
                                       cp_method) for mode in modes}
    kv = f", {cfg.n_kv_head} kv" if cfg.arch == "llama" and cfg.n_kv_head else ""
    lora = f", LoRA rank {adapter.rank}" if adapter is not None and adapter.kind == "lora" \
        else ""
    return Profile(
        name=f"{'GPT' if cfg.arch == 'gpt' else 'Llama'} {cfg.n_layer}x{cfg.n_embd} "
             f"({cfg.n_head} heads{kv}, vocab {cfg.vocab_size}{lora})"
             f"{', DPO' if reference else ''}",
        micro_batch=micro_batch, seq_len=cfg.block_size,
        width=cfg.block_size // cp * cfg.n_embd * 4,
        params_embed=_params(tensors, "embed"), params_block=_params(tensors, "block"),
        params_head=_params(tensors, "head"), modes=figures, tensors=tensors,
        shape=ModelShape.of(cfg), tied=sum(t.numel for t in tensors if t.tied),
        replicated_block=sum(1 for t in tensors if t.part == "block" and not t.split), cp=cp,
        cp_method=cp_method, reference=reference,
        base_bytes=2 if adapter is not None and adapter.kind == "lora"
        and adapter.base_dtype == "bfloat16" else 4,
    )


def _dense_stand_in(cfg: ModelConfig) -> ModelConfig:
    """`cfg` itself, or for a mixture of experts the dense Llama whose MLP is as wide as
    what one token passes through: its k routed experts and the shared ones (see the
    module doc)."""
    if not cfg.n_experts:
        return cfg
    dense = cfg.ffn_hidden or llama_ffn_hidden(cfg.n_embd)
    width = (cfg.experts_per_token + cfg.n_shared_experts) * (cfg.moe_inter_size or dense)
    return dataclasses.replace(cfg, n_experts=0, ffn_hidden=width, moe_inter_size=0,
                               n_shared_experts=0)


def profile_factory(spec: str, micro_batch: int, modes: tuple[str, ...] = RECOMPUTE) -> Profile:
    """Trace a user's model: `factory()` returns (model, inputs for a batch of one); the
    forward returns a loss, or outputs whose floating-point sum stands for one. Each mode
    of `modes` the model allows is traced (dtrain.models.recompute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtrain.models import recompute

    factory = load_factory(spec, f"--model {spec!r}")
    figures: dict[str, Activations] = {}
    with FakeTensorMode():
        for mode in modes:
            try:
                model, inputs = factory()
            except Exception as exc:  # the user's code: say whose
                raise ConfigError(f"--model {spec}: the factory failed: {exc}") from None
            if not isinstance(model, nn.Module) or not isinstance(inputs, tuple):
                raise ConfigError(f"--model {spec}: the factory must return (nn.Module, tuple "
                                  "of inputs for one sample)")
            try:
                recompute.recompute_mode(model, mode)
            except ConfigError:
                continue  # nothing this mode recomputes: not offered
            figures[mode] = _trace_whole(model, inputs, micro_batch)
        params = [p for p in model.parameters() if p.requires_grad]
    tensors = tuple(ParamTensor("embed", p.numel(), p.numel() // max(p.shape[0], 1)
                                if p.dim() else 1, False) for p in params)
    return Profile(name=f"{spec} ({type(model).__name__})", micro_batch=micro_batch,
                   seq_len=0, width=0, params_embed=Params(sum(t.numel for t in tensors), 0),
                   params_block=Params(), params_head=Params(), modes=figures, tensors=tensors)


def _trace_whole(model: nn.Module, inputs: tuple, micro_batch: int) -> Activations:
    """A user's model forward and backward on `micro_batch` copies of `inputs`."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    batch = tuple(t.repeat(micro_batch, *[1] * (t.dim() - 1))
                  if isinstance(t, torch.Tensor) and t.dim() else t for t in inputs)
    marks = Marks(held=[t for p in model.parameters() for t in (p, p.grad)])
    with marks.tracker:
        out = model(*batch)
        marks.mark("forward")
        start = marks.start_backward()
        leaves = [t for t in torch.utils._pytree.tree_flatten(out)[0]
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        sum(t.float().sum() for t in leaves).backward()
    forward = Activation(*marks.at["forward"])
    return Activations(embed=forward, block=Activation(), head=Activation(),
                       peak_extra=_peak(marks.peaks_since(start)) - forward, block_extra=Peak())
