"""The mixture-of-experts layer: a router, E experts, optional shared experts, and what
one step learns of the load.

    moe = MoE(MoEConfig(n_experts=8, experts_per_token=2, hidden=512), dim=256)
    y = moe(x)                     # (batch, time, dim) -> same; x + y is the block's output

Each token goes to `experts_per_token` (k) of the E experts its router picks (router.py)
and leaves as the weighted sum of their outputs, plus the output of the shared experts
(a SwiGLU MLP every token passes through, of `n_shared_experts` x hidden) if any.

Two rules are per sequence, so that they do not depend on how a global batch is cut
between ranks or micro-batches (a run on any layout equals one process):

- Capacity (`capacity_factor` c > 0): each sequence of t tokens sends at most
  ceil(c * t * k / E) of its assignments to any one expert; later tokens' assignments
  beyond that are dropped (their output from that expert is zero; the residual carries
  the token on). c = 0 is dropless.
- The load-balancing loss (`aux_loss_weight` w > 0), DeepSeek-V3's sequence-wise form of
  Switch's: for each sequence, sum_i f_i P_i with f_i = E / (k t) x the assignments to
  expert i and P_i the mean over the sequence's tokens of the router's probability of i
  (normalized over the experts); 1 when perfectly balanced. The model adds w x its mean
  over sequences and MoE layers to the training loss (`aux_loss`).

Under expert parallelism (`expert_parallel`, dtrain.models.moe.expert_parallel does it for a
model) a rank holds E / ep of the experts; the tokens routed to the others go there and
back by all-to-all (experts.py), in one exchange each way or in chunks hidden under the
experts' compute (overlap.py). Where ep is folded over tensor-parallel ranks that see the
same tokens (dtrain.mesh.dims), the router, capacity, balance loss and shared experts run
on all of them alike, and each sends its 1/tp share of the assignments to the experts,
the results all-gathered back (`tp_group`). Under sequence parallelism each tp rank holds
its own part of every sequence and routes it alone (`split_sequence`).

While training, each layer counts the assignments per expert (`load`) and the dropped
ones; `after_step` sums them over the data-parallel ranks once per optimizer step, moves
the sigmoid_bias router's bias, and keeps them for the metrics (`balance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain import comm, timeline
from dtrain.comm import GroupLike
from dtrain.errors import ConfigError
from dtrain.graph_break import graph_break
from dtrain.models.moe.experts import (
    EXPERTS,
    Dispatch,
    Experts,
    counts_within,
    gather_shares,
    share_of,
    take_share,
)
from dtrain.models.moe.overlap import Overlapped
from dtrain.models.moe.router import ROUTERS, Router

BIAS_UPDATE_RATE = 1e-3
"""How far the sigmoid_bias router's bias moves per step (DeepSeek-V3's gamma)."""


@dataclass(frozen=True)
class MoEConfig:
    """The shape and rules of a mixture-of-experts layer.

    Raises:
        ConfigError: on construction, k outside [1, E], an unknown router, a negative
            capacity factor or loss weight.
    """

    n_experts: int
    """E: routed experts per layer."""
    experts_per_token: int = 2
    """k: experts each token goes to."""
    hidden: int = 0
    """Each expert's SwiGLU hidden width."""
    n_shared_experts: int = 0
    """Experts every token passes through (one MLP of n_shared_experts x hidden)."""
    router: str = "softmax_topk"
    """softmax_topk or sigmoid_bias (router.py)."""
    norm_topk_prob: bool = True
    """Renormalize each token's k weights to sum to one."""
    aux_loss_weight: float = 0.0
    """Weight of the load-balancing loss; 0 leaves it out."""
    capacity_factor: float = 0.0
    """Assignments an expert takes per sequence, as a multiple of an even share; 0 is
    dropless."""
    n_group: int = 1
    """Groups the experts are in for group-limited routing (router.py); 1: no limit."""
    topk_group: int = 1
    """The groups each token picks its experts from (at most n_group)."""

    def __post_init__(self) -> None:
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ConfigError(f"model.experts_per_token = {self.experts_per_token} must lie in "
                              f"[1, model.n_experts = {self.n_experts}]")
        if self.router not in ROUTERS:
            raise ConfigError(f"model.router = {self.router!r} is unknown: use one of "
                              f"{', '.join(ROUTERS)}")
        if self.capacity_factor < 0:
            raise ConfigError(f"model.capacity_factor = {self.capacity_factor} must be 0 "
                              "(dropless) or positive")
        if self.aux_loss_weight < 0:
            raise ConfigError(f"model.aux_loss_weight = {self.aux_loss_weight} must be 0 "
                              "(off) or positive")


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the shared experts."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _recomputing() -> bool:
    """Whether this forward runs inside backward (activation checkpointing's second run),
    where it must not count its tokens twice."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """A mixture-of-experts MLP: (batch, time, dim) -> (batch, time, dim)."""

    def __init__(self, cfg: MoEConfig, dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(dim, cfg.n_experts, cfg.experts_per_token, cfg.router,
                           cfg.norm_topk_prob, cfg.n_group, cfg.topk_group)
        self.experts = Experts(cfg.n_experts, dim, cfg.hidden)
        self.shared = SwiGLU(dim, cfg.n_shared_experts * cfg.hidden) \
            if cfg.n_shared_experts else None
        self.ep_group: GroupLike = None
        self.ep_rank, self.ep_size = 0, 1
        self.tp_group: comm.Group | None = None
        """The tensor-parallel ranks that see this rank's tokens, over which ep is folded:
        each computes the experts of its share of the assignments (None: all of them)."""
        self.overlap_chunks = 1
        """Chunks of the exchange hidden under the experts' compute (1: one exchange)."""
        self.sequence_group: GroupLike = None
        """Under sequence parallelism, the ranks holding the other parts of these
        sequences, which route their own tokens: the step's load sums over them too."""
        self.aux_loss: torch.Tensor | None = None
        """This forward's load-balancing loss (weighted), while training with a weight."""
        self.load = torch.zeros(cfg.n_experts, dtype=torch.int64, device="cpu")
        """Assignments per expert since the last `after_step`, on this rank (a plain
        tensor, never on the meta device, moved to the activations' device)."""
        self.dropped = torch.zeros((), dtype=torch.int64, device="cpu")
        """Assignments dropped for capacity since the last `after_step`, on this rank."""
        self.balance: tuple[float, float] | None = None
        """(max / mean assignments per expert, dropped fraction) of the last step, over
        the data-parallel ranks."""

    def expert_parallel(self, group: GroupLike, rank: int, size: int,
                        tp_group: GroupLike = None, overlap_chunks: int = 1) -> None:
        """Keep experts [rank * E / size, (rank + 1) * E / size) of the E only (sliced in
        place; a model on the meta device stays there), and exchange tokens over
        `group` (the `size` ranks that hold the others, in rank order).

        Args:
            tp_group: where ep is folded over tensor-parallel ranks that hold the same
                tokens (not under sequence parallelism): their group; each rank then sends
                only its share of the assignments and the results are all-gathered.
            overlap_chunks: cut the exchange into this many chunks by local expert, each
                one's all-to-all under another's compute (dtrain.models.moe.overlap).

        Raises:
            ConfigError: size does not divide E.
        """
        n = self.cfg.n_experts
        if n % size:
            raise ConfigError(f"parallel.ep = {size} does not divide model.n_experts = {n}: "
                              "choose an expert-parallel degree that divides it")
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(self.experts, name)
            part = EXPERTS.shard(whole.detach(), rank, size)
            setattr(self.experts, name, nn.Parameter(part, requires_grad=whole.requires_grad))
        self.ep_group, self.ep_rank, self.ep_size = group, rank, size
        shares = comm.resolve(tp_group) if tp_group is not None else None
        self.tp_group = shares if shares is not None and shares.size > 1 else None
        self.overlap_chunks = overlap_chunks

    def split_sequence(self, group: GroupLike) -> None:
        """This layer's input is this rank's part of each sequence, the other parts on the
        ranks of `group` (sequence parallelism), which route theirs: `after_step` sums the
        load over `group` too."""
        self.sequence_group = group

    @graph_break  # data-dependent shapes: eager between a block's compiled parts
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, experts, probs = self.gate(flat)
        k, n_experts = experts.shape[1], self.cfg.n_experts
        keep = self._within_capacity(experts.view(b, t, k)) if self.cfg.capacity_factor \
            else None
        if self.training and not _recomputing():
            if self.load.device != x.device:
                self.load, self.dropped = self.load.to(x.device), self.dropped.to(x.device)
            self.load += torch.bincount(experts.reshape(-1), minlength=n_experts)
            if keep is not None:
                self.dropped += (~keep).sum()
        self.aux_loss = self._balance_loss(experts.view(b, t, k), probs.view(b, t, -1)) \
            if self.training and self.cfg.aux_loss_weight else None
        token = torch.arange(b * t, device=x.device).repeat_interleave(k)
        expert, weight = experts.reshape(-1), weights.reshape(-1)
        if keep is not None:
            kept = keep.reshape(-1)
            token, expert, weight = token[kept], expert[kept], weight[kept]
        order = torch.argsort(expert, stable=True)
        token, weight = token[order], weight[order]
        counts = torch.bincount(expert, minlength=n_experts)
        rows = flat.index_select(0, token)
        shared = None
        if self.ep_size == 1:
            with timeline.span("moe experts", "moe"):
                out = self.experts(rows, counts.tolist())
        elif self.tp_group is None:
            out, shared = self._exchanged(rows, counts.cpu(), flat)
        else:  # ep folded over tp: this rank's share of the assignments, then all of them
            lo, hi = share_of(rows.shape[0], self.tp_group.rank, self.tp_group.size)
            mine, shared = self._exchanged(take_share(rows, self.tp_group),
                                           counts_within(counts.cpu(), lo, hi), flat)
            out = gather_shares(mine, rows.shape[0], self.tp_group)
        out = out * weight.to(out.dtype)[:, None]
        y = torch.zeros_like(flat).index_add(0, token, out)
        if self.shared is not None:
            y = y + (self.shared(flat) if shared is None else shared)
        return y.view(b, t, dim)

    def _exchanged(self, rows: torch.Tensor, counts: torch.Tensor, flat: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows sorted by global expert (`counts[e]` for expert e) through their experts on
        the ranks of the expert-parallel group: their outputs in the same order, and the
        shared experts' output of `flat` where the chunked exchange computed it during
        its first dispatch (else None)."""
        if self.overlap_chunks > 1:
            exchange = Overlapped(rows, counts, self.ep_group, self.ep_size,
                                  self.overlap_chunks)
            shared = self.shared(flat) if self.shared is not None else None  # meanwhile
            return exchange.finish(self.experts.gate_up_proj, self.experts.down_proj), shared
        dispatch = Dispatch(rows, counts, self.ep_group, self.ep_size)
        with timeline.span("moe experts", "moe"):
            out = self.experts(dispatch.tokens, dispatch.counts)
        return dispatch.combine(out), None

    def _within_capacity(self, experts: torch.Tensor) -> torch.Tensor:
        """(batch, time, k) experts -> whether each assignment fits its expert's capacity in
        its sequence (earlier tokens first, then lower k)."""
        b, t, k = experts.shape
        capacity = math.ceil(self.cfg.capacity_factor * t * k / self.cfg.n_experts)
        onehot = F.one_hot(experts.reshape(b, t * k), self.cfg.n_experts)
        place = (onehot.cumsum(dim=1) * onehot).sum(-1)  # 1-based place in its expert's queue
        return (place <= capacity).view(b, t, k)

    def _balance_loss(self, experts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The weighted sequence-wise load-balancing loss, averaged over the sequences."""
        b, t, k = experts.shape
        n = self.cfg.n_experts
        counts = F.one_hot(experts.reshape(b, t * k), n).sum(1).float()  # (b, E)
        f = counts * n / (k * t)
        p = (probs / probs.sum(-1, keepdim=True)).mean(1)  # (b, E)
        return self.cfg.aux_loss_weight * (f * p).sum(-1).mean()


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model`, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_parallel(model: nn.Module, group: GroupLike, rank: int, size: int,
                    tp_group: GroupLike = None, overlap_chunks: int = 1) -> None:
    """Split the experts of every MoE layer of `model` over the `size` ranks of `group`,
    this rank (`rank` in it) keeping its E / size (`MoE.expert_parallel`, whose `tp_group`
    and `overlap_chunks` these are).

    Raises:
        ConfigError: size does not divide a layer's expert count.
    """
    for layer in moe_layers(model):
        layer.expert_parallel(group, rank, size, tp_group, overlap_chunks)


def split_experts(model: nn.Module) -> list[nn.Parameter]:
    """The expert parameters split over an expert-parallel group (each rank holds other
    experts): what averages over the ranks that hold the same experts, not over all
    data-parallel ranks."""
    return [p for layer in moe_layers(model) if layer.ep_size > 1
            for p in layer.experts.parameters()]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The weighted load-balancing loss of the model's last forward: the mean over its MoE
    layers (None when none computes one)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).mean() if losses else None


@torch.no_grad()
def after_step(model: nn.Module, group: GroupLike = None) -> None:
    """Once per optimizer step, on every rank: sum each MoE layer's counts over `group`
    (the data-parallel ranks: those that see different tokens; and under sequence
    parallelism over the tp ranks holding the sequences' other parts, `split_sequence`),
    move the sigmoid_bias routers' biases toward even load, and keep the step's balance
    for the metrics."""
    layers = moe_layers(model)
    if not layers:
        return
    counts = torch.cat([torch.cat([m.load, m.dropped.view(1)]) for m in layers]).double()
    if group is not None or dist.is_initialized():  # else one process, not yet a job
        counts = comm.all_reduce(counts, group=group)
    parts = next((m.sequence_group for m in layers if m.sequence_group is not None), None)
    if parts is not None:  # sequence parallelism: every layer's tokens cut alike
        counts = comm.all_reduce(counts, group=parts)
    for m, row in zip(layers, counts.view(len(layers), -1), strict=True):
        load, dropped = row[:-1], float(row[-1])
        total = float(load.sum())
        if total:
            m.balance = (float(load.max() / load.mean()), dropped / total)
            if m.cfg.router == "sigmoid_bias":
                m.gate.update_bias(load, BIAS_UPDATE_RATE)
        m.load.zero_()
        m.dropped.zero_()
