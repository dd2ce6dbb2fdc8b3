"""dtrain.ps with `replicas = 2`: SIGKILL a server mid-run, many times, and count the pushes.

    python benchmarks/ps_failover.py [--kills 20 --steps 30]

Each trial starts 3 servers (processes of their own, 2 copies of each shard) and 2 workers
(threads of this process) training a small MLP for `--steps` steps, and SIGKILLs one server
(trials cycle through servers 0, 1, 2 and through sync, ssp with staleness 1, and async) at
a random step of worker 0. Before the workers stop, each surviving server reports its
counters (the "stats" message): for every shard copy it holds, the pushes it applied per
worker and the resends it dropped as already applied. A shard's surviving copies must have
applied exactly `--steps` pushes of each worker: fewer is a lost push, more a duplicated
one. A sync trial must also end with the parameters of one process training on the whole
batch (parallel equals serial). Prints one line per trial and the totals.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import time

import torch
from torch import nn

from dtrain import ps
from tests.test_ps import PER_WORKER, SGD, WORKERS, batch, model, train_through_a_kill

MODES = (("sync", 0), ("ssp", 1), ("async", 0))


def serial(steps: int) -> dict[str, torch.Tensor]:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        nn.functional.cross_entropy(m(batch(step)[0]), batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    return m.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--servers", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    lost = duplicated = resent = 0
    reference = serial(args.steps)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    started = time.monotonic()
    for trial in range(args.kills):
        consistency, staleness = MODES[trial % len(MODES)]
        victim, kill_at = trial % args.servers, rng.randrange(1, args.steps - 1)
        settings = ps.Settings(consistency, staleness, replicas=2, **SGD)
        models, stats = train_through_a_kill(settings, args.servers, victim, kill_at,
                                             args.steps)
        applied: dict[str, dict[str, int]] = {}
        for server in stats.values():
            for shard, copy in server["shards"].items():
                resent += copy["duplicates"]
                counts = applied.setdefault(shard, copy["applied"])
                assert counts == copy["applied"], "two surviving copies disagree"
        shards = {str(k) for k in range(args.servers)}
        assert set(applied) == shards, f"a shard has no surviving copy: {sorted(applied)}"
        trial_lost = sum(max(0, args.steps - n) for c in applied.values() for n in c.values())
        trial_dup = sum(max(0, n - args.steps) for c in applied.values() for n in c.values())
        lost, duplicated = lost + trial_lost, duplicated + trial_dup
        equal = ""
        if consistency == "sync":
            for m in models:
                torch.testing.assert_close(m.state_dict(), reference)
            equal = ", equals one process"
        print(f"trial {trial + 1}: {consistency}, server {victim} killed after step {kill_at}: "
              f"{trial_lost} lost, {trial_dup} duplicated{equal}", flush=True)
    print(f"{args.kills} server kills ({args.servers} servers, 2 copies per shard, {WORKERS} "
          f"workers x {args.steps} steps, {PER_WORKER} samples per worker step): {lost} lost, "
          f"{duplicated} duplicated pushes; {resent} resends dropped as already applied; "
          f"{time.monotonic() - started:.0f} s; load before: {load}")


if __name__ == "__main__":
    main()
