"""Expert parallelism's all-to-all hidden under compute, inside one micro-batch.

One exchange (dtrain.models.moe.experts.Dispatch) sends every row to its expert's rank,
waits, computes, sends the results back and waits again: the exchanges and the experts'
compute take turns, and every exchange is exposed. Here the exchange is cut into C chunks
by the experts the rows go to: chunk c carries, from every rank of the group to every
other, the rows of the local experts [b_c, b_c+1) (each rank's L experts cut into C runs of
near-equal length). Forward:

    start the C dispatches                 (in flight one after the other)
    the shared experts                     (the layer's, while dispatch 0 travels)
    for each chunk c: wait for dispatch c, its experts compute, start its combine
                                           (combine c and dispatch c+1 travel while
                                            chunk c+1's experts compute)
    wait for the combines

Backward is the same the other way round: the combines' gradients start at once; for
each chunk, wait for its gradients, its experts' backward, start its dispatch's gradient
back (which travels while the next chunk's backward computes); then autograd runs the
shared experts' backward while the last of those travel, and only then waits for them.

Why chunks of experts rather than of tokens: every expert's rows then arrive in one chunk,
in the order one exchange gives them (by source rank), so each expert computes the same
products on the same rows, and the result is the one exchange's bit for bit, forward and
backward (tests/models/test_moe_overlap.py; dtrain.models.moe.experts.swiglu computes each
expert on its own rows for that). A chunk of tokens would cut an expert's rows between
products and sum its weight gradient in another order. The price: at most L chunks (more
act as L), each as large as its experts' load.

Two autograd functions make one call (`Overlapped`): `_Dispatch` starts the dispatches and
in backward waits for the dispatches' gradients, `_Experts` does the rest; the shared
experts run between them in the layer's own graph, so autograd orders their backward
between the two as it orders their forward (the layer's hooks, and a zero-bubble
pipeline's deferred weight gradients, see them as always). Each chunk's experts compute in
a graph of their own, built in forward, whose backward `_Experts` runs when the schedule
says (autograd would run an exchange's backward and wait for it at once); the stacked
weights enter it as detached aliases, whose gradients `_Experts` returns for autograd to
hand the parameters, once.

On CPU the async collectives of gloo run on its own threads while this one computes; on
GPUs NCCL runs them on its stream, the compute stream waiting only where a chunk's rows
are read. Every wait is an "all-to-all wait" span of category "moe wait" on the timeline:
the exchange time compute did not hide (benchmarks/moe_overlap.py reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dtrain import timeline
from dtrain.comm import GroupLike
from dtrain.models.moe.experts import (
    Counts,
    Pending,
    by_local_expert,
    start_exchange,
    swiglu,
    wait_rows,
)


@dataclass
class Chunks:
    """How C chunks cut one exchange of rows sorted by global expert (see the module's
    docstring): per chunk, the rows sent to and received from each rank of the group, the
    rows per local expert once received, and the order that sorts what arrived by
    expert; `perm`, this rank's rows in chunk order (chunk, then destination, then expert).

    Build with `Chunks.of`."""

    group: GroupLike
    bounds: list[int]
    send: list[list[int]]
    recv: list[list[int]]
    counts: list[list[int]]
    orders: list[torch.Tensor]
    perm: torch.Tensor

    @classmethod
    def of(cls, counts: torch.Tensor, group: GroupLike, size: int, chunks: int,
           device: torch.device) -> Chunks:
        """The chunks of an exchange of rows, `counts[e]` for global expert e (E / size
        consecutive experts on each of the `size` ranks of `group`), in `chunks` runs of
        local experts (at most one per local expert). Collective: every rank of `group`
        exchanges its counts."""
        exchanged = Counts.exchanged(counts, group, size, device)
        local = exchanged.local
        n = min(chunks, local)
        bounds = [local * c // n for c in range(n + 1)]
        sent, received = exchanged.sent, exchanged.received  # on the host
        flat = sent.reshape(-1)
        starts = (flat.cumsum(0) - flat).view(size, local)  # each expert's first row
        send, recv, per_expert, orders, pieces = [], [], [], [], []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            to_each = sent[:, lo:hi].sum(1)
            send.append(to_each.tolist())
            recv.append(received[:, lo:hi].sum(1).tolist())
            per_expert.append(received[:, lo:hi].sum(0).tolist())
            orders.append(by_local_expert(received[:, lo:hi], device))
            pieces += [torch.arange(int(starts[j, lo]), int(starts[j, lo] + to_each[j]))
                       for j in range(size)]
        perm = torch.cat(pieces).to(device)
        return cls(group, bounds, send, recv, per_expert, orders, perm)

    def __len__(self) -> int:
        return len(self.send)

    def sizes(self) -> list[int]:
        """Rows this rank sends in each chunk."""
        return [sum(s) for s in self.send]


@dataclass
class _Graph:
    """A chunk's expert compute, run in forward in a graph of its own: its output, and the
    leaves its backward returns gradients for."""

    output: torch.Tensor
    leaves: tuple[torch.Tensor, ...]

    def backward(self, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(self.output, self.leaves, grad)


def _leaf(t: torch.Tensor, graph: bool) -> torch.Tensor:
    """A leaf of a graph of its own holding `t`'s values (no hook of `t`'s fires on it)."""
    return t.detach().requires_grad_(graph)


@dataclass
class Overlapped:
    """One chunked exchange of rows sorted by global expert, through the experts on the
    ranks that hold them (see the module's docstring): `Overlapped(rows, ...)` starts the
    dispatches, `finish(gate_up, down)` computes this rank's chunks and brings every row's
    output back; compute what should hide the first dispatch in between. Differentiable;
    collective over the expert-parallel group.

    Args:
        rows: (n, dim) rows sorted by global expert, `counts[e]` of them for expert e.
        counts: (E,) rows per global expert, E / size consecutive experts on each of the
            `size` ranks of the expert-parallel `group`.
        chunks: how many chunks (at most one per local expert).
    """

    plan: Chunks
    n: int
    going: list[Pending] = field(default_factory=list)
    """Forward: the chunks' dispatches in flight. Backward: their gradients, on the way
    back."""
    graphs: list[_Graph] = field(default_factory=list)
    token: torch.Tensor | None = None
    """What ties `finish`'s autograd function to the start's (None without gradients)."""

    def __init__(self, rows: torch.Tensor, counts: torch.Tensor, group: GroupLike, size: int,
                 chunks: int) -> None:
        self.plan = Chunks.of(counts, group, size, chunks, rows.device)
        self.n, self.going, self.graphs, self.token = rows.shape[0], [], [], None
        if torch.is_grad_enabled() and rows.requires_grad:
            self.token = _Dispatch.apply(self, rows)
        else:
            self.send(rows)

    def finish(self, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """The rows' outputs (in `rows`' order) from the local experts of stacked weights
        `gate_up`, `down` (this rank's) and the other ranks'."""
        if self.token is None and not (torch.is_grad_enabled() and
                                       (gate_up.requires_grad or down.requires_grad)):
            return self.compute(gate_up, down, graph=False)
        token = self.token if self.token is not None else gate_up.new_empty(0)
        return _Experts.apply(self, token, gate_up, down)

    # ------------------------------------------------------------------ the schedule
    def send(self, rows: torch.Tensor) -> None:
        """Start every chunk's dispatch."""
        plan = self.plan
        in_order = rows.index_select(0, plan.perm).split(plan.sizes())
        self.going = [start_exchange(part, plan.group, plan.send[c], plan.recv[c])
                      for c, part in enumerate(in_order)]

    def compute(self, gate_up: torch.Tensor, down: torch.Tensor, graph: bool
                ) -> torch.Tensor:
        """Forward from the dispatches in flight: each chunk waited for, computed, its
        combine started; the combines waited for (`graph`: each chunk's graph kept)."""
        plan, coming = self.plan, []
        for c, lo, hi in zip(range(len(plan)), plan.bounds, plan.bounds[1:], strict=False):
            tokens = wait_rows(self.going[c]).index_select(0, plan.orders[c])
            with timeline.span("moe experts", "moe"), torch.enable_grad():
                x, gu, dn = (_leaf(t, graph) for t in (tokens, gate_up[lo:hi], down[lo:hi]))
                out = swiglu(x, gu, dn, plan.counts[c])
                if graph:
                    self.graphs.append(_Graph(out, (x, gu, dn)))
            back = torch.empty_like(out).index_copy(0, plan.orders[c], out.detach())
            coming.append(start_exchange(back, plan.group, plan.recv[c], plan.send[c]))
        self.going = []
        returned = torch.cat([wait_rows(p) for p in coming])
        return torch.empty_like(returned).index_copy(0, plan.perm, returned)

    def backward(self, grad: torch.Tensor, grad_gate_up: torch.Tensor,
                 grad_down: torch.Tensor) -> None:
        """Backward of `compute`: the combines' gradients started at once, each chunk's
        experts' backward as its gradients arrive (into `grad_gate_up`, `grad_down`), its
        dispatch's gradient started back (`received` waits for them) where the rows take
        one (on every rank alike: the same model)."""
        plan = self.plan
        in_order = grad.index_select(0, plan.perm).split(plan.sizes())
        coming = [start_exchange(part, plan.group, plan.send[c], plan.recv[c])
                  for c, part in enumerate(in_order)]
        for c, lo, hi in zip(range(len(plan)), plan.bounds, plan.bounds[1:], strict=False):
            arrived = wait_rows(coming[c]).index_select(0, plan.orders[c])
            with timeline.span("moe experts backward", "moe"):
                grad_x, grad_gate_up[lo:hi], grad_down[lo:hi] = self.graphs[c].backward(arrived)
            if self.token is not None:
                back = torch.empty_like(grad_x).index_copy(0, plan.orders[c], grad_x)
                self.going.append(start_exchange(back, plan.group, plan.recv[c],
                                                 plan.send[c]))
        self.graphs = []

    def received(self) -> torch.Tensor:
        """The gradient of the rows, once the dispatches' gradients have come back."""
        returned = torch.cat([wait_rows(p) for p in self.going])
        self.going = []
        return torch.empty_like(returned).index_copy(0, self.plan.perm, returned)


class _Ctx(torch.autograd.function.FunctionCtx):
    """_Dispatch's and _Experts' ctx as their forward fills it."""

    exchange: Overlapped
    shapes: tuple[torch.Size, torch.Size]


class _Dispatch(torch.autograd.Function):
    """Starts the chunks' dispatches in forward (returning an empty token that ties
    `_Experts` to it); in backward, waits for the dispatches' gradients `_Experts` started
    and returns the rows' gradient."""

    @staticmethod
    def forward(ctx: _Ctx, exchange: Overlapped, rows: torch.Tensor) -> torch.Tensor:
        ctx.exchange = exchange
        exchange.send(rows)
        return rows.new_empty(0)

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, ctx.exchange.received()


class _Experts(torch.autograd.Function):
    """Forward from the dispatches in flight to the rows' outputs (`Overlapped.compute`);
    backward through the experts to the dispatches' gradients, started
    (`Overlapped.backward`), and the stacked weights' gradients."""

    @staticmethod
    def forward(ctx: _Ctx, exchange: Overlapped, token: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
        ctx.exchange, ctx.shapes = exchange, (gate_up.shape, down.shape)
        return exchange.compute(gate_up, down, graph=True)

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor
                 ) -> tuple[None, torch.Tensor, torch.Tensor, torch.Tensor]:
        grad_gate_up = grad.new_zeros(ctx.shapes[0])
        grad_down = grad.new_zeros(ctx.shapes[1])
        ctx.exchange.backward(grad, grad_gate_up, grad_down)
        return None, grad.new_empty(0), grad_gate_up, grad_down
