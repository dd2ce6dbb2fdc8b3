"""What a model costs before any layout: its parameters, and the memory one micro-batch
needs, traced on fake tensors.

The planner never allocates the model. It builds it under `FakeTensorMode` (tensors with
shapes and dtypes but no data), runs one forward and backward of a micro-batch, and
counts live bytes op by op (dtrain.planner.tracker), with the same kernels a CPU run would
pick. For dtrain's GPT and Llama (any model cut by `Stages`, built from a `[model]`
section) the trace is of a 2-block model; the figures per block carry over to any depth:

- `embed`: activations the embedding leaves for backward;
- `block`: those one transformer block leaves (its output included);
- `head`: those of the final norm, the head and the loss (the logits, mostly);
- `peak_extra`: how far backward rises above what forward left, at its peak;
- `block_extra`: the same for one block alone (a pipeline stage without the head).

Each is an `Activation`: bytes every tensor-parallel rank holds whole, and bytes split
across tp ranks (attention heads, the MLP's hidden layer, the vocabulary's logits), told
apart by where they are made: from a column-parallel layer to the next row-parallel one.

A user's model (`module:factory`) is traced whole: the planner then offers data-parallel
layouts (dp, ZeRO) only, since tensor and pipeline parallelism need a plan and pieces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig
from dtrain.models.custom import load_factory
from dtrain.models.gpt import GPTConfig
from dtrain.planner.tracker import LiveBytes

TRACED_BLOCKS = 2


@dataclass(frozen=True)
class Activation:
    """Bytes of one micro-batch's tensors: held whole on every tp rank, or split over tp."""

    whole: int = 0
    split: int = 0

    def per_rank(self, tp: int) -> float:
        return self.whole + self.split / tp

    def __add__(self, other: Activation) -> Activation:
        return Activation(self.whole + other.whole, self.split + other.split)

    def __sub__(self, other: Activation) -> Activation:
        return Activation(self.whole - other.whole, self.split - other.split)

    def __mul__(self, k: float) -> Activation:
        return Activation(int(self.whole * k), int(self.split * k))


@dataclass(frozen=True)
class Params:
    """Parameter elements, split into what tp divides and what every tp rank keeps."""

    whole: int = 0
    split: int = 0

    @property
    def total(self) -> int:
        return self.whole + self.split

    def per_rank(self, tp: int) -> float:
        return self.whole + self.split / tp

    def __add__(self, other: Params) -> Params:
        return Params(self.whole + other.whole, self.split + other.split)

    def __mul__(self, k: int) -> Params:
        return Params(self.whole * k, self.split * k)


@dataclass(frozen=True)
class Shape:
    """What the estimates need of a language model beyond its traced figures."""

    n_layer: int
    n_embd: int
    vocab_size: int
    seq_len: int
    heads: tuple[int, ...]  # head counts tp must divide (query heads, key/value heads)
    tied: int  # elements of the weights the first and last stage share (a tied head)


@dataclass(frozen=True)
class Profile:
    """A model's parameters and one micro-batch's activation memory (see the module doc).

    For a user's model (`shape` None) the whole model counts as its embedding:
    `params_embed` and `embed` hold everything, the block and head figures are zero and
    `n_layer` is 0.
    """

    name: str
    micro_batch: int
    seq_len: int
    width: int  # bytes of one stage-to-stage activation of one sequence position
    params_embed: Params  # the first stage's input part (token, position embeddings)
    params_block: Params
    params_head: Params  # the last stage's output part, less what it shares with the first
    embed: Activation
    block: Activation
    head: Activation
    peak_extra: Activation
    block_extra: Activation
    shape: Shape | None = None

    @property
    def n_layer(self) -> int:
        return self.shape.n_layer if self.shape else 0

    @property
    def tied(self) -> int:
        """Elements of the weights the first and last pipeline stage share (a tied head)."""
        return self.shape.tied if self.shape else 0

    @property
    def params(self) -> Params:
        return self.params_embed + self.params_block * self.n_layer + self.params_head

    def tp_degrees(self, devices: int) -> list[int]:
        """Tensor-parallel degrees this model can use on `devices` (dividing the heads and
        the vocabulary)."""
        if self.shape is None:
            return [1]
        counts = (*self.shape.heads, self.shape.vocab_size)
        return [t for t in range(1, devices + 1)
                if devices % t == 0 and all(c % t == 0 for c in counts)]


