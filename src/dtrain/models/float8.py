"""FP8 training of the transformer blocks' linear layers, with torchao's float8 training.

    check_float8(torch.device("cuda"))          # ConfigError unless this GPU has FP8
    converted = convert_to_float8(model, "rowwise")   # the linear layers converted

Each plain nn.Linear inside the model's blocks (`dtrain.models.stages.block_lists`)
becomes torchao's `Float8Linear`: the same `weight` and `bias` parameters (so names,
checkpoints, optimizers and every layout see the model unchanged), whose forward scales
its input and weight to FP8 (e4m3), multiplies them with the GPU's FP8 tensor cores and
returns the result in the input's dtype; backward does the same for the gradient (e5m2
with "tensorwise", e4m3 with "rowwise"). The scales are computed from each tensor as it
comes ("dynamic" scaling): one per tensor ("tensorwise", the fastest) or one per row
("rowwise", more accurate; scales rounded down to powers of two). The master weights,
gradients and optimizer state stay as they were (fp32, or bf16 under ZeRO's mixed
precision), and torchao keeps the linears' inputs for backward in that precision too.

What is left alone: the embeddings and the output head (outside the blocks: the head's
logits are where precision matters most, and torchao's own recipes leave them out too);
a layer whose dimensions are not multiples of 16 (FP8 matrix multiplies need them);
a subclass of nn.Linear (a swap would drop what the subclass adds); MoE routers and routed
experts (dtrain's `Router` and `Experts` hold their weights themselves, not in nn.Linear;
a MoE layer's shared experts are nn.Linear and are converted).

How it composes with the layouts (dtrain.layouts.build converts after tp, cp and ep have
split the model and before `train.compile`, as torchao recommends):

- DataParallel and the pipeline: unchanged; their gradients are the parameters' own.
- ZeRO (every stage): dtrain's ZeRO keeps its own flat shards and gathers parameters in
  the master or compute dtype (fp32, or bf16 with `parallel.mixed_precision`); the cast
  to FP8 happens inside each linear's forward, after the gather. torchao's FP8 all-gather
  (`enable_fsdp_float8_all_gather`, which halves ZeRO-3's gather traffic) works on the
  DTensor parameters of PyTorch's FSDP2 only, so dtrain does not turn it on.
- Tensor parallelism: dtrain's ColumnParallelLinear and RowParallelLinear are modules of
  their own (not nn.Linear) that compute their block of the product through `.matmul`
  between their collectives; conversion makes that product FP8's (torchao's Float8Linear
  run with the layer's weight block), so each rank multiplies its block in FP8 and the
  collectives carry the result in the compute dtype, as torchao's own tensor-parallel
  styles do for DTensor. Under sequence parallelism the column-parallel layer's FP8
  product keeps only this rank's part of the sequence for backward, where Float8Linear
  would keep the gathered whole (dtrain.tensor_parallel.functions.matmul_keeping_part).
- torch.compile (`train.compile`): convert first, then compile; the compiler fuses the
  scaling (the absolute maximum and the cast) into the kernels around the multiply, which
  is where most of the speed comes from.

torchao is an optional dependency (`pip install 'dtrain[float8]'`): it is PyTorch's own
library of low-precision training (torchtitan's FP8 is this), tracks the FP8 kernels of
each PyTorch release, and brings both scaling recipes. Its float8 API with these recipe
names dates from torchao 0.9; dtrain asks for 0.12, the first to run "rowwise" on fp32
activations (DataParallel computes in fp32; the rowwise kernel returns bf16 only, which
torchao casts back from 0.12 on).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.stages import block_lists

Recipe = Literal["tensorwise", "rowwise"]
"""torchao's float8 scaling recipes dtrain offers (`[train] float8`)."""
RECIPES: tuple[str, ...] = get_args(Recipe)
"""The scaling recipes (`[train] float8`): one scale per tensor, or one per row."""

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with FP8 tensor cores (Ada: L4, RTX 4090;
Hopper: H100, H200 are 9.0)."""

Matmul = Callable[..., torch.Tensor]
"""A linear layer's product as a function: (x, weight, bias=None) -> x weight^T + bias
(F.linear's signature). Tensor-parallel layers compute their block through one
(`.matmul`), which FP8 replaces."""

_ALIGN = 16  # FP8 matrix multiplies (torch._scaled_mm) need both dimensions multiples of it
_BLOCKS_FIX = ("train.float8", "keep the model's blocks in an nn.ModuleList, or set "
               "train.float8 = \"none\"")


def check_float8(device: torch.device | str) -> None:
    """Refuse FP8 training where it cannot run: on a CPU, on a GPU older than compute
    capability 8.9, or without torchao installed.

    Raises:
        ConfigError: one line saying what the machine has and what FP8 needs.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError("train.float8 needs a GPU with FP8 tensor cores (compute capability "
                          ">= 8.9: H100, H200, L4, RTX 4090); this run computes on "
                          f"{_described(device)}: set train.float8 = \"none\"")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError("train.float8 needs a GPU with FP8 tensor cores (compute capability "
                          f">= 8.9: H100, H200, L4, RTX 4090); this machine has {name} "
                          f"(compute capability {capability[0]}.{capability[1]}): set "
                          "train.float8 = \"none\"")
    _torchao_float8()


def _described(device: torch.device) -> str:
    """The CPU, and the GPU the machine has if any (then a CPU run chose gloo)."""
    if torch.cuda.is_available():
        return (f"the CPU (the job's backend is not NCCL, though this machine has "
                f"{torch.cuda.get_device_name(0)})")
    return "the CPU (no CUDA GPU is visible)"


def _torchao_float8() -> ModuleType:
    """torchao's float8 training package, or a ConfigError saying how to install it."""
    try:
        from torchao import float8
    except ImportError:
        raise ConfigError("train.float8 needs torchao (PyTorch's low-precision training "
                          "library): pip install 'dtrain[float8]'") from None
    return float8


def float8_layers(model: nn.Module) -> tuple[list[str], list[str]]:
    """(the names of the linear layers of `model`'s blocks that FP8 can run, those it
    cannot because a dimension is not a multiple of 16), as named_modules() names them.
    Linear layers are plain nn.Linear ones and tensor-parallel ones (a `.matmul` that is
    F.linear: dtrain.tensor_parallel's ColumnParallelLinear and RowParallelLinear), judged
    by the block of the weight this rank holds. Layers converted already, and subclasses
    of nn.Linear, are in neither list.

    Raises:
        ConfigError: the model keeps no blocks in an nn.ModuleList.
    """
    chosen: list[str] = []
    skipped: list[str] = []
    for list_name in block_lists(model, _BLOCKS_FIX):
        for name, module in model.get_submodule(list_name).named_modules(prefix=list_name):
            if not (type(module) is nn.Linear or _splits_by_matmul(module)):
                continue
            aligned = all(n % _ALIGN == 0 for n in module.weight.shape)
            (chosen if aligned else skipped).append(name)
    return chosen, skipped


def _splits_by_matmul(module: nn.Module) -> bool:
    """Whether `module` is a tensor-parallel layer computing through F.linear still."""
    return getattr(module, "matmul", None) is F.linear


def convert_to_float8(model: nn.Module, recipe: str) -> list[str]:
    """Swap the linear layers `float8_layers(model)` chooses for torchao's Float8Linear
    with the scaling `recipe` ("tensorwise" or "rowwise"), in place; their parameters are
    the same objects. Returns the names of the layers swapped; applying it again swaps
    none. It does not look at the hardware (a model may be converted before it is moved to
    its GPU): `check_float8` does.

    Raises:
        ConfigError: an unknown recipe, torchao is not installed, the model keeps no blocks
            in an nn.ModuleList, or no layer of its blocks can run in FP8.
    """
    if recipe not in RECIPES:
        raise ConfigError(f"train.float8 = {recipe!r} must be one of none, "
                          f"{', '.join(RECIPES)}")
    float8 = _torchao_float8()
    chosen = float8_layers(model)[0]
    if not chosen and _converted(model):
        return []
    if not chosen:
        raise ConfigError(f"train.float8: no nn.Linear layer in the blocks of "
                          f"{type(model).__name__} has dimensions that are multiples of 16 "
                          f"(FP8 needs them): set train.float8 = \"none\"")
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    modules = dict(model.named_modules())
    plain = {name for name in chosen if type(modules[name]) is nn.Linear}
    float8.convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda _module, fqn: fqn in plain)
    for name in chosen:
        if name not in plain:  # a tensor-parallel layer: its own block's product in FP8
            modules[name].matmul = _float8_matmul(modules[name].weight, float8, config)
    return chosen


