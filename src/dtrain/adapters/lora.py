"""LoRA: low-rank adapters beside a frozen model's linear layers (Hu et al., 2021).

    names = apply(model, AdapterConfig(kind="lora", rank=8, alpha=16))

An adapted nn.Linear computes W x + b + B A dropout(x) * alpha / rank, with A (rank x in)
and B (out x rank) its only trained tensors; W and b, and every other parameter of the
model, are frozen (requires_grad False: no gradient, no optimizer state). B starts at
zero, so the adapted model starts as its base. The layer stays the same object under the
same name (its class becomes `LoRALinear`): its weight keeps its name, the adapters are
its submodules `lora_A` and `lora_B`, as PEFT names them (`...q_proj.lora_A.weight`), and
a model built in split form (dtrain.models.init) draws A and B by their own rules.

Default targets (`[adapter] targets` empty), by architecture: the attention's and the
MLP's projections, not the embeddings or the output head (PEFT's choice for Llama; for
DeepSeek-V3's latent attention, the projections PEFT recipes name for DeepseekV3):

| arch           | layers                                                    |
|----------------|-----------------------------------------------------------|
| llama          | q_proj, k_proj, v_proj, o_proj, gate, up, down; latent    |
|                | attention's q_a_proj, q_b_proj (q_proj without a query    |
|                | bottleneck), kv_a_proj_with_mqa, kv_b_proj, o_proj        |
| gpt            | qkv, proj (attention's and MLP's), fc                     |
| hf             | q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,       |
|                | down_proj (Llama family); q_a_proj, q_b_proj,             |
|                | kv_a_proj_with_mqa, kv_b_proj and the shared experts      |
|                | (DeepSeek-V3: dtrain's MoE layer in its blocks, its       |
|                | `shared.gate`, `shared.up`, `shared.down`); c_attn,       |
|                | c_proj, c_fc (GPT-2)                                      |

A mixture of experts' shared experts are a SwiGLU MLP of nn.Linear layers, adapted as a
dense MLP is (dtrain's Llama: `mlp.shared.gate`, `.up`, `.down`, matched by gate, up,
down). Its routed experts are grouped tensors, not nn.Linear layers, and its router a
weight of its own: both stay frozen and unadapted. A multi-token prediction module's
block (`mtp.depths.*.block`) is a block like the others and adapted alike; its eh_proj
is not.

Under tensor parallelism (dtrain.tensor_parallel.adapted) an adapter is split with its
layer; the latent projections q_a_proj and kv_a_proj_with_mqa stay whole on every tp
rank (dtrain.tensor_parallel.latent_attention_plan), and so do their adapters: the
gradients reaching them are already summed over tp by the up-projections (under
sequence parallelism, with the other replicated parameters' at the end of backward).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.adapters.config import AdapterConfig
from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig
from dtrain.models.init import Init, constant

LATENT_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
"""Latent attention's projections beside q_proj and o_proj, named as in transformers'
DeepseekV3Attention and dtrain.models.mla."""
HF_SHARED_EXPERTS = tuple(f"hf.model.layers.*.mlp.shared.{name}" for name in ("gate", "up",
                                                                               "down"))
"""A transformers DeepSeek-V3's shared experts, once dtrain's MoE layer holds them
(dtrain.models.hf swaps each sparse block for it): its SwiGLU's gate, up and down."""
DEFAULTS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", *LATENT_ATTENTION, "gate", "up",
              "down"),
    "gpt": ("qkv", "proj", "fc"),
    "hf": ("q_proj", "k_proj", "v_proj", "o_proj", *LATENT_ATTENTION, "gate_proj", "up_proj",
           "down_proj", *HF_SHARED_EXPERTS, "c_attn", "c_proj", "c_fc"),
}


def default_targets(arch: str) -> tuple[str, ...]:
    """The layers adapted when `[adapter] targets` is empty.

    Raises:
        ConfigError: a custom model, which has no defaults.
    """
    if arch not in DEFAULTS:
        raise ConfigError(f"model.arch = {arch!r} has no default adapter targets: list the "
                          "layers in [adapter] targets")
    return DEFAULTS[arch]


