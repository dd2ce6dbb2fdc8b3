"""Tools beside training: `dtrain bench comm` (comm_bench), `dtrain plan` (plan) and
`dtrain bench scaling` (scaling)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from dtrain.errors import ConfigError


def check_output(flag: str, path: str | None) -> None:
    """Refuse an output file (`--json PATH`, ...) whose folder does not exist, before any
    work is done; empty or "-" (standard output) passes."""
    if path and path != "-" and not Path(path).absolute().parent.is_dir():
        raise ConfigError(f"{flag} {path!r}: its folder does not exist")


def write_json(flag: str, path: str, data: dict) -> bool:
    """Write `data` to `path` (`--json PATH`), or print it for "-"; True when printed
    (the caller then prints nothing else)."""
    text = json.dumps(data, indent=2)
    if path == "-":
        print(text)
        return True
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r}: cannot write it ({exc.strerror})") from None
    return False


def parse_list(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """The comma-separated names in `text`, in order, without repeats.

    Raises:
        ConfigError: a name is not in `allowed`, or there is none.
    """
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    for name in names:
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{flag}: unknown {name!r} ({hint}choose from {', '.join(allowed)})")
    if not names:
        raise ConfigError(f"{flag} is empty: choose from {', '.join(allowed)}")
    return names
