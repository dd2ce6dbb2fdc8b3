"""benchmarks/RESULTS.md is made of sections, one per benchmark, each between markers
`<!-- NAME:begin -->` and `<!-- NAME:end -->`; a benchmark replaces only its own."""

from __future__ import annotations

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