class LoRAFactor(nn.Linear):
    """A or B of an adapter: a bias-free nn.Linear that says how it is drawn."""

    rule: Init

    @classmethod
    def drawn(cls, fan_in: int, fan_out: int, rule: Init, device: torch.device,
              dtype: torch.dtype) -> LoRAFactor:
        """A factor of `fan_out` x `fan_in` drawn by `rule` (left empty on the meta device,
        where dtrain.models.init draws it by name)."""
        factor = cls(fan_in, fan_out, bias=False, device=device, dtype=dtype)
        factor.rule = rule
        if device.type != "meta":
            factor.reset_parameters()
        return factor

    def init_rule(self, pname: str) -> Init | None:
        """Its weight's initial values (dtrain.models.init reads it)."""
        return self.rule if pname == "weight" else None

    def reset_parameters(self) -> None:
        rule = getattr(self, "rule", None)
        if rule is None:  # nn.Linear's constructor, before the rule is set
            return
        with torch.no_grad():
            if rule.kind == "constant":
                self.weight.fill_(rule.a)
            elif rule.kind == "uniform":
                self.weight.uniform_(rule.a, rule.b)
            else:
                self.weight.normal_(rule.a, rule.b)


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank adapter (see the module doc); made by `adapt`."""

    lora_A: LoRAFactor
    lora_B: LoRAFactor
    lora_dropout: nn.Module
    scaling: float
    active: bool = True
    """False inside `disabled`: the layer computes its base alone."""

    @classmethod
    def adapt(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
              init: str = "kaiming", name: str = "") -> LoRALinear:
        """`linear` itself, adapted in place: frozen, with A and B beside it.

        Raises:
            ConfigError: a rank above the layer's smaller side.
        """
        fan_in, fan_out = linear.in_features, linear.out_features
        if rank > min(fan_in, fan_out):
            raise ConfigError(f"adapter.rank = {rank} is above the size of {name or 'a layer'} "
                              f"({fan_out} x {fan_in}): choose a rank of at most "
                              f"{min(fan_in, fan_out)}")
        down = (Init("uniform", -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
                if init == "kaiming" else Init("normal", 0.0, 1 / rank))
        device, dtype = linear.weight.device, linear.weight.dtype
        linear.__class__ = cls
        adapted: LoRALinear = linear  # type: ignore[assignment]  # its class, now
        adapted.lora_A = LoRAFactor.drawn(fan_in, rank, down, device, dtype)
        adapted.lora_B = LoRAFactor.drawn(rank, fan_out, constant(0.0), device, dtype)
        adapted.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        adapted.scaling = alpha / rank
        for p in (adapted.weight, adapted.bias):
            if p is not None:
                p.requires_grad_(False)
        return adapted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.active:
            return out
        return out + adapted(self, x)

    def delta(self) -> torch.Tensor:
        """B A * scaling: what merging adds to the weight."""
        return self.lora_B.weight @ self.lora_A.weight * self.scaling


class Adapted(Protocol):
    """A layer with a LoRA adapter beside it (LoRALinear, and the tensor-parallel ones of
    dtrain.tensor_parallel.adapted)."""

    lora_A: LoRAFactor
    lora_B: LoRAFactor
    lora_dropout: nn.Module
    scaling: float


def adapted(layer: Adapted, x: torch.Tensor) -> torch.Tensor:
    """B A dropout(x) * alpha / rank: what the adapter adds to its layer's output."""
    return layer.lora_B(layer.lora_A(layer.lora_dropout(x))) * layer.scaling


def _regex(pattern: str) -> re.Pattern[str]:
    if "." not in pattern and "*" not in pattern:  # a layer's own name, anywhere
        return re.compile(rf"(?:.*\.)?{re.escape(pattern)}")
    return re.compile(".".join("[^.]+" if p == "*" else re.escape(p)
                               for p in pattern.split(".")))


