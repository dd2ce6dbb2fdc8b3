"""Muon on the hidden weight matrices and AdamW on everything else, as one optimizer.

Muon (Keller Jordan, 2024; "Muon is Scalable for LLM Training", Moonshot AI, 2025) keeps a
momentum of each matrix's gradient and steps along that momentum *orthogonalized*: the
nearest matrix with all singular values about 1, computed by a few Newton-Schulz
iterations instead of an SVD. It is meant for the hidden layers' matrices; embeddings,
the output head, norms and biases train with AdamW. `Muon` is one
torch.optim.Optimizer whose parameter groups say which half steps them (`"muon": True`
or False), so a learning-rate scheduler, a checkpoint and ZeRO see one optimizer.

The math is torch.optim.Muon's (torch 2.9 on), written here again so that it also runs on
pieces of a matrix held by several ranks: for gradient g, momentum mu and buffer B,

    B <- mu B + (1 - mu) g                      (torch's lerp form)
    U <- (1 - mu) g + mu B  if nesterov, else B
    O <- NS(U)                                  (ns_steps quintic iterations, ns_coefficients)
    W <- W (1 - lr wd) - lr * adjust(shape) * O

with adjust = sqrt(max(1, A / B)) ("original", Keller Jordan's) or 0.2 sqrt(max(A, B))
("match_rms_adamw", Moonlight's: O's RMS becomes AdamW's update's, so AdamW's rate and
weight decay serve). AdamW's half is torch's own (torch.optim.adam.adam, decoupled decay).

State is per element and shaped like the parameter (Muon: `momentum_buffer`; AdamW:
`exp_avg`, `exp_avg_sq` and the scalar `step`), which is what dtrain's checkpoints and
ZeRO's sharded state read. A matrix cut over tensor-parallel ranks (`Block`) is gathered
whole to be orthogonalized, each of its ranks computing the same orthogonalization and
keeping its block: a tp-redundant computation (tp times the Newton-Schulz work, once per
rank) that costs one all-gather of the update per matrix and leaves every rank's step
alike. Under ZeRO the matrices are held in flat shards instead:
dtrain.data_parallel.zero.muon steps them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.optim.adam import adam

from dtrain import comm
from dtrain.errors import DtrainError
from dtrain.split import Split

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic coefficients (a, b, c), torch.optim.Muon's default."""
AdjustLr = Literal["original", "match_rms_adamw"] | None


@dataclass(frozen=True)
class Block:
    """A parameter that is one tensor-parallel rank's block of a matrix: cut by `split`
    over `group` (dtrain.tensor_parallel's layers say so in their `splits`)."""

    split: Split
    group: comm.Group

    def whole(self, block: torch.Tensor) -> torch.Tensor:
        """The whole matrix from every rank's `block` (collective over `group`)."""
        stacked = comm.all_gather(block.contiguous(), group=self.group)
        return self.split.join(list(stacked.view(self.group.size, *block.shape).unbind(0)))

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's block of `whole`."""
        return self.split.shard(whole, self.group.rank, self.group.size)

    def whole_shape(self, shape: torch.Size) -> torch.Size:
        """The whole matrix's shape, of a block of `shape`."""
        return torch.Size(n * self.group.size if d == self.split.dim else n
                          for d, n in enumerate(shape))


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalized `update` (a matrix), in `dtype`: scaled to a spectral norm of at
    most 1 (by its Frobenius norm), then `steps` iterations X <- a X + (b A + c A^2) X with
    A = X X^T, on the wide orientation (fewer rows than columns: the smaller Gram matrix).
    The singular values land near 1 (in about [0.7, 1.2] with Keller Jordan's
    coefficients), not exactly on it, which trains as well as U V^T. The same operations
    in the same order as torch.optim.Muon, so that one process matches it bit for bit."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rule: AdjustLr, shape: torch.Size) -> float:
    """Muon's rate for a matrix of `shape` (rows A, columns B): lr sqrt(max(1, A / B))
    ("original", or None) or lr 0.2 sqrt(max(A, B)) ("match_rms_adamw")."""
    rows, cols = shape[:2]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def momentum_update(state: dict[str, Any], grad: torch.Tensor, group: Mapping[str, Any]
                    ) -> torch.Tensor:
    """Advance the momentum buffer in `state` (made at the first step) with `grad`, and
    return the update to orthogonalize: elementwise, so it runs on any piece of a matrix."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buffer: torch.Tensor = state["momentum_buffer"]
    momentum = group["momentum"]
    buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(buffer, momentum) if group["nesterov"] else buffer


def orthogonalized(update: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
    """`newton_schulz` of a whole matrix with its group's options."""
    return newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                         group["ns_dtype"])


