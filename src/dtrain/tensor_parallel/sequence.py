"""Sequence parallelism (Korthikanti et al., 2022): between its split layers, a
tensor-parallel model holds 1/tp of the sequence on each rank.

Tensor parallelism splits attention and the MLP across the group, but every rank still
holds all of the activations around them: the norms' inputs, the dropout masks, the
residual stream. `apply_sequence_parallel` leaves each rank its own contiguous 1/tp of
the sequence (dimension 1 of [batch, time, width]) there instead:

    input part (embeddings)      whole sequence, as before; then cut to this rank's part
    each block                   norm on the part -> column-parallel layers all-gather the
                                 sequence -> attention / MLP split by heads / features ->
                                 row-parallel layer reduce-scatters into parts -> residual
    output part                  final norm on the part -> the head gathers the sequence
                                 -> whole-sequence logits, as before

An all-gather and a reduce-scatter move what the all-reduce they replace moved, so the
communication is the same and the activations kept around the split layers are 1/tp.
What a column-parallel layer keeps for backward is this rank's part of its input; backward
gathers it again for the weight gradient (dtrain.tensor_parallel.functions.GatheredLinear).
Replicated parameters used on the parts (the norms, the row-parallel biases, a
mixture-of-experts block's router and shared experts) get only their part's gradient: one
all-reduce at the end of backward sums all of them over the group
(dtrain.tensor_parallel.summed). A MoE block routes each part's tokens on its own rank;
its experts, where ep splits them (folded over tp first), are each rank's own and not
summed, and the step's load counts sum over the group (`MoE.split_sequence`). Dropout
there draws each rank's own masks (dtrain.tensor_parallel.rng), as each rank holds its
own tokens.

    parallelize(model, llama_plan(cfg), group)
    apply_sequence_parallel(model, group)      # dtrain.tensor_parallel.split_model does both
"""

from __future__ import annotations

import torch
from torch import nn

from dtrain import comm
from dtrain.errors import ConfigError
from dtrain.mesh.config import ParallelConfig
from dtrain.models.config import ModelConfig
from dtrain.models.moe import moe_layers, split_experts
from dtrain.models.stages import AttentionCore, Stages
from dtrain.tensor_parallel.functions import SEQUENCE, SequenceGather, scatter_sequence
from dtrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SharedAcrossGroup,
)
from dtrain.tensor_parallel.rng import RankRNG, fork_dropouts
from dtrain.tensor_parallel.summed import SumAtEnd
from dtrain.tensor_parallel.whole import placements


