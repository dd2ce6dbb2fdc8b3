"""A tensor-parallel model's state as whole tensors, its global gradient norm, its bytes.

The layers' `splits` say how each parameter is cut; from them:

    full_state_dict(model)            the unsplit model's state_dict (all-gather per tensor)
    load_full_state_dict(model, sd)   take this rank's blocks of a whole state_dict
    full_grads(model)                 whole gradients by parameter name
    full_optimizer_state(model, opt)  opt.state_dict() as the unsplit model's optimizer's
    clip_grad_norm_(model, max_norm)  clip by the norm of the whole gradient
    parameter_bytes(model)            this rank's split and replicated parameter bytes

Every function that gathers is collective over the tensor-parallel group: all its ranks call
it. The results load into the plain model with `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dtrain import comm
from dtrain.data_parallel import clip
from dtrain.data_parallel.clip import GradPart
from dtrain.split import Split

Placement = tuple[Split, comm.Group]


def placements(model: nn.Module) -> dict[str, Placement]:
    """Split and group of every split tensor, by its name in `model.state_dict()`."""
    found = {}
    for prefix, module in model.named_modules():
        for pname, split in getattr(module, "splits", {}).items():
            if getattr(module, pname, None) is not None:
                found[f"{prefix}.{pname}" if prefix else pname] = (split, module.group)
    return found


def _by_tensor(model: nn.Module) -> dict[int, Placement]:
    named = dict(model.named_parameters(remove_duplicate=False))
    return {id(named[name]): where for name, where in placements(model).items()}


def _whole(block: torch.Tensor, where: Placement) -> torch.Tensor:
    split, group = where
    if group.size == 1:
        return block.detach().clone()
    stacked = comm.all_gather(block.detach().contiguous(), group=group)
    return split.join(list(stacked.view(group.size, *block.shape).unbind(0)))


def _gather_named(tensors: Iterable[tuple[str, torch.Tensor]],
                  where: dict[str, Placement]) -> dict[str, torch.Tensor]:
    """Whole tensors by name; a tensor under two names (tied) is gathered once."""
    done: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in tensors:
        if id(tensor) not in done:
            done[id(tensor)] = _whole(tensor, where[name]) if name in where else tensor.detach()
        out[name] = done[id(tensor)]
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict of the unsplit model, on every rank (collective)."""
    return _gather_named(model.state_dict(keep_vars=True).items(), placements(model))


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Whole gradients by parameter name (None where a parameter has none) (collective)."""
    where = placements(model)
    named = list(model.named_parameters(remove_duplicate=False))
    with_grad = [(n, p.grad) for n, p in named if p.grad is not None]
    grads = _gather_named(iter(with_grad), where)
    return {n: grads.get(n) for n, _ in named}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a state_dict of the unsplit model: each rank keeps its blocks."""
    where = placements(model)
    mine = {}
    for name, tensor in state.items():
        if name in where:
            split, group = where[name]
            tensor = split.shard(tensor, group.rank, group.size)
        mine[name] = tensor
    model.load_state_dict(mine)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with every per-parameter tensor of a split parameter made
    whole: what the same optimizer over the unsplit model would hold (collective)."""
    state = optimizer.state_dict()
    where = _by_tensor(model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    whole: dict[int, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        param = params[index]
        split = where.get(id(param))
        whole[index] = {
            key: _whole(value, split)
            if split and torch.is_tensor(value) and value.shape == param.shape else value
            for key, value in entry.items()
        }
    return {"state": whole, "param_groups": state["param_groups"]}


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale gradients so the norm of the whole (unsplit) gradient is at most `max_norm`;
    returns that norm. Split parameters' squares are summed across their group, replicated
    ones are counted once (collective; dtrain.data_parallel.clip with parts over "tp" and ()).

    Raises:
        ValueError: the model's layers use several tensor-parallel groups.
    """
    where = _by_tensor(model)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]  # one for each of params
    device = grads[0].device if grads else torch.device("cpu")
    groups = {id(where[id(p)][1]): where[id(p)][1] for p in params if id(p) in where}
    if len(groups) > 1:
        raise ValueError("clip_grad_norm_: the model's layers use different tensor-parallel "
                         "groups; parallelize it with one group")
    parts = [GradPart(grad, over=("tp",) if id(p) in where else ())
             for p, grad in zip(params, grads, strict=True)]
    tp = {"tp": next(iter(groups.values()))} if groups else {}  # none: nothing is split
    norm = clip.clip_grad_norm_(parts, max_norm, tp, device)
    return torch.tensor(norm, dtype=torch.float32, device=device)


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of this rank's parameters: `split` (a block of a split tensor) and
    `replicated` (held whole on every rank)."""
    where = _by_tensor(model)
    out = {"split": 0, "replicated": 0}
    for p in model.parameters():
        out["split" if id(p) in where else "replicated"] += p.numel() * p.element_size()
    return out
