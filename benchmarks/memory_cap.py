"""The largest GPT that trains under a cap on each rank's live tensor bytes: one process,
dtrain ZeRO-3 (split-form construction, full recomputation), PyTorch FSDP2 with
activation checkpointing, and dtrain tp=2 x ZeRO-3 with sequence parallelism.

    python benchmarks/memory_cap.py [--cap-mib 128 --write]

A probe is one spawned world (src/dtrain/testing/processes.py's `run_ranks`, gloo, 1 thread per
rank) that builds a GPT of `n_layer` blocks (width fixed) and trains it 3 steps with AdamW
on `--batch` sequences of 64 tokens per copy of the model, construction included, under
`dtrain.planner.LiveBytes(limit=cap)` on every rank (the CPU's equivalent of
`torch.cuda.max_memory_allocated`, raising MemoryError past the cap). n_layer is found by
growing it until a probe fails (one process: doubling from 4; the others: from 4 times
one process's answer, perfect sharding over 4 ranks, in steps of 25%), then bisecting.

The setups:
  one process  the GPT built whole, AdamW, no recomputation (no process group work).
  zero3        4 ranks: `[parallel] zero = 3`, `[memory] recompute =
               "full"`, built in split form (init.skeleton -> layouts.build).
  fsdp2        4 ranks: the GPT built under torch.device("meta"), every block wrapped in
               torch's checkpoint_wrapper then `fully_shard`, the root `fully_shard`,
               `to_empty(device="cpu")` and normal(0, 0.02) init; the same AdamW
               (dtrain's build_optimizer). DTensors are counted by their local shards.
  tp2_zero3_sp 4 ranks: tp=2 x ZeRO-3 over dp=2, sequence parallel, full recomputation.

dtrain's collectives with algorithm "auto" time their candidates on first use (probe
tensors up to 16 MiB): every dtrain probe first trains one step of a 1-block GPT on the
same mesh, outside the cap, so that one-time cost is not counted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from results_md import replace_section
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dtrain
from dtrain import layouts, models
from dtrain.config import config_from_dict, dims_of
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.optim import build_optimizer
from dtrain.planner import LiveBytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # dtrain.testing.processes
from dtrain.testing import run_ranks  # noqa: E402

MiB = 2**20
WIDTH = {"n_head": 4, "n_embd": 256, "block_size": 64}
SEQUENCE = WIDTH["block_size"]
STEPS = 3
SETUPS = ("one_process", "zero3", "fsdp2", "tp2_zero3_sp")
PARALLEL = {"zero3": {"zero": 3},
            "tp2_zero3_sp": {"tp": 2, "dp": 2, "zero": 3, "sequence_parallel": True}}


def gpt_shape(n_layer: int) -> dict:
    return {"arch": "gpt", "n_layer": n_layer, **WIDTH}


def parameter_count(n_layer: int) -> int:
    shape = models.resolve(models.ModelConfig(**gpt_shape(n_layer)), 256)
    model = init.skeleton(lambda: models.build(shape))
    return sum(p.numel() for p in model.parameters())


def config_of(n_layer: int, setup: str, world_size: int, batch: int):
    parallel = PARALLEL.get(setup, {})
    copies = world_size // parallel.get("tp", 1)  # of the model (data parallel)
    return config_from_dict({
        "model": gpt_shape(n_layer),
        "optimizer": {"name": "adamw"},
        "train": {"batch_size": batch * copies, "seed": 0},
        "parallel": {"nproc": world_size, **parallel},
        "memory": {"recompute": "none" if setup == "one_process" else "full"},
    })


def tokens(rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (batch, SEQUENCE + 1),
                        generator=torch.Generator().manual_seed(rank))
    return ids[:, :-1], ids[:, 1:]


class Tracker(LiveBytes):
    """LiveBytes counting a DTensor by its local shard: the wrapper's own storage reports
    the global size and holds no memory (FSDP2's parameters, gradients and AdamW state
    are DTensors; the ops on their shards run inside DTensor's dispatch, below this mode).

    With `contents`, it also keeps what is alive at the peak: how many storages of each
    size (MiB, rounded), and the operation that reached it."""

    def __init__(self, limit: int | None = None, contents: bool = False) -> None:
        super().__init__(limit=limit)
        self.contents = contents
        self.at_peak: tuple[str, list[tuple[float, int]]] | None = None

    def _note(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            with torch.no_grad():
                t = t.to_local()
        super()._note(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.contents and self.peak > before:
            sizes: dict[float, int] = {}
            for ref, _ in self._storages.values():
                storage = ref()
                if storage is not None and storage.nbytes() >= 2**17:
                    size = round(storage.nbytes() / MiB, 2)
                    sizes[size] = sizes.get(size, 0) + 1
            self.at_peak = (str(func), sorted(sizes.items(), reverse=True))
        return out


# ------------------------------------------------------------------ one rank of a probe
def dtrain_steps(n_layer: int, setup: str, batch: int, mesh, tracker) -> float:
    """Build in split form and train STEPS steps; returns the last loss."""
    world = dtrain.world.current()
    config = config_of(n_layer, setup, world.world_size, batch)
    shape = models.resolve(config.model, 256)
    with tracker:
        model = init.skeleton(lambda: models.build(shape))
        held = layouts.build(model, mesh, config)
        x, y = tokens(mesh.coords["dp"], batch)
        for _ in range(STEPS):
            loss = held.forward_backward([(x, y)])
            held.step()
            held.zero_grad()
    return float(loss)


def probe_dtrain(n_layer: int, setup: str, batch: int, tracker: Tracker) -> float:
    """One rank: warm the collectives up on a 1-block GPT, then train under the cap."""
    world = dtrain.world.current()
    mesh = Mesh(dims_of(config_of(1, setup, world.world_size, batch), world.world_size))
    dtrain_steps(1, setup, batch, mesh, LiveBytes())
    return dtrain_steps(n_layer, setup, batch, mesh, tracker)


def probe_one_process(n_layer: int, batch: int, tracker: Tracker) -> float:
    config = config_of(n_layer, "one_process", 1, batch)
    with tracker:
        torch.manual_seed(0)
        model = models.build(models.resolve(config.model, 256))
        optimizer = build_optimizer(model.parameters(), config.optimizer)
        x, y = tokens(0, batch)
        return train_steps(model, optimizer, x, y)


def train_steps(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """STEPS steps of one batch; the last loss."""
    for _ in range(STEPS):
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def fsdp2_model(n_layer: int, mesh) -> nn.Module:
    """The GPT sharded by FSDP2 per block and at the root, blocks recomputed, built on the
    meta device and allocated shard by shard."""
    shape = models.resolve(models.ModelConfig(**gpt_shape(n_layer)), 256)
    with torch.device("meta"):
        model = models.build(shape)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
        fully_shard(model.blocks[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
    assert model.head.weight is model.wte.weight  # still tied
    return model


def probe_fsdp2(n_layer: int, batch: int, tracker: Tracker) -> float:
    world = dtrain.world.current()
    config = config_of(n_layer, "zero3", world.world_size, batch)
    mesh = init_device_mesh("cpu", (world.world_size,))
    with tracker:
        model = fsdp2_model(n_layer, mesh)
        optimizer = build_optimizer(model.parameters(), config.optimizer)
        x, y = tokens(world.rank, batch)
        return train_steps(model, optimizer, x, y)


def probe(setup: str, n_layer: int, batch: int, cap: int | None,
          contents: bool) -> tuple[int, float, tuple | None]:
    """One rank of one probe: (this rank's peak live bytes, the last loss, what was alive
    at the peak if `contents`)."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    tracker = Tracker(limit=cap, contents=contents)
    if setup == "one_process":
        loss = probe_one_process(n_layer, batch, tracker)
    elif setup == "fsdp2":
        loss = probe_fsdp2(n_layer, batch, tracker)
    else:
        loss = probe_dtrain(n_layer, setup, batch, tracker)
    return tracker.peak, loss, tracker.at_peak


# ------------------------------------------------------------------ the search
def trains(setup: str, n_layer: int, batch: int, cap: int | None, log: list[dict],
           contents: bool = False) -> bool:
    """Whether `n_layer` blocks train STEPS steps under the cap on every rank (one world);
    with `contents`, print what the busiest rank held at its peak."""
    world_size = 1 if setup == "one_process" else 4
    start = time.perf_counter()
    results = under_cap(probe, world_size, setup, n_layer, batch, cap, contents)
    ok, peak = results is not None, None
    if ok:
        peak = max(p for p, _, _ in results)
        if contents:
            op, sizes = max(results, key=lambda r: r[0])[2]
            print(f"at the peak ({op}), storages of at least 0.125 MiB: "
                  + ", ".join(f"{n} x {size} MiB" for size, n in sizes))
    seconds = time.perf_counter() - start
    log.append({"setup": setup, "n_layer": n_layer, "trains": ok, "peak": peak,
                "seconds": round(seconds, 1)})
    print(f"{setup:>13} n_layer={n_layer:4d}: "
          f"{'trains, peak %.1f MiB' % (peak / MiB) if ok else 'over the cap'} "
          f"({seconds:.0f} s)", flush=True)
    return ok


def under_cap(fn: Callable[..., Any], world_size: int, *args: Any) -> list | None:
    """Each rank's result of `fn(*args)` on `world_size` spawned ranks (run_ranks), or None
    where a rank went over its cap (a MemoryError of LiveBytes)."""
    try:
        return run_ranks(fn, world_size, *args, timeout=1800, collective_timeout=120)
    except AssertionError as exc:
        if "MemoryError" not in str(exc):
            raise
        return None


def largest(setup: str, start: int, growth: float, batch: int, cap: int,
            log: list[dict]) -> int:
    """The largest n_layer that trains (see `search`).

    Raises:
        RuntimeError: not even one block trains under the cap.
    """
    return search(lambda n: trains(setup, n, batch, cap, log), start, growth, setup)


def search(fits: Callable[[int], bool], start: int, growth: float, what: str) -> int:
    """The largest n >= 1 that `fits`: from `start`, multiply by `growth` until it does
    not (or divide until it does), then bisect.

    Raises:
        RuntimeError: not even n = 1 fits.
    """
    n = start
    if fits(n):
        lo = n
        while True:
            n = max(lo + 1, round(lo * growth))
            if not fits(n):
                hi = n
                break
            lo = n
    else:
        hi = n
        while True:
            n = min(hi - 1, round(hi / growth))
            if n < 1:
                raise RuntimeError(f"{what}: the smallest size does not fit under the cap")
            if fits(n):
                lo = n
                break
            hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per copy of the model")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--probe", metavar="SETUP:N_LAYER", help="run one probe only")
    parser.add_argument("--contents", action="store_true",
                        help="with --probe and no cap: what is alive at the peak")
    parser.add_argument("--json", metavar="PATH", help="also write the probes as JSON")
    parser.add_argument("--from-json", metavar="PATH", help="write the section of a saved run")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    cap = args.cap_mib * MiB
    log: list[dict] = []
    if args.probe:
        setup, n_layer = args.probe.split(":")
        trains(setup, int(n_layer), args.batch, None if args.contents else cap, log,
               args.contents)
        return
    if args.from_json:
        replace_section("memory_cap", section(json.loads(Path(args.from_json).read_text())))
        return
    load = os.getloadavg()[0]
    started = time.time()
    found: dict[str, int] = {}
    for setup in args.setups.split(","):
        if setup == "one_process":
            found[setup] = largest(setup, 4, 2.0, args.batch, cap, log)
        else:  # from perfect sharding over 4 ranks, in steps of 25%
            found[setup] = largest(setup, 4 * found.get("one_process", 8), 1.25, args.batch,
                                   cap, log)
    minutes = (time.time() - started) / 60
    rows = {s: {"n_layer": n, "params": parameter_count(n),
                "peak": next(p["peak"] for p in log if p["setup"] == s and p["n_layer"] == n
                             and p["trains"])} for s, n in found.items()}
    summary = {"cap_mib": args.cap_mib, "batch": args.batch, "rows": rows, "probes": log,
               "load_before": load, "load_after": os.getloadavg()[0], "minutes": minutes,
               "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(rows, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.write:
        replace_section("memory_cap", section(summary))


NAMES = {
    "one_process": "(a) one process, no recomputation",
    "zero3": "(b) dtrain ZeRO-3, 4 ranks, split form, full recomputation",
    "fsdp2": "(c) PyTorch FSDP2, 4 ranks, meta init, checkpoint_wrapper per block",
    "tp2_zero3_sp": "(d) dtrain tp=2 x ZeRO-3 (dp=2), sequence parallel, full recomputation",
}


def found_table(rows: dict[str, dict], names: dict[str, str], columns: list[str], size: str,
                cells: Callable[[dict], list[str]]) -> list[str]:
    """A search's answers as a Markdown table: per setup its name, `cells(row)` under
    `columns`, its `size` as a multiple of one process's (bold), and its peak per rank."""
    base = rows.get("one_process", {}).get(size)
    lines = ["| setup | " + " | ".join(columns) + " | x (a) | peak per rank (MiB) |",
             "|---|" + "---|" * (len(columns) + 2)]
    for setup, row in rows.items():
        ratio = f"**{row[size] / base:.2f}x**" if base else "-"
        lines.append(f"| {names[setup]} | " + " | ".join(cells(row))
                     + f" | {ratio} | {row['peak'] / MiB:.1f} |")
    return lines


def probe_list(rows: dict[str, dict], probes: list[dict], size: str) -> list[str]:
    """Every probe of each setup, a line each: its `size` and the busiest rank's peak in
    MiB, or "over" the cap."""
    return [f"- {setup}: " + ", ".join(
        f"{p[size]}: {p['peak'] / MiB:.1f}" if p["trains"] else f"{p[size]}: over"
        for p in probes if p["setup"] == setup) for setup in rows]


def section(summary: dict) -> list[str]:
    rows, cap = summary["rows"], summary["cap_mib"]
    base = rows.get("one_process", {}).get("params")
    lines = [
        f"## The largest GPT that trains under a per-rank cap of {cap} MiB of live tensors",
        "",
        f"Command: `python benchmarks/memory_cap.py --cap-mib {cap} --batch "
        f"{summary['batch']} --write`  ",
        f"Date: {summary['date']}. Machine: {os.cpu_count()} cores, {platform.machine()}, torch "
        f"{torch.__version__}, gloo, 1 thread per rank; load average {summary['load_before']:.1f}"
        f" before, {summary['load_after']:.1f} after (shared with other work; the figures are "
        f"bytes, not times, so load does not move them); {summary['minutes']:.0f} min in all.  ",
        f"Model: GPT, width {WIDTH['n_embd']}, {WIDTH['n_head']} heads, vocabulary 256, "
        f"{summary['batch']} sequences x {SEQUENCE} tokens per copy of the model, AdamW "
        f"(dtrain's `[optimizer]` defaults), {STEPS} steps, construction included; n_layer "
        "searched (one process: doubling from 4; the others: from 4x one process's answer, "
        "in steps of 25%; then bisection), each probe one spawned world. dtrain's collectives "
        "calibrate (`algorithm = \"auto\"`, probes up to 16 MiB) in a warm-up step of a "
        "1-block GPT on the same mesh before the cap applies; FSDP2's are torch's own.",
        "",
        *found_table(rows, NAMES, ["largest n_layer", "parameters"], "params",
                     lambda row: [str(row["n_layer"]), f"{row['params'] / 1e6:.2f}M"]),
        "",
        "Every probe (n_layer: peak MiB of the busiest rank, or over the cap):",
        "",
        *probe_list(rows, summary["probes"], "n_layer"),
    ]
    if {"one_process", "zero3", "fsdp2"} <= set(rows):
        b, c = rows["zero3"], rows["fsdp2"]
        times = b["params"] / base
        lines += [
            "",
            "| target | value | met? |",
            "|---|---|---|",
            f"| (b) at least 3.5x (a) | {times:.2f}x | {'yes' if times >= 3.5 else 'no'} |",
            f"| (b) at least (c) | {b['params'] / 1e6:.2f}M vs {c['params'] / 1e6:.2f}M "
            f"({b['n_layer']} vs {c['n_layer']} layers) | "
            f"{'yes' if b['params'] >= c['params'] else 'no'} |",
        ]
    lines += [
        "",
        "Both sharded setups hold the same state, 4 bytes per parameter per rank at 4 ranks "
        "(3.0 MiB per block); they differ in what backward holds besides. What each holds at "
        "the busiest rank's peak: `python benchmarks/memory_cap.py --probe zero3:38 "
        "--contents`, and `--probe fsdp2:38 --contents`. FSDP2 holds two buffers of one "
        "whole unit (a block, 3.01 MiB) besides the per-parameter gradients it is computing. "
        "dtrain's ZeRO-3 held four until 2026-11-26, and a fifth now and then: the block's "
        "gathered parameters, the next block's (prefetched from the start of the block's "
        "backward), the block's flat gradient buffer (made whole at its first gradient) and "
        "the previous blocks' buffers, read by reduce-scatters in flight (up to two) and "
        "released whenever the collective's thread finished, so that its peak moved by one "
        "unit from run to run (at 38 layers, 126.4 MiB in two probes of eight, 129.4 in the "
        "other six). Now a block's gradients stay autograd's own until its last one and are "
        "packed into its buffer after its parameters are freed; the buffer's reduce-scatter "
        "runs through the next block's recomputed forward and is waited for at that block's "
        "first gradient, which releases the buffer and only then prefetches the block after; "
        "gathers write straight into the parameters, and a reduce-scatter's buffer goes when "
        "it is waited for, not when the collective's thread ends. At its peak (a matrix "
        "product in a block's backward) ZeRO-3 holds two whole units (the block and the "
        "prefetched one, or the block and the buffer in flight), as FSDP2 does, at the same "
        "point in every run. Probes on 2026-11-26 "
        "(load 10-13 on the 2 cores; bytes, not times): zero3 at 38 layers 124.2 MiB in 5 "
        "of 5 (was 126.4 or 129.4), at 39 layers 127.2 MiB in 5 of 5, under the cap, at 40 "
        "over it; fsdp2 at 38 layers 126.8 MiB in 5 of 5, at 39 layers 129.8 MiB (measured "
        "without the cap), over it. So (b) trains 39 layers (30.88M parameters, 3.87x (a)) "
        "where (c) trains 38, in every run.",
    ]
    return lines


if __name__ == "__main__":
    main()
