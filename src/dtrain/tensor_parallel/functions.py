"""The differentiable collectives of tensor parallelism: what crosses ranks, and its gradient.

Megatron-LM (Shoeybi et al., 2019, section 3) splits a layer's weight across the ranks of a
tensor-parallel group and needs just two conjugate operators to keep forward and backward
right:

    f = copy_to_group      forward: identity           backward: all-reduce (sum)
    g = reduce_from_group  forward: all-reduce (sum)   backward: identity

An MLP `Y = GeLU(X A) B` with A split by columns and B by rows runs `f` before A and `g`
after B: one all-reduce forward and one backward. Attention does the same with Q, K, V split
by heads. `gather_last` and `scatter_last` move between a tensor split along its last
dimension and the whole one (each the other's gradient).

Sequence parallelism (Korthikanti et al., 2022, section 4.2.2) keeps the activations
between those regions as each rank's part of the sequence (dimension 1 of [batch, time,
width]) and replaces `f` and `g` by the two halves of an all-reduce:

    gather_sequence          forward: all-gather       backward: reduce-scatter
    reduce_scatter_sequence  forward: reduce-scatter   backward: all-gather
    scatter_sequence         forward: keep own part    backward: all-gather

An all-gather and a reduce-scatter move what one all-reduce moves, so the communication
is the same; the norms, dropouts and residuals in between hold 1/tp of the activations.
A column-parallel layer there keeps only its part of its input for backward and gathers it
again for its weight's gradient (`GatheredLinear`), once for the layers reading it
(`Regather`), in the row-parallel layer's backward all-gather when one comes just before.

Every function takes the tensor-parallel `group` (a dtrain Group) and an `algorithm` for
dtrain.comm; a group of one is the identity. Each is a graph break for torch.compile
(`dtrain.graph_break`): a compiled block (dtrain.models.compiled) runs its collectives
eagerly between compiled regions, which every block of the model shares.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from dtrain import comm
from dtrain.comm.collectives import Result
from dtrain.graph_break import graph_break
from dtrain.models.float8 import Matmul

SEQUENCE = 1
"""The sequence dimension of a [batch, time, width] activation."""


def _all_reduce(x: torch.Tensor, group: comm.Group, algorithm: str) -> torch.Tensor:
    return comm.all_reduce(x.contiguous().clone(), group=group, algorithm=algorithm)


def _gather(x: torch.Tensor, dim: int, group: comm.Group, algorithm: str) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    stacked = comm.all_gather(x.contiguous(), group=group, algorithm=algorithm)
    pieces = stacked.view(group.size, *x.shape)
    return torch.cat(pieces.unbind(0), dim=dim)


def _own_block(x: torch.Tensor, dim: int, group: comm.Group) -> torch.Tensor:
    """This rank's block of `x`'s dimension `dim`."""
    width = x.shape[dim] // group.size
    return x.narrow(dim, group.rank * width, width).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: comm.Group,
                    algorithm: str) -> torch.Tensor:
    """The sum over ranks of `x`, this rank's block of `dim` only."""
    front = x.movedim(dim, 0).contiguous()  # each rank's block: a contiguous shard
    part = comm.reduce_scatter(front, group=group, algorithm=algorithm)
    return part.view(front.shape[0] // group.size, *front.shape[1:]).movedim(0, dim)


class _GroupCtx(FunctionCtx):
    """The ctx of a Function whose backward communicates over `group` with `algorithm`
    (torch types a ctx as a bare FunctionCtx)."""

    group: comm.Group
    algorithm: str


class _GatherCtx(FunctionCtx):
    """Gather's ctx: the dimension and group its backward cuts this rank's block by."""

    dim: int
    group: comm.Group


class _ScatterCtx(_GroupCtx):
    """Scatter's ctx: its backward gathers along `dim`."""

    dim: int


class _ReduceScatterCtx(_GroupCtx):
    """ReduceScatterSequence's ctx."""

    regather: Regather | None


class _GatheredLinearCtx(FunctionCtx):
    """GatheredLinear's ctx as its forward fills it."""

    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]
    again: Regather
    has_bias: bool


