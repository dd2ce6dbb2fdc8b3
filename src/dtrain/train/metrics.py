"""What rank 0 shows and records: a progress bar or progress lines, and JSON-lines metrics."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"


def _speed(figures: Mapping[str, float | int]) -> str:
    """`  0.41 TFLOP/s  MFU 12.3%  mem 1.21 GiB` of the figures there are."""
    text = ""
    if "tflops" in figures:
        text += f"  {figures['tflops']:.3g} TFLOP/s"
    if "mfu" in figures:
        text += f"  MFU {figures['mfu']:.1%}"
    if "peak_memory_gib" in figures:
        text += f"  mem {figures['peak_memory_gib']:.2f} GiB"
    return text


class Progress:
    """A tqdm bar when the output is a terminal, else a plain line every `log_every` steps.

    Args:
        total: steps planned.
        log_every: steps between printed lines.
        enabled: False on every rank but 0.
        stream: where to write (default stdout).
    """

    def __init__(self, total: int, log_every: int, enabled: bool, stream: TextIO | None = None):
        self.total, self.log_every, self.enabled = total, log_every, enabled
        self.stream = stream or sys.stdout
        self.start = time.perf_counter()
        self.bar = None
        if enabled and self.stream.isatty():
            self.bar = tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True)

    def step(self, step: int, loss: float, tokens_per_s: float,
             speed: Mapping[str, float | int] | None = None) -> None:
        """Show `step`'s loss and speed: tokens/s and, from dtrain.train.speed's figures,
        TFLOP/s per rank, MFU and peak memory."""
        if not self.enabled:
            return
        speed = speed or {}
        if self.bar is not None:
            self.bar.update(1)
            shown = {"loss": f"{loss:.4f}", "tok_s": f"{tokens_per_s:,.0f}"}
            if "mfu" in speed:
                shown["mfu"] = f"{speed['mfu']:.1%}"
            self.bar.set_postfix(shown)
        elif step % self.log_every == 0 or step == self.total:
            elapsed = time.perf_counter() - self.start
            eta = elapsed / step * (self.total - step)
            self.write(f"step {step:>5}/{self.total}  loss {loss:.4f}  "
                       f"{tokens_per_s:,.0f} tok/s{_speed(speed)}  "
                       f"elapsed {_clock(elapsed)}  eta {_clock(eta)}")

    def write(self, line: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsLog:
    """Append one JSON object per line to `path` (no-op when path is empty or disabled); a
    run resumed by a restart or a new rendezvous round (`resumed`) goes on in the same file,
    any other starts it anew."""

    def __init__(self, path: str, enabled: bool, resumed: bool = False) -> None:
        self.file = None
        if path and enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if not resumed:
                Path(path).write_text("", encoding="utf-8")  # a new run starts it anew
            # appended, each record at the file's end whoever else wrote since (a live
            # replica taking over as the writer): never at an offset of its own
            self.file = open(path, "a", encoding="utf-8")  # see close()

    def has(self, step: int) -> bool:
        """Whether the file's last records (its last 64 KiB, whoever appended them) hold
        one of `step`."""
        if self.file is None:
            return False
        with open(self.file.name, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (64 << 10)))
            tail = f.read().decode("utf-8", errors="replace")
        return any(line.startswith(f'{{"step": {step},') for line in tail.splitlines())

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
