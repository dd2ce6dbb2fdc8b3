"""Live replicas (dtrain.ft.live): how fast survivors go on after a SIGKILL, and how
fast a replacement catches up from a live peer compared with loading a checkpoint.

    .venv/bin/python benchmarks/live_recovery.py [--replicas 4 --trials 5 --width 1024]

Runs `--replicas` processes on this machine around a TCPStore this process hosts, training
an MLP of `--layers` x `--width`^2 parameters (tens of MB, with Adam's state three times
that) with DataParallel(averaging=LiveAveraging(live)) and the default timeouts. Each trial
SIGKILLs the last replica at a random moment of a step, then starts a replacement with its
id. Reported:

- recovery: seconds from the SIGKILL to the end of the survivors' first step that went
  on without the dead live replica (median and range over trials);
- steps lost: steps missing from, or repeated in, the survivors' record (must be 0);
- catch-up: seconds in the replacement's first `begin_step` (waiting for the next step to
  begin, plus receiving model, optimizer state, step and extra from a live peer), against
  saving and loading the same model and optimizer state as a universal checkpoint on this
  machine's disk (dtrain.checkpoint.universal, the way a restarted job resumes).

It prints one JSON object; `--json PATH` also writes it there.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks)


def replica_main(port: int, replica: int, args: dict[str, Any], trial: int) -> None:
    """One replica: train until the store says stop; report commits and catch-up times."""
    import dtrain
    from dtrain.ft.live import LiveAveraging, LiveReplicas

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    live = LiveReplicas(store, replica, args["replicas"])
    net = make_model(args["layers"], args["width"])
    model = dtrain.DataParallel(net, averaging=LiveAveraging(live))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    position = {"batches": 0}
    live.track(optimizer=optimizer, save_extra=lambda: dict(position),
               load_extra=lambda extra: position.update(extra))
    step, first = 0, True
    while not store.check(["stop"]):
        started = time.perf_counter()
        step = live.begin_step(step)
        if first and trial >= 0:
            store.set(f"catchup/{trial}", str(time.perf_counter() - started))
        first = False
        x = torch.randn(args["batch"], args["width"], generator=torch.Generator().manual_seed(
            step * 100 + replica))
        model(x).square().mean().backward()
        if live.committed:
            optimizer.step()
            position["batches"] += live.size
            store.compare_set(f"commit/{step}", "", json.dumps([time.time(), live.participants]))
        optimizer.zero_grad()
        step += 1
    live.close()


def wait_for(store: dist.TCPStore, key: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise SystemExit(f"benchmark stuck: no {key!r} after {timeout}s")
        time.sleep(0.01)
    return store.get(key).decode()


def latest_commit(store: dist.TCPStore, after: int) -> tuple[int, float, list[int]]:
    """The newest committed step at or after `after` (waiting for one)."""
    step = after
    wait_for(store, f"commit/{step}")
    while store.check([f"commit/{step + 1}"]):
        step += 1
    when, members = json.loads(store.get(f"commit/{step}"))
    return step, when, members


def checkpoint_round_trip(args: dict[str, Any]) -> dict[str, float]:
    """Seconds to save and to load the same model and Adam state as a universal checkpoint."""
    from dtrain.checkpoint import universal

    net = make_model(args["layers"], args["width"])
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    net(torch.randn(2, args["width"])).square().mean().backward()
    optimizer.step()
    names = dict(net.named_parameters())
    pieces = [piece for name, p in names.items()
              for piece in universal.pieces_of(f"model/{name}", p.data)]
    for name, p in names.items():
        for key, value in optimizer.state[p].items():
            if value.dim():
                pieces += universal.pieces_of(f"optim/{name}/{key}", value)
    with tempfile.TemporaryDirectory(dir=args["disk"]) as folder:
        start = time.perf_counter()
        universal.save(folder, 1, pieces, {}, {}, keep_last=1, group=None)
        saved = time.perf_counter() - start
        os.sync()
        start = time.perf_counter()
        ckpt = universal.Checkpoint(folder)
        net.load_state_dict(ckpt.model_state())
        for name, p in names.items():
            for key in ("exp_avg", "exp_avg_sq"):
                optimizer.state[p][key].copy_(ckpt.tensor(f"optim/{name}/{key}"))
        loaded = time.perf_counter() - start
    return {"save_s": saved, "load_s": loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--disk", default=None, help="folder for the checkpoint (default tmp)")
    parser.add_argument("--json", default=None)
    args = vars(parser.parse_args())
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    spawner = multiprocessing.get_context("forkserver")
    spawner.set_forkserver_preload(["torch._dynamo", "dtrain.data_parallel"])
    victim_id = args["replicas"] - 1

    def start(replica: int, trial: int = -1) -> Any:
        proc = spawner.Process(target=replica_main, args=(store.port, replica, args, trial),
                               daemon=True)
        proc.start()
        return proc

    procs = [start(r) for r in range(args["replicas"])]
    rng = random.Random(0)
    recoveries, catchups, kills = [], [], []
    try:
        step, _, _ = latest_commit(store, 0)
        step, t0, _ = latest_commit(store, step + 1)
        step, t1, _ = latest_commit(store, step + 1)
        step_s = t1 - t0
        for trial in range(args["trials"]):
            step, _, _ = latest_commit(store, step + 1)  # just after a step ends: kill within
            time.sleep(rng.uniform(0, step_s))  # the next, at a random moment of it
            os.kill(procs[victim_id].pid, signal.SIGKILL)
            killed = time.time()
            procs[victim_id].join()
            kills.append(step + 1)
            while True:
                step, when, members = latest_commit(store, step + 1)
                if victim_id not in members and when > killed:
                    recoveries.append(when - killed)
                    break
            procs[victim_id] = start(victim_id, trial)
            catchups.append(float(wait_for(store, f"catchup/{trial}")))
            while victim_id not in members:
                step, _, members = latest_commit(store, step + 1)
        store.set("stop", "1")
        last = latest_commit(store, step)[0]
        history = {s: json.loads(store.get(f"commit/{s}"))[1] for s in range(last + 1)
                   if store.check([f"commit/{s}"])}
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    lost = len(set(range(max(history) + 1)) - set(history))  # steps nobody committed
    disk = checkpoint_round_trip(args)
    nbytes = sum(p.numel() * 4 for p in make_model(args["layers"], args["width"]).parameters())
    report = {
        "replicas": args["replicas"], "trials": args["trials"],
        "model_mb": round(nbytes / 2**20, 1), "state_mb_with_adam": round(3 * nbytes / 2**20, 1),
        "step_s": round(step_s, 3),
        "recovery_s": {"median": round(statistics.median(recoveries), 2),
                       "min": round(min(recoveries), 2), "max": round(max(recoveries), 2)},
        "steps_lost": lost, "steps": max(history) + 1, "killed_at_steps": kills,
        "catchup_live_s": {"median": round(statistics.median(catchups), 2),
                           "min": round(min(catchups), 2), "max": round(max(catchups), 2)},
        "checkpoint_save_s": round(disk["save_s"], 2),
        "checkpoint_load_s": round(disk["load_s"], 2),
        "participants_per_step": [len(history[s]) for s in sorted(history)],
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
    }
    print(json.dumps(report))
    if args["json"]:
        Path(args["json"]).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
