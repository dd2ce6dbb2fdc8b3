"""The cost model behind `algorithm="auto"`: per group, measured once, the same on every rank.

For each operation and each algorithm that implements it, the time of one call is modelled
as a curve through measured points: latency-bound at small messages (alpha times the
algorithm's rounds), bandwidth-bound at large ones (beta per byte, plus reduction), joined
piecewise-linearly, and past the largest probe scaled by its time per byte (a slope taken
between two noisy points would amplify their noise). The points are measured on the group
itself the first time `algorithm="auto"` meets that operation: every candidate is timed at
4 KiB, 64 KiB, 1 MiB, 4 MiB and 16 MiB (one to two seconds on gloo for two ranks), the
way `dtrain bench comm` times them (`time_turns`): taking turns in rounds, the median
round's mean time per call, on the slowest rank. Those figures are agreed by an allreduce,
so every rank makes the same choice (ranks choosing differently would deadlock).

A probe is never larger than the message in hand (nor than 4 KiB, the smallest): a call
of an operation whose tensor has the same size on every rank (SIZE_AGREED) measures the
probes up to its own size, and a later, larger call measures the next ones, so that
measuring never holds more memory than the calls it serves (a model being built holds only
its shards, and an `auto` collective among them probes no 16 MiB tensor). An operation
whose ranks may hold different sizes (all_to_all) measures every probe at its first call.

`dtrain bench comm --calibrate` measures ahead of time and saves the curves to a file
(DTRAIN_CALIBRATION, default ~/.cache/dtrain/calibration.json) that later runs load
instead of measuring.

This module sits below dtrain.comm.collectives, whose calls it times: what measures takes
them as `comm`, that module, handed down by it (`choose`) or by dtrain.comm.select and
dtrain.comm.timing, which offer the same functions bound to it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from dtrain import env
from dtrain.comm.group import Group

PROBE_BYTES = (4096, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
CALLS = (60, 40, 24, 12, 12)  # calls per point: many where they are cheap, fewer when large
WARMUP = 3  # untimed calls per point first: a process's first calls are slow
ROUNDS = 6  # the candidates take turns in this many rounds (see `time_turns`)
SIZE_AGREED = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"})
"""The operations whose tensor has the same size on every rank of a call: their probes grow
with the messages, every rank deciding alike without a word."""


@dataclass(frozen=True)
class Curve:
    """Predicted seconds of one call as a function of its bytes, through measured points."""

    points: tuple[tuple[int, float], ...]  # (bytes, seconds), bytes increasing

    def predict(self, nbytes: int) -> float:
        points = self.points
        if nbytes <= points[0][0]:
            return points[0][1]
        if nbytes >= points[-1][0]:  # bandwidth-bound: the largest probe's time per byte
            return points[-1][1] * nbytes / points[-1][0]
        k = next(k for k in range(1, len(points)) if nbytes <= points[k][0])
        (b0, t0), (b1, t1) = points[k - 1], points[k]
        return t0 + max(0.0, (t1 - t0) / (b1 - b0)) * (nbytes - b0)


def calibration_path() -> Path:
    """The calibration file: env DTRAIN_CALIBRATION, else ~/.cache/dtrain/calibration.json."""
    default = Path.home() / ".cache" / "dtrain" / "calibration.json"
    return Path(env.CALIBRATION.get() or default)


def cache_key(g: Group, op: str) -> str:
    return f"{g.backend}/size{g.size}/{op}"


def _load_cached(key: str) -> dict[str, Curve] | None:
    try:
        entry = json.loads(calibration_path().read_text())[key]
        return {name: Curve(tuple((int(b), float(t)) for b, t in points))
                for name, points in entry.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_models(models: dict[str, dict[str, Curve]]) -> Path:
    """Merge measured models (cache key -> algorithm -> curve) into the calibration file."""
    path = calibration_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    for key, lines in models.items():
        data[key] = {name: [list(p) for p in curve.points] for name, curve in lines.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def probes(above: int = 0, up_to: int | None = None) -> list[int]:
    """The probe sizes above `above` bytes that measuring for a message of `up_to` bytes
    takes: those no larger than it (at least the smallest); every one when None."""
    ceiling = PROBE_BYTES[-1] if up_to is None else max(up_to, PROBE_BYTES[0])
    return [b for b in PROBE_BYTES if above < b <= ceiling]


def measure(g: Group, op: str, candidates: tuple[str, ...], device: torch.device | str,
            comm: ModuleType, sizes: list[int] | None = None) -> dict[str, Curve]:
    """Time every candidate of `op` on `g` with `comm`'s calls at the probe `sizes` (bytes,
    of PROBE_BYTES; default all of them). A collective call: all ranks must make it with
    the same sizes."""
    sizes = list(PROBE_BYTES) if sizes is None else sizes
    counts = dict(zip(PROBE_BYTES, CALLS, strict=True))
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    for nbytes, count in ((b, counts[b]) for b in sizes):
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        calls = {name: _probe(comm, op, tensor, g, name) for name in candidates}
        for call in calls.values():
            for _ in range(WARMUP):
                call()
        timed = time_turns(calls, dict.fromkeys(candidates, count), ROUNDS, g, device, comm)
        for name, taken in timed.items():
            seconds[name].append(taken)
    g.release_scratch()  # grown to the largest probe; real messages grow it again as needed
    return {name: Curve(tuple(zip(sizes, seconds[name], strict=True))) for name in candidates}


def _probe(comm: ModuleType, op: str, tensor: torch.Tensor, g: Group,
           name: str) -> Callable[[], Any]:
    if op in ("broadcast", "reduce"):
        return lambda: getattr(comm, op)(tensor, 0, group=g, algorithm=name)
    return lambda: getattr(comm, op)(tensor, group=g, algorithm=name)


def models(g: Group, op: str, candidates: tuple[str, ...], device: torch.device | str,
           comm: ModuleType, nbytes: int | None = None) -> dict[str, Curve]:
    """The cost lines of `op` on `g`, from the group, the calibration file, or measurement
    at the probes a message of `nbytes` takes (see the module's docstring; None: every
    probe), extended as larger messages come."""
    cache = g.cost_models
    up_to = nbytes if op in SIZE_AGREED else None
    if op not in cache:
        lines = _load_cached(cache_key(g, op))
        if lines is None or set(lines) != set(candidates):
            sizes = probes(up_to=up_to)
            lines = measure(g, op, candidates, device, comm, sizes)
            g.probed[op] = sizes[-1]
        cache[op] = lines
        return lines
    lines = cache[op]
    if op not in g.probed:  # loaded from a calibration, or given (a traced group's)
        return lines
    more = probes(above=g.probed[op], up_to=up_to)
    if more:  # a larger message than any measured: the probes up to it
        g.probed[op] = more[-1]
        added = measure(g, op, candidates, device, comm, more)
        lines = cache[op] = {name: Curve(lines[name].points + added[name].points)
                             for name in candidates}
    return lines


def choose(op: str, tensor: torch.Tensor, g: Group, algorithm: str,
           available: tuple[str, ...], comm: ModuleType) -> str:
    """The algorithm to run `op` with (measured with `comm`'s calls the first time auto
    meets `op` on `g`).

    Raises:
        ValueError: an unknown algorithm, or one `op` does not have.
    """
    if algorithm != "auto":
        if algorithm not in available:
            raise ValueError(
                f"{op} has no algorithm {algorithm!r}: use auto or one of {', '.join(available)}"
            )
        return algorithm
    if len(available) == 1 or tensor.numel() == 0:  # an empty tensor sends nothing anyway
        return available[0]
    nbytes = tensor.numel() * tensor.element_size()
    lines = models(g, op, available, tensor.device, comm, nbytes)
    return min(available, key=lambda name: lines[name].predict(nbytes))


def time_turns(calls: dict[str, Callable[[], Any]], counts: dict[str, int], rounds: int,
               group: Group, device: torch.device | str, comm: ModuleType) -> dict[str, float]:
    """Seconds per call of each of `calls`: `counts[name]` calls in all, split over `rounds`
    (dtrain.comm.timing describes the method; `comm` gives the barrier and the allreduce).

    A collective call: every rank of `group` must make it with the same counts.
    """
    sync = synchronizer(device)
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(rounds):
        for name, call in calls.items():
            turn = counts[name] // rounds + (i < counts[name] % rounds)
            if turn == 0:
                continue
            comm.barrier(group=group)
            start = time.perf_counter()
            for _ in range(turn):
                call()
            sync()
            per_call[name].append((time.perf_counter() - start) / turn)
    return dict(zip(calls, slowest([statistics.median(per_call[name]) for name in calls],
                                   group, device, comm), strict=True))


def slowest(seconds: list[float], group: Group, device: torch.device | str,
            comm: ModuleType) -> list[float]:
    """Each of `seconds`, replaced by its largest value over the ranks of `group`."""
    values = torch.tensor(seconds, dtype=torch.float64, device=device)
    comm.all_reduce(values, op="max", group=group, algorithm="native")
    return values.tolist()


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for the work queued on `device` (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
