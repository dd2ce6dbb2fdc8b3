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

Everything a copy holds is its `state()`: what a snapshot saves, and what a live copy
sends a server that joins the chain in a dead one's place (`load_state` takes either).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
        resume: resume from the newest snapshot in `snapshots`, if any (False: the copy
            will take another's state, `load_state`).
    """

    def __init__(self, shard: int, numel: int, workers: int, snapshots: Path | None = None,
                 snapshot_every: int = 0, resume: bool = True) -> None:
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
        self.copied_from: dict[str, object] | None = None
        """For a copy made from another's state (a server that joined the chain): its
        updates and pushes applied per worker at that cut."""
        self.snapshots, self.snapshot_every = snapshots, snapshot_every
        if resume and self._snapshotted():
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
        if self._snapshotted():  # put there since this copy was made (a checkpoint's copy)
            self._restore()
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

    def _updated(self) -> None:
        """An update is applied and its bookkeeping done: snapshot if one is due (a
        snapshot taken before a sync round is cleared would apply that round again)."""
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
            self._updated()
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
        self._updated()

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
        """What this copy applied: pushes per worker (those of the state it was copied
        from included), duplicates dropped, optimizer steps, and where it was copied."""
        return {"applied": {str(w): n for w, n in self.applied.items()},
                "duplicates": self.duplicates, "updates": self.updates,
                "clocks": {str(w): n for w, n in self.clocks.of.items()},
                "copied_from": self.copied_from}

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """Everything this copy holds (its values, optimizer state, clocks, the sync round
        being gathered, its counters), as tensors and plain values; the tensors are this
        copy's own, which its next update changes."""
        c = self.clocks
        return {"settings": self.settings.to_json(), "param": self.param.detach(),
                "optimizer": self.optimizer.state_dict(), "updates": self.updates,
                "clocks": {str(w): v for w, v in c.of.items()}, "version": c.version,
                "done": sorted(c.done), "dropped": sorted(c.dropped),
                "round": {"from": sorted(c.round_from), "lr": c.round_lr,
                          **({} if c.round_sum is None else {"sum": c.round_sum})},
                "applied": {str(w): n for w, n in self.applied.items()},
                "duplicates": self.duplicates}

    def load_state(self, state: dict[str, Any]) -> None:
        """Take over `state()` of another copy of this shard, or a snapshot's (one written
        before the sync round and the counters were kept lacks them: none is taken).

        Raises:
            ConfigError: settings that do not validate.
            KeyError, TypeError, ValueError, RuntimeError: a state of another form or shard.
        """
        settings = Settings.from_json(state["settings"])
        param = torch.nn.Parameter(state["param"].clone())
        if param.numel() != self.numel:
            raise ValueError(f"a state of {param.numel()} values for shard {self.shard}, which "
                             f"holds {self.numel}")
        optimizer = settings.build_optimizer([param])
        optimizer.load_state_dict(_optimizer_state(state["optimizer"], optimizer.state_dict()))
        c = Clocks(of=dict.fromkeys(range(self.workers), 0))
        c.of.update({int(w): int(v) for w, v in state["clocks"].items()})
        c.version = int(state["version"])
        c.done, c.dropped = set(state.get("done", [])), set(state["dropped"])
        gathered = state.get("round", {})
        c.round_from, c.round_lr = set(gathered.get("from", [])), gathered.get("lr")
        c.round_sum = gathered["sum"].clone() if "sum" in gathered else None
        self.settings, self.param, self.optimizer, self.clocks = settings, param, optimizer, c
        self.updates = int(state["updates"])
        self.applied.update({int(w): int(n) for w, n in state.get("applied", {}).items()})
        self.duplicates = int(state.get("duplicates", 0))

    # ------------------------------------------------------------------ snapshots
    def _snapshotted(self) -> bool:
        return self.snapshots is not None and bool(atomic.read_index(self.snapshots))

    def _snapshot(self) -> None:
        atomic.save(self.snapshots, self.updates, self.state(), keep_last=2)

    def _restore(self) -> None:
        self.load_state(atomic.load(self.snapshots))
        log.warning("shard %d resumed from its snapshot at update %d", self.shard, self.updates)


def _optimizer_state(saved: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state_dict as it came through JSON (from another copy), in torch's
    own form again, taking the types from a `fresh` state_dict of the same optimizer:
    parameter ids as integers (JSON made them strings; torch would skip them) and options
    that were tuples (Adam's betas) as tuples."""
    groups = [{k: tuple(v) if isinstance(mine.get(k), tuple) else v for k, v in theirs.items()}
              for mine, theirs in zip(fresh["param_groups"], saved["param_groups"],
                                      strict=True)]
    return {"state": {int(k): v for k, v in saved["state"].items()}, "param_groups": groups}


def _lr(m: Message) -> float | None:
    lr = (m.meta or {}).get("lr")
    if lr is None:
        return None
    if not isinstance(lr, int | float) or not 0 <= lr < float("inf"):
        raise BadMessage(f"lr {lr!r} is not a finite number >= 0")
    return float(lr)
