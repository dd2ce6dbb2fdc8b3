"""A timeline of where each rank's time went, as one Chrome-trace file for Perfetto.

    dtrain run -n 2 --timeline trace.json script.py     # or: dtrain train --timeline trace.json
    # then open trace.json in https://ui.perfetto.dev (or chrome://tracing)

    with dtrain.timeline.span("evaluate", batches=8):   # a span of your own; no-op when off
        ...

When `dtrain.init()` finds a timeline path (env DTRAIN_TIMELINE, which `dtrain run
--timeline` sets), the world gets a `Recorder` and installs it here as this process's
(`install`; `recorder()` returns it). Every collective of `dtrain.comm` becomes
a span (op, bytes, the algorithm that ran, group size; an async one from its issue to the
end of its `wait()`), and `dtrain train` adds each step's data loading, forward, backward
and optimizer step. At shutdown or exit each rank writes its spans to `OUT.rank-R.json`;
the launcher merges them into OUT once the ranks end (a one-process world writes OUT
itself). Off, every hook is one `recorder() is None` check: no clock read, no allocation.

The file is Chrome's trace-event format: "complete" events (`"ph": "X"`, `ts` and `dur` in
microseconds since the epoch, so ranks on one host line up) with `pid` = rank and `tid`
0 for the main thread's compute, 1, 2, ... for collectives in flight at once (overlapping
spans on one row would not nest), and metadata events naming the rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeAlias

from dtrain.errors import ConfigError

_OFF = contextlib.nullcontext()  # what `span` returns when not recording: reusable, stateless
_RECORDER: Recorder | None = None  # this process's, installed by dtrain.world (install)


def recorder() -> Recorder | None:
    """This process's timeline recorder, or None when no timeline is recorded (the check
    every hook makes first)."""
    return _RECORDER


def install(active: Recorder | None) -> None:
    """Make `active` this process's recorder (None: record nothing). dtrain.world installs
    its world's; closing the recorder is the caller's."""
    global _RECORDER
    _RECORDER = active


def part_path(out: str | os.PathLike[str], rank: int) -> Path:
    """Where rank `rank` writes its own spans before the merge into `out`."""
    return Path(f"{out}.rank-{rank}.json")


def prepare(path: str | os.PathLike[str]) -> str:
    """The absolute form of a timeline path (ranks may run elsewhere), its folder created.

    Raises:
        ConfigError: the folder cannot be created, or the path is a folder.
    """
    out = Path(path).expanduser().absolute()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"timeline {str(path)!r}: cannot create its folder: "
                          f"{exc.strerror or exc}") from None
    if out.is_dir():
        raise ConfigError(f"timeline {str(path)!r} is a folder: name a .json file")
    return str(out)


class Recorder:
    """This process's spans, kept in memory until `close()` writes them.

    Args:
        out: the merged timeline's path; this rank writes `part_path(out, rank)`.
        rank: the rank, the trace's `pid`.
        alone: no launcher merges the parts (a one-process world): `close()` writes `out`.
    """

    def __init__(self, out: str, rank: int, alone: bool = False) -> None:
        self.out, self.rank, self.alone, self.closed = out, rank, alone, False
        self._events: list[tuple[str, str, int, int, int, dict[str, Any]]] = []
        self._offset_ns = time.time_ns() - time.perf_counter_ns()  # one wall-clock anchor
        self._lock = threading.Lock()
        self._busy_lanes: set[int] = set()
        self._lanes = 0  # rows of collectives used: tids 1 .. lanes
        self._threads: dict[int, str] = {0: "main"}  # other threads' rows: tid -> name

    def record(self, name: str, cat: str, start_ns: int, end_ns: int,
               args: dict[str, Any] | None = None, tid: int | None = None) -> None:
        """Add a span; times are `time.perf_counter_ns()` readings of this process."""
        if tid is None:
            tid = self._thread_tid()
        self._events.append((name, cat, start_ns, end_ns, tid, args or {}))

    def span(self, name: str, cat: str = "user", args: dict[str, Any] | None = None) -> _Span:
        """A context manager recording its body as one span."""
        return _Span(self, name, cat, args)

    def begin_comm(self, op: str, nbytes: int, algorithm: str, group_size: int,
                   async_op: bool, peer: int | None = None) -> CommSpan:
        """Start a collective's span now, on the first row free of collectives in flight;
        `end()` it when the collective has completed."""
        with self._lock:
            lane = 0
            while lane in self._busy_lanes:
                lane += 1
            self._busy_lanes.add(lane)
        self._lanes = max(self._lanes, lane + 1)
        args = {"bytes": nbytes, "algorithm": algorithm, "group_size": group_size,
                "async": async_op}
        if peer is not None:
            args["peer"] = peer
        return CommSpan(self, op, args, lane)

    def _end_comm(self, span: CommSpan) -> None:
        self._events.append((span.op, "comm", span.start_ns, time.perf_counter_ns(),
                             span.lane + 1, span.args))
        self._busy_lanes.discard(span.lane)  # atomic; at worst a begin skips this free row

    def _thread_tid(self) -> int:
        thread = threading.current_thread()
        if thread is threading.main_thread():
            return 0
        tid = thread.native_id or 0
        self._threads.setdefault(tid, thread.name)
        return tid

    def events(self) -> list[dict[str, Any]]:
        """The spans as trace events, after the metadata that names this rank's rows."""
        pid = self.rank
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"name": f"rank {pid}"}},
                {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"sort_index": pid}}]
        rows = self._threads | {lane + 1: f"comm {lane}" for lane in range(self._lanes)}
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                  "args": {"name": name}} for tid, name in sorted(rows.items())]
        return meta + [
            {"name": name, "cat": cat, "ph": "X", "ts": (start + self._offset_ns) / 1e3,
             "dur": (end - start) / 1e3, "pid": pid, "tid": tid, "args": args}
            for name, cat, start, end, tid, args in list(self._events)
        ]

    def close(self) -> None:
        """Write this rank's part (and, alone, the whole timeline) once; later calls do nothing."""
        if self.closed:
            return
        self.closed = True
        part = part_path(self.out, self.rank)
        _write_json(part, {"traceEvents": self.events(), "displayTimeUnit": "ms"})
        if self.alone:
            merge([part], self.out)