class CopyToGroup(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) of the gradient in backward: Megatron's `f`.

    Placed where a replicated activation enters split computation: each rank's branch
    contributes part of the input's gradient, and the sum is the whole of it.
    """

    @staticmethod
    def forward(ctx: _GroupCtx, x: torch.Tensor, group: comm.Group, algorithm: str
                ) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: _GroupCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group, ctx.algorithm), None, None


class ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: Megatron's `g`.

    Placed where split computation produces partial sums of a replicated activation; every
    rank then holds the whole result, and its gradient is already the same everywhere.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: comm.Group, algorithm: str
                ) -> torch.Tensor:
        return _all_reduce(x, group, algorithm)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class Gather(torch.autograd.Function):
    """All-gather along `dim` in forward; keep this rank's block in backward (the gathered
    tensor's gradient is the same on every rank)."""

    @staticmethod
    def forward(ctx: _GatherCtx, x: torch.Tensor, dim: int, group: comm.Group,
                algorithm: str) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group, algorithm)

    @staticmethod
    def backward(ctx: _GatherCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _own_block(grad, ctx.dim, ctx.group), None, None, None


class Scatter(torch.autograd.Function):
    """Keep this rank's block of `dim` in forward; all-gather it in backward."""

    @staticmethod
    def forward(ctx: _ScatterCtx, x: torch.Tensor, dim: int, group: comm.Group,
                algorithm: str) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.algorithm = dim, group, algorithm
        return _own_block(x, dim, group)

    @staticmethod
    def backward(ctx: _ScatterCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.dim, ctx.group, ctx.algorithm), None, None, None


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence in forward, reduce-scatter in backward: sequence
    parallelism's `g` (Korthikanti et al., 2022), before a column-parallel layer. Each
    rank's split layer contributes part of the whole sequence's gradient; the sum over
    ranks is the whole of it, and each rank keeps its own part's."""

    @staticmethod
    def forward(ctx: _GroupCtx, x: torch.Tensor, group: comm.Group, algorithm: str
                ) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return _gather(x, SEQUENCE, group, algorithm)

    @staticmethod
    def backward(ctx: _GroupCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, SEQUENCE, ctx.group, ctx.algorithm), None, None


class ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence in forward, all-gather in backward: sequence
    parallelism's `g-bar`, after a row-parallel layer. The partial sums of the whole
    sequence become each rank's part of the summed output.

    `regather`: the Regather of the input the column-parallel layers before this one read
    (attention's q, k and v before its output projection). Their backward comes next and
    needs that input whole again; when it is still wanted, this backward's all-gather
    carries it too, stacked with the gradient: one call for both."""

    @staticmethod
    def forward(ctx: _ReduceScatterCtx, x: torch.Tensor, group: comm.Group, algorithm: str,
                regather: Regather | None) -> torch.Tensor:
        ctx.group, ctx.algorithm, ctx.regather = group, algorithm, regather
        return _reduce_scatter(x, SEQUENCE, group, algorithm)

    @staticmethod
    def backward(ctx: _ReduceScatterCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, None, None, None]:
        regather = ctx.regather
        part = regather.wanted() if regather is not None else None
        if (regather is None or part is None or part.shape != grad.shape
                or part.dtype != grad.dtype):
            return _gather(grad, SEQUENCE, ctx.group, ctx.algorithm), None, None, None
        both = _gather(torch.stack((grad, part)), SEQUENCE + 1, ctx.group, ctx.algorithm)
        regather.fill(both[1])
        return both[0], None, None, None


def _divides(x: torch.Tensor, dim: int, group: comm.Group, what: str) -> None:
    if x.shape[dim] % group.size:
        raise ValueError(f"{what} {x.shape[dim]} does not divide into {group.size} ranks")


@graph_break
def copy_to_group(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """`f`: identity forward, gradient summed across `group` backward."""
    return x if group.size == 1 else CopyToGroup.apply(x, group, algorithm)


@graph_break
def reduce_from_group(x: torch.Tensor, group: comm.Group,
                      algorithm: str = "auto") -> torch.Tensor:
    """`g`: summed across `group` forward, gradient passed through backward."""
    return x if group.size == 1 else ReduceFromGroup.apply(x, group, algorithm)


@graph_break
def gather_last(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """The whole tensor from every rank's block of the last dimension (differentiable)."""
    return x if group.size == 1 else Gather.apply(x, -1, group, algorithm)


@graph_break
def scatter_last(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """This rank's block of the last dimension, which must divide by the group size
    (differentiable)."""
    if group.size == 1:
        return x
    _divides(x, -1, group, "last dimension")
    return Scatter.apply(x, -1, group, algorithm)


@graph_break
def gather_sequence(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """The whole sequence from every rank's part of dimension 1; the gradient is summed
    over `group` and cut back to this rank's part (differentiable)."""
    return x if group.size == 1 else GatherSequence.apply(x, group, algorithm)


@graph_break
def reduce_scatter_sequence(x: torch.Tensor, group: comm.Group, algorithm: str = "auto",
                            regather: Regather | None = None) -> torch.Tensor:
    """This rank's part of dimension 1 of the sum of `x` over `group`; the gradient is
    gathered whole (differentiable), with `regather`'s part in the same call when it is
    still wanted (see ReduceScatterSequence)."""
    return x if group.size == 1 else ReduceScatterSequence.apply(x, group, algorithm, regather)


@graph_break
def scatter_sequence(x: torch.Tensor, group: comm.Group, algorithm: str = "auto") -> torch.Tensor:
    """This rank's part of dimension 1, which must divide by the group size; the gradient
    is gathered whole (differentiable)."""
    if group.size == 1:
        return x
    _divides(x, SEQUENCE, group, "sequence length")
    return Scatter.apply(x, SEQUENCE, group, algorithm)


class Regather:
    """One sequence part gathered whole again in backward, once for all the layers that
    read it (Llama's q, k and v; its gate and up).

    Each layer counts itself in forward (`users`); in backward the first to need the whole
    starts the all-gather (`start`, asynchronous), and every one `take`s it; the last one
    drops it, so the whole lives only while those layers' backward runs. Backward reaches
    the layers in the same order on every rank, so the gathers line up.
    """

    def __init__(self, part: torch.Tensor, group: comm.Group, algorithm: str) -> None:
        self.group, self.algorithm = group, algorithm
        self.users = 0
        self.partnered = False  # a row-parallel layer's backward gathers it (`fill`)
        self._part = weakref.ref(part)  # the layers keep it for backward, not this
        self._taken = 0
        self._whole: torch.Tensor | None = None
        self._pending: Result[torch.Tensor] | None = None

    def wanted(self) -> torch.Tensor | None:
        """The part to gather, if layers will still take the whole and it is not here or on
        its way (None: nothing to do)."""
        if self._taken >= self.users or self._whole is not None or self._pending is not None:
            return None
        part = self._part()
        return None if part is None else part.detach()

    def fill(self, whole: torch.Tensor) -> None:
        """The whole, gathered by someone else (a row-parallel layer's backward)."""
        self._whole = whole

    def start(self, part: torch.Tensor) -> None:
        """Start gathering `part` unless the whole is here or on its way."""
        if self._whole is None and self._pending is None:
            # detached: a point-to-point algorithm copies it on the group's own thread,
            # where grad mode is on
            self._pending = comm.all_gather(part.detach().contiguous(), group=self.group,
                                            async_op=True, algorithm=self.algorithm)

    def take(self, part: torch.Tensor) -> torch.Tensor:
        """The whole sequence `part` is this rank's part of (waiting for the gather)."""
        self.start(part)
        if self._whole is None:
            assert self._pending is not None  # start() has just begun the gather
            stacked = self._pending.wait()
            self._pending = None
            pieces = stacked.view(self.group.size, *part.shape)
            self._whole = torch.cat(pieces.unbind(0), dim=SEQUENCE)
        whole = self._whole
        self._taken += 1
        if self._taken >= self.users:  # the last of this backward: a retained graph starts over
            self._whole, self._taken = None, 0
        return whole


class GatheredLinear(torch.autograd.Function):
    """`F.linear(whole, weight, bias)` for a column-parallel layer under sequence
    parallelism, keeping for backward this rank's `part` of the input instead of the whole
    (Korthikanti et al., 2022, section 4.2.2: the weight gradient needs the whole sequence,
    gathered again in backward).

    `whole` is `part` gathered (gather_sequence), so its gradient flows back through that
    gather's reduce-scatter as before. In backward the gather of `part` (shared through
    `again` with the other layers reading it) runs while the input gradient is computed;
    then the weight gradient reads it."""

    @staticmethod
    def forward(ctx: _GatheredLinearCtx, part: torch.Tensor, whole: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None, again: Regather
                ) -> torch.Tensor:
        ctx.save_for_backward(part, weight)
        ctx.again, ctx.has_bias = again, bias is not None
        again.users += 1
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx: _GatheredLinearCtx, grad: torch.Tensor
                 ) -> tuple[None, torch.Tensor | None, torch.Tensor | None,
                            torch.Tensor | None, None]:
        part, weight = ctx.saved_tensors
        _, wants_input, wants_weight, wants_bias, _ = ctx.needs_input_grad
        if wants_weight:
            ctx.again.start(part)  # in flight while the input gradient is computed
        grad_input = grad.matmul(weight) if wants_input else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = None
        if wants_weight:
            whole = ctx.again.take(part)
            grad_weight = rows.t().matmul(whole.reshape(-1, whole.shape[-1]))
        grad_bias = rows.sum(0) if ctx.has_bias and wants_bias else None
        return None, grad_input, grad_weight, grad_bias, None


@dataclass(frozen=True)
class _KeptPart:
    """What a column-parallel layer's own product saved in place of its whole input: this
    rank's part, gathered whole again through `again` when backward reads it."""

    part: torch.Tensor
    again: Regather


@graph_break
def matmul_keeping_part(part: torch.Tensor, whole: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None, again: Regather, matmul: Matmul
                        ) -> torch.Tensor:
    """`matmul(whole, weight, bias)` for a product that saves its own input for backward
    (FP8's: torchao's Float8Linear keeps it in high precision), with the saved input
    replaced by `part`, gathered whole again (through `again`, shared with the other
    layers reading it) when backward reads it: the whole sequence is held only while that
    backward runs, as GatheredLinear holds it for F.linear. Only `whole` itself is
    replaced (the same storage, shape, strides and offset: the gather lays its result out
    otherwise than `again` does, so a view of it could not be rebuilt); anything else the
    product saves is kept as it is."""
    layout = (whole.untyped_storage().data_ptr(), whole.shape, whole.stride(),
              whole.storage_offset())

    def pack(saved: torch.Tensor) -> torch.Tensor | _KeptPart:
        if (saved.untyped_storage().data_ptr(), saved.shape, saved.stride(),
                saved.storage_offset()) != layout:
            return saved
        again.users += 1
        return _KeptPart(part, again)

    def unpack(kept: torch.Tensor | _KeptPart) -> torch.Tensor:
        return kept.again.take(kept.part) if isinstance(kept, _KeptPart) else kept

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return matmul(whole, weight, bias)


@graph_break
def gathered_linear(part: torch.Tensor, whole: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, again: Regather) -> torch.Tensor:
    """`F.linear(whole, weight, bias)` keeping only `part` (of which `whole` is the
    gathered sequence) for backward; see GatheredLinear."""
    return GatheredLinear.apply(part, whole, weight, bias, again)


class SequenceGather:
    """`gather_sequence` for the column-parallel layers of one model, done once per input.

    Llama's q, k and v projections (and its gate and up) read the same norm output; they
    share one all-gather: the gathered tensor feeds each of them, autograd sums their
    gradients into it, and one reduce-scatter sends the sum back. They share the gather in
    backward too (`Regather`). The one entry kept is the last input (by identity, weakly,
    with its version and the grad mode), its gathered tensor and its Regather; it goes when
    that input is freed or at `forget` (dtrain.tensor_parallel.sequence calls it when the
    module calling the layers returns), so no gathered tensor outlives the layers' forward.
    A recomputation (activation checkpointing) makes a new input and gathers it anew.
    """

    def __init__(self, group: comm.Group, algorithm: str = "auto") -> None:
        self.group, self.algorithm = group, algorithm
        self._last: tuple[weakref.ref, tuple[int, bool], torch.Tensor, Regather] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gathered(x)[0]

    @graph_break
    def gathered(self, x: torch.Tensor) -> tuple[torch.Tensor, Regather | None]:
        """(`x` gathered whole, the Regather the layers reading it share in backward; None
        without autograd)."""
        if x.is_inference():  # no version counter to tell a change by
            return gather_sequence(x, self.group, self.algorithm), None
        stamp = (x._version, torch.is_grad_enabled())
        last = self._last
        if last is not None and last[0]() is x and last[1] == stamp:
            return last[2], last[3] if stamp[1] else None
        whole = gather_sequence(x, self.group, self.algorithm)
        owner = weakref.ref(self)  # the callback must not keep this object alive

        def forget(ref: weakref.ref) -> None:
            me = owner()
            if me is not None and me._last is not None and me._last[0] is ref:
                me._last = None

        again = Regather(x, self.group, self.algorithm)
        self._last = (weakref.ref(x, forget), stamp, whole, again)
        return whole, again if stamp[1] else None

    def partner(self) -> Regather | None:
        """For the row-parallel layer after the column-parallel ones that read the last
        input: that input's Regather, once, if those layers keep only its part (see
        ReduceScatterSequence); else None."""
        last = self._last
        if last is None or not last[1][1] or last[3].users == 0 or last[3].partnered:
            return None
        last[3].partnered = True
        return last[3]

    def forget(self) -> None:
        """Drop the gathered tensor kept for the next layer reading the same input."""
        self._last = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last": None}  # a copy of the model starts empty
