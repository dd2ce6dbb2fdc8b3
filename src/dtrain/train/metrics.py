"""What rank 0 shows and records: a progress bar or progress lines, and JSON-lines metrics
in step order."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO, TextIO

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
    The bar moves at each step (`tick`); the figures, gathered from every rank once per
    `log_every` steps, are shown as they come (`step`).

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

    def tick(self) -> None:
        """A step is done: the bar moves on (its figures come with `step`, at the next log,
        when they are gathered)."""
        if self.bar is not None:
            self.bar.update(1)

    def step(self, step: int, loss: float, tokens_per_s: float,
             speed: Mapping[str, float | int] | None = None) -> None:
        """Show `step`'s loss and speed: tokens/s and, from dtrain.train.speed's figures,
        TFLOP/s per rank, MFU and peak memory (the bar's figures, or a line every
        `log_every` steps and at the last)."""
        if not self.enabled:
            return
        speed = speed or {}
        if self.bar is not None:
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
    """Write one JSON object per line to `path`, in step order (no-op when path is empty or
    disabled); a run resumed by a restart or a new rendezvous round (`resumed`) goes on in
    the same file, any other starts it anew.

    In a live job the writer changes between steps (dtrain.ft.live.job: the first live
    replica of each step's quorum), and the writers are processes of their own: the one
    taking over may record its steps before the one it replaces has written its last, so
    appending would leave two records out of order. Each write therefore takes an exclusive
    lock on the file (flock: the other writers wait for it) and puts its record after every
    record of the same or an earlier step, before any of a later one. Records of one step
    keep the order they came in, so a step run again (a run resumed from an earlier
    checkpoint) has its newest record last, as readers taking a step's last record expect.
    """

    def __init__(self, path: str, enabled: bool, resumed: bool = False) -> None:
        self.path: Path | None = None
        if path and enabled:
            self.path = Path(path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not resumed:
                self.path.write_text("", encoding="utf-8")  # a new run starts it anew

    def has(self, step: int) -> bool:
        """Whether the file's last records (its last 64 KiB, whoever wrote them) hold one
        of `step`."""
        if self.path is None or not self.path.exists():
            return False
        with open(self.path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
        return any(line.startswith(f'{{"step": {step},') for line in tail.splitlines())

    def write(self, record: Mapping[str, object]) -> None:
        """Put `record` into the file in step order (at its end, unless another writer has
        already recorded a later step); a record without an integer "step" goes at the end.
        """
        if self.path is None:
            return
        line = (json.dumps(record) + "\n").encode("utf-8")
        step = record.get("step")
        # opened for each record (the file is created again if it was removed), never
        # in append mode: an insertion writes at an offset
        with open(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released as the file closes
            at = _later_records(f, step) if isinstance(step, int) else None
            if at is None:
                size = f.seek(0, os.SEEK_END)
                if size:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":  # a line a killed writer left cut short
                        line = b"\n" + line
                f.write(line)
            else:
                f.seek(at)
                later = f.read()
                f.seek(at)
                f.write(line + later)  # only longer: nothing of the old end is left over

    def close(self) -> None:
        """Nothing is held between records; kept so that every sink closes alike."""


TAIL_BYTES = 64 << 10
"""How much of the file's end is read at first to find a record's place (a few records
are usually all there is to pass); a wider window is read when they fill it."""


def _step_of(line: bytes) -> int | None:
    """The step a record line holds; None for a line that is not a record with one (a
    line cut short by a writer killed while writing it, or a record without a step)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def _later_records(f: BinaryIO, step: int) -> int | None:
    """The offset in `f` of the first of the records at its end whose step is after `step`,
    where `step`'s record goes to keep the file in step order; None when no record at the
    end is after it (the record is appended).

    Reads back from the end only as far as the records of later steps go: a window of
    TAIL_BYTES, widened while they fill it. A line that holds no step (one cut short)
    stops the search: nothing is inserted before it.
    """
    size = f.seek(0, os.SEEK_END)
    window = TAIL_BYTES
    while True:
        start = max(0, size - window)
        f.seek(start)
        text = f.read()
        if not text.endswith(b"\n"):  # empty, or its last line cut short: append
            return None
        # the window's first line may begin before it: it is read whole in a wider one
        first = 0 if start == 0 else text.find(b"\n") + 1
        found, end = None, len(text)
        for line in reversed(text[first:-1].split(b"\n") if first < len(text) else []):
            end -= len(line) + 1
            later = _step_of(line)
            if later is None or later <= step:
                return found
            found = start + end
        if start == 0:
            return found
        window *= 4