def _count(module: nn.Module, prefix: str, styles: dict, skip: set[int]) -> Params:
    """Parameter elements of `module` (named from `prefix`), less those in `skip`; tp
    divides a colwise layer's weight and bias, a rowwise layer's weight, and an
    embedding's rows."""
    from dtrain.tensor_parallel.parallelize import Colwise, Rowwise, Vocab

    whole = split = 0
    for name, p in module.named_parameters():
        if id(p) in skip:
            continue
        owner, _, kind = f"{prefix}{name}".rpartition(".")
        style = styles.get(owner)
        divided = (isinstance(style, Colwise) or (isinstance(style, Vocab | Rowwise)
                                                  and kind == "weight"))
        split += p.numel() if divided else 0
        whole += 0 if divided else p.numel()
    return Params(whole, split)


def _stage_params(model: nn.Module, styles: dict) -> tuple[Params, Params, Params, int]:
    """(input part, one block, output part less what it shares with the input part,
    elements shared) of a model cut by `Stages`."""
    inputs, blocks, outputs = model.stage_parts()
    first = [model.get_submodule(n) for n in inputs]
    seen = {id(p) for m in first for p in m.parameters()}
    embed = sum((_count(m, f"{n}.", styles, set()) for n, m in zip(inputs, first, strict=True)),
                Params())
    tied = sum(p.numel() for n in outputs for p in model.get_submodule(n).parameters()
               if id(p) in seen)
    head = sum((_count(model.get_submodule(n), f"{n}.", styles, seen) for n in outputs),
               Params())
    block = _count(model.get_submodule(blocks)[0], f"{blocks}.0.", styles, set())
    return embed, block, head, tied


class _Marks:
    """Which kind new tensors are (split over tp or not), and the bytes at named moments."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Count afresh (a second trace on the same hooks)."""
        self.split = False
        self.tracker = LiveBytes(split=lambda _: self.split)
        self.at: dict[str, Activation] = {}

    def now(self) -> Activation:
        other, split = self.tracker.series[-1] if self.tracker.series else (0, 0)
        return Activation(other, split)

    def mark(self, name: str) -> None:
        self.at[name] = self.now()

    def peak_since(self, start: int) -> Activation:
        other, split = max(self.tracker.series[start:], key=sum)
        return Activation(other, split)

    def setter(self, value: bool):
        def hook(*_):
            self.split = value
        return hook


def _watch_tp_regions(model: nn.Module, styles: dict, marks: _Marks) -> None:
    """Forward: a colwise layer starts a split region, a rowwise layer ends it. Backward
    runs the other way: a rowwise layer's input gradient is split, a colwise one's whole."""
    from dtrain.tensor_parallel.parallelize import Colwise, Rowwise

    for name, module in model.named_modules():
        style = styles.get(name)
        if isinstance(style, Colwise | Rowwise):
            starts = isinstance(style, Colwise)
            module.register_forward_pre_hook(marks.setter(starts))
            module.register_full_backward_pre_hook(marks.setter(not starts))


def profile_gpt(cfg: GPTConfig, micro_batch: int) -> Profile:
    """Trace dtrain's GPT (2 blocks stand for all) on one micro-batch of full sequences."""
    return profile_model(ModelConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                                     n_layer=cfg.n_layer, n_head=cfg.n_head,
                                     n_embd=cfg.n_embd, dropout=cfg.dropout), micro_batch)


