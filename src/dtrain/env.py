"""The contract between dtrain's launcher, its ranks and the user: every `DTRAIN_*`
environment variable, declared once with its type, default and meaning.

This module is the only one of dtrain that names them (tests/package/test_env_contract.py
greps the sources for it): the others read and write a variable through its `Var` below,
so that a reader finds every variable, who sets it and who reads it, in one place, and a
malformed value gets the same one-line error wherever it is read.

    from dtrain import env

    timeout = env.TIMEOUT.get()           # a float, or the default when unset or empty
    env.ROUND.set(2)                      # into os.environ (for the ranks this starts)
    child = {**env.RUN_ID.pair(run_id)}   # into an environment being built for a child

The variables fall in three groups: what a user may set (timeouts, the backend, debug
mode, fault injection, file locations), what `dtrain run` and `dtrain train` pass to the
ranks they start (run id, rounds, roles, live replicas, parameter servers), and what the
launcher passes to itself across a re-executed process (the user's C++ log level).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dtrain.errors import ConfigError

T = TypeVar("T")

PREFIX = "DTRAIN_"


@dataclass(frozen=True)
class Var(Generic[T]):
    """One environment variable of the contract.

    Attributes:
        name: its name, `DTRAIN_...`.
        parse: text -> value; raises ValueError on a malformed value.
        default: the value when it is unset or empty.
        kind: what a value is, in words, for the one-line error on a malformed one.
        meaning: what it says and who sets it (the docs' table of variables is this).
    """

    name: str
    parse: Callable[[str], T]
    default: T
    kind: str
    meaning: str

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The text as set, or None when unset or empty."""
        value = (os.environ if environ is None else environ).get(self.name, "")
        return value or None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return self.raw(environ) is not None

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value, or `default` when unset or empty.

        Raises:
            ConfigError: the value is malformed; the message names the variable and what a
                value must be.
        """
        text = self.raw(environ)
        if text is None:
            return self.default
        try:
            return self.parse(text)
        except ValueError:
            raise ConfigError(f"{self.name}={text!r} is not {self.kind}") from None

    def pair(self, value: object) -> dict[str, str]:
        """`{name: str(value)}`, for an environment being built for another process."""
        return {self.name: str(value)}

    def set(self, value: object, environ: MutableMapping[str, str] | None = None) -> None:
        """Set it (in os.environ unless given another mapping) to `str(value)`."""
        (os.environ if environ is None else environ)[self.name] = str(value)

    def unset(self, environ: MutableMapping[str, str] | None = None) -> None:
        (os.environ if environ is None else environ).pop(self.name, None)


def _flag(text: str) -> bool:
    return text not in ("0", "false", "no")


def _var(name: str, parse: Callable[[str], T], default: T, kind: str, meaning: str) -> Var[T]:
    var = Var(PREFIX + name, parse, default, kind, meaning)
    VARIABLES.append(var)
    return var


VARIABLES: list[Var[Any]] = []
"""Every variable of the contract, in the order declared below."""

# ------------------------------------------------------------------ set by users
TIMEOUT = _var("TIMEOUT", float, None, "a number of seconds",
               "how long a collective waits for a silent peer before it fails naming it "
               "(default 180 s)")
BACKEND = _var("BACKEND", str, None, "a backend name",
               "the collective backend dtrain.init() uses (gloo, nccl, shm); `dtrain run "
               "--backend` sets it for the ranks")
DEBUG = _var("DEBUG", _flag, False, "0 or 1",
             "check every collective's arguments across ranks; `dtrain run --debug` sets it")
TIMELINE = _var("TIMELINE", str, None, "a file path",
                "where each rank records its timeline of steps and collectives; `dtrain "
                "run --timeline` sets it and merges the ranks' files")
CALIBRATION = _var("CALIBRATION", str, None, "a file path",
                   "the measured collective costs `dtrain bench comm --save` writes and "
                   "`algorithm='auto'` reads (default ~/.cache/dtrain/calibration.json)")
SHM_SLOT_MB = _var("SHM_SLOT_MB", float, 2.0, "a number of MiB",
                   "the size of each slot of the shared-memory backend's segments")
STALL_TIMEOUT = _var("STALL_TIMEOUT", float, 5.0, "a number of seconds",
                     "how long the launcher lets a rank stay stopped (SIGSTOP, a hung "
                     "machine) before it kills it and names it; 0: never")
FAULT = _var("FAULT", str, None, "a fault description",
             "fault injection for tests and drills (dtrain.faults): ACTION@POINT"
             "[,rank=R][,attempt=A]")
NODE_RANK = _var("NODE_RANK", int, None, "an integer",
                 "this process's host among simulated hosts on one machine, when the "
                 "launcher's GROUP_RANK is absent (the hierarchical collectives group by it)")

# ------------------------------------------------------------------ launcher -> ranks
RUN_ID = _var("RUN_ID", str, None, "a run id",
              "the job's id, set by `dtrain run` for its ranks (names shared-memory "
              "segments and store keys; its presence says the ranks are dtrain's)")
RDZV_BACKEND = _var("RDZV_BACKEND", str, "c10d", "c10d or etcd",
                   "where the job's store lives: c10d, node 0's launcher (MASTER_ADDR:"
                   "MASTER_PORT); etcd, the cluster at DTRAIN_RDZV_ENDPOINTS")
RDZV_ENDPOINTS = _var("RDZV_ENDPOINTS", str, "", "HOST:PORT,...",
                      "the etcd cluster's members, with DTRAIN_RDZV_BACKEND=etcd")
ROLE = _var("ROLE", str, "worker", "worker or server",
            "this process's role in a parameter-server job")
ATTEMPT = _var("ATTEMPT", str, None, "an attempt id",
               "the rendezvous round (and live generation) whose store keys the ranks meet "
               "under, so nothing an earlier round left is read")
ROUND = _var("ROUND", int, 1, "an integer",
             "the job's rendezvous round, 1 first: `dtrain train` resumes from its newest "
             "checkpoint after the first")
EXIT_DIR = _var("EXIT_DIR", str, None, "a folder",
                "where each rank notes the moment it exits, so the launcher names the rank "
                "that failed first")
ELASTIC_MAX_RANKS = _var("ELASTIC_MAX_RANKS", int, 0, "an integer",
                         "the most ranks an elastic job can have (rank 0's launcher's "
                         "--nnodes maximum times its ranks); 0: not elastic")
LIVE_ID = _var("LIVE_ID", int, None, "an integer",
               "this live replica's id: its rank among the launcher's ranks")
LIVE_SLOTS = _var("LIVE_SLOTS", int, None, "an integer",
                  "the number of live replicas of the job, all alive")
LIVE_INCARNATION = _var("LIVE_INCARNATION", int, 0, "an integer",
                        "0 for a live replica's first process, then 1, 2, ... for its "
                        "replacements")
LIVE_READY_FD = _var("LIVE_READY_FD", int, None, "a file descriptor",
                     "where a live replica's rank writes one byte once it has taken part "
                     "in a step: its supervisor then starts the rank's warm standby")
LIVE_RANKS = _var("LIVE_RANKS", int, 1, "an integer",
                  "ranks per live replica: dp x tp x pp of the config")
PS_SERVERS = _var("PS_SERVERS", int, None, "an integer",
                  "parameter servers in the whole job")
PS_WORKERS = _var("PS_WORKERS", int, None, "an integer", "workers in the whole job")
PS_INDEX = _var("PS_INDEX", int, None, "an integer",
                "this process's index among the servers or among the workers")
PS_SECRET = _var("PS_SECRET", str, None, "a hex key",
                 "the key that signs parameter-server messages; the same on every machine "
                 "of the job (set it yourself across machines)")
PS_HOST = _var("PS_HOST", str, None, "an address", "the address servers bind and publish")
PS_SNAPSHOT_DIR = _var("PS_SNAPSHOT_DIR", str, None, "a folder",
                       "where servers save snapshots of their shards")
PS_SNAPSHOT_EVERY = _var("PS_SNAPSHOT_EVERY", int, 0, "an integer",
                         "servers save a snapshot every K updates; 0: never")

# ------------------------------------------------------------------ launcher -> itself
USER_CPP_LOG_LEVEL = _var("USER_CPP_LOG_LEVEL", str, "WARNING", "a log level",
                          "the user's TORCH_CPP_LOG_LEVEL, kept while the launcher quiets "
                          "its own, and given back to the ranks")
