"""Time from a rank's SIGKILL to the next completed step of `dtrain train`, and steps lost.

    python benchmarks/recovery.py [--repeats 3] [--write]

The built-in job's tiny GPT on 4 ranks (`--max-restarts 1`, a checkpoint every 4 steps).
Once step 6 is recorded, this script SIGKILLs rank 1 (a process of the launcher's), notes
the time, and reads the metrics file: the first step completed after the kill, how long
after it, and how many steps were lost (done before the kill, done again after: those
since the newest checkpoint). Two ways of recovering:

- restart: the agent restarts every rank, which resume from the newest checkpoint;
- elastic: the same with `--nnodes 1:2` on one launcher: nothing changes but the round
  (the path an elastic job's survivors take);
- live: `[fault_tolerance] mode = "live"`: the other live replicas drop rank 1 within the
  step and go on; its supervisor starts it again and it recovers from a live peer;
- live-tp: the same with live replicas of two tensor-parallel ranks (`parallel.tp = 2`):
  the other live replica goes on, and rank 1's (ranks 0 and 1) is started again whole;
- restart-zero3 and live-zero3: ZeRO-3 in bf16 mixed precision, over the 4 ranks
  restarted from the newest checkpoint, or in live replicas of two ZeRO-3 ranks
  (`parallel.dp = 2`), whose replacement is sent its shards' fp32 masters, optimizer state
  and loss scaler by the live replica.

A second time is read for every way: from the kill to the end of the first step the killed
rank took part in again (a restart: the same step; live replicas: the first step with every
live replica back, its replacement started from its warm standby).

benchmarks/live_recovery.py measures the library's live replicas alone, and the time a
replacement takes to catch up from a live peer against loading from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import replace_section

from dtrain.launch.waker import children

CONFIG = """
[model]
n_layer = 2
n_head = 2
n_embd = 64
block_size = 64

[data]
max_bytes = 400000

[train]
steps = 60
batch_size = 16
eval_every = 0
eval_batches = 2

[checkpoint]
every = 4

[logging]
log_every = 100
sample_tokens = 0
"""

KILL_AFTER_STEP = 6


def _records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of `rank` among the launcher's ranks (each runs with RANK in its environment)."""
    for pid in children(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


ZERO3 = ["--set", "parallel.zero=3", "--set", "parallel.mixed_precision='bf16'"]
WAYS = {
    "restart": ("restart from the newest checkpoint", []),
    "elastic": ("new elastic round from the newest checkpoint", []),
    "live": ("live: the others go on", []),
    "live-tp": ("live, live replicas of 2 tp ranks: the other goes on", ["--set", "parallel.tp=2"]),
    "restart-zero3": ("ZeRO-3 over 4 ranks in bf16: restart from the newest checkpoint", ZERO3),
    "live-zero3": ("live, live replicas of 2 ZeRO-3 ranks in bf16: the other goes on",
                   [*ZERO3, "--set", "parallel.dp=2"]),
}
"""Each way of recovering: its row and the flags it adds."""


def trial(how: str, folder: Path) -> tuple[float, float | None, int]:
    """(seconds from the kill to the end of the first step begun after it, to the end of
    the first step the killed rank took part in again (None: not before the run ended),
    steps lost) of one run."""
    config = folder / "job.toml"
    config.write_text(CONFIG)
    metrics = folder / "metrics.jsonl"
    flags = []
    if how.startswith("live"):
        flags = ["--set", "fault_tolerance.mode='live'"]
    flags += WAYS[how][1]
    if how == "elastic":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            flags = ["--nnodes", "1:2", "--master", f"127.0.0.1:{probe.getsockname()[1]}"]
    command = [sys.executable, "-m", "dtrain.cli", "train", str(config), "-n", "4",
               "--max-restarts", "1", *flags, "--metrics", str(metrics),
               "--set", f"train.out_dir='{folder / 'run'}'"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:
        while not any(r["step"] >= KILL_AFTER_STEP for r in _records(metrics)):
            assert proc.poll() is None, "the run ended before the kill"
            time.sleep(0.05)
        pid = _rank_pid(proc.pid, 1)
        assert pid is not None, "rank 1 not found"
        if how.startswith("live"):  # the rank runs under its supervisor (launch.supervisor)
            pid = next(iter(children(pid)))
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        while True:  # the first step begun after the kill (one in flight may still end)
            after = [r for r in _records(metrics) if r["time"] - r["step_time_s"] > killed]
            if after:
                break
            assert proc.poll() is None, "the run ended without recovering"
            time.sleep(0.05)
        done = max(r["step"] for r in _records(metrics) if r["time"] < after[0]["time"]
                   and r["time"] - r["step_time_s"] <= killed)
        lost = done - (after[0]["step"] - 1)
        whole = _records(metrics)[0].get("live_replicas")

        def back() -> dict | None:  # live: the first step with every replica back
            return after[0] if whole is None else next(
                (r for r in _records(metrics)
                 if r["time"] > after[0]["time"] and r["live_replicas"] == whole), None)

        while back() is None and proc.poll() is None:
            time.sleep(0.05)
        assert proc.wait(timeout=300) == 0
        again = back()  # None: the run ended first
        return (after[0]["time"] - killed, None if again is None else again["time"] - killed,
                lost)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = []
    for how in WAYS:
        seconds, again, lost = [], [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                s, b, n = trial(how, Path(tmp))
            seconds.append(s)
            again.append(b)
            lost.append(n)
            print(f"{how}: {s:.1f} s from the kill to the next step, "
                  f"{'-' if b is None else f'{b:.1f}'} s to the killed rank's next step, "
                  f"{n} step(s) lost", flush=True)
        back = [b for b in again if b is not None]
        rows.append((how, statistics.median(seconds), min(seconds), max(seconds),
                     f"{statistics.median(back):.1f}" if len(back) == len(again) else
                     f"{len(again) - len(back)} of {len(again)} not within the run",
                     statistics.median(lost)))
    lines = [
        "## Recovery: from a rank's SIGKILL to the next completed step (4 ranks, 2 cores)",
        "",
        f"Command: `python benchmarks/recovery.py --repeats {args.repeats} --write` "
        f"(load average {load:.1f} at the start; median of {args.repeats}). Rank 1 is "
        f"SIGKILLed once step {KILL_AFTER_STEP} is recorded; checkpoints every 4 steps.",
        "",
        "| recovery | seconds from the kill to the end of the first step begun after it "
        "(median) | min | max | seconds to the killed rank's next step (median) | steps lost |",
        "|---|---|---|---|---|---|",
    ]
    for how, med, low, high, again, lost in rows:
        lines.append(f"| {WAYS[how][0]} | {med:.1f} | {low:.1f} | {high:.1f} | {again} | "
                     f"{lost:g} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        replace_section("recovery", lines)


if __name__ == "__main__":
    main()
