"""Fault injection: make a rank fail on purpose, at a named point, to drill recovery.

    DTRAIN_FAULT="kill@step=5,rank=1" dtrain train --max-restarts 1 ...

The variable holds one fault, `ACTION@POINT[=VALUE][,rank=R][,attempt=A]`:

- ACTION: `kill` (SIGKILL itself: a crash nothing can catch), `stop` (SIGSTOP: a stalled
  rank, alive but silent), `exit` (exit code 3), `diverge` (call a collective the other
  ranks do not: a rank whose code took another path).
- POINT: where dtrain checks for it. `step=K`: as training step K begins (dtrain train);
  `record=K`: once step K is applied, before its metrics are recorded;
  `save`: inside a checkpoint write, after this rank's data file is written and before the
  checkpoint is published. `push=C` and `relayed=C` are a parameter server's (dtrain.ps):
  `push` as the head of a shard receives a worker's push of clock C, before applying or
  relaying it; `relayed` as the head reads its backup's acknowledgement of such a push,
  before acknowledging the worker (so the backup has it and the worker will resend it).
- rank: the global rank that fails (default: every rank); a live replica's id; for the
  points push and relayed, the parameter server's index.
- attempt: the attempt it fails in (default 0, the first), so a job restarted with
  `--max-restarts`, or in a new round of an elastic job, runs through the second time:
  under dtrain's launcher the rendezvous round less one (DTRAIN_ROUND), else torch's
  TORCHELASTIC_RESTART_COUNT.

Unset, each check is one environment lookup. The fault tests (tests/faults/test_faults.py) and the
RESULTS table of faults are built on it.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from dtrain import env
from dtrain.errors import ConfigError

ACTIONS = ("kill", "stop", "exit", "diverge")
POINTS = ("step", "record", "save", "push", "relayed")


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    value: str = ""
    rank: int | None = None
    attempt: int = 0


def parse(text: str) -> Fault:
    """The fault `text` describes.

    Raises:
        ConfigError: it is malformed.
    """
    head, _, rest = text.partition(",")
    action, at, where = head.partition("@")
    point, _, value = where.partition("=")
    if action not in ACTIONS or not at or point not in POINTS:
        raise ConfigError(f"{env.FAULT.name}={text!r}: expected ACTION@POINT[,rank=R]"
                          f"[,attempt=A] with ACTION one of {', '.join(ACTIONS)} and POINT "
                          "step=K, record=K, save, push=C or relayed=C")
    options: dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        key, _, number = item.partition("=")
        if key not in ("rank", "attempt") or not number.isdigit():
            raise ConfigError(f"{env.FAULT.name}={text!r}: {item!r} is not rank=R or attempt=A")
        options[key] = int(number)
    return Fault(action, point, value, options.get("rank"), options.get("attempt", 0))


def at(point: str, value: object = "", server: int | None = None) -> None:
    """Fail here if DTRAIN_FAULT names this point (and this rank and attempt); `server`:
    called by parameter server `server`, whose index the fault's rank then names."""
    text = env.FAULT.get()
    if not text:
        return
    fault = parse(text)
    if fault.point != point or (fault.value and fault.value != str(value)):
        return
    rank = int(os.environ.get("RANK", "0")) if server is None else server
    live = env.LIVE_ID.get() if server is None else None  # None: unset
    if live is not None:  # a live replica's rank sees its replica's world
        rank += live * int(os.environ.get("WORLD_SIZE", "1"))
    attempt = attempt_number()
    if (fault.rank is not None and fault.rank != rank) or fault.attempt != attempt:
        return
    who = f"rank {rank}" if server is None else f"parameter server {server}"
    print(f"dtrain: injected fault {text!r} on {who}", file=sys.stderr, flush=True)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "exit":
        os._exit(3)
    else:  # diverge: a collective the others are not making, then on as if nothing happened
        import torch

        from dtrain.comm.collectives import broadcast

        broadcast(torch.zeros(7), 0)


def attempt_number() -> int:
    """This process's attempt: 0 in the first rendezvous round (or start), 1 in the next...;
    a live replica's replacement counts one more each time it is started again."""
    again = env.LIVE_INCARNATION.get()
    if env.ROUND.is_set():
        return env.ROUND.get() - 1 + again
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) + again
