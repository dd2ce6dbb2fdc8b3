"""Models built in split form: parameters on the meta device, values only where held.

    model = skeleton(lambda: build(cfg))   # no parameter memory: shapes, names, ties
    initial = Initial(model, seed=1337)    # every parameter's initial values, by name
    # dtrain.layouts splits and shards the skeleton, allocates what this rank holds, then
    held.restore(initial)                  # each rank computes only its own slices

An initial value is a function of (seed, parameter name) alone, never of the layout: each
parameter's whole tensor is drawn in groups of rows of at most `CHUNK` elements, each group
from its own generator keyed by (seed, name, group). A rank holding a tensor-parallel
block, a ZeRO shard or a pipeline stage computes just the groups covering its slice (a
column block: every group, one at a time), so construction needs its share of the model
plus one group, and one process and any layout start from the same weights.

How a parameter is drawn (`Init`) comes from the model:

| model                 | Linear / Embedding weights      | everything else                  |
|-----------------------|---------------------------------|----------------------------------|
| dtrain's GPT, Llama   | normal(0, 0.02)                 | biases 0, norm weights 1         |
| Hugging Face          | normal(0, initializer_range)    | its own `_init_weights` (whole)  |
| custom                | torch's defaults, or the model's `init_rules()`; else the     |
|                       | owning module's `reset_parameters()` (whole)                    |

A module with an `init_rule(pname)` method says how its own parameters are drawn, in any
model (a LoRA adapter's A and B: dtrain.adapters.lora).

A "whole" rule builds the owning module alone on the CPU, seeded by its name, and keeps
the values: exact but not chunked (norms and biases, small).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.moe import Experts, Router
from dtrain.models.weights import SlicedWeights

if TYPE_CHECKING:
    from dtrain.checkpoint.universal import Checkpoint

CHUNK = 1 << 20
"""Elements per generator group (at least one row)."""


@dataclass(frozen=True)
class Init:
    """How one parameter's whole tensor is drawn.

    kind: "normal" (mean `a`, std `b`), "uniform" (between `a` and `b`), "constant"
    (every element `a`), or "module" (`fill(module)` initializes a copy of the owning
    module, seeded by the parameter's name; the tensor is then taken whole).
    zero_row: a row set to zero after drawing (an embedding's padding index).
    """

    kind: str
    a: float = 0.0
    b: float = 0.0
    zero_row: int | None = None
    fill: Callable[[nn.Module], None] | None = None


def normal(std: float, zero_row: int | None = None) -> Init:
    return Init("normal", 0.0, std, zero_row)


def constant(value: float) -> Init:
    return Init("constant", value)


# ------------------------------------------------------------------ the skeleton
def skeleton(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()`'s model with every parameter on the meta device: shapes, names and ties,
    no memory. Built under `torch.device("meta")`; a model whose buffers then lack values
    (rotary frequencies a Hugging Face model computes once, a mask) is built again with
    only its parameters moved to the meta device as they are registered (each allocated
    for that moment only; torch's layers allocate without touching the memory)."""
    model = on_meta(build)
    if not any(b.is_meta for b in model.buffers()):
        return model
    with _parameters_on_meta():
        return build()


_INITIALIZERS = {
    *(getattr(nn.init, name) for name in ("normal_", "uniform_", "trunc_normal_", "constant_",
                                          "ones_", "zeros_", "xavier_normal_", "xavier_uniform_",
                                          "kaiming_normal_", "kaiming_uniform_", "orthogonal_",
                                          "eye_", "dirac_", "sparse_")),
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_,
}
"""Functions that only write values into a tensor they return: on a meta tensor, nothing."""


class _NoValuesOnMeta(torch.overrides.TorchFunctionMode):
    """Skips the initializers of meta tensors while a skeleton is built: they would write
    no values anyway, and some (normal_) reach torch's reference kernels on the meta device,
    whose first call imports the compiler (torch._dynamo): seconds of every rank's start."""

    def __torch_function__(self, func: Callable, types: tuple[type, ...], args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _INITIALIZERS:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` under `torch.device("meta")`: every tensor it makes on the meta device
    (buffers too), no memory, no initializer run."""
    with torch.device("meta"), _NoValuesOnMeta():
        return build()


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def is_skeleton(model: nn.Module) -> bool:
    """Whether any of `model`'s parameters are on the meta device (values not yet made)."""
    return any(p.is_meta for p in model.parameters())


def allocate(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Give `module`'s meta parameters uninitialized memory on `device` (the parameter
    objects stay the same, so tied parameters stay tied) and move its buffers there;
    returns `module`. Hooks registered on a meta parameter do not follow it (its tensor is
    swapped): register them after."""
    allocate_parameters(module.parameters(), device)
    return allocate_buffers(module, device)


def allocate_parameters(params: Iterable[nn.Parameter], device: torch.device | str) -> None:
    """Give those of `params` on the meta device uninitialized memory on `device`, each
    swapped in place (the parameter objects stay the same: ties and ids hold)."""
    for p in params:
        if p.is_meta:
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device),
                                                     requires_grad=p.requires_grad))


def allocate_buffers(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Move `module`'s buffers to `device` (values kept), parameters untouched."""
    for m in module.modules():
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and b.device != torch.device(device):
                setattr(m, name, b.to(device))
    return module


# ------------------------------------------------------------------ rules per model
def _owner(model: nn.Module, name: str) -> tuple[str, nn.Module, str]:
    path, _, pname = name.rpartition(".")
    return path, model.get_submodule(path) if path else model, pname


def _whole(init: Callable[[nn.Module], None]) -> Init:
    return Init("module", fill=init)


def _reset(module: nn.Module) -> None:
    module.reset_parameters()


def _torch_default(module: nn.Module, pname: str) -> Init | None:
    """torch's own initialization of its common layers, drawn in chunks."""
    if isinstance(module, nn.Linear):
        bound = 1 / math.sqrt(module.in_features) if module.in_features else 0.0
        return Init("uniform", -bound, bound)
    if isinstance(module, nn.Embedding) and pname == "weight":
        return Init("normal", 0.0, 1.0, module.padding_idx)
    return None


def _norm(module: nn.Module, pname: str) -> Init | None:
    if "Norm" in type(module).__name__ and pname in ("weight", "bias"):
        return constant(1.0 if pname == "weight" else 0.0)
    return None


def _gpt_like(module: nn.Module, pname: str) -> Init:
    """dtrain's GPT and Llama: normal(0, 0.02) weights (a MoE layer's router and experts
    too), zero biases (the router's balancing bias too), unit norms."""
    if isinstance(module, (nn.Linear, nn.Embedding, Router)) and pname == "weight":
        return normal(0.02)
    if isinstance(module, Experts):
        return normal(0.02)
    return _norm(module, pname) or constant(0.0)


def _hf_rule(hf: nn.Module) -> Callable[[nn.Module, str], Init]:
    config = hf.config
    std = getattr(config, "initializer_range", None) or 0.02

    def rule(module: nn.Module, pname: str) -> Init:
        if isinstance(module, nn.Linear) and pname == "weight":
            return normal(std)
        if isinstance(module, (Router, Experts)):  # a swapped sparse block: as theirs draws it
            return constant(0.0) if pname == "expert_bias" else normal(std)
        if isinstance(module, nn.Embedding) and pname == "weight":
            return normal(std, module.padding_idx)
        return _whole(hf._init_weights)

    return rule


def _custom_rule(module: nn.Module, pname: str) -> Init:
    rule = _torch_default(module, pname) or _norm(module, pname)
    if rule is not None:
        return rule
    if callable(getattr(module, "reset_parameters", None)):
        return _whole(_reset)
    raise ConfigError(f"{type(module).__name__}.{pname} has no known initialization to build "
                      "it in split form: give the module a reset_parameters() or the model "
                      "an init_rules() returning {parameter name: dtrain.models.init.Init}")


def init_rules(model: nn.Module) -> dict[str, Init]:
    """How each parameter of `model` (by its name in `named_parameters()`, tied ones
    once) is drawn; see the module docstring.

    Raises:
        ConfigError: a custom model's parameter has no known initialization.
    """
    from dtrain.models.gpt import GPT
    from dtrain.models.hf import HFCausalLM
    from dtrain.models.llama import Llama

    given = model.init_rules() if callable(getattr(model, "init_rules", None)) else {}
    if isinstance(model, (GPT, Llama)):
        rule = _gpt_like
    elif isinstance(model, HFCausalLM):
        rule = _hf_rule(model.hf)
    else:
        rule = _custom_rule
    rules = {}
    for name, _ in model.named_parameters():
        _, module, pname = _owner(model, name)
        own = module.init_rule(pname) if callable(getattr(module, "init_rule", None)) else None
        if name in given:
            rules[name] = given[name]
        elif own is not None:  # a module that says how it is drawn (an adapter)
            rules[name] = own
        else:
            rules[name] = rule(module, pname)
    return rules


# ------------------------------------------------------------------ the values
def _key(seed: int, name: str, group: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{group}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Initial(SlicedWeights):
    """The initial values of `model`'s parameters for `seed`, read the way a checkpoint is
    (names `model/` + the parameter's), computed on demand and only as far as asked:
    `tensor` (whole), `block` (a tensor-parallel block), `rows` (a ZeRO span). No
    optimizer state.

    Raises:
        ConfigError: a custom model's parameter has no known initialization.
    """

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.seed = seed
        self.path = f"initial weights (seed {seed})"
        self.rules = init_rules(model)
        params = dict(model.named_parameters())
        self.shapes = {n: tuple(p.shape) for n, p in params.items()}
        self.dtypes = {n: p.dtype for n, p in params.items()}
        # Copies of the modules a "module" rule builds, taken now, on the meta device: the
        # model's own will hold a layout's views (ZeRO-3's released storage) by restore time.
        self.owners = {n: (_owner(model, n)[2], copy.deepcopy(_owner(model, n)[1]))
                       for n, r in self.rules.items() if r.kind == "module"}
        self._last: tuple[str, torch.Tensor] | None = None

    def _names(self) -> list[str]:
        return list(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.plain(name)]

    def _dtype(self, name: str) -> torch.dtype:
        return self.dtypes[self.plain(name)]

    def _rows_per_read(self, name: str) -> int:
        """Rows of one generator group of `name` (at least one)."""
        shape = self.shapes[self.plain(name)]
        return max(1, CHUNK // max(1, math.prod(shape[1:])))

    def _groups(self, name: str, rows: slice) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, values) of each part of `rows` of `name`, one generator group at a
        time: views of the group, which is let go once the caller moves on."""
        rule, shape = self.rules[name], self.shapes[name]
        per_group = self._rows_per_read(name)
        first, last, _ = rows.indices(shape[0])
        for group in range(first // per_group, (last - 1) // per_group + 1 if last > first else 0):
            lo = group * per_group
            values = self._group(name, rule, group, lo, min(lo + per_group, shape[0]))
            yield max(first, lo), values[max(first, lo) - lo : min(last, lo + per_group) - lo]
            del values  # before the next group is drawn

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        name = self.plain(name)
        rule, shape = self.rules[name], self.shapes[name]
        if rule.kind == "module" or not shape:
            return self._module_value(name)[index] if shape else self._module_value(name)
        first, last, _ = index[0].indices(shape[0])
        per_group = self._rows_per_read(name)
        if last > first and first // per_group == (last - 1) // per_group:
            (_, values), = self._groups(name, index[0])  # within one group: a view of it
            return values[(slice(None), *index[1:])]
        out = torch.empty(torch.empty(shape, device="meta")[index].shape,
                          dtype=self.dtypes[name])
        self._read_into(out, name, index)
        return out

    def _read_into(self, out: torch.Tensor, name: str, index: tuple[slice, ...]) -> None:
        name = self.plain(name)
        if self.rules[name].kind == "module" or not self.shapes[name]:
            out.copy_(self._read(name, index))
            return
        first = index[0].indices(self.shapes[name][0])[0]
        for at, values in self._groups(name, index[0]):
            out[at - first : at - first + len(values)].copy_(values[(slice(None), *index[1:])])
            del values  # before the next group is drawn

    def _group(self, name: str, rule: Init, group: int, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi of `name`'s whole tensor: group `group` of its draw."""
        shape = (hi - lo, *self.shapes[name][1:])
        out = torch.empty(shape, dtype=torch.float32)
        generator = torch.Generator().manual_seed(_key(self.seed, name, group))
        if rule.kind == "normal":
            out.normal_(rule.a, rule.b, generator=generator)
        elif rule.kind == "uniform":
            out.uniform_(rule.a, rule.b, generator=generator)
        else:
            out.fill_(rule.a)
        if rule.zero_row is not None and lo <= rule.zero_row < hi:
            out[rule.zero_row - lo] = 0
        return out.to(self.dtypes[name])

    def _module_value(self, name: str) -> torch.Tensor:
        """The whole tensor, from a copy of its owning module built alone on the CPU."""
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        pname, module = self.owners[name]
        alone = copy.deepcopy(module).to_empty(device="cpu", recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_key(self.seed, name, 0))
            self.rules[name].fill(alone)
        value = getattr(alone, pname).detach()
        self._last = (name, value)
        return value


def materialized(model: nn.Module, weights: Checkpoint | SlicedWeights,
                 device: torch.device | str = "cpu") -> nn.Module:
    """`model` (a skeleton) whole on `device` with the values of `weights` (`Initial`, a
    checkpoint, Hugging Face weights): what one process trains."""
    from dtrain.checkpoint.universal import MODEL

    allocate(model, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.tensor(MODEL + name))
    return model
