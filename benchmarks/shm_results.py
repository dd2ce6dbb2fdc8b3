"""Summarize `dtrain bench comm --backend shm,gloo --ops all_reduce --json` runs (2 and 4
ranks) into benchmarks/RESULTS.md: the shm backend against gloo, side by side.

    for n in 2 4; do for i in 1 2 3; do
        dtrain bench comm -n $n --backend shm,gloo --ops all_reduce --algorithms native \\
            --json benchmarks/data/shm-n$n-run$i.json
    done; done
    python benchmarks/shm_results.py benchmarks/data/shm-n*-run*.json --write

Every figure is the median over the runs of one rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from collections import defaultdict
from pathlib import Path

from results_md import replace_section

TARGET_SIZE, SMALL_SIZE = 16 << 20, 4096


def medians(paths: list[str]) -> dict[int, dict[tuple[str, int], tuple[float, float]]]:
    """ranks -> (backend, bytes) -> (median time us, median busbw GB/s)."""
    samples: dict[int, dict] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        for r in json.loads(Path(path).read_text()):
            if r["op"] == "all_reduce" and r["algorithm"] == "native":
                samples[r["world_size"]][(r["backend"], r["bytes"])].append(
                    (r["time_us"], r["busbw_gbps"]))
    return {n: {key: (statistics.median(t for t, _ in v), statistics.median(b for _, b in v))
                for key, v in table.items()} for n, table in samples.items()}


def section(paths: list[str]) -> list[str]:
    by_ranks = medians(paths)
    runs = {n: sum(1 for p in paths if json.loads(Path(p).read_text())[0]["world_size"] == n)
            for n in by_ranks}
    lines = [
        "## The shm backend vs gloo (all_reduce)",
        "",
        "Command: see benchmarks/shm_results.py (3 runs per rank count, raw data in "
        "benchmarks/data/shm-n*-run*.json); each cell the median over the runs.  ",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}; both backends measured in "
        "one run, one after the other. Cell: time in us / busbw in GB/s.",
    ]
    checks = []
    for n in sorted(by_ranks):
        table = by_ranks[n]
        sizes = sorted({b for _, b in table})
        lines += ["", f"### {n} ranks on {os.cpu_count()} cores ({runs[n]} runs)", "",
                  "| size | gloo | shm | time shm / gloo |", "|---|---|---|---|"]
        ratios = {}
        for size in sizes:
            (tg, bg), (ts, bs) = table[("gloo", size)], table[("shm", size)]
            ratios[size] = ts / tg
            lines.append(f"| {_size(size)} | {tg:,.0f} / {bg:.3f} | {ts:,.0f} / {bs:.3f} | "
                         f"{ts / tg:.3f} |")
        if n == 2:
            bus = table[("shm", TARGET_SIZE)][1] / table[("gloo", TARGET_SIZE)][1]
            checks.append(("busbw shm / gloo at 16 MiB, 2 ranks", f"{bus:.2f}", ">= 4",
                           bus >= 4))
            small = ratios[SMALL_SIZE]
            checks.append(("latency shm / gloo at 4 KiB, 2 ranks", f"{small:.3f}", "<= 0.25",
                           small <= 0.25))
        else:
            worst = max(ratios, key=ratios.__getitem__)
            checks.append((f"worst time shm / gloo over sizes, {n} ranks on "
                           f"{os.cpu_count()} cores", f"{ratios[worst]:.3f} at {_size(worst)}",
                           "< 1", ratios[worst] < 1))
    lines += ["", "| target | value | goal | met? |", "|---|---|---|---|"]
    lines += [f"| {name} | **{value}** | {goal} | {'yes' if ok else 'no'} |"
              for name, value, goal, ok in checks]
    return lines


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="JSON files from dtrain bench comm --json")
    parser.add_argument("--write", action="store_true", help="replace the section in RESULTS.md")
    args = parser.parse_args()
    lines = section(args.runs)
    print("\n".join(lines))
    if args.write:
        replace_section("shm_vs_gloo", lines)


if __name__ == "__main__":
    main()