def profile_model(cfg: ModelConfig, micro_batch: int) -> Profile:
    """Trace the built-in model of a resolved `[model]` section (arch gpt or llama; 2
    blocks stand for all) on one micro-batch of full sequences.

    Raises:
        ConfigError: another arch (trace it with `profile_factory`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtrain import models
    from dtrain.tensor_parallel.parallelize import matches
    from dtrain.tensor_parallel.plan_of import plan_of

    if cfg.arch not in ("gpt", "llama"):
        raise ConfigError(f"the planner traces dtrain's GPT and Llama, not model.arch = "
                          f"{cfg.arch!r}: plan another model with --model MODULE:FACTORY")
    b, s = micro_batch, cfg.block_size
    with FakeTensorMode():
        model = models.build(dataclasses.replace(cfg, n_layer=TRACED_BLOCKS))
        styles = dict(matches(model, plan_of(model)))
        embed_p, block_p, head_p, tied = _stage_params(model, styles)
        blocks = model.get_submodule(model.stage_parts()[1])
        for p in model.parameters():  # gradients are model state, counted by the layout
            p.grad = torch.zeros_like(p)
        x = torch.randint(0, cfg.vocab_size, (b, s))
        marks = _Marks()
        _watch_tp_regions(model, styles, marks)
        blocks[0].register_forward_pre_hook(lambda *_: marks.mark("embed"))
        for i, block in enumerate(blocks):
            block.register_forward_hook(lambda *_, i=i: marks.mark(f"block{i}"))
        with marks.tracker:
            loss = model(x, x)[1]  # the logits go, as in training
            marks.mark("forward")
            end = len(marks.tracker.series)
            loss.backward()
        at, last = marks.at, f"block{TRACED_BLOCKS - 1}"
        peak_extra = marks.peak_since(end) - at["forward"]

        h = torch.randn(b, s, cfg.n_embd, requires_grad=True)
        marks.restart()
        with marks.tracker:
            out = model.stage_block(blocks[0], h)
            marks.mark("forward")
            end = len(marks.tracker.series)
            out.backward(torch.ones_like(out))
        block_extra = marks.peak_since(end) - marks.at["forward"]
    kv = f", {cfg.n_kv_head} kv" if cfg.arch == "llama" and cfg.n_kv_head else ""
    return Profile(
        name=f"{'GPT' if cfg.arch == 'gpt' else 'Llama'} {cfg.n_layer}x{cfg.n_embd} "
             f"({cfg.n_head} heads{kv}, vocab {cfg.vocab_size})",
        micro_batch=b, seq_len=s, width=s * cfg.n_embd * 4,
        params_embed=embed_p, params_block=block_p, params_head=head_p,
        embed=at["embed"], block=at[last] - at[f"block{TRACED_BLOCKS - 2}"],
        head=at["forward"] - at[last], peak_extra=peak_extra, block_extra=block_extra,
        shape=Shape(cfg.n_layer, cfg.n_embd, cfg.vocab_size, s,
                    (cfg.n_head, cfg.n_kv_head or cfg.n_head), tied),
    )


def profile_factory(spec: str, micro_batch: int) -> Profile:
    """Trace a user's model: `factory()` returns (model, inputs for a batch of one); the
    forward returns a loss, or outputs whose floating-point sum stands for one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    factory = load_factory(spec, f"--model {spec!r}")
    with FakeTensorMode():
        try:
            model, inputs = factory()
        except Exception as exc:  # the user's code: say whose
            raise ConfigError(f"--model {spec}: the factory failed: {exc}") from None
        if not isinstance(model, nn.Module) or not isinstance(inputs, tuple):
            raise ConfigError(f"--model {spec}: the factory must return (nn.Module, tuple of "
                              "inputs for one sample)")
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        batch = tuple(t.repeat(micro_batch, *[1] * (t.dim() - 1))
                      if isinstance(t, torch.Tensor) and t.dim() else t for t in inputs)
        marks = _Marks()
        with marks.tracker:
            out = model(*batch)
            marks.mark("forward")
            end = len(marks.tracker.series)
            leaves = [t for t in torch.utils._pytree.tree_flatten(out)[0]
                      if isinstance(t, torch.Tensor) and t.is_floating_point()]
            sum(t.float().sum() for t in leaves).backward()
        peak_extra = marks.peak_since(end) - marks.at["forward"]
    return Profile(name=f"{spec} ({type(model).__name__})", micro_batch=micro_batch,
                   seq_len=0, width=0, params_embed=Params(params, 0),
                   params_block=Params(), params_head=Params(), embed=marks.at["forward"],
                   block=Activation(), head=Activation(), peak_extra=peak_extra,
                   block_extra=Activation())
