"""Where a test run's time goes, by file: a Markdown table from pytest's --durations=0.

    pytest -q --durations=0 > quick.log; python scripts/test_times.py quick.log [--top 15]

Sums each file's setup, call and teardown seconds and counts its tests (those pytest timed
at 5 ms or more); the share is of the sum over all files (pytest's own collection and
start-up are not in it). With two logs, the
table has both side by side (before, after): `python scripts/test_times.py before.log
after.log`.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+?)::(\S+)")
SUMMARY = re.compile(r"(\d+) passed.* in ([0-9.]+)s")


def by_file(log: Path) -> tuple[dict[str, float], dict[str, set[str]], str]:
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set[str]] = defaultdict(set)
    summary = ""
    for line in log.read_text().splitlines():
        if m := LINE.match(line):
            seconds[m[3]] += float(m[1])
            tests[m[3]].add(m[4])
        elif SUMMARY.search(line):
            summary = line.strip("= ")
    return seconds, tests, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    runs = [by_file(log) for log in args.logs]
    files = sorted(set().union(*(r[0] for r in runs)), key=lambda f: -max(
        r[0].get(f, 0.0) for r in runs))
    head = " | ".join(f"{log.name} s | share" for log in args.logs)
    print(f"| file | tests timed | {head} |")
    print("|---|---|" + "---|---|" * len(runs))
    for name in files[:args.top]:
        cells = []
        for seconds, _, _ in runs:
            total = sum(seconds.values()) or 1.0
            cells.append(f"{seconds.get(name, 0.0):.0f} | {seconds.get(name, 0.0) / total:.0%}")
        count = max(len(tests.get(name, ())) for _, tests, _ in runs)
        print(f"| {name} | {count} | {' | '.join(cells)} |")
    rest = [sum(s for f, s in seconds.items() if f not in files[:args.top])
            for seconds, _, _ in runs]
    print(f"| the other {max(0, len(files) - args.top)} files | | "
          + " | ".join(f"{r:.0f} | " for r in rest) + " |")
    print("| **all** | | " + " | ".join(f"**{sum(s.values()):.0f}** | "
                                       for s, _, _ in runs) + " |")
    for log, (_, _, summary) in zip(args.logs, runs, strict=True):
        print(f"\n{log.name}: {summary}")


if __name__ == "__main__":
    main()
