"""Hybrid sharding (HSDP) and quantized ZeRO communication, on 4 ranks as 2 emulated hosts
x 2 ranks: dtrain against PyTorch FSDP2, and what the quantized gathers save on the link.

    python benchmarks/hsdp.py all --write               # everything, ~10 min on 2 cores
    python benchmarks/hsdp.py speed [--links ...] [--precisions fp32 bf16] [--steps 5]
    python benchmarks/hsdp.py quality [--quality-steps 200]
    python benchmarks/hsdp.py report --write            # the section, into RESULTS.md

- speed: on each emulated link (slow_links.py's: dtrain.tools.emulated_links, two network
  namespaces of two ranks each joined by a shaped link, one `dtrain run --nnodes 2` per
  host), benchmarks/hsdp_worker.py builds side by side, on one GPT of 4 blocks x 256 (3.3M
  parameters), the same batch and the same AdamW: dtrain ZeRO-3 over all 4 ranks; dtrain
  HSDP (ZeRO-3 over a host's 2 ranks, each gradient shard averaged across the 2 hosts);
  FSDP2's HSDP (`fully_shard` over a 2 x 2 mesh) and FSDP2 over all 4; ZeRO-3 over all 4
  with int8 and with bf16 gathers and reduce-scatters. They take turns, one step each per
  round after a warm-up step (dtrain.comm.timing.time_turns); the median step time, the
  bytes each rank handed to collectives per step by group (dtrain.comm.traffic: dtrain's
  only) and the bytes each host's device sent per step (what really crossed the link, IP
  headers included). `--links loopback` runs the same on this machine's loopback, without
  link bytes.
- quality: on loopback, the default job's GPT, data, AdamW and schedule trained
  `--quality-steps` steps with ZeRO-3 over 4 ranks under bf16 mixed precision, with the
  compute dtype on the wire and with int8 gathers and reduce-scatters (fp8 gathers only on
  a GPU that computes in fp8): the training and held-out losses, and their gap.
- report: the section "Hybrid sharding and quantized ZeRO communication" from the data in
  `--data`, with the commands that made it, the machine and the dates.

Collectives take the backend's own algorithm on every side (slow_links.py's calibration
file), as FSDP2 does. Targets: dtrain HSDP / FSDP2 HSDP step time at most 1.0x; int8 within
2% of bf16's loss.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results_md import replace_section
from slow_links import LINKS, finished, native_calibration

from dtrain.tools.emulated_links import EmulatedHosts

HERE = Path(__file__).resolve().parent
WORKER = HERE / "hsdp_worker.py"
SECTION = "hsdp"
TITLE = "## Hybrid sharding and quantized ZeRO communication (4 ranks as 2 emulated hosts x 2)"
DEFAULT_LINKS = ("1gbit-1ms", "100mbit-20ms")
LOOPBACK = "loopback"
PREFIX = "dthsdp"
"""The emulated hosts' own names, apart from the tests' and slow_links.py's (entering
EmulatedHosts deletes the namespaces left of its prefix)."""
SUBNET = "10.178.0"
NAMES = {"zero3": "dtrain ZeRO-3 over 4", "hsdp": "dtrain HSDP (2 replicas x ZeRO-3 over 2)",
         "fsdp2_hsdp": "FSDP2 HSDP (2 x 2 mesh)", "fsdp2": "FSDP2 over 4",
         "zero3_int8": "dtrain ZeRO-3 over 4, int8 gather + reduce",
         "zero3_bf16": "dtrain ZeRO-3 over 4, bf16 gather + reduce",
         "bf16": "ZeRO-3, bf16 on the wire", "int8": "ZeRO-3, int8 gather + reduce",
         "fp8_gather": "ZeRO-3, fp8 gather"}
MIB = 1 / 2**20


def command_line() -> str:
    """This process's command, as a reader would type it."""
    return " ".join(["python", os.path.relpath(sys.argv[0], HERE.parent), *sys.argv[1:]])


def environment() -> dict[str, str]:
    return {**os.environ, "DTRAIN_CALIBRATION": native_calibration(), "OMP_NUM_THREADS": "1"}


def record(out: Path, started: float, load_before: float) -> None:
    """Add to the worker's JSON `out` how and where it was made."""
    result = json.loads(out.read_text())
    result.update(command=command_line(), cores=os.cpu_count(),
                  date=datetime.datetime.fromtimestamp(started).isoformat(timespec="minutes"),
                  wall_s=time.time() - started, load_before=load_before,
                  load_after=os.getloadavg()[0])
    out.write_text(json.dumps(result))


def speed(args: argparse.Namespace) -> None:
    args.data.mkdir(parents=True, exist_ok=True)
    for name in args.links:
        if name == LOOPBACK:
            for precision in args.precisions:
                speed_run(args, name, precision, None)
            continue
        rate, delay = LINKS[name]
        with EmulatedHosts(hosts=2, rate_mbit=rate, delay_ms=delay, prefix=PREFIX,
                           subnet=SUBNET) as net:
            for precision in args.precisions:
                speed_run(args, name, precision, net)