def apply_update(param: torch.Tensor, ortho: torch.Tensor, group: Mapping[str, Any],
                 shape: torch.Size) -> None:
    """Decoupled weight decay, then the orthogonalized step at the rate of a matrix of
    `shape` (the whole matrix's, of a tensor-parallel block or a ZeRO piece): elementwise,
    as torch.optim.Muon applies them."""
    lr = group["lr"]
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))


def step_adamw(state: Mapping[torch.Tensor, dict[str, Any]], group: Mapping[str, Any]) -> None:
    """AdamW on `group`'s parameters that have a gradient: torch's own functional step
    (what torch.optim.AdamW runs, by the group's `foreach` or `fused` kernel), its state
    made here as torch.optim.AdamW makes it."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        s = state[p]
        if "step" not in s:  # fused kernels read it on the parameter's device
            s["step"] = torch.tensor(0.0, dtype=torch.float32,
                                     device=p.device if group.get("fused") else None)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in s:
                s[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(s["exp_avg"])
        exp_avg_sqs.append(s["exp_avg_sq"])
        steps.append(s["step"])
    beta1, beta2 = group["betas"]
    adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group.get("foreach"),
         capturable=False, differentiable=False, fused=group.get("fused"), has_complex=False,
         decoupled_weight_decay=True,
         amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
         weight_decay=group["weight_decay"], eps=group["adam_eps"], maximize=False)


class Muon(torch.optim.Optimizer):
    """Muon on the groups flagged `"muon": True` (2-D parameters only), AdamW on those
    flagged False (see the module docstring for the math).

    Args:
        params: parameters, or parameter groups each with "muon" (default True) and any of
            the options below as its own.
        lr: learning rate of both halves (a group may set its own).
        weight_decay: decoupled weight decay of both halves.
        momentum, nesterov: Muon's momentum.
        ns_coefficients, ns_steps, eps: the Newton-Schulz iteration.
        adjust_lr_fn: None or "original" (Keller Jordan's), "match_rms_adamw" (Moonlight's).
        ns_dtype: the dtype Newton-Schulz computes in (torch's: bfloat16).
        betas, adam_eps: AdamW's.
        foreach, fused: the kernel of AdamW's step, as torch.optim.AdamW takes them (None:
            torch's choice; dtrain.optim.build_optimizer picks fused on CUDA, foreach
            elsewhere).
        blocks: id(parameter) -> its tensor-parallel Block, for the matrices cut over tp
            ranks (orthogonalized whole; every rank of the block's group steps it alike).

    Raises:
        DtrainError: a Muon group holds a parameter that is not a matrix, or an unknown
            adjust_lr_fn.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: AdjustLr = None,
                 ns_dtype: torch.dtype = torch.bfloat16,
                 betas: tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-8,
                 foreach: bool | None = None, fused: bool | None = None,
                 blocks: Mapping[int, Block] | None = None) -> None:
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise DtrainError(f"Muon adjust_lr_fn={adjust_lr_fn!r}: use None, \"original\" "
                              "or \"match_rms_adamw\"")
        defaults = {"muon": True, "lr": lr, "weight_decay": weight_decay,
                    "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": tuple(ns_coefficients), "eps": eps,
                    "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn, "ns_dtype": ns_dtype,
                    "betas": tuple(betas), "adam_eps": adam_eps, "foreach": foreach,
                    "fused": fused}
        super().__init__(params, defaults)
        self.blocks = dict(blocks or {})
        self.check_matrices()

    def check_matrices(self) -> None:
        """Every parameter of a Muon group is a matrix.

        Raises:
            DtrainError: one is not (named by its shape).
        """
        for group in self.param_groups:
            for p in group["params"] if group["muon"] else []:
                if p.dim() != 2:
                    raise DtrainError(f"Muon orthogonalizes matrices: a parameter of shape "
                                      f"{tuple(p.shape)} is in a Muon group; train it with "
                                      "AdamW (\"muon\": False)")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's overloads
        """One step of every group: AdamW's groups, then Muon's (`step_matrices`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["muon"]:
                step_adamw(self.state, group)
        self.step_matrices([g for g in self.param_groups if g["muon"]])
        return loss

    def step_matrices(self, groups: list[dict[str, Any]]) -> None:
        """Muon on the matrices of `groups`, one at a time; a tensor-parallel block's
        update gathered whole first (in ns_dtype, which Newton-Schulz casts to anyway)."""
        for group in groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = momentum_update(self.state[p], p.grad, group)
                block = self.blocks.get(id(p))
                if block is None or block.group.size == 1:
                    apply_update(p, orthogonalized(update, group), group, p.shape)
                    continue
                whole = block.whole(update.to(group["ns_dtype"]))
                apply_update(p, block.mine(orthogonalized(whole, group)), group, whole.shape)
