"""Choosing an algorithm: a cost model per group, measured once, the same on every rank.

For each operation and each algorithm that implements it, the time of one call is modelled
as `a + b * bytes` — `a` the latency (alpha: per-message cost times the algorithm's number
of rounds) and `b` the inverse bandwidth (beta, plus reduction cost). Both are measured on
the group itself the first time `algorithm="auto"` meets that operation: every candidate
is timed at a small and a large message and the line through the two points is the model.
Rank 0's measurements are broadcast, so every rank makes the same choice — ranks choosing
differently would deadlock. `dtrain bench comm --calibrate` measures ahead of time and
saves the models to a file (DTRAIN_CALIBRATION, default ~/.cache/dtrain/calibration.json)
that later runs load instead of measuring.

`explain(op, nbytes, group)` says which algorithm a call would use and why.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dtrain.comm.group import Group

ALGORITHMS = ("native", "ring", "tree", "halving_doubling")
PROBE_BYTES = (4096, 1 << 20)
REPEATS = 3


@dataclass(frozen=True)
class Line:
    """Predicted seconds for one call: latency + seconds_per_byte * bytes."""

    latency: float
    seconds_per_byte: float

    def predict(self, nbytes: int) -> float:
        return self.latency + self.seconds_per_byte * nbytes


@dataclass(frozen=True)
class Choice:
    """What `explain` reports: the algorithm chosen and the predictions behind it."""

    op: str
    nbytes: int
    algorithm: str
    predicted_us: dict[str, float]
    reason: str


def _cache_path() -> Path:
    default = Path.home() / ".cache" / "dtrain" / "calibration.json"
    return Path(os.environ.get("DTRAIN_CALIBRATION", default))


def cache_key(g: Group, op: str) -> str:
    return f"{g.backend}/size{g.size}/{op}"


def _load_cached(key: str) -> dict[str, Line] | None:
    try:
        entry = json.loads(_cache_path().read_text())[key]
        return {name: Line(*values) for name, values in entry.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_models(models: dict[str, dict[str, Line]]) -> Path:
    """Merge measured models (cache key -> algorithm -> line) into the calibration file."""
    path = _cache_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    for key, lines in models.items():
        data[key] = {name: [line.latency, line.seconds_per_byte] for name, line in lines.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def measure(g: Group, op: str, candidates: tuple[str, ...],
            device: torch.device | str = "cpu") -> dict[str, Line]:
    """Time every candidate of `op` on `g` (a collective call: all ranks must make it)."""
    from dtrain.comm import collectives  # the calls being measured

    timings = torch.zeros(len(candidates), len(PROBE_BYTES), dtype=torch.float64, device=device)
    for j, nbytes in enumerate(PROBE_BYTES):
        tensor = torch.ones(max(g.size, nbytes // 4), dtype=torch.float32, device=device)
        for i, name in enumerate(candidates):
            call = _probe(collectives, op, tensor, g, name)
            call()  # warm-up
            collectives.barrier(group=g)
            _sync(device)
            start = time.perf_counter()
            for _ in range(REPEATS):
                call()
            _sync(device)
            timings[i, j] = (time.perf_counter() - start) / REPEATS
    collectives.broadcast(timings, src=0, group=g, algorithm="native")
    small, big = (max(g.size, n // 4) * 4 for n in PROBE_BYTES)
    lines = {}
    for i, name in enumerate(candidates):
        t_small, t_big = timings[i].tolist()
        slope = max(0.0, (t_big - t_small) / (big - small))
        lines[name] = Line(max(0.0, t_small - slope * small), slope)
    return lines


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _probe(collectives, op: str, tensor: torch.Tensor, g: Group, name: str):
    if op in ("broadcast", "reduce"):
        return lambda: getattr(collectives, op)(tensor, 0, group=g, algorithm=name)
    return lambda: getattr(collectives, op)(tensor, group=g, algorithm=name)


def models(g: Group, op: str, candidates: tuple[str, ...],
           device: torch.device | str = "cpu") -> dict[str, Line]:
    """The cost lines of `op` on `g`, from the group, the calibration file, or measurement."""
    cache = g.cost_models
    if op not in cache:
        lines = _load_cached(cache_key(g, op))
        if lines is None or set(lines) != set(candidates):
            lines = measure(g, op, candidates, device)
        cache[op] = lines
    return cache[op]


def choose(op: str, tensor: torch.Tensor, g: Group, algorithm: str,
           available: tuple[str, ...]) -> str:
    """The algorithm to run `op` with.

    Raises:
        ValueError: an unknown algorithm, or one `op` does not have.
    """
    if algorithm != "auto":
        if algorithm not in available:
            raise ValueError(
                f"{op} has no algorithm {algorithm!r}: use auto or one of {', '.join(available)}"
            )
        return algorithm
    if len(available) == 1:
        return available[0]
    lines = models(g, op, available, tensor.device)
    nbytes = tensor.numel() * tensor.element_size()
    return min(available, key=lambda name: lines[name].predict(nbytes))


def explain(op: str, nbytes: int, group=None, device: torch.device | str = "cpu") -> Choice:
    """Which algorithm `algorithm="auto"` would use for `op` on `nbytes`, and why.

    A collective call the first time (it may measure): call it on every rank.
    """
    from dtrain.comm.collectives import AVAILABLE
    from dtrain.comm.groups import resolve

    g = resolve(group)
    available = AVAILABLE[op]
    if len(available) == 1:
        return Choice(op, nbytes, available[0], {}, f"{op} has only the native algorithm")
    lines = models(g, op, available, device)
    predicted = {name: lines[name].predict(nbytes) * 1e6 for name in available}
    best = min(predicted, key=predicted.__getitem__)
    runner_up = sorted(predicted.values())[1]
    reason = (f"{best} predicted {predicted[best]:.0f} us for {nbytes} bytes on {g.size} ranks "
              f"({runner_up / max(predicted[best], 1e-9):.2f}x faster than the next best); "
              f"model per algorithm: latency + bytes / bandwidth, measured on this group")
    return Choice(op, nbytes, best, predicted, reason)
