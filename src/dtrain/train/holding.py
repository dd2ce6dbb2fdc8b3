"""What one rank holds of the model in a hybrid layout, and the global gradient norm.

`Holding` records, for the trainer, which parameters this rank trains and how: whole or
as tensor-parallel blocks (DataParallel, pipeline pieces) or as ZeRO shards, its place on
the tp and dp axes, and which tied copies another rank accounts for. Checkpoints
(dtrain.train.state) and gradient clipping read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dtrain import comm, tensor_parallel
from dtrain.errors import DtrainError
from dtrain.parallel import zero_state
from dtrain.parallel.zero import ZeRO
from dtrain.tensor_parallel.split import Split
from dtrain.universal import Checkpoint, Piece, pieces_of


@dataclass
class Holding:
    """What this rank holds of the model, and where it sits in the layout.

    Args:
        whole: the complete model this rank built (names, ties, tensor-parallel splits).
        params: parameters held as tensors (whole or tp blocks), with `optimizer`.
        zeros: ZeRO wrappers holding parameters as shards (each with its optimizer).
        skip: parameters another rank writes (the head's copy of a tied weight).
    """

    whole: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    zeros: list[ZeRO] = field(default_factory=list)
    skip: set[int] = field(default_factory=set)
    tp: tuple[int, int] = (0, 1)
    dp: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        self.canonical = {id(p): n for n, p in self.whole.named_parameters()}
        named = dict(self.whole.named_parameters(remove_duplicate=False))
        self.split: dict[int, Split] = {
            id(named[n]): split for n, (split, _) in tensor_parallel.placements(self.whole).items()
            if n in named}

    def aliases(self) -> dict[str, str]:
        """Other names of tied parameters -> their canonical name."""
        return {n: self.canonical[id(p)] for n, p in
                self.whole.named_parameters(remove_duplicate=False)
                if self.canonical[id(p)] != n}

    def _writes(self, p: nn.Parameter) -> bool:
        """Whether this rank writes (its tp block of) `p`: replicated tensors come from tp
        rank 0 only, a tied copy from the lowest stage only."""
        return id(p) not in self.skip and (id(p) in self.split or self.tp[0] == 0)

    def placement(self, p: nn.Parameter) -> tuple[int, int, Split | None]:
        """(part, parts, split): which tensor-parallel block of its tensor `p` is."""
        split = self.split.get(id(p))
        return (*self.tp, split) if split is not None else (0, 1, None)

    def _block_pieces(self, name: str, p: nn.Parameter, block: torch.Tensor,
                      owner: tuple[int, int]) -> list[Piece]:
        return pieces_of(name, block, *owner, *self.placement(p))

    def local(self, ckpt: Checkpoint, name: str, p: nn.Parameter) -> torch.Tensor:
        """This rank's block of the logical tensor `name` (p's shape)."""
        whole = ckpt.tensor(name)
        split = self.split.get(id(p))
        block = split.shard(whole, *self.tp) if split is not None else whole
        if block.shape != p.shape:
            raise DtrainError(f"checkpoint {ckpt.path}: {name} has shape {tuple(block.shape)} "
                              f"there but this model needs {tuple(p.shape)}: it was saved from "
                              "another model config")
        return block

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, groups: dict[str, comm.Group]) -> float:
        """Scale every gradient this rank holds so that the norm of the whole model's
        gradient is at most `max_norm`; returns that norm (collective over the mesh).

        Split parameters' squares are summed over tp, replicated ones counted once; ZeRO's
        shards are summed over dp; each pipeline stage's over pp, a tied copy once.
        """
        device = next(self.whole.parameters()).device  # where the backend reduces
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # [split, replicated]
        grads: list[torch.Tensor] = []

        def add(p: nn.Parameter, grad: torch.Tensor) -> None:
            grads.append(grad)
            if id(p) not in self.skip:
                sums[0 if id(p) in self.split else 1] += grad.double().pow(2).sum()

        for p in self.params:
            if p.grad is not None:
                add(p, p.grad)
        for z in self.zeros:
            own = dict(z.module.named_parameters())
            for n, grad in zero_state.grad_segments(z):
                add(own[n], grad)
        if self.zeros:
            comm.all_reduce(sums, group=groups["dp"])
        split = sums[:1].clone()
        if self.tp[1] > 1:
            comm.all_reduce(split, group=groups["tp"])
        total = (split + sums[1:]).sum().view(1)
        comm.all_reduce(total, group=groups["pp"])
        norm = total.sqrt().item()
        scale = min(1.0, max_norm / (norm + 1e-6))
        if scale < 1.0:
            for grad in grads:
                grad.mul_(scale)
        return norm
