"""dtrain.ps with `copies = 2`: SIGKILL a server mid-run, many times, and count the pushes.

    python benchmarks/ps_failover.py [--kills 20 --steps 30]

Each trial starts 3 servers (processes of their own, 2 copies of each shard) and 2 workers
(threads of this process) training a small MLP for `--steps` steps, and SIGKILLs a random
server at a random clock C, at one of three moments (trials cycle through sync, ssp with
staleness 1 and async, and through the moments):

    between   after worker 0's step C, from outside: no push is in flight
    push      the server kills itself as the first push of clock C for its shard arrives,
              before relaying it (DTRAIN_FAULT=kill@push=C): the workers resend it
    relayed   the server kills itself as its backup acknowledges that push, before it
              acknowledges the worker (kill@relayed=C): the backup has it, and the resend
              must be dropped as a duplicate

Before the workers stop, each surviving server reports its counters (the "stats" message):
for every shard copy it holds, the pushes it applied per worker and the resends it dropped
as already applied. A shard's surviving copies must have applied exactly `--steps` pushes
of each worker: fewer is a lost push, more a duplicated apply. A sync trial must also end
with the parameters of one process training on the whole batch (parallel equals serial).
Prints one line per trial and the totals, with the pushes the workers resent.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import time

import torch

from dtrain import ps
from dtrain.testing.ps_drill import PER_WORKER, SGD, WORKERS, one_process, train_through_a_kill

MODES = (("sync", 0), ("ssp", 1), ("async", 0))
MOMENTS = ("between", "push", "relayed")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--servers", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    lost = duplicated = dropped = resent = 0
    reference = one_process(args.steps)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    started = time.monotonic()
    for trial in range(args.kills):
        consistency, staleness = MODES[trial % len(MODES)]
        moment = MOMENTS[trial // len(MODES) % len(MOMENTS)]
        victim, kill_at = rng.randrange(args.servers), rng.randrange(1, args.steps - 1)
        settings = ps.Settings(consistency, staleness, copies=2, **SGD)
        if moment == "between":
            models, stats, trial_resent = train_through_a_kill(
                settings, args.servers, victim, args.steps, kill_at=kill_at)
        else:
            models, stats, trial_resent = train_through_a_kill(
                settings, args.servers, victim, args.steps,
                fault=f"kill@{moment}={kill_at},rank={victim}")
        resent += trial_resent
        applied: dict[str, dict[str, int]] = {}
        trial_dropped = 0
        for server in stats.values():
            for shard, copy in server["shards"].items():
                trial_dropped += copy["duplicates"]
                counts = applied.setdefault(shard, copy["applied"])
                assert counts == copy["applied"], "two surviving copies disagree"
        shards = {str(k) for k in range(args.servers)}
        assert set(applied) == shards, f"a shard has no surviving copy: {sorted(applied)}"
        trial_lost = sum(max(0, args.steps - n) for c in applied.values() for n in c.values())
        trial_dup = sum(max(0, n - args.steps) for c in applied.values() for n in c.values())
        lost, duplicated = lost + trial_lost, duplicated + trial_dup
        dropped += trial_dropped
        equal = ""
        if consistency == "sync":
            for m in models:
                torch.testing.assert_close(m.state_dict(), reference)
            equal = ", equals one process"
        print(f"trial {trial + 1}: {consistency}, server {victim} killed at clock {kill_at} "
              f"({moment}): {trial_resent} pushes resent, {trial_dropped} dropped as already "
              f"applied; {trial_lost} lost, {trial_dup} applied twice{equal}", flush=True)
    print(f"{args.kills} server kills ({args.servers} servers, 2 copies per shard, {WORKERS} "
          f"workers x {args.steps} steps, {PER_WORKER} samples per worker step): {resent} "
          f"pushes resent, {dropped} dropped as already applied; {lost} lost, {duplicated} "
          f"applied twice; {time.monotonic() - started:.0f} s; load before: {load}")


if __name__ == "__main__":
    main()
