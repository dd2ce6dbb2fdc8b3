"""Local SGD and DiLoCo: sync groups train on their own for H steps, then synchronize.

Synchronous data parallelism all-reduces gradients every step. Here each sync group steps
its own inner optimizer (e.g. AdamW) for `sync_every` = H steps, then the sync groups
synchronize once over `group` (this rank and its counterparts in the other sync groups),
so they send H times fewer bytes and tolerate slow links (Lin et al. 2018, "Don't use
large mini-batches, use local SGD"; Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training"):

- local SGD: the parameters become the sync groups' average.
- DiLoCo: the pseudo-gradient Δ = θ_anchor − mean_i(θ_i), where θ_anchor (kept in fp32)
  is where every sync group started the round, is the gradient of an outer optimizer (SGD
  with Nesterov momentum, `outer_lr`, `outer_momentum`) that steps the anchor; every
  sync group then continues from the new anchor.

With H = 1, outer_lr = 1 and no momentum DiLoCo is local SGD with H = 1, which with an SGD
inner optimizer is synchronous data parallelism. Memory: DiLoCo keeps an fp32 anchor and
an fp32 momentum buffer beside the model; streaming keeps one more copy of the parameters.

Run it with `dtrain run -n 2 train.py`, where train.py does::

    model = MyModel()
    inner = torch.optim.AdamW(model.parameters())
    diloco = DiLoCo(model, group=mesh.group("sync"), sync_every=500)
    ...
    loss.backward()
    inner.step()
    diloco.step()        # every 500th call: synchronize the sync groups
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain import comm
from dtrain.comm.ops import bus_factor
from dtrain.data_parallel.agreement import broadcast_state, check_same_model
from dtrain.data_parallel.zero.flat import split_by_size
from dtrain.errors import DtrainError


class SyncMode(enum.Enum):
    """How sync groups synchronize at a round's end."""

    LOCAL_SGD = "local_sgd"  # the parameters become their average
    DILOCO = "diloco"  # an outer optimizer steps the anchor with the averaged pseudo-gradient

    @classmethod
    def parse(cls, mode: SyncMode | str) -> SyncMode:
        """The mode named by `mode`.

        Raises:
            DtrainError: no mode has that name.
        """
        if isinstance(mode, SyncMode):
            return mode
        try:
            return cls(mode)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise DtrainError(f"DiLoCo: unknown mode {mode!r}: use one of {names}") from None


