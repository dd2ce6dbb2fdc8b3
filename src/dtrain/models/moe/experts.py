"""The experts of a mixture-of-experts layer, computed together, and the exchange that
brings each token to the rank holding its expert (expert parallelism).

`Experts` holds E SwiGLU MLPs as two stacked tensors, laid out as Hugging Face's MoE
models lay theirs out (`gate_up_proj` (E, 2F, D): the gate's rows, then the up
projection's; `down_proj` (E, D, F)), so weights convert by name alone. Rows sorted by
expert are computed in two grouped matrix products (`torch._grouped_mm`) where this torch
has one for the device and dtype, else one expert at a time over its contiguous slice
(`swiglu`): never a Python call per token.

Under expert parallelism the E experts are split over the `ep` ranks of a group, E / ep
consecutive ones each (`Experts.shard`). `Dispatch` sends each row to the rank of its
expert with one uneven all-to-all (the counts are exchanged first, `Counts`, so each rank
knows what it receives), and `combine` returns the results the same way back; both are
differentiable (their backward is the opposite exchange). dtrain.models.moe.overlap cuts
the same exchange into chunks hidden under the experts' compute.

When ep is folded over tensor-parallel ranks that see the same tokens (dtrain.mesh.dims),
each of them sends only its share of the assignments (`take_share`: a contiguous 1/tp of
them, in expert order) and the results are all-gathered back (`gather_shares`), as
Megatron-Core does with expert tensor parallelism 1: every assignment reaches its expert
once, and every tp rank ends with the whole layer's output, as replicated computation
expects (Megatron's scatter to and gather from the tensor-parallel region: each the
other's gradient).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtrain import comm, timeline
from dtrain.comm import GroupLike
from dtrain.comm.collectives import Result
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


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int]
           ) -> torch.Tensor:
    """Rows of `x` sorted by expert (counts[e] rows for expert e) through the SwiGLU MLPs
    of stacked weights `gate_up` (n, 2F, D) and `down` (n, D, F): (rows, D) -> (rows, D).

    Without grouped products each expert's rows go through its whole MLP on their own, so
    that an expert's outputs and gradients are the same bits whichever other experts'
    rows share the call (the chunked exchange of dtrain.models.moe.overlap computes a
    few experts at a time and equals one exchange bit for bit)."""
    if x.shape[0] and _grouped_mm_works(x, gate_up) and _grouped_mm_works(x, down):
        gate, up = grouped_matmul(x, gate_up, counts).chunk(2, dim=-1)
        return grouped_matmul(F.silu(gate) * up, down, counts)
    parts = []
    for e, piece in enumerate(x.split(counts)):
        if counts[e]:
            gate, up = (piece @ gate_up[e].t()).chunk(2, dim=-1)
            parts.append((F.silu(gate) * up) @ down[e].t())
    if parts:
        return torch.cat(parts)
    # No rows: still the products, so that backward reaches this rank's all-to-all
    # exchanges as it does on every other rank (a rank that skipped them would hang its
    # peers).
    gate, up = (x @ gate_up[0].t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down[0].t()


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
        return swiglu(x, self.gate_up_proj, self.down_proj, counts)


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
    from rank j, stacked in rank order (waited for at once: a "moe wait" span on the
    timeline)."""
    return wait_rows(start_exchange(x, group, send, recv))


@dataclass
class Pending:
    """An exchange of rows in flight: `wait_rows` completes it."""

    result: Result[torch.Tensor]
    shape: tuple[int, ...]
    """The received rows' shape."""


def start_exchange(x: torch.Tensor, group: GroupLike, send: list[int], recv: list[int]
                   ) -> Pending:
    """`exchange` started, not waited for (dtrain.comm's async all-to-all)."""
    width = math.prod(x.shape[1:])
    result = comm.all_to_all(x.contiguous().reshape(-1), group=group, async_op=True,
                             send_sizes=[n * width for n in send],
                             recv_sizes=[n * width for n in recv])
    return Pending(result, (sum(recv), *x.shape[1:]))


def wait_rows(pending: Pending) -> torch.Tensor:
    """The rows `start_exchange` receives, once they have arrived; the time this rank
    waits for them (what computing did not hide) is a "moe wait" span on the timeline."""
    with timeline.span("all-to-all wait", "moe wait"):
        return pending.result.wait().view(pending.shape)