def speed_run(args: argparse.Namespace, link: str, precision: str,
              net: EmulatedHosts | None) -> None:
    """One speed run of the worker: on this machine's loopback when `net` is None, else
    one `dtrain run` of 2 ranks on each of `net`'s 2 emulated hosts."""
    out = args.data / f"speed-{link}-{precision}.json"
    out.unlink(missing_ok=True)  # `finished` takes a file there for the run's results
    print(f"{link}, {precision}", flush=True)
    started = time.time()
    load = os.getloadavg()[0]
    worker = [str(WORKER), "speed", "--steps", str(args.steps), "--count-steps",
              str(args.count_steps), "--precision", precision, "--out", str(out),
              *(["--variants", *args.variants] if args.variants else [])]
    launch = [sys.executable, "-m", "dtrain.cli", "run"]
    if net is None:
        subprocess.run([*launch, "-n", "4", *worker], check=True, env=environment(),
                       cwd=HERE.parent)
    else:
        jobs = [net.popen(host, [*launch, "--nnodes", "2", "--node-rank", str(host), "-n", "2",
                                 "--master", f"{net.address(0)}:{args.port}", *worker],
                          env=net.env(host, environment()), cwd=HERE.parent)
                for host in range(2)]
        finished(jobs, out, args.timeout, f"{link} {precision}")
    record(out, started, load)


def quality(args: argparse.Namespace) -> None:
    args.data.mkdir(parents=True, exist_ok=True)
    out = args.data / "quality.json"
    started = time.time()
    load = os.getloadavg()[0]
    subprocess.run([sys.executable, "-m", "dtrain.cli", "run", "-n", "4", str(WORKER),
                    "quality", "--steps", str(args.quality_steps), "--eval-every",
                    str(args.eval_every), "--out", str(out)],
                   check=True, env=environment(), cwd=HERE.parent)
    record(out, started, load)


def mib(n: float) -> str:
    return f"{n * MIB:.2f}"


def sent_cell(traffic: dict[str, dict[str, float]]) -> str:
    """Bytes per rank per step by group, e.g. `in host 18.36 + across hosts 6.21`."""
    if not traffic:
        return "not seen (torch's own collectives)"
    return " + ".join(f"{label} {mib(sum(ops.values()))}" for label, ops in traffic.items())


def link_cell(tx: list[float] | None) -> str:
    if tx is None:
        return "- (loopback)"
    return f"{mib(sum(tx))} ({' + '.join(mib(t) for t in tx)})"


def speed_lines(run: dict, name: str) -> list[str]:
    """One link's table, at one precision, and its ratios."""
    got = run["variants"]
    base = got.get("fsdp2_hsdp", {}).get("step_s")
    lines = [f"**{name}, {run['precision']}** ({run['date']}; load average "
             f"{run['load_before']:.1f} before, {run['load_after']:.1f} after; "
             f"{run['wall_s']:.0f} s): `{run['command']}`", "",
             "| variant | ms/step | / FSDP2 HSDP | sent per rank per step, by group (MiB) "
             "| crossed the link per step, host 0 + host 1 (MiB) |",
             "|---|---|---|---|---|"]
    for variant, figures in got.items():
        ratio = f"{figures['step_s'] / base:.2f}" if base else "-"
        lines.append(f"| {NAMES[variant]} | {figures['step_s'] * 1e3:.0f} | {ratio} | "
                     f"{sent_cell(figures['traffic'])} | {link_cell(figures['link_tx'])} |")
    for variant, reason in run["skipped"].items():
        lines.append(f"| {NAMES[variant]} | skipped: {reason} | | | |")
    lines.append("")
    notes = []
    if "hsdp" in got and base:
        notes.append(f"dtrain HSDP / FSDP2 HSDP: **{got['hsdp']['step_s'] / base:.2f}x** "
                     "(target at most 1.0x)")
    if "hsdp" in got and "zero3" in got:
        notes.append(f"HSDP is {got['zero3']['step_s'] / got['hsdp']['step_s']:.2f}x as fast "
                     "as ZeRO-3 over all 4" + crossed_ratio(got, "hsdp", "zero3"))
    for wire in ("zero3_int8", "zero3_bf16"):
        if wire in got and "zero3" in got:
            notes.append(f"{wire.split('_')[1]} gathers and reduce-scatters: "
                         f"{got['zero3']['step_s'] / got[wire]['step_s']:.2f}x as fast as "
                         "fp32 ZeRO-3 over all 4" + crossed_ratio(got, wire, "zero3"))
    return lines + [f"- {note}." for note in notes] + [""]


def crossed_ratio(got: dict, variant: str, against: str) -> str:
    mine, theirs = got[variant]["link_tx"], got[against]["link_tx"]
    if not mine or not theirs:
        return ""
    return f", {sum(mine) / sum(theirs):.2f}x its bytes on the link"