@dataclass
class _Bucket:
    """Parameters synchronized in one flat all-reduce, and (DiLoCo) their fp32 anchor."""

    params: list[torch.Tensor]
    anchor: torch.Tensor | None

    @torch.no_grad()
    def flat(self) -> torch.Tensor:
        """A new flat fp32 tensor of the parameters' current values, end to end."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    @torch.no_grad()
    def assign(self, flat: torch.Tensor) -> None:
        """Copy `flat` into the parameters (cast to their dtype)."""
        for p, piece in zip(self.params, flat.split([p.numel() for p in self.params]),
                            strict=True):
            p.copy_(piece.view_as(p))

    def anchored(self) -> torch.Tensor:
        """The anchor, which DiLoCo mode sets on every bucket."""
        assert self.anchor is not None  # DiLoCo mode
        return self.anchor

    def comm_bytes(self, mode: SyncMode) -> int:
        """Bytes of the buffer one synchronization all-reduces."""
        itemsize = 4 if mode is SyncMode.DILOCO else self.params[0].element_size()
        return sum(p.numel() for p in self.params) * itemsize


@dataclass
class _Sync:
    """A round's outer all-reduce: its handles, its buffers (reduced in place) and, when
    streaming, the parameters they were taken from (to keep the progress made since)."""

    works: list[Any]
    reduced: list[torch.Tensor]
    sent: list[torch.Tensor] | None

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


class DiLoCo:
    """Synchronize sync groups that each step their own inner optimizer, every H steps.

    Call `step()` after every inner `optimizer.step()`. The sync groups start identical: at
    construction the module's parameters and buffers (and any of `params` outside the
    module) are broadcast from the group's first rank; buffers are not synchronized after.
    The anchor is taken then too: load weights before wrapping, or load `state_dict()`.

    Streaming (`streaming=True`) overlaps the outer all-reduce with the next inner step.
    At the round's end (step t) the buffers are sent asynchronously and this sync group's
    parameters θ_t are remembered; the next `step()` (after inner step t+1 made θ_{t+1})
    waits for the result, computes the round's new global parameters G exactly as without
    streaming (the average, or the outer step of the anchor), and sets
    θ ← G + (θ_{t+1} − θ_t): the overlapped step's local progress is kept on top of G
    (unlike Streaming DiLoCo's α-mixing). Step t+1 is the next round's first, whose
    anchor is G, so rounds still have H inner steps. `flush()` applies an update still
    in flight (at the end of training, before evaluating).

    Args:
        module: the model; broadcast from the group's first rank at construction.
        group: this rank and its counterparts in the other sync groups (e.g.
            `mesh.group("sync")`); default the world. A group of one synchronizes
            nothing, but DiLoCo's outer step still runs.
        sync_every: H, the inner steps per round.
        mode: "diloco" or "local_sgd" (a `SyncMode`).
        outer_lr: DiLoCo's outer learning rate.
        outer_momentum: DiLoCo's outer Nesterov momentum (0: plain SGD).
        streaming: overlap the outer all-reduce with the next inner step (see above).
        params: the tensors to synchronize (default the module's trainable parameters):
            what this rank holds of a tensor- or ZeRO-split model, in the same order on
            every sync group.
        bucket_mb: cap on one all-reduce's buffer in MB (fewer, larger messages).
        algorithm: the synchronizing all-reduce's algorithm (see `dtrain.comm`).

    Raises:
        DtrainError: sync_every < 1, an unknown mode, outer_lr <= 0, outer_momentum outside
            [0, 1), bucket_mb <= 0, or sync groups holding different models.
    """

    def __init__(
        self,
        module: nn.Module,
        group: comm.GroupLike = None,
        *,
        sync_every: int,
        mode: SyncMode | str = SyncMode.DILOCO,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        streaming: bool = False,
        params: list[torch.Tensor] | None = None,
        bucket_mb: float = 25.0,
        algorithm: str = "auto",
    ) -> None:
        _validate(sync_every, outer_lr, outer_momentum, bucket_mb)
        self.mode = SyncMode.parse(mode)
        self.group = comm.resolve(group)
        self.sync_every = sync_every
        self.streaming = streaming
        self.algorithm = algorithm
        self.params: list[torch.Tensor] = list(params) if params is not None else \
            [p for p in module.parameters() if p.requires_grad]
        self._inner_step = 0
        self._round_step = 0
        self._in_flight: _Sync | None = None
        if not self.params:
            raise DtrainError("DiLoCo: no parameters to synchronize: pass a module with "
                              "trainable parameters, or params=")
        if self.group.size > 1:
            check_same_model(self.params, self.group, "DiLoCo")
            self._broadcast(module)
        diloco = self.mode is SyncMode.DILOCO
        runs = split_by_size([(str(k), p) for k, p in enumerate(self.params)],
                             int(bucket_mb * 1024 * 1024))
        self._buckets = [_Bucket([p for _, p in run], None) for run in runs]
        for bucket in self._buckets if diloco else ():
            bucket.anchor = bucket.flat()
        self._outer = torch.optim.SGD(
            [b.anchored() for b in self._buckets], lr=outer_lr, momentum=outer_momentum,
            nesterov=outer_momentum > 0) if diloco else None

    @torch.no_grad()
    def _broadcast(self, module: nn.Module) -> None:
        """Make every sync group start from the group's first rank's values."""
        broadcast_state(module, self.group)
        owned = {id(t) for t in module.parameters()}
        for tensor in self.params:
            if id(tensor) not in owned:
                comm.broadcast(tensor.data, src=0, group=self.group)

    # ----------------------------------------------------------------- stepping
    @property
    def inner_step(self) -> int:
        """Inner steps taken so far (calls of `step()`)."""
        return self._inner_step

    @property
    def round_step(self) -> int:
        """Inner steps taken in the current round: 0 right after a synchronization."""
        return self._round_step

    def step(self) -> bool:
        """Count one inner step; at a round's end synchronize the sync groups.

        Returns True when this step ended a round (synchronized, or with streaming started
        the synchronization that the next call applies).
        """
        self._inner_step += 1
        self.flush()
        self._round_step += 1
        if self._round_step < self.sync_every:
            return False
        self._round_step = 0
        sync = self._launch()
        if self.streaming:
            self._in_flight = sync
        else:
            self._apply(sync)
        return True

    def flush(self) -> None:
        """Apply the streamed synchronization still in flight, if any (waiting for it)."""
        if self._in_flight is not None:
            sync, self._in_flight = self._in_flight, None
            self._apply(sync)

    @torch.no_grad()
    def _launch(self) -> _Sync:
        """Start averaging each bucket's pseudo-gradient (DiLoCo) or parameters."""
        diloco = self.mode is SyncMode.DILOCO
        sent = [b.flat() for b in self._buckets] if diloco or self.streaming else None
        if diloco:
            assert sent is not None  # taken above in DiLoCo mode
            reduced = [b.anchored() - flat for b, flat in zip(self._buckets, sent, strict=True)]
        else:  # the parameters themselves, in their own dtype
            reduced = [torch.cat([p.detach().reshape(-1) for p in b.params])
                       for b in self._buckets]
        works = [comm.all_reduce(buffer, op="avg", group=self.group, async_op=True,
                                 algorithm=self.algorithm) for buffer in reduced]
        return _Sync(works, reduced, sent if self.streaming else None)

    @torch.no_grad()
    def _apply(self, sync: _Sync) -> None:
        """Finish `sync`: the new global parameters, plus any progress made since sending."""
        sync.wait()
        if self.mode is SyncMode.DILOCO:
            assert self._outer is not None  # made in DiLoCo mode
            for bucket, delta in zip(self._buckets, sync.reduced, strict=True):
                bucket.anchored().grad = delta
            self._outer.step()
            for bucket in self._buckets:
                bucket.anchored().grad = None
            reached = [b.anchored() for b in self._buckets]
        else:
            reached = sync.reduced
        for k, (bucket, base) in enumerate(zip(self._buckets, reached, strict=True)):
            if sync.sent is not None:
                base = base + (bucket.flat() - sync.sent[k])
            bucket.assign(base)

    # ----------------------------------------------------------------- cost
    def bytes_per_sync(self, n_ranks: int) -> float:
        """Bytes one synchronization sends per rank over a group of `n_ranks`, as
        `comm.traffic(group)` counts them: fp32 pseudo-gradients (DiLoCo) or the parameters
        in their dtype (local SGD), all-reduced bucket by bucket."""
        factor = bus_factor("all_reduce", n_ranks)
        return float(sum(int(factor * b.comm_bytes(self.mode)) for b in self._buckets))

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue exactly, mid-round included (with the model
        and the inner optimizer): the step counters, the fp32 anchor (one flat tensor per
        bucket) and outer optimizer state (DiLoCo), and a streamed synchronization still
        to apply (waited for; its result and this sync group's sent parameters). Tensors are
        references, as in torch's state dicts."""
        pending = None
        if self._in_flight is not None:
            self._in_flight.wait()
            pending = {"reduced": self._in_flight.reduced, "sent": self._in_flight.sent}
        return {
            "mode": self.mode.value, "sync_every": self.sync_every,
            "inner_step": self._inner_step, "round_step": self._round_step,
            "anchor": [b.anchor for b in self._buckets if b.anchor is not None],
            "outer": None if self._outer is None else self._outer.state_dict(),
            "pending": pending,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output (load the model and inner optimizer too).

        Raises:
            DtrainError: the state was saved with another mode, sync_every or model.
        """
        if state["mode"] != self.mode.value or state["sync_every"] != self.sync_every:
            raise DtrainError(
                f"DiLoCo: the checkpoint was saved with mode={state['mode']!r}, "
                f"sync_every={state['sync_every']}: build DiLoCo with mode="
                f"{self.mode.value!r}, sync_every={self.sync_every} to match it, or the reverse")
        anchors = [b.anchor for b in self._buckets if b.anchor is not None]
        if [a.shape for a in anchors] != [a.shape for a in state["anchor"]]:
            raise DtrainError("DiLoCo: the checkpoint's anchor does not fit these parameters: "
                              "load it into the same model, params= and bucket_mb=")
        for mine, saved in zip(anchors, state["anchor"], strict=True):
            mine.copy_(saved)
        if self._outer is not None:
            self._outer.load_state_dict(state["outer"])
        if self._in_flight is not None:
            self._in_flight.wait()
        pending = state["pending"]
        self._in_flight = None if pending is None else _Sync(
            [], [t.clone() for t in pending["reduced"]], [t.clone() for t in pending["sent"]])
        self._inner_step, self._round_step = state["inner_step"], state["round_step"]


def _validate(sync_every: int, outer_lr: float, outer_momentum: float,
              bucket_mb: float) -> None:
    """Raise a DtrainError naming the first argument out of range."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise DtrainError(f"DiLoCo: sync_every={sync_every!r} must be an integer >= 1 "
                          "(inner steps between synchronizations)")
    if not outer_lr > 0:
        raise DtrainError(f"DiLoCo: outer_lr={outer_lr!r} must be positive (DiLoCo uses 0.7)")
    if not 0 <= outer_momentum < 1:
        raise DtrainError(f"DiLoCo: outer_momentum={outer_momentum!r} must be in [0, 1) "
                          "(DiLoCo uses 0.9)")
    if not bucket_mb > 0:
        raise DtrainError(f"DiLoCo: bucket_mb={bucket_mb!r} must be positive")
