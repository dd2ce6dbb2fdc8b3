"""One copy of one shard: its parameters, optimizer, clocks, and what was applied.

A server holds its own shard and, with `Settings.copies` > 1, backup copies of its
neighbours' (dtrain.ps.chain). Every copy of a shard is driven by the same sequence of
events, in the same order: init (worker 0's seed), push (a worker's gradient for one
clock), stop (a worker is done) and drop (the head found a worker silent). The state is a
function of that sequence alone (no timer or arrival time decides anything here), so a
backup that saw the head's sequence holds what the head held, sync rounds in progress
included. A push carries its id, (worker, clock): one already applied is counted as a
duplicate and not applied again, so a worker may resend one whose acknowledgement never
came. The consistency models (`ready`) are described in dtrain.ps.server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dtrain.checkpoint import atomic
from dtrain.errors import ConfigError
from dtrain.ps.settings import Settings
from dtrain.ps.wire import BadMessage, Message

log = logging.getLogger("dtrain.ps")


@dataclass
class Clocks:
    """Per-worker progress, and the synchronous round being gathered."""

    of: dict[int, int]
    done: set[int] = field(default_factory=set)  # said stop
    dropped: set[int] = field(default_factory=set)  # silent too long: counted as dead
    version: int = 0  # sync: pulls of clocks up to this are answerable
    round_sum: torch.Tensor | None = None
    round_from: set[int] = field(default_factory=set)
    round_lr: float | None = None

    def live(self) -> set[int]:
        return set(self.of) - self.done - self.dropped

    def slowest(self) -> int:
        return min((self.of[w] for w in self.live()), default=1 << 30)


class ShardCopy:
    """One copy of shard `shard` (of `numel` values) on one server.

    Args:
        shard: which shard.
        numel: its length; an init or push of any other length is refused.
        workers: number of workers in the job.
        snapshots: folder for this copy's snapshots (None: none); a copy made on a folder
            holding snapshots resumes from the newest.
        snapshot_every: snapshot after every this many applied updates (0: never).
    """

    def __init__(self, shard: int, numel: int, workers: int, snapshots: Path | None = None,
                 snapshot_every: int = 0) -> None:
        self.shard, self.numel, self.workers = shard, numel, workers
        self.settings: Settings | None = None
        self.param: torch.nn.Parameter | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.clocks = Clocks(of=dict.fromkeys(range(workers), 0))
        self.updates = 0
        self.applied = dict.fromkeys(range(workers), 0)
        """Pushes applied, per worker (a duplicate is not one)."""
        self.duplicates = 0
        """Pushes received again after they were applied (resends), and not applied."""
        self.snapshots, self.snapshot_every = snapshots, snapshot_every
        if snapshots is not None and atomic.read_index(snapshots):
            self._restore()

    @property
    def initialized(self) -> bool:
        return self.param is not None

    def seed(self, m: Message) -> None:
        """Worker 0's init: the shard's values and the job's settings; later inits (a
        restarted worker, a copy resumed from a snapshot) keep what the copy has.

        Raises:
            BadMessage: not from worker 0, not a float32 tensor of this shard's length, or
                settings that do not validate.
        """
        if m.worker != 0:
            raise BadMessage(f"worker {m.worker} sent init: only worker 0 seeds the servers")
        if self.initialized:
            log.info("shard %d: init again from worker 0; kept its values", self.shard)
            return
        if m.tensor is None or m.tensor.dtype != torch.float32:
            raise BadMessage("init needs a float32 tensor")
        if m.tensor.numel() != self.numel:
            raise BadMessage(f"init of {m.tensor.numel()} values, but shard {self.shard} holds "
                             f"{self.numel}")
        try:
            settings = Settings.from_json(m.meta or {})
            param = torch.nn.Parameter(m.tensor.clone())
            optimizer = settings.build_optimizer([param])
        except (ConfigError, ValueError, TypeError) as exc:  # torch's checks of its options too
            raise BadMessage(str(exc)) from None
        self.settings, self.param, self.optimizer = settings, param, optimizer

    def check_tensor(self, m: Message, what: str) -> None:
        """Raise BadMessage unless `m` carries a float32 tensor of this shard's length."""
        if not self.initialized:
            raise BadMessage(f"{what} before worker 0 seeded the servers")
        if m.tensor is None or m.tensor.dtype != torch.float32:
            raise BadMessage(f"{what} needs a float32 tensor")
        if m.tensor.numel() != self.param.numel():
            raise BadMessage(f"{what} of {m.tensor.numel()} values, but this shard holds "
                             f"{self.param.numel()}")

    # ------------------------------------------------------------------ consistency
    def _apply(self, grad: torch.Tensor, lr: float | None) -> None:
        if lr is not None:  # the worker's scheduler decides the step size
            self.optimizer.param_groups[0]["lr"] = lr
        self.param.grad = grad
        self.optimizer.step()
        self.param.grad = None
        self.updates += 1
        if self.snapshot_every and self.updates % self.snapshot_every == 0:
            self._snapshot()

    def push(self, m: Message) -> None:
        """Apply worker `m.worker`'s gradient for clock `m.clock` once (a resend of one
        already applied is counted and dropped).

        Raises:
            BadMessage: a wrong tensor or learning rate (nothing changes).
        """
        self.check_tensor(m, "push")
        c, lr = self.clocks, _lr(m)  # checked before anything changes
        expected = c.of[m.worker]
        if m.clock < expected:
            self.duplicates += 1
            log.info("shard %d: worker %d resent push %d; already applied", self.shard,
                     m.worker, m.clock)
            return
        if m.clock > expected:  # only a copy resumed from an older snapshot sees this
            log.warning("shard %d: worker %d pushed clock %d, expected %d (updates after the "
                        "last snapshot were lost)", self.shard, m.worker, m.clock, expected)
        c.of[m.worker] = m.clock + 1
        self.applied[m.worker] += 1
        if self.settings.consistency != "sync":
            # 1/W of each push: a round of W pushes moves the parameters as far as one
            # sync step, so one lr means the same per sample in every mode.
            self._apply(m.tensor / self.workers, lr)
            return
        c.round_sum = m.tensor.clone() if c.round_sum is None else c.round_sum.add_(m.tensor)
        c.round_from.add(m.worker)
        c.round_lr = lr
        self.close_round()

    def stop(self, worker: int) -> None:
        """`worker` is done: the clocks no longer wait on it."""
        self.clocks.done.add(worker)
        self.close_round()

    def drop(self, worker: int) -> None:
        """`worker` went silent (the head decided): the clocks no longer wait on it."""
        self.clocks.dropped.add(worker)
        self.close_round()

    def close_round(self) -> None:
        """sync: once every live worker's gradient is in, apply their mean."""
        c = self.clocks
        if c.round_sum is None or not c.live() <= c.round_from:
            return
        self._apply(c.round_sum / len(c.round_from), c.round_lr)
        c.version = max(c.of[w] for w in c.round_from)
        c.round_sum, c.round_from = None, set()

    def ready(self, clock: int) -> bool:
        """Whether a pull of a worker at `clock` may be answered now."""
        if not self.initialized:
            return False
        if self.settings.consistency == "sync":
            return self.clocks.version >= clock
        if self.settings.consistency == "ssp":
            return self.clocks.slowest() >= clock - self.settings.staleness
        return True

    def stats(self) -> dict[str, object]:
        """What this copy applied: pushes per worker, duplicates dropped, optimizer steps."""
        return {"applied": {str(w): n for w, n in self.applied.items()},
                "duplicates": self.duplicates, "updates": self.updates,
                "clocks": {str(w): n for w, n in self.clocks.of.items()}}

    # ------------------------------------------------------------------ snapshots
    def _snapshot(self) -> None:
        c = self.clocks
        state = {"settings": self.settings.to_json(), "param": self.param.detach(),
                 "optimizer": self.optimizer.state_dict(), "updates": self.updates,
                 "clocks": {str(w): v for w, v in c.of.items()}, "version": c.version,
                 "dropped": sorted(c.dropped)}
        atomic.save(self.snapshots, self.updates, state, keep_last=2)

    def _restore(self) -> None:
        state = atomic.load(self.snapshots)
        self.settings = Settings.from_json(state["settings"])
        self.param = torch.nn.Parameter(state["param"].clone())
        self.optimizer = self.settings.build_optimizer([self.param])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = state["updates"]
        self.clocks.of.update({int(w): v for w, v in state["clocks"].items()})
        self.clocks.version = state["version"]
        self.clocks.dropped = set(state["dropped"])
        log.warning("shard %d resumed from its snapshot at update %d", self.shard, self.updates)


def _lr(m: Message) -> float | None:
    lr = (m.meta or {}).get("lr")
    if lr is None:
        return None
    if not isinstance(lr, int | float) or not 0 <= lr < float("inf"):
        raise BadMessage(f"lr {lr!r} is not a finite number >= 0")
    return float(lr)