def quality_lines(run: dict) -> list[str]:
    runs = run["variants"]
    tail = min(10, run["steps"])
    lines = [f"**Quality** ({run['date']}; load average {run['load_before']:.1f} before, "
             f"{run['load_after']:.1f} after; {run['wall_s']:.0f} s): `{run['command']}`  ",
             f"The default job's GPT ({next(iter(runs.values()))['parameters'] / 1e6:.2f}M "
             f"parameters) and data, global batch 32, AdamW with its schedule over "
             f"{run['steps']} steps, ZeRO-3 over 4 ranks in bf16 mixed precision, on "
             "loopback. Training loss: the mean over ranks, the last "
             f"{tail} steps averaged; held-out: 4 batches per rank.", "",
             "| variant | training loss | held-out loss | held-out vs bf16 | largest held-out "
             "gap over the curve | s |", "|---|---|---|---|---|---|"]
    reference = runs.get("bf16")
    for variant, got in runs.items():
        final = statistics.fmean(got["losses"][-tail:])
        held = got["evals"][-1][1]
        if reference is None:
            vs, gap = "-", "-"
        else:
            vs = f"{held / reference['evals'][-1][1] - 1:+.2%}"
            gaps = [abs(mine / theirs - 1) for (_, mine), (_, theirs)
                    in zip(got["evals"], reference["evals"], strict=True)]
            gap = f"{max(gaps):.2%}"
        lines.append(f"| {NAMES[variant]} | {final:.4f} | {held:.4f} | {vs} | {gap} | "
                     f"{got['seconds']:.0f} |")
    for variant, reason in run["skipped"].items():
        lines.append(f"| {NAMES[variant]} | skipped: {reason} | | | | |")
    steps = [s for s, _ in next(iter(runs.values()))["evals"]]
    lines += ["", "Held-out loss along the run:", "",
              "| step | " + " | ".join(runs) + " |", "|---" * (1 + len(runs)) + "|"]
    for i, step in enumerate(steps):
        lines.append(f"| {step} | " + " | ".join(f"{got['evals'][i][1]:.4f}"
                                                  for got in runs.values()) + " |")
    return lines + ["", "Target: int8 within 2% of bf16's held-out loss."]


def report(args: argparse.Namespace) -> None:
    speeds = [(name, json.loads(path.read_text()))
              for name in [*LINKS, LOOPBACK] for precision in ("fp32", "bf16")
              if (path := args.data / f"speed-{name}-{precision}.json").exists()]
    quality_path = args.data / "quality.json"
    if not speeds and not quality_path.exists():
        raise SystemExit(f"no results in {args.data}: run `speed` and `quality` first")
    lines = [TITLE, ""]
    if speeds:
        first = speeds[0][1]
        lines += [f"Machine: {first['cores']} cores, {first['machine']}, torch "
                  f"{first['torch']}, gloo, 1 thread per rank. Model: GPT "
                  f"{first['model']['n_layer']} blocks x {first['model']['n_embd']} "
                  f"(Ψ = {first['parameters'] / 1e6:.2f}M parameters), "
                  f"{first['tokens_per_rank']} tokens per rank, AdamW, the same batch "
                  "every step. Links: tbf bandwidth and a user-space delay line (one-way "
                  "delay as named) between 2 network namespaces, 2 ranks each. Each "
                  "variant: one warm-up step, then one step per round in turns with the "
                  "others, the median round's slowest rank; bytes from one more step each. "
                  "Sent per rank: what each rank handed to collectives on each of its "
                  "groups (dtrain.comm.traffic, as a bandwidth-optimal algorithm sends it); "
                  "crossed the link: the bytes each host's device sent (IP packets with "
                  "their headers, the step's barriers and TCP acknowledgements included).",
                  ""]
        for name, run in speeds:
            lines += speed_lines(run, name)
    if quality_path.exists():
        lines += quality_lines(json.loads(quality_path.read_text()))
    where = args.data.relative_to(HERE.parent) if args.data.is_relative_to(HERE.parent) \
        else args.data
    lines += ["", f"Report: `{command_line()}` on {datetime.date.today()}, from "
              f"{where}/. The machine is "
              f"{platform.machine()} with {os.cpu_count()} cores; the 4 ranks share them."]
    print("\n".join(lines))
    if args.write:
        replace_section(SECTION, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("speed", "quality", "report", "all"))
    parser.add_argument("--links", nargs="+", default=list(DEFAULT_LINKS),
                        choices=[*LINKS, LOOPBACK])
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=("fp32", "bf16"),
                        help="speed: fp32 and/or bf16 mixed precision")
    parser.add_argument("--variants", nargs="+", help="speed: only these (hsdp_worker.py's)")
    parser.add_argument("--steps", type=int, default=5, help="speed: timed steps per variant")
    parser.add_argument("--count-steps", type=int, default=1,
                        help="speed: steps per variant with the byte counters around them")
    parser.add_argument("--quality-steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25, help="quality")
    parser.add_argument("--data", type=Path, default=HERE / "data" / "hsdp",
                        help="where the runs' JSON goes and the report reads it")
    parser.add_argument("--port", type=int, default=29519)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per speed run")
    parser.add_argument("--write", action="store_true", help="report, all: into RESULTS.md")
    args = parser.parse_args()
    args.data = args.data.resolve()
    if args.what in ("speed", "all"):
        speed(args)
    if args.what in ("quality", "all"):
        quality(args)
    if args.what in ("report", "all"):
        report(args)


if __name__ == "__main__":
    main()