def _float8_matmul(weight: torch.Tensor, float8: ModuleType, config: object) -> Matmul:
    """F.linear in FP8 for weights shaped like `weight`: torchao's Float8Linear (made by
    its public `convert_to_float8_training` from a parameterless shell on the meta device)
    run with the layer's own weight (torch.func.functional_call), the bias added after as
    Float8Linear adds it."""
    shell = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                    device="meta"))
    float8.convert_to_float8_training(shell, config=config)
    fp8 = shell[0]

    def matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
               ) -> torch.Tensor:
        y = torch.func.functional_call(fp8, {"weight": w}, (x,))
        return y if b is None else y + b.to(y.dtype)

    return matmul


def _converted(model: nn.Module) -> bool:
    """Whether any linear layer of `model` runs in FP8 already (a torchao Float8Linear, or
    a tensor-parallel layer whose product is FP8's)."""
    return any(type(m).__name__ == "Float8Linear" or
               getattr(m, "matmul", F.linear) is not F.linear for m in model.modules())


def describe(converted: list[str], skipped: list[str], recipe: str) -> str:
    """The banner's words for a conversion: how many layers run in FP8, which were left."""
    text = f"float8 {recipe} in {len(converted)} linear layers"
    if skipped:
        shown = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3
                                          else "")
        text += f" ({shown} left as they were: dimensions not multiples of 16)"
    return text
