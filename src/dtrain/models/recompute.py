"""Activation checkpointing: recompute chosen modules' activations in backward instead of
keeping them from forward.

Training keeps every activation that backward will need; for a transformer that is most of
a rank's memory at long sequences. A recomputed module keeps only its inputs: backward runs
its forward again (torch.utils.checkpoint, non-reentrant, with the RNG state of the first
run restored, so dropout draws the same mask and the gradients are exactly those without
recomputation) and then its backward. The price is one more forward of what is recomputed.

    recompute_mode(model, "full")               # every transformer block
    recompute_mode(model, "selective")          # attention's softmax(q k^T) v, SwiGLU
    recompute_modules(model, ["blocks.*.mlp"])  # exactly these modules

`[memory]` (`MemoryConfig`, defined here) says which: `recompute` a mode, or
`recompute_modules` a list of names.

A module is recomputed by replacing its forward on the instance, not by wrapping it in a
new parent: module names stay the same (checkpoints, tensor-parallel plans and pipeline
cuts read them), and its forward hooks run once, at the call, never at recomputation.
That is what ZeRO stage 3 needs: it gathers a unit's parameters in a forward pre-hook, frees
them in a forward hook, and gathers them again from a hook on the unit's outputs, which
fires before backward reaches the unit and so before the recomputation. Tensor-parallel
collectives inside a recomputed module run again in backward, on every rank alike.
"""

from __future__ import annotations

import enum
import functools
import re
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtrain.errors import ConfigError
from dtrain.models.stages import Activation, AttentionCore, block_lists

if TYPE_CHECKING:
    from dtrain.models.hf import HFCausalLM

HF_ATTENTION = "dtrain_recomputed_sdpa"
"""The name under which transformers' SDPA attention, recomputed, is registered."""

_ORIGINAL = "_recompute_original_forward"  # the instance attribute holding the forward
_WITHIN = "_recompute_within"  # instance attribute: the module or one holding it recomputes
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called: their elements are
_FULL_FIX = ("memory.recompute = \"full\"", "list the modules to recompute in "
             "[memory] recompute_modules")


class Mode(enum.Enum):
    """What `recompute_mode` recomputes."""

    NONE = "none"  # nothing
    FULL = "full"  # every transformer block: only each block's input is kept
    SELECTIVE = "selective"  # the attention cores and activations: their insides, not inputs


