"""Which way to synchronize wins on which link: DDP, dtrain fp32, PowerSGD, int8, local
SGD and DiLoCo on 4 ranks as 2 hosts x 2 ranks, side by side.

    python benchmarks/slow_links.py progress [--steps 200]     # loss against steps
    python benchmarks/slow_links.py speed [--links ...]        # seconds per step, per link
    python benchmarks/slow_links.py report --write              # the table, into RESULTS.md

Each run is benchmarks/slow_links_worker.py under `dtrain run`: the default job's GPT,
data, AdamW and schedule on a global batch of 32, the same batches for every method.

- progress: every method for `--steps` steps on this machine's loopback, the held-out loss
  every 20 steps. How a method learns per step does not depend on the link; the target is
  the loss DDP reaches at `--target-step` (half the steps), and each method's steps to the
  target are read off its curve (interpolated between evaluations).
- speed: each method on each emulated link (dtrain.tools.emulated_links: two network
  namespaces of two ranks each, joined by the link; one `dtrain run --nnodes 2` per
  host), timed over whole rounds (2 x H steps for local SGD and DiLoCo, else 12 steps,
  after a warm-up step), median seconds per step.

Time to the target on a link = steps to the target x seconds per step on that link. Bytes
are what each rank hands to collectives per step (dtrain.comm.traffic; DDP's counted as
the all-reduce of its gradients). Collectives use the backend's own algorithm for every
method (a calibration file saying so), as DDP does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import replace_section

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "slow_links"
METHODS = [("ddp", 1), ("dtrain", 1), ("powersgd", 1), ("int8", 1), ("local_sgd", 10),
           ("local_sgd", 50), ("diloco", 10), ("diloco", 50)]
TUNED = ("diloco", 50, 0.3)
"""DiLoCo H=50 with outer momentum 0.3 instead of the paper's 0.9 (progress only: its
bytes and seconds per step are those of DiLoCo H=50)."""
LINKS = {"1gbit-1ms": (1000.0, 1.0), "100mbit-20ms": (100.0, 20.0), "10mbit-50ms": (10.0, 50.0)}


def label(method: str, h: int) -> str:
    return f"{method} H={h}" if method in ("local_sgd", "diloco") else method


def native_calibration() -> str:
    """A calibration file under which `auto` takes the backend's own algorithm at once."""
    from dtrain.comm.ops import AVAILABLE

    path = Path(tempfile.mkdtemp()) / "calibration.json"
    curves = {f"gloo/size{n}/{op}": {a: [[4096, 1e-5 if a == "native" else 1e-3],
                                         [16 << 20, 1e-2 if a == "native" else 1.0]]
                                     for a in algorithms}
              for n in (2, 4) for op, algorithms in AVAILABLE.items() if len(algorithms) > 1}
    path.write_text(json.dumps(curves))
    return str(path)


def worker_args(method: str, h: int, steps: int, eval_every: int, out: Path) -> list[str]:
    return [str(HERE / "slow_links_worker.py"), "--method", method, "--sync-every", str(h),
            "--steps", str(steps), "--eval-every", str(eval_every), "--out", str(out)]


