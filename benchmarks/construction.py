"""A rank's peak memory while its share of a model is built: split form (a skeleton on the
meta device, then `dtrain.layouts.build`, which allocates only what the rank holds and
restores it from the initial values) against the old way (the whole model built on every
rank, then laid out).

    python benchmarks/construction.py [--write]

Five layouts of one GPT, each in its own spawned world (dtrain.testing's `run_ranks`,
gloo): tp=2 on 2 ranks; ZeRO-1, ZeRO-2 and ZeRO-3 over 4 ranks; tp2 x pp2 on 4. On every
rank the peak of live tensor bytes (dtrain.planner.LiveBytes, the CPU's
max_memory_allocated) from the first line of construction to the end of `layouts.build`,
restore included; the figure is the busiest rank's. The collectives' one-time calibration
(`algorithm="auto"`, probes up to 16 MiB) is done before, on the same mesh
(dtrain.planner.traced.measure.calibrate, then a model of one block per stage built the
same way), so it is not counted.

Target: split form peaks at no more than 1/N of the whole model plus one generator chunk
(dtrain.models.init.CHUNK elements of 4 bytes), N the ranks the layout divides the
parameters over (tp x pp; ZeRO-3 x dp too; ZeRO-1 and 2 keep every parameter on every rank,
so theirs is the whole model plus one chunk). Where a rank peaks above what it holds once
built, the largest tensors alive at that moment are listed with the line of dtrain that made
each (`Busiest`), which names the excess.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import platform
import sys
import traceback
from pathlib import Path

import torch
from results_md import replace_section

import dtrain
from dtrain import layouts, models
from dtrain.config import config_from_dict, dims_of
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.planner import LiveBytes
from dtrain.planner.traced.measure import calibrate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # dtrain.testing.processes
from dtrain.testing import run_ranks  # noqa: E402

MiB = 2**20
SHAPE = {"arch": "gpt", "n_layer": 8, "n_head": 8, "n_embd": 512, "block_size": 128}
LAYOUTS = {"tp=2": (2, {"tp": 2}), "ZeRO-1 x 4": (4, {"zero": 1}),
           "ZeRO-2 x 4": (4, {"zero": 2}), "ZeRO-3 x 4": (4, {"zero": 3}),
           "tp2 x pp2": (4, {"tp": 2, "pp": 2, "microbatches": 2})}
NOTED = MiB
"""Storages of at least this many bytes get the line that made them noted (`Busiest`)."""
SRC = str(Path(dtrain.__file__).resolve().parent)
TRACKER = inspect.getsourcefile(LiveBytes)


class Busiest(LiveBytes):
    """LiveBytes that also keeps, at its peak, the largest storages then alive, each with
    the line of dtrain whose operation made it: what a peak above the target is made of."""

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[int, str] = {}
        self.at_peak: list[tuple[int, str]] = []

    def _note(self, t: torch.Tensor) -> None:
        if not t.is_meta and t.untyped_storage().nbytes() >= NOTED:
            known = self._storages.get(id(t.untyped_storage()))
            if known is None or known[0]() is None:
                self._made[id(t.untyped_storage())] = made_where()
        super()._note(t)

    def _update(self) -> None:
        before = self.peak
        super()._update()
        if self.peak > before:
            alive = [(ref().nbytes(), self._made.get(key, "")) for key, (ref, _)
                     in self._storages.items() if ref() is not None]
            self.at_peak = sorted(alive, reverse=True)[:6]


def made_where() -> str:
    """The innermost line of dtrain (below this benchmark) on the stack, as file:line."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(SRC) and frame.filename != TRACKER:
            return f"{Path(frame.filename).relative_to(SRC)}:{frame.lineno} ({frame.name})"
    return "?"


def config_of(shape: dict, parallel: dict, world_size: int):
    return config_from_dict({"model": shape, "optimizer": {"name": "adamw"},
                             "train": {"batch_size": world_size, "seed": 0},
                             "parallel": {"nproc": world_size, **parallel}})


def build(shape: dict, parallel: dict, mesh, split_form: bool):
    world = dtrain.world.current()
    config = config_of(shape, parallel, world.world_size)
    resolved = models.resolve(config.model, 256)
    if split_form:
        model = init.skeleton(lambda: models.build(resolved))
    else:  # every rank builds the whole model, seeded alike, then lays it out
        torch.manual_seed(config.train.seed)
        model = models.build(resolved)
    return layouts.build(model, mesh, config)


def parameter_bytes(held) -> int:
    """Bytes of the parameters (or ZeRO's parameter shards) a Holding keeps."""
    zero = getattr(held, "zero", None)
    if zero is not None:
        return sum(u.master.untyped_storage().nbytes() for u in zero.units)
    storages = {id(p.untyped_storage()): p.untyped_storage() for p in held.module.parameters()}
    return sum(s.nbytes() for s in storages.values())