@dataclass(frozen=True)
class Counts:
    """How many rows each rank of an expert-parallel group sends each other rank's local
    experts: `sent[j][e]` this rank sends rank j's local expert e, `received[j][e]` rank j
    sends this rank's local expert e (one all-to-all of E counts tells every rank)."""

    sent: torch.Tensor
    received: torch.Tensor

    @classmethod
    def exchanged(cls, counts: torch.Tensor, group: GroupLike, size: int,
                  device: torch.device) -> Counts:
        """From this rank's rows per global expert (E,), the E / size experts of each of
        the `size` ranks of `group` consecutive: the counts every rank sends (exchanged on
        `device`, the rows' device, which NCCL needs; held on the host)."""
        local = counts.numel() // size
        mine = counts.to(torch.int64).cpu()
        received = comm.all_to_all(mine.to(device), group=group).cpu().view(size, local)
        return cls(mine.view(size, local), received)

    @property
    def local(self) -> int:
        """Experts each rank holds."""
        return self.sent.shape[1]


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
        exchanged = Counts.exchanged(counts, group, size, rows.device)
        received = exchanged.received
        self.group = group
        self.send = exchanged.sent.sum(1).tolist()
        self.recv = received.sum(1).tolist()
        with timeline.span("moe dispatch", "moe"):
            arrived = _AllToAll.apply(rows, group, self.send, self.recv)
        self.order = by_local_expert(received, rows.device)
        self.tokens = arrived.index_select(0, self.order)
        self.counts = received.sum(0).tolist()

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The local experts' outputs for `tokens` -> the outputs of this rank's rows, in
        the order `rows` had."""
        back = torch.empty_like(out).index_copy(0, self.order, out)
        with timeline.span("moe combine", "moe"):
            return _AllToAll.apply(back, self.group, self.recv, self.send)


def by_local_expert(received: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows that arrived by source rank, then local expert (`received[j][e]` rows from
    rank j for expert e) -> the order that sorts them by local expert, each expert's rows
    still by source rank."""
    size, local = received.shape
    expert_of_row = torch.arange(local, device=device).repeat(size) \
        .repeat_interleave(received.reshape(-1).to(device))
    return torch.argsort(expert_of_row, stable=True)


# ------------------------------------------------------------------ ep folded over tp
def share_of(n: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi): rank `rank`'s share of `n` rows among `size` ranks: ceil(n / size) rows
    each in rank order, the last shares shorter or empty (so the shares padded to the same
    length and concatenated hold the rows first, in order)."""
    each = -(-n // size)
    lo = min(rank * each, n)
    return lo, min(lo + each, n)


def counts_within(counts: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Of rows sorted by expert, `counts[e]` for expert e: how many of rows [lo, hi) each
    expert has."""
    ends = counts.cumsum(0)
    starts = ends - counts
    return (ends.clamp(lo, hi) - starts.clamp(lo, hi)).clamp_min(0)


class _ShareCtx(torch.autograd.function.FunctionCtx):
    """The ctx of _TakeShare and _GatherShares as their forward fills it."""

    group: comm.Group
    n: int
    lo: int
    hi: int


def _gather_padded(share: torch.Tensor, n: int, group: comm.Group) -> torch.Tensor:
    """Every rank's share (`share_of`) of n rows, all-gathered into the n rows."""
    each = -(-n // group.size)
    padded = share.new_zeros(each, *share.shape[1:])
    padded[:share.shape[0]] = share
    return comm.all_gather(padded, group=group)[:n]


class _TakeShare(torch.autograd.Function):
    """This rank's share of rows every rank of the group holds alike, in forward; the
    shares' gradients all-gathered in backward (each rank's gradient of the whole rows is
    then the same, as the replicated computation around it needs): Megatron's scatter to
    the tensor-parallel region."""

    @staticmethod
    def forward(ctx: _ShareCtx, rows: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group, ctx.n = group, rows.shape[0]
        lo, hi = share_of(rows.shape[0], group.rank, group.size)
        return rows[lo:hi].contiguous()

    @staticmethod
    def backward(ctx: _ShareCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_padded(grad.contiguous(), ctx.n, ctx.group), None


class _GatherShares(torch.autograd.Function):
    """Every rank's share all-gathered into the whole rows in forward; this rank's share of
    their gradient (the same on every rank) in backward: Megatron's gather from the
    tensor-parallel region."""

    @staticmethod
    def forward(ctx: _ShareCtx, share: torch.Tensor, n: int, group: comm.Group
                ) -> torch.Tensor:
        ctx.lo, ctx.hi = share_of(n, group.rank, group.size)
        return _gather_padded(share.contiguous(), n, group)

    @staticmethod
    def backward(ctx: _ShareCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[ctx.lo:ctx.hi].contiguous(), None, None


def take_share(rows: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """This rank's share (`share_of`) of `rows`, which every rank of `group` holds alike;
    differentiable (see _TakeShare)."""
    return _TakeShare.apply(rows, group)


def gather_shares(share: torch.Tensor, n: int, group: comm.Group) -> torch.Tensor:
    """The n rows whose shares the ranks of `group` hold, on every rank; differentiable
    (see _GatherShares)."""
    return _GatherShares.apply(share, n, group)