class _Span:
    """One span of compute (or of a user's code) on the calling thread's row."""

    __slots__ = ("_recorder", "_name", "_cat", "_args", "_start")

    def __init__(self, recorder: Recorder, name: str, cat: str,
                 args: dict[str, Any] | None) -> None:
        self._recorder, self._name, self._cat, self._args = recorder, name, cat, args
        self._start = 0

    def __enter__(self) -> None:
        self._start = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        self._recorder.record(self._name, self._cat, self._start, time.perf_counter_ns(),
                              self._args)


class CommSpan:
    """A collective in flight, on a row of its own until `end()`."""

    __slots__ = ("_recorder", "op", "args", "lane", "start_ns")

    def __init__(self, recorder: Recorder, op: str, args: dict[str, Any], lane: int) -> None:
        self._recorder, self.op, self.args, self.lane = recorder, op, args, lane
        self.start_ns = time.perf_counter_ns()

    def end(self) -> None:
        """The collective has completed: record its span."""
        self._recorder._end_comm(self)


def span(name: str, cat: str = "user", **args: Any) -> contextlib.AbstractContextManager[None]:
    """Record the body of a `with` block as a span named `name` (category `cat`, `args`
    shown with it) on this rank's timeline; does nothing when no timeline is recorded."""
    active = _RECORDER
    if active is None:
        return _OFF
    return active.span(name, cat, args)


def _write_json(path: Path, value: Any) -> None:
    """Write `value` as JSON into `path` atomically: a reader sees all of it or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(value, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def merge(parts: Iterable[str | os.PathLike[str]], out: str | os.PathLike[str]) -> int:
    """Join the ranks' part files into the one trace `out`, then delete the parts.

    Returns:
        The number of parts merged.
    """
    paths = [Path(p) for p in parts]
    events: list[dict[str, Any]] = []
    for path in paths:
        events += json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
    _write_json(Path(out), {"traceEvents": events, "displayTimeUnit": "ms"})
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


def merge_ranks(out: str, ranks: Iterable[int], into: str | None = None) -> int:
    """Merge the parts of `ranks` (those that exist: a failure may leave some out) of the
    timeline recorded for `out` into `into` (default `out`); returns how many there were."""
    parts = [p for p in (part_path(out, rank) for rank in ranks) if p.exists()]
    return merge(parts, into or out) if parts else 0


Trace: TypeAlias = "str | os.PathLike[str] | dict[str, Any] | list[dict[str, Any]]"
"""A timeline: its file's path, its loaded JSON, or its list of events."""


def _load(trace: Trace) -> list[dict[str, Any]]:
    if isinstance(trace, (str, os.PathLike)):
        loaded = json.loads(Path(trace).read_text(encoding="utf-8"))
    else:
        loaded = trace
    events: list[dict[str, Any]] = loaded["traceEvents"] if isinstance(loaded, dict) else loaded
    return events


def summarize(trace: Trace) -> dict[int, dict[str, float]]:
    """Seconds each rank spent in each category: {rank: {"step": s, "comm": s, ...}}.

    `trace` is a timeline's path, its loaded JSON, or its list of events. Time covered by
    several spans of one category at once (async collectives in flight together) counts
    once, so `comm / step` is the share of step time during which a collective was running.
    """
    intervals: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for event in _load(trace):
        if event.get("ph") == "X":
            per_rank = intervals.setdefault(int(event["pid"]), {})
            per_rank.setdefault(event["cat"], []).append(
                (event["ts"], event["ts"] + event["dur"]))
    return {rank: {cat: _covered(spans) / 1e6 for cat, spans in sorted(cats.items())}
            for rank, cats in sorted(intervals.items())}


def _covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