@dataclass
class MemoryConfig:
    """The `[memory]` section: what backward recomputes instead of keeping, and where
    ZeRO's optimizer state lives."""

    recompute: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of keeping them: none; full (each
    transformer block's, keeping only its input); selective (the attention core's and
    SwiGLU's: large activations, cheap to recompute)."""
    recompute_modules: list[str] = field(default_factory=list)
    """Instead of recompute's choice, recompute exactly these modules: dotted names, `*`
    standing for one name component (e.g. "blocks.*.mlp")."""
    offload: Literal["none", "optimizer"] = "none"
    """none; optimizer: keep ZeRO's optimizer state and fp32 master shards in host memory
    and step the optimizer there, each step's gradient shards copied to the host and the
    parameters back in the background (ZeRO-Offload; needs parallel.zero >= 1)."""


def apply(model: nn.Module, memory: MemoryConfig) -> list[str]:
    """Recompute what `[memory]` asks: the modules of `memory.recompute_modules` when it
    names any, else those of `memory.recompute`'s mode. Returns the names
    of the modules recomputed (see `recompute_mode`).

    Call it on the bare model (no DataParallel or ZeRO prefix in the names), after tensor
    parallelism has split it: the split replaces layers, and with them their forward.

    Raises:
        ConfigError: an unknown mode, a pattern naming no module, or a model with nothing
            the mode can recompute.
    """
    if memory.recompute_modules:
        return recompute_modules(model, memory.recompute_modules)
    return recompute_mode(model, memory.recompute)


def recompute_mode(model: nn.Module, mode: str | Mode) -> list[str]:
    """Recompute `model`'s activations in backward as `mode` says:

    - "none": nothing.
    - "full": every transformer block (the blocks `model.stage_parts()` names for a
      `Stages` model, else every element of every nn.ModuleList).
    - "selective": every `AttentionCore` (dtrain's GPT and Llama) and `Activation`
      (Llama's SwiGLU product: silu(gate) is dropped, gate and up kept); for a Hugging Face model
      (dtrain.models.hf) its attention function, transformers' SDPA.

    Returns the names of the modules recomputed (for a Hugging Face model, its attention
    modules, whose attention function is). Applying it again changes nothing.

    Raises:
        ConfigError: an unknown mode, no blocks ("full"), or no attention that dtrain
            can recompute ("selective").
    """
    try:
        mode = Mode(mode)
    except ValueError:
        raise ConfigError(f"memory.recompute = {mode!r} is unknown: use "
                          f"{', '.join(m.value for m in Mode)}") from None
    if mode is Mode.NONE:
        return []
    if mode is Mode.FULL:
        return recompute_modules(model, [f"{name}.*" for name in
                                          block_lists(model, _FULL_FIX)])
    cores = [name for name, m in model.named_modules()
             if isinstance(m, (AttentionCore, Activation))]
    if cores:
        return recompute_modules(model, cores)
    from dtrain.models.hf import HFCausalLM

    if isinstance(model, HFCausalLM):
        return _recompute_hf_attention(model)
    raise ConfigError(f"memory.recompute = \"selective\": "
                      f"{type(model).__name__} has no attention core dtrain can recompute "
                      "(dtrain.models.stages.AttentionCore): use \"full\", or list modules "
                      "in [memory] recompute_modules")


def recompute_modules(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Recompute in backward each module of `model` that `patterns` name: dotted names as
    `model.named_modules()` gives them, where `*` stands for one name component (or part
    of one): "blocks.*", "blocks.*.attn.core". A module inside another one named is left
    to the outer one, which recomputes it anyway; an nn.ModuleList or nn.ModuleDict is
    never called, so naming one names nothing (name its elements, "blocks.*").

    Returns the names of the modules recomputed, in `named_modules()` order (those
    recomputed already included: applying the same patterns twice changes nothing).

    Raises:
        ConfigError: a pattern that names no module (the message says what exists there).
    """
    modules = dict(model.named_modules())
    chosen: set[str] = set()
    for pattern in patterns:
        matched = _matches(pattern, modules)
        callable_ones = {n for n in matched if not isinstance(modules[n], _CONTAINERS)}
        if not callable_ones:
            raise ConfigError(_no_match(pattern, matched, modules))
        chosen |= callable_ones
    chosen |= {name for name, m in modules.items() if is_recomputed(m)}
    outermost = [name for name in modules if name in chosen
                 and not any(_inside(name, other) for other in chosen)]
    for name in outermost:
        for inner_name, inner in modules.items():
            if _inside(inner_name, name) and is_recomputed(inner):
                _restore(inner)  # recomputed by `name` already: no nested recomputation
        _recompute(modules[name])
        for inner in modules[name].modules():
            setattr(inner, _WITHIN, True)
    return outermost


def is_recomputed(module: nn.Module) -> bool:
    """Whether `module`'s activations are recomputed in backward (by `recompute_modules`)."""
    return _ORIGINAL in vars(module)


def recomputed_within(module: nn.Module) -> bool:
    """Whether `module` runs inside a recomputed module (or is one): what it saves for
    backward while training is dropped and made again, so it need not keep less itself
    (dtrain.tensor_parallel's column-parallel layers under sequence parallelism keep their
    whole input there)."""
    return vars(module).get(_WITHIN, False)


def recomputed_names(model: nn.Module) -> list[str]:
    """The names of `model`'s modules whose activations are recomputed."""
    return [name for name, m in model.named_modules() if is_recomputed(m)]


# ----------------------------------------------------------------------- one module
def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a recomputed module: the original one under a checkpoint while
    training with gradients, the original one alone otherwise (nothing to recompute).

    Bound to the instance as a method, so a deep copy of the model (copy.deepcopy binds
    methods to the copy) recomputes the copy's forward, not the original's."""
    original = vars(self)[_ORIGINAL]
    if not (torch.is_grad_enabled() and self.training):
        return original(*args, **kwargs)
    # kwargs through a partial: checkpoint's own keywords cannot collide with the module's
    return checkpoint(functools.partial(original, **kwargs), *args, use_reentrant=False)


def _recompute(module: nn.Module) -> None:
    if is_recomputed(module):
        return
    setattr(module, _ORIGINAL, module.forward)
    module.forward = types.MethodType(_recomputed_forward, module)


def _restore(module: nn.Module) -> None:
    original = vars(module).pop(_ORIGINAL)
    if getattr(original, "__func__", None) is type(module).forward:
        del module.forward  # the class's forward again
    else:
        module.forward = original


# ----------------------------------------------------------------------- names
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """`*` as any run of characters within one dotted component."""
    return re.compile("[^.]*".join(re.escape(piece) for piece in pattern.split("*")))


def _matches(pattern: str, modules: dict[str, nn.Module]) -> list[str]:
    regex = _pattern_regex(pattern)
    return [name for name in modules if name and regex.fullmatch(name)]


def _inside(name: str, outer: str) -> bool:
    """Whether module `name` is a descendant of module `outer` (not itself)."""
    return outer != name and (outer == "" or name.startswith(outer + "."))


def _no_match(pattern: str, matched: list[str], modules: dict[str, nn.Module]) -> str:
    """One line: what `pattern` missed and what exists where it went wrong."""
    where = "memory.recompute_modules"
    if matched:  # only containers
        return (f"{where}: {pattern!r} names {type(modules[matched[0]]).__name__} "
                f"{matched[0]!r}, which is never called: name its elements, {pattern + '.*'!r}")
    parts = pattern.split(".")
    depth = 0  # how many leading components of the pattern name something
    while depth < len(parts) and _matches(".".join(parts[: depth + 1]), modules):
        depth += 1
    prefix = _pattern_regex(".".join(parts[:depth]))
    children = sorted({name.split(".")[depth] for name in modules
                       if name and name.count(".") >= depth
                       and prefix.fullmatch(".".join(name.split(".")[:depth]))})
    there = f"under {'.'.join(parts[:depth])!r}" if depth else "at the top"
    lists = [n for n, m in modules.items() if isinstance(m, nn.ModuleList)]
    hint = f"; its blocks are {lists[0] + '.*'!r}" if lists and not depth else ""
    shown = ", ".join(children[:12]) + (", ..." if len(children) > 12 else "")
    return (f"{where}: {pattern!r} names no module of the model: {there} there are "
            f"{shown or 'no submodules'}{hint}")


# ----------------------------------------------------------------------- modes
def _recomputed_sdpa(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """transformers' SDPA attention function (`sdpa_attention_forward`, called as every
    model's attention calls it: module, query, key, value, mask, keywords) with its
    activations recomputed in backward while training."""
    from transformers import AttentionInterface

    sdpa: Callable[..., Any] = AttentionInterface()["sdpa"]
    if not (torch.is_grad_enabled() and module.training):
        return sdpa(module, *args, **kwargs)
    return checkpoint(functools.partial(sdpa, **kwargs), module, *args, use_reentrant=False)


def _recompute_hf_attention(model: HFCausalLM) -> list[str]:
    """"selective" for a Hugging Face model: switch its attention function from SDPA to
    `_recomputed_sdpa`, registered with transformers as HF_ATTENTION (with SDPA's masks)."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError:
        raise ConfigError("memory.recompute = \"selective\" for a Hugging "
                          "Face model needs transformers >= 5 (its AttentionInterface): "
                          "upgrade transformers, or use \"full\"") from None
    hf = model.hf
    # transformers has no public getter for the implementation in use
    current = getattr(hf.config, "_attn_implementation", None)
    if current not in ("sdpa", HF_ATTENTION):
        raise ConfigError(f"memory.recompute = \"selective\": {type(hf).__name__} "
                          f"attends with {current!r}, and dtrain recomputes only SDPA "
                          "attention: use \"full\"")
    AttentionInterface.register(HF_ATTENTION, _recomputed_sdpa)
    AttentionMaskInterface.register(HF_ATTENTION, sdpa_mask)
    hf.set_attn_implementation(HF_ATTENTION)
    if getattr(hf.config, "_attn_implementation", None) != HF_ATTENTION:
        raise ConfigError(f"memory.recompute = \"selective\": {type(hf).__name__} "
                          "cannot switch its attention function (it does not use "
                          "transformers' AttentionInterface): use \"full\"")
    return [name for name, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "config")]
