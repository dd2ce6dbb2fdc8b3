"""The sharded optimizer: the factory's optimizer rebuilt over this rank's shard pieces.

The optimizer factory is called once with the module's parameters; it may build parameter
groups with their own options. `group_index` reads which group each parameter is in, and
`shard_optimizer` builds the same optimizer class with the same options over the pieces
of each unit's master shard that fall in each group (an empty placeholder piece keeps a
group that meets no shard of this rank, so groups stay aligned across ranks). A Muon
template (dtrain.optim.Muon), whose matrices cannot be orthogonalized in pieces, becomes
the distributed one of dtrain.data_parallel.zero.muon.

The shard optimizer steps its pieces all at once (dtrain.optim.build.step_kernel: fused
kernels on CUDA, multi-tensor ones elsewhere), chosen by where the pieces are: the
compute device, or the host under optimizer offload, whatever the template was built on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
from torch import nn

from dtrain.data_parallel.zero.muon import ShardedMuon
from dtrain.data_parallel.zero.units import Unit
from dtrain.errors import DtrainError
from dtrain.optim import Muon
from dtrain.optim.build import steps_follow_params, with_step_kernel

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def group_index(template: torch.optim.Optimizer,
                named: list[tuple[str, nn.Parameter]]) -> dict[int, int]:
    """id(parameter) -> index of its parameter group in `template`.

    Raises:
        DtrainError: the template leaves out some of the trainable parameters `named`.
    """
    group_of = {id(p): k for k, g in enumerate(template.param_groups) for p in g["params"]}
    left_out = [n for n, p in named if id(p) not in group_of]
    if left_out:
        raise DtrainError(f"ZeRO: the optimizer factory left out trainable parameters "
                          f"({', '.join(left_out[:3])}{', ...' if len(left_out) > 3 else ''}); "
                          "set requires_grad=False on parameters that should not train")
    return group_of


def shard_optimizer(template: torch.optim.Optimizer, units: list[Unit]
                    ) -> torch.optim.Optimizer:
    """The template's class and options over this rank's pieces of each parameter group
    (recorded in each unit's `pieces`); for a Muon template, a ShardedMuon.

    Raises:
        ConfigError: a Muon template over offloaded units (ShardedMuon).
    """
    pieces: list[list[nn.Parameter]] = [[] for _ in template.param_groups]
    for unit in units:
        for group, lo, hi in unit.flat.pieces(unit.rank):
            piece = nn.Parameter(unit.master[lo:hi])
            pieces[group].append(piece)
            unit.pieces.append((group, lo, hi, piece))
    kind, device = type(template), units[0].master.device  # the host's, offloaded
    groups = []
    for k, options in enumerate(template.param_groups):
        params = pieces[k] or [empty_piece(units[0].master)]  # keep groups aligned
        groups.append({**with_step_kernel({key: v for key, v in options.items()
                                           if key != "params"}, kind, device),
                       "params": params})
    if isinstance(template, Muon):
        return steps_follow_params(ShardedMuon(groups, template, units))
    accepted = inspect.signature(kind).parameters  # defaults may hold more
    defaults = with_step_kernel(template.defaults, kind, device)
    return steps_follow_params(kind(groups, **{k: v for k, v in defaults.items()
                                               if k in accepted}))


def empty_piece(like: torch.Tensor) -> nn.Parameter:
    """A parameter of no elements (with an empty gradient), for a group with no piece."""
    piece = nn.Parameter(like.new_zeros(0))
    piece.grad = like.new_zeros(0)
    return piece


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-element state tensors."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