def rank_peaks(parallel: dict) -> dict[str, int]:
    """One rank: the peak live bytes of building in split form and the old way, and what
    is alive once built (the Holding: parameters or shards, and gradient buffers)."""
    world = dtrain.world.current()
    mesh = Mesh(dims_of(config_of(SHAPE, parallel, world.world_size), world.world_size))
    calibrate(mesh)
    build({**SHAPE, "n_layer": mesh.dims.pp}, parallel, mesh, split_form=True)
    peaks: dict = {}
    for name, split_form in (("split", True), ("old", False)):
        tracker = Busiest()
        with tracker:
            held = build(SHAPE, parallel, mesh, split_form)
            peaks[f"{name} held"] = tracker.live
            peaks[f"{name} params"] = parameter_bytes(held)
        peaks[name] = tracker.peak
        peaks[f"{name} at peak"] = tracker.at_peak
        del held
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    started = datetime.datetime.now()
    shape = models.resolve(models.ModelConfig(**SHAPE), 256)
    skeleton = init.skeleton(lambda: models.build(shape))
    params = sum(p.numel() for p in skeleton.parameters())
    unit = 4 * sum(p.numel() for p in skeleton.blocks[0].parameters())
    whole = 4 * params
    rows = []
    for name, (world_size, parallel) in LAYOUTS.items():
        results = run_ranks(rank_peaks, world_size, parallel, timeout=900)
        busiest = max(results, key=lambda r: r["split"])
        rows.append({"layout": name, "ranks": world_size, "divided": divided(parallel,
                                                                          world_size),
                     "at peak": busiest["split at peak"],
                     **{k: max(r[k] for r in results) for k in results[0]
                        if not k.endswith("at peak")}})
        print(name, {k: f"{v / MiB:.1f} MiB" for k, v in rows[-1].items()
                     if k.startswith(("split", "old")) and isinstance(v, int)},
              [(f"{b / MiB:.1f} MiB", where) for b, where in busiest["split at peak"]],
              flush=True)
    lines = [
        "## Construction: a rank's peak while its share of the model is built",
        "",
        "Command: `python benchmarks/construction.py --write`  ",
        f"Date: {started:%Y-%m-%d %H:%M}. Machine: {os.cpu_count()} cores, "
        f"{platform.machine()}, torch {torch.__version__}, gloo, 1 thread per rank; load "
        f"average {load:.1f} before, {os.getloadavg()[0]:.1f} after (shared with other work; "
        "bytes, not times).  ",
        f"Model: GPT n_layer={SHAPE['n_layer']}, n_embd={SHAPE['n_embd']}, vocabulary 256 "
        f"({params / 1e6:.2f}M parameters: {whole / MiB:.1f} MiB whole in fp32; a block "
        f"{unit / MiB:.1f} MiB). Peak: "
        "live tensor bytes from the first line of construction to the end of "
        "`layouts.build` (restore included), the busiest rank's; collectives calibrated "
        "before, unmeasured (`dtrain.planner.traced.measure.calibrate` on the same mesh, then a "
        f"GPT of one block per stage built). Chunk: {init.CHUNK} elements x 4 bytes = "
        f"{4 * init.CHUNK / MiB:.0f} MiB. Target: whole / N + one chunk, N the ranks the "
        "layout divides the parameters over (tp x pp, and dp too at ZeRO-3; ZeRO-1 and 2 "
        "keep every parameter on every rank, N = 1).",
        "",
        "| layout | ranks | N | split form: peak (MiB) | / whole | held once built: "
        "parameters + other (MiB) | peak - held (MiB) | target: whole / N + chunk (MiB) | "
        "met? | whole, then laid out: peak (MiB) | / whole |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = whole / r["divided"] + 4 * init.CHUNK
        split, held, params = r["split"], r["split held"], r["split params"]
        lines.append(
            f"| {r['layout']} | {r['ranks']} | {r['divided']} | {split / MiB:.1f} | "
            f"**{split / whole:.2f}** | {params / MiB:.1f} + {(held - params) / MiB:.1f} | "
            f"{(split - held) / MiB:.1f} | {target / MiB:.1f} | "
            f"{'yes' if split <= target else 'no'} | {r['old'] / MiB:.1f} | "
            f"{r['old'] / whole:.2f} |")
    lines += ["", "The largest tensors alive at the busiest rank's peak, and the line that "
              "made each:", ""]
    for r in rows:
        alive = "; ".join(f"{b / MiB:.1f} MiB {where or '(under 1 MiB when made)'}"
                          for b, where in r["at peak"][:4])
        lines.append(f"- {r['layout']}: {alive}")
    lines += ["", *EXPLAINED]
    print("\n".join(lines))
    if args.write:
        replace_section("construction", lines)


def divided(parallel: dict, world_size: int) -> int:
    """The ranks a layout divides the parameters over: tp x pp, and dp too at ZeRO-3."""
    if parallel.get("zero") == 3:
        return world_size
    return parallel.get("tp", 1) * parallel.get("pp", 1)


EXPLAINED = [
    "What a rank no longer allocates while it is built: ZeRO-3 a whole unit (a unit's "
    "memory comes at its first gather; the parameters until then are views of "
    "`dtrain.data_parallel.zero.units.unallocated`), ZeRO-1 its unsharded gradient buffers and "
    "DataParallel its buckets (both at the first backward; DDP allocates its buckets in "
    "its constructor), ZeRO-1 and 2 a second copy of the parameters and of their shards "
    "(each unit is all-gathered in place, from the master shard that is its own part, "
    "two in flight). The initial values are drawn one generator group at a time and "
    "their rows copied straight into place (`Initial._read_into`; a ZeRO shard's span "
    "is read a group at a time, `SlicedWeights.row_cuts`), so in every layout the peak "
    "is what the rank holds plus one group: peak - held is one chunk or less. "
    "What remains above the target in tp and tp x pp is no transient: tp keeps some "
    "tensors whole on every rank (layer norms, row-split biases; Megatron-LM too), so a "
    "rank's parameters are a little over whole / N (48.7 MiB against 48.5 at tp=2, "
    "24.6 against 24.3 at tp2 x pp2).",
]


if __name__ == "__main__":
    main()
