"""Tools beside training: `dtrain bench comm` (comm_bench), `dtrain plan` (plan) and
`dtrain bench scaling` (scaling)."""

from __future__ import annotations

from pathlib import Path

from dtrain.errors import ConfigError


def check_output(flag: str, path: str | None) -> None:
    """Refuse an output file (`--json PATH`, ...) whose folder does not exist, before any
    work is done; empty or "-" (standard output) passes."""
    if path and path != "-" and not Path(path).absolute().parent.is_dir():
        raise ConfigError(f"{flag} {path!r}: its folder does not exist")
