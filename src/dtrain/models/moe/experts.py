"""The experts of a mixture-of-experts layer, computed together, and the exchange that
brings each token to the rank holding its expert (expert parallelism).

`Experts` holds E SwiGLU MLPs as two stacked tensors, laid out as Hugging Face's MoE
models lay theirs out (`gate_up_proj` (E, 2F, D): the gate's rows, then the up
projection's; `down_proj` (E, D, F)), so weights convert by name alone. Rows sorted by
expert are computed in two grouped matrix products (`torch._grouped_mm`) where this torch
has one for the device and dtype, else one matrix product per expert over its contiguous
slice: never a Python call per token.

Under expert parallelism the E experts are split over the `ep` ranks of a group, E / ep
consecutive ones each (`Experts.shard`). `dispatch` sends each row to the rank of its
expert with one uneven all-to-all (the counts are exchanged first, so each rank knows
what it receives), and `combine` returns the results the same way back; both are
differentiable (their backward is the opposite exchange).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from dtrain import comm, timeline
from dtrain.comm import GroupLike
from dtrain.split import Split

EXPERTS = Split(0)
"""How expert parallelism cuts a layer's stacked expert tensors: by expert, along dim 0,
rank r of n keeping experts [r E / n, (r + 1) E / n) (checkpoints place them the same way,
dtrain.layouts.parts)."""

_GROUPED: dict[tuple[str, torch.dtype, int, int], bool] = {}
"""(device type, dtype, dim, hidden) -> whether torch._grouped_mm works forward and back."""


def _try_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    try:
        a = torch.zeros(4, w.shape[-1], dtype=x.dtype, device=x.device, requires_grad=True)
        b = torch.zeros(2, w.shape[-2], w.shape[-1], dtype=x.dtype, device=x.device,
                        requires_grad=True)
        offs = torch.tensor([1, 4], dtype=torch.int32, device=x.device)
        out = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        out.backward(torch.ones_like(out))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _grouped_mm_works(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm serves rows like `x` against stacked weights like `w`
    (E, out, in) on this device, forward and backward: tried once on two tiny experts, on
    a thread of its own (so that the trial's autograd graph stays out of the caller's:
    activation checkpointing counts the tensors a forward saves)."""
    key = (x.device.type, x.dtype, w.shape[-1], w.shape[-2])
    if key not in _GROUPED:
        found: list[bool] = []
        if hasattr(torch, "_grouped_mm"):
            trial = threading.Thread(target=lambda: found.append(_try_grouped_mm(x, w)),
                                     name="dtrain-grouped-mm-trial")
            trial.start()
            trial.join()
        _GROUPED[key] = bool(found and found[0])
    return _GROUPED[key]


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """`t`, whose gradient reaches its grouped product contiguous (some backends refuse
    the expanded gradients autograd hands out, e.g. of a sum)."""
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of `x` (sorted by expert, counts[e] rows for expert e) times w[e]^T, for
    stacked weights w (E, out, in): (rows, in) -> (rows, out)."""
    if x.shape[0] and _grouped_mm_works(x, w):
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _contiguous_grad(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    parts = [piece @ w[e].t() for e, piece in enumerate(x.split(counts)) if counts[e]]
    # No rows: still a product, so that backward reaches this rank's all-to-all exchanges
    # as it does on every other rank (a rank that skipped them would hang its peers).
    return torch.cat(parts) if parts else x @ w[0].t()


class Experts(nn.Module):
    """E SwiGLU MLPs (dim -> hidden -> dim), stacked: `gate_up_proj` (E, 2 hidden, dim)
    and `down_proj` (E, dim, hidden). After `shard`, this rank's E / size of them."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.n_experts, self.dim, self.hidden = n_experts, dim, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """normal(0, std), as the Linear layers of dtrain's Llama."""
        for p in (self.gate_up_proj, self.down_proj):
            if not p.is_meta:
                nn.init.normal_(p, std=std)

    @property
    def local(self) -> int:
        """Experts this rank holds."""
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by (local) expert, counts[e] of them for expert e -> their outputs."""
        h = grouped_matmul(x, self.gate_up_proj, counts)
        gate, up = h.chunk(2, dim=-1)
        return grouped_matmul(F.silu(gate) * up, self.down_proj, counts)


class _AllToAllCtx(torch.autograd.function.FunctionCtx):
    """_AllToAll's ctx as its forward fills it (torch types a ctx as a bare FunctionCtx)."""

    group: GroupLike
    send: list[int]
    recv: list[int]


class _AllToAll(torch.autograd.Function):
    """Rows sent in blocks of `send` rows to each rank, received in blocks of `recv`;
    backward sends the gradients back the opposite way."""

    @staticmethod
    def forward(ctx: _AllToAllCtx, x: torch.Tensor, group: GroupLike,
                send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return exchange(x, group, send, recv)

    @staticmethod
    def backward(ctx: _AllToAllCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, None, None, None]:
        return exchange(grad.contiguous(), ctx.group, ctx.recv, ctx.send), None, None, None


def exchange(x: torch.Tensor, group: GroupLike, send: list[int], recv: list[int]
             ) -> torch.Tensor:
    """Rows of `x` (rows, width): send[j] consecutive rows to rank j, receive recv[j]
    from rank j, stacked in rank order."""
    width = math.prod(x.shape[1:])
    out = comm.all_to_all(x.reshape(-1), group=group,
                          send_sizes=[n * width for n in send],
                          recv_sizes=[n * width for n in recv])
    return out.view(sum(recv), *x.shape[1:])


class Dispatch:
    """One exchange of rows sorted by global expert to the ranks of their experts, and
    back: `tokens` for the local experts, sorted by local expert, and `counts` per local
    expert; `combine` returns the experts' outputs in the original order.

    Args:
        rows: (n, dim) rows sorted by global expert.
        counts: (E,) how many rows go to each global expert (on this rank).
        group: the expert-parallel group, of `size` ranks, E / size experts each.
    """

    def __init__(self, rows: torch.Tensor, counts: torch.Tensor, group: GroupLike,
                 size: int) -> None:
        local = counts.numel() // size
        # Every rank's count for each of this rank's experts: (size, local).
        received = comm.all_to_all(counts.to(torch.int64), group=group).view(size, local)
        self.group = group
        self.send = counts.view(size, local).sum(1).tolist()
        self.recv = received.sum(1).tolist()
        with timeline.span("moe dispatch", "moe"):
            arrived = _AllToAll.apply(rows, group, self.send, self.recv)
        # Arrived rows come by source rank, then local expert: order them by local expert.
        expert_of_row = torch.arange(local, device=rows.device).repeat(size) \
            .repeat_interleave(received.reshape(-1).to(rows.device))
        self.order = torch.argsort(expert_of_row, stable=True)
        self.tokens = arrived.index_select(0, self.order)
        self.counts = received.sum(0).tolist()

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The local experts' outputs for `tokens` -> the outputs of this rank's rows, in
        the order `rows` had."""
        back = torch.empty_like(out).index_copy(0, self.order, out)
        with timeline.span("moe combine", "moe"):
            return _AllToAll.apply(back, self.group, self.recv, self.send)
