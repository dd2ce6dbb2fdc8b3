"""How many rounds the soak drills run: the crash-and-rejoin of a host in a row
(test_multihost: 2, 20 in full), whole hosts of a live job lost in turn (test_host_loss:
1, 20 in full), the etcd leader killed mid-run (test_etcd: 1, 10 in full), the SIGKILLs at
random moments of saving, blocking (test_faults) and in the background
(test_background_save), the pipeline example's clean exits with native collectives
(test_exit: 15 runs, 100 in full), and parameter servers killed in turn, each replaced
(tests/ps/test_replacement: 4, 20 in full).

By default (make test-slow, CI) each runs a few rounds, enough for every kind of moment it
strikes at; `make soak` runs each with its full count (DTRAIN_SOAK_ROUNDS=full), and
DTRAIN_SOAK_ROUNDS=N runs N rounds of each.
"""

from __future__ import annotations

import os

ENV = "DTRAIN_SOAK_ROUNDS"


def rounds(quick: int, full: int) -> int:
    """`quick` rounds, or `full` with DTRAIN_SOAK_ROUNDS=full, or N with DTRAIN_SOAK_ROUNDS=N."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return quick
    if value == "full":
        return full
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{ENV}={value!r}: give a number of rounds (1 or more) or 'full'")
    return count