def check_config(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Sequence parallelism cuts each sequence over tp: its length must divide.

    Raises:
        ConfigError: `model.block_size` does not divide by `parallel.tp`.
    """
    if parallel.sequence_parallel and model.block_size % parallel.tp:
        raise ConfigError(f"parallel.sequence_parallel: model.block_size = {model.block_size} "
                          f"does not divide by parallel.tp = {parallel.tp}: make it a multiple "
                          f"of {parallel.tp}")


class CutSequence:
    """A forward hook on the module that makes the first block's input: keep this rank's
    part of the sequence (its gradient is gathered whole in backward).

    Raises (in forward):
        ConfigError: the sequence length does not divide by the group size.
    """

    def __init__(self, group: comm.Group, algorithm: str) -> None:
        self.group, self.algorithm = group, algorithm

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        length, parts = output.shape[SEQUENCE], self.group.size
        if length % parts:
            raise ConfigError(f"sequence parallelism: a sequence of {length} tokens does not "
                              f"divide into tp={parts} parts: use sequences whose length is a "
                              f"multiple of {parts}")
        return scatter_sequence(output, self.group, self.algorithm)


def _check_attention(model: nn.Module, blocks: str) -> None:
    """Refuse a plan that would leave an attention to its own part of the sequence, or a
    row-parallel layer cutting a sequence part by features."""
    for name, module in model.named_modules():
        if isinstance(module, RowParallelLinear) and not module.input_is_parallel:
            raise ConfigError(f"sequence parallelism: {name} splits its own input "
                              "(Rowwise(input_is_parallel=False)); feed it a colwise layer's "
                              "output instead")
        if isinstance(module, AttentionCore) and name.startswith(f"{blocks}."):
            owner = name.rpartition(".")[0]
            if not any(isinstance(m, ColumnParallelLinear)
                       for m in model.get_submodule(owner).children()):
                raise ConfigError(f"sequence parallelism: {owner} would attend within this "
                                  "rank's part of the sequence only: split its projections in "
                                  "the plan (colwise q/k/v, rowwise output)")


def _parts_after_cut(model: nn.Module) -> tuple[nn.Module, list[nn.Module], set[int]]:
    """(the module making the first block's input, the modules that run on sequence parts,
    the ids of the input part's parameters)."""
    inputs, blocks, outputs = model.stage_parts()
    before = {id(p) for name in inputs for p in model.get_submodule(name).parameters()}
    after = [model.get_submodule(name) for name in (blocks, *outputs)]
    return model.get_submodule(inputs[-1]), after, before


def apply_sequence_parallel(model: nn.Module, group: comm.GroupLike = None,
                            algorithm: str = "auto") -> nn.Module:
    """Run `model`'s blocks and output part on this rank's part of the sequence.

    `model` is a `Stages` model already split by `parallelize` over `group`, whose last
    input-part module (in `stage_parts()`) makes the first block's input (dtrain's GPT and
    Llama). Its column-parallel layers after that point gather the sequence through one
    shared SequenceGather, its row-parallel layers reduce-scatter, the replicated
    parameters there have their gradients summed over `group` (one all-reduce at the end
    of backward), its dropouts draw each rank's own masks, and a model with a
    `sequence_parts` attribute (Llama's rotary positions) is told the number of parts.
    Every rank of `group` must call it; sequences must then divide by the group size.

    Returns `model`, changed in place; applying it again changes nothing.

    Raises:
        ConfigError: `model` is not a Stages model, its layers are split over a group of
            another size, or its plan leaves an attention whole on each part or a rowwise
            layer splitting its own input.
    """
    if not isinstance(model, Stages):
        raise ConfigError(f"sequence parallelism: {type(model).__name__} does not name its "
                          "input part, blocks and output part (dtrain.models.Stages)")
    g = comm.resolve(group)
    _check_attention(model, model.stage_parts()[1])
    layers = [(n, m) for n, m in model.named_modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for name, layer in layers:
        if layer.group.size != g.size:
            raise ConfigError(f"sequence parallelism over {g.size} ranks, but {name} is split "
                              f"over {layer.group.size}: pass the group parallelize was given")
    if g.size == 1 or any(getattr(m, "sequence_parallel", False) for _, m in layers):
        return model
    cut, after, before = _parts_after_cut(model)
    gather = SequenceGather(g, algorithm)
    callers: dict[int, nn.Module] = {}
    for part in after:
        for name, module in part.named_modules():
            if isinstance(module, ColumnParallelLinear):
                module.sequence_gather = gather
                caller = part.get_submodule(name.rpartition(".")[0]) if "." in name else part
                callers[id(caller)] = caller
            elif isinstance(module, RowParallelLinear):
                module.sequence_parallel = True
                module.sequence_gather = gather
            elif isinstance(module, SharedAcrossGroup):  # MLA's rotary key part
                module.sequence_parallel = True
    for caller in callers.values():  # the layers reading one input have all run
        caller.register_forward_hook(lambda *_: gather.forget())
    fork_dropouts(after, RankRNG(g))
    named = dict(model.named_parameters(remove_duplicate=False))
    # Split parameters meet the whole sequence (their layers gather it); the input part's
    # run before the cut. Neither is summed.
    skip = before | {id(named[name]) for name in placements(model) if name in named}
    skip |= {id(p) for m in model.modules() if getattr(m, "headwise", None) is not None
             for p in m.parameters()}  # summed over the heads already, whatever the part
    # experts split over ep, folded over tp: each tp rank holds others, summed over the
    # ranks holding the same ones by the data-parallel wrap (dtrain.mesh.dims)
    skip |= {id(p) for p in split_experts(model)}
    for layer in moe_layers(model):  # each part routes its own tokens
        layer.split_sequence(g)
    summed: dict[int, nn.Parameter] = {}
    for part in after:
        for p in part.parameters():
            if p.requires_grad and id(p) not in skip:
                summed[id(p)] = p
    SumAtEnd(list(summed.values()), g, algorithm)
    cut.register_forward_hook(CutSequence(g, algorithm))
    if hasattr(model, "sequence_parts"):
        model.sequence_parts = g.size
    return model