def progress(args: argparse.Namespace) -> None:
    env = {**os.environ, "DTRAIN_CALIBRATION": native_calibration(), "OMP_NUM_THREADS": "1"}
    DATA.mkdir(parents=True, exist_ok=True)
    for method, h in METHODS:
        if method == "dtrain":
            continue  # the same arithmetic as DDP's (tests/data_parallel/test_data_parallel.py)
        out = DATA / f"progress-{method}-{h}.json"
        cmd = [sys.executable, "-m", "dtrain.cli", "run", "-n", "4",
               *worker_args(method, h, args.steps, 20, out)]
        print(" ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, env=env, cwd=HERE.parent)
    method, h, momentum = TUNED
    out = DATA / f"progress-{method}-{h}-m{momentum}.json"
    subprocess.run([sys.executable, "-m", "dtrain.cli", "run", "-n", "4",
                    *worker_args(method, h, args.steps, 20, out), "--outer-momentum",
                    str(momentum)], check=True, env=env, cwd=HERE.parent)


def speed(args: argparse.Namespace) -> None:
    from dtrain.tools.emulated_links import EmulatedHosts

    methods = [m for m in METHODS if args.methods is None or label(*m) in args.methods]
    calibration = native_calibration()
    DATA.mkdir(parents=True, exist_ok=True)
    for name in args.links:
        rate, delay = LINKS[name]
        with EmulatedHosts(hosts=2, rate_mbit=rate, delay_ms=delay) as net:
            for method, h in methods:
                steps = 1 + (2 * h if method in ("local_sgd", "diloco") else 12)
                out = DATA / f"speed-{name}-{method}-{h}.json"
                print(f"{name}: {label(method, h)}", flush=True)
                jobs = []
                for host in range(2):
                    env = {**os.environ, **net.env(host), "DTRAIN_CALIBRATION": calibration,
                           "OMP_NUM_THREADS": "1"}
                    cmd = [sys.executable, "-m", "dtrain.cli", "run", "--nnodes", "2",
                           "--node-rank", str(host), "-n", "2",
                           "--master", f"{net.address(0)}:{args.port}",
                           *worker_args(method, h, steps, 10**6, out),
                           "--compress-from", "1"]  # timed: compressed after the warm-up step
                    jobs.append(net.popen(host, cmd, env=env, cwd=HERE.parent))
                finished(jobs, out, args.timeout, f"{name} {label(method, h)}")


def finished(jobs: list[subprocess.Popen], out: Path, timeout: float, what: str) -> None:
    """Wait for both hosts' launchers. Torch's DDP can abort in its teardown once the run
    is over (a thread still joinable at exit, over the slowest link): results written are
    kept, the other host's launcher then stopped."""
    deadline = time.monotonic() + timeout
    while any(job.poll() is None for job in jobs) and time.monotonic() < deadline:
        if out.exists() and any(job.poll() not in (None, 0) for job in jobs):
            time.sleep(5)  # the run is over: give its teardown a moment, then stop it
            break
        time.sleep(0.5)
    for job in jobs:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    if not out.exists():
        raise SystemExit(f"{what}: no results (exit codes {[j.returncode for j in jobs]})")


def steps_to(evals: list[list[float]], target: float) -> float | None:
    """The first step (interpolated between evaluations) at which the loss is <= target."""
    previous = (0, float("inf"))
    for step, loss in evals:
        if loss <= target:
            if previous[1] == float("inf"):
                return float(step)
            return previous[0] + (step - previous[0]) * (previous[1] - target) / \
                (previous[1] - loss)
        previous = (step, loss)
    return None


def report(args: argparse.Namespace) -> None:
    runs = {(m, h): json.loads((DATA / f"progress-{m}-{h}.json").read_text())
            for m, h in METHODS if m != "dtrain"}
    runs[("dtrain", 1)] = runs[("ddp", 1)]
    method, h, momentum = TUNED
    runs[TUNED] = json.loads((DATA / f"progress-{method}-{h}-m{momentum}.json").read_text())
    ddp = runs[("ddp", 1)]
    steps, target = next(e for e in ddp["evals"] if e[0] == args.target_step)
    final_ddp = ddp["evals"][-1][1]
    lines = ["## Training over slow links (4 ranks as 2 emulated hosts x 2)", "",
             "Commands: `python benchmarks/slow_links.py progress`, `python benchmarks/"
             "slow_links.py speed`, `python benchmarks/slow_links.py report --write` "
             "(raw data in benchmarks/data/slow_links/).  ",
             f"The default job's GPT ({ddp['parameters'] / 1e6:.2f}M parameters), global "
             f"batch 32, AdamW. Target: the held-out loss DDP reaches after {steps} steps, "
             f"{target:.4f}. Steps to it from the loss curves on loopback; seconds per step "
             "measured on each emulated link (tbf bandwidth, a user-space delay line; one "
             "way delay as named), median over whole rounds. Time to target = steps x "
             "seconds per step.", ""]
    header = (f"| method | bytes/step per rank | vs DDP | steps to target | loss after "
              f"{ddp['evals'][-1][0]} steps vs DDP |")
    lines += [header + "".join(f" {n} s/step | {n} to target |" for n in args.links),
              "|---" * (5 + 2 * len(args.links)) + "|"]
    ddp_bytes = ddp["bytes_per_step"]
    times: dict[str, dict[tuple, float]] = {}
    for m, h, *tuned in [*METHODS, TUNED]:
        run = runs[(m, h, *tuned)]
        speeds = [DATA / f"speed-{name}-{m}-{h}.json" for name in args.links]
        measured = [json.loads(p.read_text()) for p in speeds if p.exists()]
        if measured:  # the bytes of whole rounds (a progress run's last round is partial)
            run = {**run, "bytes_per_step": measured[0]["bytes_per_step"]}
        reach = steps_to(run["evals"], target)
        final = run["evals"][-1][1] / final_ddp - 1
        name_of = label(m, h) + (f" (outer momentum {tuned[0]})" if tuned else "")
        row = (f"| {name_of} | {run['bytes_per_step'] / 2**20:.3f} MiB | "
               f"{ddp_bytes / max(run['bytes_per_step'], 1):.0f}x fewer | "
               f"{'not reached' if reach is None else f'{reach:.0f}'} | {final:+.1%} |")
        for name in args.links:
            path = DATA / f"speed-{name}-{m}-{h}.json"
            if not path.exists():
                row += " - | - |"
                continue
            step_s = json.loads(path.read_text())["step_s"][1:]  # the warm-up step out
            per = statistics.median(step_s) if m not in ("local_sgd", "diloco") else \
                sum(step_s) / len(step_s)
            total = None if reach is None else reach * per
            times.setdefault(name, {})[(m, h, *tuned)] = total if total is not None \
                else float("inf")
            row += f" {per:.3f} | {'-' if total is None else f'{total:.0f} s'} |"
        lines.append(row)
    lines.append("")
    for name in args.links:
        if name in times:
            best = min(times[name], key=times[name].get)
            ratio = times[name][best] / times[name][("ddp", 1)]
            lines.append(f"- {name}: fastest to target: {label(*best[:2])}, {ratio:.2f}x "
                         "DDP's time.")
    diloco, tuned = runs[("diloco", 50)], runs[TUNED]
    gap = [r["evals"][-1][1] / final_ddp - 1 for r in (diloco, tuned)]
    lines += ["", "Targets: the best option on 100 Mbit/s, 20 ms within 0.3x DDP's time "
              "(see above); DiLoCo H=50 sending at least 40x fewer bytes "
              f"({ddp_bytes / diloco['bytes_per_step']:.0f}x) and ending within 3% of "
              f"DDP's loss after the same samples ({gap[0]:+.1%} with the paper's outer "
              f"momentum 0.9, {gap[1]:+.1%} with 0.3). No other job ran during the speed "
              "runs; one run per link (2 cores)."]
    print("\n".join(lines))
    if args.write:
        replace_section("slow_links", lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("progress", "speed", "report"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--target-step", type=int, default=200,
                        help="report: the target is DDP's held-out loss at this step")
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--methods", nargs="+", help="speed: only these (e.g. powersgd)")
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    {"progress": progress, "speed": speed, "report": report}[args.what](args)


if __name__ == "__main__":
    main()
