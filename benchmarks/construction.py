"""A rank's peak memory while its share of a model is built: split form (a skeleton on the
meta device, then `dtrain.layouts.build`, which allocates only what the rank holds and
restores it from the initial values) against the old way (the whole model built on every
rank, then laid out).

    python benchmarks/construction.py [--write]

Two layouts of one GPT, each in its own spawned world (tests/distributed.py's `run_ranks`,
gloo): tp=2 on 2 ranks, and ZeRO-3 over 4 ranks. On every rank the peak of live tensor
bytes (dtrain.planner.LiveBytes, the CPU's max_memory_allocated) from the first
line of construction to the end of `layouts.build`, restore included; the figure is the
busiest rank's. The collectives' one-time calibration (`algorithm="auto"`, probes up to
16 MiB) is done before, on the same mesh (dtrain.planner.traced.measure.calibrate, then a 1-block
model built the same way), so it is not counted.

Target: split form peaks at no more than 1/N of the whole model plus one generator chunk
(dtrain.models.init.CHUNK elements of 4 bytes), N the ranks the layout shares it over.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import torch
from results_md import replace_section

import dtrain
from dtrain import layouts, models
from dtrain.config import config_from_dict, layout_of
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.planner import LiveBytes
from dtrain.planner.traced.measure import calibrate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.distributed
from tests.distributed import run_ranks  # noqa: E402

MiB = 2**20
SHAPE = {"arch": "gpt", "n_layer": 8, "n_head": 8, "n_embd": 512, "block_size": 128}
LAYOUTS = {"tp=2": (2, {"tp": 2}), "ZeRO-3": (4, {"zero": 3})}


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
    return layouts.build(model, mesh, layout_of(config, world.world_size), config)


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
    layout = layout_of(config_of(SHAPE, parallel, world.world_size), world.world_size)
    mesh = Mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp)
    calibrate(mesh)
    build({**SHAPE, "n_layer": 1}, parallel, mesh, split_form=True)
    peaks = {}
    for name, split_form in (("split", True), ("old", False)):
        tracker = LiveBytes()
        with tracker:
            held = build(SHAPE, parallel, mesh, split_form)
            peaks[f"{name} held"] = tracker.live
            peaks[f"{name} params"] = parameter_bytes(held)
        peaks[name] = tracker.peak
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
        rows.append({"layout": name, "ranks": world_size,
                     **{k: max(r[k] for r in results) for k in results[0]}})
        print(name, {k: f"{v / MiB:.1f} MiB" for k, v in rows[-1].items()
                     if k.startswith(("split", "old"))}, flush=True)
    lines = [
        "## Construction: a rank's peak while its share of the model is built",
        "",
        "Command: `python benchmarks/construction.py --write`  ",
        f"Date: {started:%Y-%m-%d %H:%M}. Machine: {os.cpu_count()} cores, "
        f"{platform.machine()}, torch {torch.__version__}, gloo, 1 thread per rank; load "
        f"average {load:.1f} before, {os.getloadavg()[0]:.1f} after (shared with other work; "
        "bytes, not times).  ",
        f"Model: GPT n_layer={SHAPE['n_layer']}, n_embd={SHAPE['n_embd']}, vocabulary 256 "
        f"({params / 1e6:.2f}M parameters: {whole / MiB:.1f} MiB whole in fp32). Peak: "
        "live tensor bytes from the first line of construction to the end of "
        "`layouts.build` (restore included), the busiest rank's; collectives calibrated "
        "before, unmeasured (`dtrain.planner.traced.measure.calibrate` on the same mesh, then a "
        f"1-block GPT built). Chunk: {init.CHUNK} elements x 4 bytes = "
        f"{4 * init.CHUNK / MiB:.0f} MiB.",
        "",
        "| layout | ranks N | split form: peak (MiB) | / whole | held once built: parameters "
        "+ other (MiB) | peak - held (MiB) | target: whole / N + chunk (MiB) | met? | peak "
        "less other held (MiB) | met? | whole, then laid out: peak (MiB) | / whole |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = whole / r["ranks"] + 4 * init.CHUNK
        split, held, params = r["split"], r["split held"], r["split params"]
        other = held - params

        def met(x: float, target: float = target) -> str:
            return "yes" if x <= target else "no"

        lines.append(
            f"| {r['layout']} | {r['ranks']} | {split / MiB:.1f} | **{split / whole:.2f}** | "
            f"{params / MiB:.1f} + {other / MiB:.1f} | {(split - held) / MiB:.1f} | "
            f"{target / MiB:.1f} | {met(split)} | {(split - other) / MiB:.1f} | "
            f"{met(split - other)} | {r['old'] / MiB:.1f} | {r['old'] / whole:.2f} |")
    lines += [
        "",
        "Held once built, other than parameters: under tp=2 alone the Holding is a "
        "DataParallel over a dp group of 1, which allocates its gradient buckets (as large as "
        "the parameters) when it wraps the model; they are the gradients' memory, made before "
        "the first backward rather than during it. The \"peak less other held\" column takes "
        "them out. What remains above the target is the draw: under tp=2 a tensor's values "
        "need a generator group, its slice's pieces and the joined slice at once (about two "
        f"chunks); under ZeRO-3 each unit (a block: {unit / MiB:.1f} MiB here) is allocated "
        "whole for a moment when its shards are made (dtrain.parallel.zero.units "
        "`_empty_unit`: torch.empty of the whole flat unit, released at once), which "
        "`LiveBytes`, like CUDA's max_memory_allocated, counts although the memory is never "
        "touched. The old way peaks above the whole model on every rank.",
    ]
    print("\n".join(lines))
    if args.write:
        replace_section("construction", lines)


if __name__ == "__main__":
    main()
