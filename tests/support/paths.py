"""Where the repository's parts are, for tests that read or run them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (this file is tests/support/paths.py)."""
SRC = ROOT / "src"
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"
