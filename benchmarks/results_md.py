"""benchmarks/RESULTS.md is made of sections, one per benchmark, each between markers
`<!-- NAME:begin -->` and `<!-- NAME:end -->`; a benchmark replaces only its own."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(name: str, body: list[str]) -> None:
    """Put `body` (lines, without the markers) in section `name`, appending it if new."""
    begin, end = markers(name)
    section = "\n".join([begin, *body, end])
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    RESULTS.write_text(text)


def run_summary(load_before: float, started: float, **more: str) -> dict:
    """What a benchmark's section says of its run: the load average before (given) and
    now, the minutes since `started` (time.time()), the date and time, and `more`."""
    return {"load_before": load_before, "load_after": os.getloadavg()[0],
            "minutes": (time.time() - started) / 60, **more,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}