def apply(model: nn.Module, cfg: AdapterConfig, arch: str = "custom") -> list[str]:
    """Freeze every parameter of `model` and adapt the nn.Linear layers `cfg.targets`
    names (the architecture's defaults when empty); returns their names.

    Raises:
        ConfigError: a target that matches no nn.Linear layer (defaults excepted: one of
            them at least must), or a rank above a layer's size.
    """
    targets = list(cfg.targets) or list(default_targets(arch))
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not isinstance(m, LoRAFactor) and name}
    chosen: dict[str, nn.Linear] = {}
    for pattern in targets:
        regex = _regex(pattern)
        found = {n: m for n, m in linears.items() if regex.fullmatch(n)}
        if not found and cfg.targets:
            some = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linears})[:12])
            raise ConfigError(f"adapter.targets: {pattern!r} matches no linear layer of the "
                              f"model (its layers are named {some}, ...): name one of them")
        chosen.update(found)
    if not chosen:
        raise ConfigError(f"adapter.targets: the defaults for {arch!r} ({', '.join(targets)}) "
                          "match no linear layer of this model: list its layers in [adapter] "
                          "targets")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in chosen.items():
        if isinstance(linear, LoRALinear):
            continue
        LoRALinear.adapt(linear, cfg.rank, cfg.alpha, cfg.dropout, cfg.init, name)
    return sorted(chosen)


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted layers of `model`, by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every adapted layer of `model` (split by tensor parallelism or not)
    computes its base alone: the base model's outputs, with no second copy of its weights
    (DPO's reference with LoRA, dtrain.train.objective)."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "lora_B", None), LoRAFactor)]
    for layer in layers:
        object.__setattr__(layer, "active", False)  # a plain attribute (nn.Module's is typed)
    try:
        yield
    finally:
        for layer in layers:
            object.__setattr__(layer, "active", True)


def built(shape: ModelConfig, cfg: AdapterConfig) -> nn.Module:
    """The job's model: `dtrain.models.build(shape)` with `cfg`'s adapters applied (as is
    when cfg.kind is "none"). Call it inside dtrain.models.init.skeleton for split form.

    Raises:
        ConfigError: see dtrain.models.build and `apply`.
    """
    from dtrain import models

    model = models.build(shape)
    if cfg.kind == "lora":
        apply(model, cfg, shape.arch)
        if cfg.base_dtype != "float32":
            hold_base_in(model, getattr(torch, cfg.base_dtype))
    return model


def frozen_base(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that never change: neither trained nor moved by a rule
    of their own (a MoE router's balancing bias is, in small steps): a LoRA run's base."""
    from dtrain.models.moe import Router

    moving = {id(m.expert_bias) for m in model.modules() if isinstance(m, Router)}
    return [p for p in model.parameters() if not p.requires_grad and id(p) not in moving]


def hold_base_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast `model`'s frozen base (`frozen_base`: not the adapters, nor a router's
    balancing bias) to `dtype` where it is floating-point, in place (on the meta device
    too, before a layout allocates it); and compute the model's forward in it
    (`compute_in`)."""
    for p in frozen_base(model):
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    compute_in(model, dtype)


class _Autocast:
    """Forward hooks that run a module's forward under torch.autocast in `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.entered: list[torch.autocast] = []

    def before(self, module: nn.Module, args: tuple) -> None:
        first = next(module.parameters(), None)
        kind = first.device.type if first is not None and first.device.type != "meta" else "cpu"
        context = torch.autocast(kind, dtype=self.dtype)
        context.__enter__()
        self.entered.append(context)

    def after(self, module: nn.Module, args: tuple, output: object) -> None:
        self.entered.pop().__exit__(None, None, None)


def computed_in(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype
                ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`fn(output, target)` (a pipeline's loss) under torch.autocast in `dtype`, as the
    whole model computes its loss inside its forward (`compute_in`)."""
    def under(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast(output.device.type, dtype=dtype):
            return fn(output, target)

    return under


def compute_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Run `module`'s forward (a model, or a pipeline piece of one) under torch.autocast
    in `dtype`: the products of a base held in it with float32 activations and adapters,
    the adapters' gradients in float32 (autograd casts them back), norms and the loss in
    float32 (autocast's own rule)."""
    hooks = _Autocast(dtype)
    module.register_forward_pre_hook(hooks.before)
    module.register_forward_hook(hooks.after, always_call=True)
