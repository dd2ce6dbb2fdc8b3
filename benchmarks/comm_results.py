"""Summarize several `dtrain bench comm --json` runs into benchmarks/RESULTS.md.

    for i in 1 2 3 4 5; do dtrain bench comm -n 2 --json benchmarks/data/comm-run$i.json; done
    python benchmarks/comm_results.py benchmarks/data/comm-run*.json --write

Times and bandwidths are medians over the runs. The targets of the collectives issue are
ratios each run measures side by side, from the all_reduce rows: ring busbw / native busbw
at 16 MiB (at least 0.8), the faster of tree and halving-doubling / native time at 4 KiB
(at most 1.5), and auto's time / the fastest algorithm's time (at most 1.1 at every size);
per size the median over the runs, then the worst size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from collections import defaultdict
from pathlib import Path

from results_md import markers, replace_section

BEGIN, END = markers("bench_comm")
ALGORITHMS = ("native", "ring", "tree", "halving_doubling", "auto")
Key = tuple[str, str, int]  # op, algorithm, bytes


def load(paths: list[str]) -> tuple[dict[Key, float], dict[Key, float], list[dict[Key, float]]]:
    """Median time (us) and busbw per (op, algorithm, bytes), and each run's times.

    In each run, ("op", "chosen", bytes) holds the time of the algorithm auto chose, as
    measured in that algorithm's own row.
    """
    runs: list[dict[Key, float]] = []
    busbw: dict[Key, list[float]] = defaultdict(list)
    for path in paths:
        records = json.loads(Path(path).read_text())
        run = {(r["op"], r["algorithm"], r["bytes"]): r["time_us"] for r in records}
        for r in records:
            busbw[(r["op"], r["algorithm"], r["bytes"])].append(r["busbw_gbps"])
            if r["algorithm"] == "auto":
                run[(r["op"], "chosen", r["bytes"])] = run[(r["op"], r["chosen"], r["bytes"])]
        runs.append(run)
    times = {k: statistics.median(run[k] for run in runs if k in run) for k in runs[0]}
    return times, {k: statistics.median(v) for k, v in busbw.items()}, runs


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _cell(times: dict, busbw: dict, key: Key) -> str:
    if key not in times:
        return "-"
    bw = busbw[key]
    return f"{times[key]:,.0f} / {'<0.001' if bw < 0.001 else f'{bw:.3f}'}"


def ratios(times: dict[Key, float]) -> dict[str, dict[int, float]]:
    """The target ratios of one run, by message size (ring and small at one size each)."""
    def t(algo: str, nbytes: int) -> float:
        return times[("all_reduce", algo, nbytes)]

    def fastest(nbytes: int) -> float:
        return min(t(a, nbytes) for a in ALGORITHMS if a != "auto")

    sizes = sorted({k[2] for k in times if k[0] == "all_reduce"})
    return {
        "ring": {16 << 20: t("native", 16 << 20) / t("ring", 16 << 20)},  # busbw ratio
        "small": {4096: min(t("tree", 4096), t("halving_doubling", 4096)) / t("native", 4096)},
        "auto": {n: t("auto", n) / fastest(n) for n in sizes},
        "choice": {n: t("chosen", n) / fastest(n) for n in sizes},
    }


def targets(runs: list[dict[Key, float]]) -> dict[str, tuple[float, int]]:
    """(value, bytes) of each target: per size, the median over the runs of the ratio each
    run measured side by side; then the worst size."""
    each = [ratios(run) for run in runs]
    result = {}
    for name in each[0]:
        medians = {n: statistics.median(r[name][n] for r in each) for n in each[0][name]}
        at = max(medians, key=medians.__getitem__)  # one size for ring and small
        result[name] = (medians[at], at)
    return result


def section(paths: list[str]) -> str:
    times, busbw, runs = load(paths)
    ranks = json.loads(Path(paths[0]).read_text())[0]["world_size"]
    lines = [
        BEGIN,
        f"## dtrain.comm collectives by algorithm ({ranks} ranks, gloo)",
        "",
        f"Command: `for i in 1 2 3 4 5; do dtrain bench comm -n {ranks} --json "
        f"benchmarks/data/comm-run$i.json; done; python benchmarks/comm_results.py "
        f"benchmarks/data/comm-run*.json --write` — {len(paths)} runs (raw data in "
        f"benchmarks/data/), every figure the median of the runs.  ",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, gloo over loopback. Each cell: "
        "time in us (slowest rank's median round) / busbw in GB/s (all_reduce busbw = algbw x "
        "2(n-1)/n).",
        "",
        "| all_reduce | " + " | ".join(ALGORITHMS) + " | auto / fastest |",
        "|---|" + "---|" * (len(ALGORITHMS) + 1),
    ]
    sizes = sorted({k[2] for k in times if k[0] == "all_reduce"})
    auto = [ratios(run)["auto"] for run in runs]
    for n in sizes:
        cells = [_cell(times, busbw, ("all_reduce", a, n)) for a in ALGORITHMS]
        ratio = statistics.median(r[n] for r in auto)
        lines.append(f"| {_size(n)} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    lines += ["", "Other operations at three sizes (busbw = algbw x (n-1)/n for all_gather and "
              "reduce_scatter, x 1 for broadcast):", "",
              "| operation | size | native | ring or tree | auto |", "|---|---|---|---|---|"]
    for op in ("all_gather", "reduce_scatter", "broadcast"):
        op_sizes = sorted({k[2] for k in times if k[0] == op})
        for n in (op_sizes[0], 4096, 16 << 20, op_sizes[-1]):
            other = "tree" if op == "broadcast" else "ring"
            if (op, "native", n) in times:
                lines.append(f"| {op} | {_size(n)} | {_cell(times, busbw, (op, 'native', n))} | "
                             f"{other} {_cell(times, busbw, (op, other, n))} | "
                             f"{_cell(times, busbw, (op, 'auto', n))} |")
    medians = targets(runs)
    per_run = [targets([run]) for run in runs]
    pooled = max((times[("all_reduce", "auto", n)]
                  / min(times[("all_reduce", a, n)] for a in ALGORITHMS if a != "auto"), n)
                 for n in sizes)

    def row(name: str, label: str, goal: str, ok: bool) -> str:
        value, at = medians[name]
        each = ", ".join(f"{r[name][0]:.2f}" for r in per_run)
        met = "yes" if ok else "no"
        return f"| {label} | **{value:.2f}** at {_size(at)} ({each}) | {goal} | {met} |"

    lines += [
        "", "Targets: ratios measured side by side within each run; per size the median "
        "over the runs, then the worst size (each run's own worst in brackets):", "",
        "| target | value | goal | met? |", "|---|---|---|---|",
        row("ring", "ring busbw / native busbw at 16 MiB", ">= 0.8", medians["ring"][0] >= 0.8),
        row("small", "min(tree, halving_doubling) time / native time at 4 KiB", "<= 1.5",
            medians["small"][0] <= 1.5),
        row("auto", "worst over sizes of auto's time / fastest algorithm's", "<= 1.1",
            medians["auto"][0] <= 1.1),
        row("choice", "the same, timing auto's choice in its own row (choice only)", "<= 1.1",
            medians["choice"][0] <= 1.1),
        "",
        "Two readings of the auto target: the first times auto itself, so it carries the "
        "noise between two measurements of the same algorithm on this shared 2-core machine "
        "(10-30% between neighbouring rows); the second asks only whether auto picked the "
        "fastest algorithm. Dividing the median times in the table above instead (which mixes "
        f"runs) gives a worst of {pooled[0]:.2f} at {_size(pooled[1])}.",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="JSON files from dtrain bench comm --json")
    parser.add_argument("--write", action="store_true", help="replace the section in RESULTS.md")
    args = parser.parse_args()
    text = section(args.runs)
    print(text)
    if args.write:
        replace_section("bench_comm", text.splitlines()[1:-1])


if __name__ == "__main__":
    main()
