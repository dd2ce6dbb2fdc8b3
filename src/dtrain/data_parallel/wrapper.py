"""Synchronous data parallelism: every rank holds the whole model, gradients are averaged.

Each rank runs forward and backward on its own slice of the global batch. Gradients are
averaged across the data-parallel group with allreduce, bucket by bucket, launched from
autograd hooks the moment a bucket is complete, so communication overlaps the rest of
backward. After `loss.backward()` returns, every rank holds the same averaged gradients,
so the same optimizer step keeps the ranks' copies of the model identical: the result
equals one process training on the concatenated batch.

Run it with `dtrain run -n 2 train.py`, where train.py does::

    world = dtrain.init()
    model = dtrain.DataParallel(MyModel())
    ...
    loss.backward()      # gradients averaged across ranks here
    optimizer.step()
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dtrain import comm, timeline
from dtrain.comm.group import Handle
from dtrain.data_parallel import late_grads
from dtrain.data_parallel.agreement import (
    agreement_device,
    broadcast_state,
    broadcast_tensors,
    check_same_model,
)
from dtrain.data_parallel.averaging import Averaging, Carried
from dtrain.data_parallel.buckets import Bucket, build_buckets, launch_ready
from dtrain.data_parallel.clip import GradPart
from dtrain.errors import DtrainError
from dtrain.models.compiled import gradients_together
from dtrain.models.moe import split_experts
from dtrain.sync import compression as compression_mod

FIRST_BUCKET = 1 << 20
"""Bytes of the first bucket at most (DDP's too): communication starts early in backward."""

LAST_BUCKET = 1 << 20
"""Bytes of the last bucket at most: its all-reduce starts only when backward has ended, so
nothing hides it, while the one before it starts as the first layers' backward begins and
is hidden by it (DDP's last bucket is whatever the cap leaves, often most of a small
model). A compiled first block goes into it whole, however large: its gradients all come
at the end of backward, and the bucket before must not wait for them."""

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def _layout(buckets: list[Bucket]) -> list[list[int]]:
    """Which parameters (by id) each bucket holds, in order: two packings compared."""
    return [[id(p) for p in bucket.params] for bucket in buckets]


def agreeing_algorithm(algorithm: str) -> str:
    """The algorithm a wrap checks and broadcasts its model with, given the one it sends
    gradients with: that one where every collective has it ("auto", "native"), else
    "native" ("ring" has no broadcast, "tree" no all-gather)."""
    return algorithm if algorithm in ("auto", "native") else "native"


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """Accept a torch dtype or its short name ("bf16", "fp16", "fp32"); None stays None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise DtrainError(f"unknown dtype {value!r}: use one of {', '.join(_DTYPES)}")
    return _DTYPES[value]


class DataParallel(nn.Module):
    """Wrap a module so its gradients are averaged across a data-parallel group.

    Args:
        module: the model; its parameters and buffers are broadcast from the group's first
            rank at wrap time so every rank's copy starts identical.
        group: the data-parallel group (e.g. `mesh.group("dp")`); default the world.
        bucket_mb: cap on a gradient bucket's size in MB; smaller buckets start
            communicating earlier, larger ones pay less per-message latency.
        grad_dtype: communicate gradients in this dtype ("bf16", "fp16" or a torch dtype)
            to halve the bytes sent; gradients are cast back to the parameter dtype.
        algorithm: the allreduce algorithm for gradient buckets (see `dtrain.comm`); the
            wrap's own checks and broadcasts take it where it is "auto" or "native", else
            "native" (not every algorithm exists for every collective).
        averaging: average over live replicas that may change from step to step instead of a
            fixed group (dtrain.data_parallel.averaging; fault tolerance, dtrain.ft, hands
            one): the buckets are summed by it, and a step it does
            not count leaves this live replica's own gradients. The wrap then neither checks
            nor broadcasts the model: the averaging makes the live replicas identical.
        compression: send the gradients compressed (dtrain.sync.compression):
            "powersgd" or "int8" with their defaults, or a `Compressor`; the gradients
            are reduced as one bucket at the end of backward (each collective costs round
            trips), and a parameter no rank used gets a zero gradient (presence is not
            sent). Its error feedback is `compression_state()`.
        expert_group: under expert parallelism, the ranks that hold the same experts as
            this one (`mesh.group("edp")`): the experts each rank holds of the model's MoE
            layers (dtrain.models.moe.split_experts) are summed over it, divided by the
            whole group's size (each holder's gradient came from the tokens of its own
            expert-parallel peers), in buckets of their own; the rest as always.

    Parameters that receive no gradient in a step (unused branches) are fine: their slots
    are sent as zeros, and a parameter no rank used keeps `grad = None`, as in one process.

    Raises:
        DtrainError: ranks hold models with different parameters; `averaging` with
            `group`, an algorithm, or compression.
    """

    def __init__(
        self,
        module: nn.Module,
        group: comm.GroupLike = None,
        bucket_mb: float = 25.0,
        grad_dtype: torch.dtype | str | None = None,
        algorithm: str = "auto",
        averaging: Averaging | None = None,
        compression: str | compression_mod.Compressor | None = None,
        expert_group: comm.GroupLike = None,
    ) -> None:
        super().__init__()
        if bucket_mb <= 0:
            raise DtrainError(f"bucket_mb={bucket_mb} must be positive")
        compressor = compression_mod.make(compression) if isinstance(compression, str) \
            else compression
        if compressor is not None and (averaging is not None or grad_dtype is not None):
            raise DtrainError("DataParallel(compression=...) sends its own encoding of fp32 "
                              "gradients over a fixed group: leave grad_dtype= and averaging= "
                              "unset")
        experts = split_experts(module)
        if experts and (averaging is not None or compressor is not None
                        or expert_group is None):
            raise DtrainError("DataParallel of a model whose experts are split (expert "
                              "parallelism) needs expert_group= (mesh.group(\"edp\")), and "
                              "takes neither averaging= nor compression=")
        self._experts = frozenset(id(p) for p in experts)
        self.expert_group = comm.resolve(expert_group) if experts else None
        self.module = module
        self.averaging = averaging
        if averaging is None:
            self.group: comm.Group | None = comm.resolve(group)
            self.size = self.group.size
        else:
            if group is not None or algorithm != "auto":
                raise DtrainError("DataParallel(averaging=...) averages over the live replicas the "
                                  "averaging chooses, its own way: leave group= and "
                                  "algorithm= unset")
            averaging.attach(Carried.of(module), None)
            self.group, self.size = None, 0  # size: the averaging's, per step
        self.algorithm = algorithm
        self._agreeing = agreeing_algorithm(algorithm)
        self.grad_dtype = parse_dtype(grad_dtype)
        self.compressor = compressor if self.size > 1 else None
        # what a gradient is multiplied by as it enters its bucket (the compressor and an
        # averaging divide once they have summed)
        self._scale = 1.0 if self.compressor is not None or averaging is not None \
            else 1.0 / self.size
        self._sync = True
        self._finalize_queued = False
        self._next_launch = 0
        self._works: list[Handle] = []
        self._late: list[tuple[int, late_grads.Finisher]] = []  # read at the end of backward
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._position = {id(p): k for k, p in enumerate(self._params)}
        self._bucket_bytes = int(bucket_mb * 1024 * 1024)
        averages = averaging is not None or self.size > 1  # a group of one: nothing to do
        self._buckets: list[Bucket] = []
        self._unpacked: dict[int, torch.Tensor] = {}  # grad_dtype's buckets, cast back
        self._where: dict[int, tuple[Bucket, int]] = {}
        if averages:
            self._pack(list(reversed(range(len(self._params)))))
        # The order backward makes the gradients in, noted in the first averaged backward:
        # the buckets are then repacked in it, so each is complete as early as it can be.
        # (Not when compressing: error feedback is kept per bucket, from the first step on.)
        self._seen: list[int] | None = [] if averaging is None and averages and \
            self.compressor is None else None
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(k))
                       for k, p in enumerate(self._params)]
        if self.group is not None and self.size > 1:  # the group: no averaging
            check_same_model(self._params, self.group, "DataParallel", self._agreeing)
            broadcast_state(module, self.group, self._agreeing, skip=self._experts)
            if self.expert_group is not None and self.expert_group.size > 1:
                broadcast_tensors(experts, self.expert_group, self._agreeing)

    def _pack(self, order: list[int]) -> None:
        """Use `_packed(order)`'s buckets."""
        self._buckets = self._packed(order)
        self._where = {self._position[id(p)]: (bucket, i)
                       for bucket in self._buckets for i, p in enumerate(bucket.params)}

    def _packed(self, order: list[int]) -> list[Bucket]:
        """Buckets of the parameters in `order` (indices), the first of at most 1 MB, cut
        between compiled blocks (whose gradients come at once: dtrain.models.compiled);
        one when compressing (reduced after backward anyway: each bucket costs round
        trips). Asked at each packing: blocks compiled after the wrap count from the
        repacking after the first backward."""
        params = [self._params[k] for k in order]
        if self.compressor is not None:
            return build_buckets(params, sys.maxsize, None)
        burst = {id(p): k for k, block in enumerate(gradients_together(self.module))
                 for p in block}
        return build_buckets(params, self._bucket_bytes, self.grad_dtype,
                             min(self._bucket_bytes, FIRST_BUCKET),
                             min(self._bucket_bytes, LAST_BUCKET),
                             apart=self._is_expert if self._experts else None,
                             burst=lambda p: burst.get(id(p)))

    def _is_expert(self, p: nn.Parameter) -> bool:
        return id(p) in self._experts

    # ----------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, inside this context.

        The first backward outside it averages everything accumulated so far, so k-1
        micro-batches under `no_sync()` plus one outside equal one batch k times larger.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ----------------------------------------------------------------- backward
    def _make_hook(self, k: int):
        # Runs once per parameter per backward, on autograd's thread: kept to a few lines.
        def hook(param: torch.Tensor) -> None:
            if not self._sync or not self._buckets:
                return
            if not self._finalize_queued:
                self._finalize_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            finisher = late_grads.late(param)
            if finisher is not None:  # summed over tp at the end of backward: read it then
                self._late.append((k, finisher))
                return
            self._ready(k, param)

        return hook

    def _ready(self, k: int, param: torch.Tensor) -> None:
        if self._seen is not None:
            self._seen.append(k)
        bucket, i = self._where[k]
        self._fill_slot(bucket, i, param)
        bucket.ready[i] = True
        bucket.pending -= 1
        if not bucket.pending:  # only a completed bucket can let the next launch go
            self._launch_ready()

    def _read_late(self) -> None:
        """The gradients finished at the end of backward (dtrain.data_parallel.late_grads), into
        their buckets."""
        late, self._late = self._late, []
        for _, finisher in late:
            finisher.finish()
        for k, _ in late:
            self._ready(k, self._params[k])

    def _fill_slot(self, bucket: Bucket, i: int, param: torch.Tensor) -> None:
        """Copy param's local gradient into its slot, pre-divided by the group size (the
        compressor and an averaging divide once they have summed). Called where autograd
        records nothing (backward's hooks, unless create_graph; `_finalize`), so without
        a no_grad context of its own, which would cost more than the copy."""
        slot, grad = bucket.slots[i], param.grad
        if grad is None:
            slot.zero_()
            bucket.present[i] = 0
            return
        bucket.present[i] = 1
        if grad.data_ptr() == slot.data_ptr() and grad.dtype == slot.dtype:
            slot.mul_(self._scale)  # accumulated in place in the bucket already
        else:
            torch.mul(grad.detach(), self._scale, out=slot)
            if self.grad_dtype is None:
                param.grad = slot  # later steps accumulate straight into the bucket

    def _launch_ready(self) -> None:
        self._next_launch = launch_ready(self._buckets, self._next_launch, self._launch)

    def _launch(self, bucket: Bucket) -> None:
        bucket.write_flags()
        if self.averaging is not None:
            self._works.append(self.averaging.start(bucket.buffer))
            return
        if self.compressor is not None:  # reduced at the end of backward, in order
            return
        group = self.expert_group if self._is_expert(bucket.params[0]) else self.group
        self._works.append(comm.all_reduce(bucket.buffer, group=group, async_op=True,
                                           algorithm=self.algorithm))

    @torch.no_grad()
    def _finalize(self) -> None:
        """At the end of backward: send what is left, wait, hand out averaged gradients
        (a timeline span "finish backward" from the end of backward's compute)."""
        with timeline.span("finish backward", "sync"):
            self._finish()

    def _finish(self) -> None:
        self._read_late()
        for bucket in self._buckets[self._next_launch :]:
            for i, p in enumerate(bucket.params):
                if not bucket.ready[i]:
                    self._fill_slot(bucket, i, p)
            self._launch(bucket)
        if self.averaging is not None:
            self._divide(self.averaging.finish(self._works, [b.buffer for b in self._buckets]))
        else:
            for work in self._works:
                work.wait()
        if self.compressor is not None:
            for bucket in self._buckets:
                self.compressor.reduce(bucket.index, bucket.grads,
                                       [p.shape for p in bucket.params], self.group)
                bucket.present = [1] * len(bucket.params)  # not sent: each parameter has one
        for bucket in self._buckets:
            grads = bucket.grads if self.grad_dtype is None else self._cast_back(bucket)
            present = bucket.present if self.compressor is not None else bucket.flags.tolist()
            for i, p in enumerate(bucket.params):
                if present[i] == 0:
                    continue  # no rank had a gradient: it stays None, as in one process
                start = bucket.offsets[i]
                p.grad = grads[start : start + p.numel()].view_as(p)
            bucket.reset()
        self._works.clear()
        self._next_launch = 0
        self._finalize_queued = False
        if self._seen is not None:
            self._repack()

    def _cast_back(self, bucket: Bucket) -> torch.Tensor:
        """A bucket's averaged gradients in the parameters' dtype: one cast into a buffer
        kept from step to step (a new one would be allocated and touched every step)."""
        kept = self._unpacked.get(bucket.index)
        if kept is None:
            kept = self._unpacked[bucket.index] = bucket.grads.to(bucket.params[0].dtype)
        else:
            kept.copy_(bucket.grads)
        return kept

    def _repack(self) -> None:
        """Repack the buckets in the order the first backward made the gradients (rank 0's,
        so that every rank launches the same buckets), as DDP rebuilds its buckets."""
        seen, self._seen = dict.fromkeys(self._seen or []), None
        order = [*seen, *(k for k in reversed(range(len(self._params))) if k not in seen)]
        agreed = torch.tensor(order, dtype=torch.int64, device=agreement_device(self._params))
        comm.broadcast(agreed, src=0, group=self.group, algorithm=self._agreeing)
        order = agreed.tolist()
        if _layout(self._packed(order)) == _layout(self._buckets):
            return
        self._pack(order)
        self._unpacked.clear()
        if self.grad_dtype is None:  # the averaged gradients move into the new buckets
            for bucket in self._buckets:
                for i, p in enumerate(bucket.params):
                    if p.grad is not None:
                        slot = bucket.slots[i]
                        slot.copy_(p.grad)
                        p.grad = slot

    def bucket_sizes(self) -> list[tuple[int, torch.dtype]]:
        """Each gradient bucket's (elements, dtype), in the order backward launches them:
        what one step all-reduces, call by call."""
        return [(bucket.numel, bucket.dtype) for bucket in self._buckets]

    def reduce_gradients(self) -> None:
        """Average what backward accumulated under `no_sync` now, as the first backward
        outside it would at its end (a pipeline piece with an averaging, once its schedule
        is done)."""
        if self.averaging is not None or self.size > 1:
            self._finalize()

    def _divide(self, members: int) -> None:
        """Averages from the sums an averaging wrote into the buckets (their presence flags
        stay counts); with 0 members (a step that does not count here) the buckets hold
        this live replica's own gradients, left as they are."""
        for bucket in self._buckets if members else ():
            bucket.buffer[: bucket.numel].div_(members)

    # ----------------------------------------------------------------- compression
    def compression_state(self) -> dict[str, torch.Tensor]:
        """This rank's compression state (error feedback, warm starts) as flat tensors,
        for a checkpoint; empty without compression."""
        return {} if self.compressor is None else self.compressor.state_dict()

    def load_compression_state(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from `compression_state()`'s tensors (a resumed run on the same ranks)."""
        if self.compressor is not None and state:
            self.compressor.load_state_dict(state)

    # ----------------------------------------------------------------- clipping
    def grad_parts(self, is_split: Callable[[nn.Parameter], bool] | None = None,
                   counted: Callable[[nn.Parameter], bool] | None = None) -> list[GradPart]:
        """The averaged gradients as parts of a global norm (see dtrain.data_parallel.clip):
        replicated over the group, so summed over no axis, or over "tp" where
        `is_split(param)` (a tensor-parallel block), or over "ep" for split experts (each
        rank of the expert-parallel group holds others); `counted(param)` False marks a
        copy another rank counts (a tied weight's second holder). Call after backward."""
        def over(p: nn.Parameter) -> tuple[str, ...]:
            if self._is_expert(p):
                return ("ep",)
            return ("tp",) if is_split is not None and is_split(p) else ()

        return [GradPart(p.grad, over=over(p), counted=counted is None or counted(p))
                for p in self.module.parameters() if p.grad is not None]

    # ----------------------------------------------------------------- state
    # torch overloads state_dict on its `destination`; this forwards every form
    def state_dict(  # type: ignore[override]
        self, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        """The wrapped module's state dict, without a wrapper prefix."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ):
        """Load into the wrapped module (keys as produced by `state_dict`)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
