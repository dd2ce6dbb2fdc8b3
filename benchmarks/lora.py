"""LoRA against full fine-tuning of the same dtrain Llama: live tensor bytes and time per
step in the same layout, and the largest Llama that fine-tunes under a per-rank cap on
4 ranks of ZeRO-3.

    python benchmarks/lora.py [--rounds 3 --steps 10 --cap-mib 64 --write]
    python benchmarks/lora.py --quick       # a smoke check, under a minute

Every figure comes from worlds spawned by dtrain.testing.run_ranks (gloo, 1 thread per
rank), AdamW (dtrain's `[optimizer]` defaults), random byte tokens (vocabulary 256). LoRA
is `[adapter] kind = "lora"`, rank `--rank`, alpha 2 x rank, on the Llama's default
targets (q, k, v, o, gate, up, down): the base frozen, no gradient or optimizer state for
it.

(a) Same layout, LoRA vs full. A Llama of `--layers` x `--width` (heads of 64, half as
many KV heads, block `--block`), built in split form as the Trainer builds it (init.skeleton of
`adapters.built`, then `layouts.build`), in two layouts: one process, and ZeRO-2 over 2
ranks (`--batch` sequences per rank in both). Each world builds the model under
`dtrain.planner.LiveBytes` (the CPU's `max_memory_allocated`: bytes of live tensors,
storages counted once), records the construction's peak, resets the peak, trains 3 steps
under it (the steps' peak: the figure shown), then leaves the mode (its dispatch costs
time) and trains `--steps` more, timed one by one with a barrier-free clock (ZeRO-2: the
slower rank's time of each step); the median step time leaves the first 2 out. ZeRO-2's
worlds first train one step of a 1-layer Llama on the same mesh, outside the tracker,
so that the one-time calibration of dtrain's collectives (`algorithm = "auto"`) is not
counted. LoRA and full alternate, `--rounds` times each; the median round is shown with
every round's. What LoRA should drop is the base's gradient and AdamW state: 12 of the
16 bytes per parameter of full fine-tuning in one process (under ZeRO-2 the gradient and
the optimizer state are sharded over 2, the parameters whole), and its step should take
about the base's forward and backward (input gradients, no weight gradients) plus the
adapters'.

(b) Under a cap. The largest Llama of width `--cap-width` (block 64, `--batch` sequences
per rank) whose construction and 3 steps fit `--cap-mib` MiB of live tensors on every one
of 4 ranks (LiveBytes(limit=cap) raising MemoryError), both with ZeRO-3 and full
recomputation, built in split form (init.skeleton -> layouts.build): full fine-tuning,
and LoRA with the frozen base sharded too (`dtrain.ZeRO(..., frozen=[...])`: each rank
keeps 1/4 of the base, gathered per block for forward and backward). n_layer is grown
(full: doubling from 4; LoRA: from 3x full's answer in steps of 25%) until a probe fails,
then bisected, as benchmarks/memory_cap.py does; each probe is one spawned world, after
a warm-up step of a 1-layer model outside the cap. Where `layouts.build` does not yet
shard a LoRA run's base under ZeRO-3 (the Trainer's wiring), the LoRA probes wrap the
split-form model in `dtrain.ZeRO(model, AdamW, stage=3, frozen=<the base>)` directly,
its shards filled with normal(0, 0.02) values (the bytes do not depend on them), and the
report says so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # memory_cap's own imports

import dtrain  # noqa: E402
from benchmarks.memory_cap import search, under_cap  # noqa: E402
from benchmarks.results_md import replace_section  # noqa: E402
from dtrain import adapters, layouts, models  # noqa: E402
from dtrain.config import config_from_dict, dims_of  # noqa: E402
from dtrain.mesh import Mesh  # noqa: E402
from dtrain.models import init, recompute  # noqa: E402
from dtrain.optim import build_optimizer  # noqa: E402
from dtrain.planner import LiveBytes  # noqa: E402
from dtrain.testing import run_ranks  # noqa: E402

MiB = 2**20
TRACKED_STEPS = 3  # under LiveBytes: the steps' peak
KINDS = ("full", "lora")
LAYOUTS = {"one_process": {"nproc": 1}, "zero2": {"nproc": 2, "zero": 2}}
CAPPED = {"full": "full fine-tuning, ZeRO-3", "lora": "LoRA, ZeRO-3, base sharded"}


def llama(n_layer: int, width: int, block: int) -> dict:
    return {"arch": "llama", "n_layer": n_layer, "n_embd": width, "n_head": width // 64,
            "n_kv_head": max(1, width // 128), "block_size": block}


def config_of(model: dict, kind: str, parallel: dict, batch: int, rank: int,
              recompute_mode: str = "none") -> Any:
    """The job's config: `batch` sequences per rank, LoRA or not."""
    copies = parallel["nproc"]
    return config_from_dict({
        "model": model,
        "adapter": {"kind": "lora", "rank": rank, "alpha": 2 * rank} if kind == "lora" else {},
        "optimizer": {"name": "adamw"},
        "train": {"batch_size": batch * copies, "seed": 0},
        "parallel": parallel,
        "memory": {"recompute": recompute_mode},
    })


def tokens(rank: int, batch: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (batch, block + 1), generator=torch.Generator().manual_seed(rank))
    return ids[:, :-1], ids[:, 1:]


def skeleton(config: Any) -> torch.nn.Module:
    """The job's model in split form, adapters beside it where `[adapter]` says."""
    shape = models.resolve(config.model, 256)
    return init.skeleton(lambda: adapters.built(shape, config.adapter))


def count(config: Any) -> tuple[int, int]:
    """(parameters of the model, of them trained)."""
    model = skeleton(config)
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in model.parameters() if p.requires_grad))


def train(held: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """`steps` steps of one batch; each one's seconds."""
    seconds = []
    for _ in range(steps):
        begin = time.perf_counter()
        held.forward_backward([(x, y)])
        held.step()
        held.zero_grad()
        seconds.append(time.perf_counter() - begin)
    return seconds


# ------------------------------------------------------------------ (a) one rank
def same_layout(kind: str, layout: str, model: dict, batch: int, rank: int,
                steps: int) -> dict[str, Any]:
    """One rank of (a): construction's and the steps' peaks, and each timed step."""
    world = dtrain.world.current()
    parallel = LAYOUTS[layout]
    config = config_of(model, kind, parallel, batch, rank)
    mesh = Mesh(dims_of(config, world.world_size))
    x, y = tokens(mesh.coords["dp"], batch, model["block_size"])
    if world.world_size > 1:  # the collectives calibrate here, outside the figures
        warm = config_of({**model, "n_layer": 1}, kind, parallel, batch, rank)
        train(layouts.build(skeleton(warm), mesh, warm), x, y, 1)
    tracker = LiveBytes()
    with tracker:
        held = layouts.build(skeleton(config), mesh, config)
        built = tracker.peak
        tracker.reset_peak()
        train(held, x, y, TRACKED_STEPS)
    seconds = train(held, x, y, steps)
    return {"build": built, "peak": tracker.peak, "seconds": seconds}


def same_layout_round(kind: str, layout: str, args: argparse.Namespace) -> dict[str, Any]:
    model = llama(args.layers, args.width, args.block)
    world_size = LAYOUTS[layout]["nproc"]
    ranks = run_ranks(same_layout, world_size, kind, layout, model, args.batch, args.rank,
                      args.steps, timeout=3600, collective_timeout=300)
    per_step = [max(r["seconds"][i] for r in ranks) for i in range(args.steps)]
    return {"build": max(r["build"] for r in ranks), "peak": max(r["peak"] for r in ranks),
            "step_s": statistics.median(per_step[2:] or per_step)}


# ------------------------------------------------------------------ (b) one rank
def filled(zero: dtrain.ZeRO) -> None:
    """Give every shard of `zero` finite values (a memory probe's: normal(0, 0.02))."""
    with torch.no_grad():
        for unit in [*zero.units, *zero.frozen]:
            unit.master.normal_(0.0, 0.02)


def sharded_lora(config: Any, mesh: Mesh) -> Any:
    """The LoRA model in split form wrapped in ZeRO-3 with its frozen base sharded,
    directly (see the module doc); a Holding-like object `train` can drive."""
    model = skeleton(config)
    recompute.apply(model, config.memory)
    init.allocate_buffers(model, mesh.world.device)
    base = [p for p in model.parameters() if not p.requires_grad]
    zero = dtrain.ZeRO(model, lambda params: build_optimizer(params, config.optimizer),
                       stage=3, group=mesh.group("dp"), frozen=base, device=mesh.world.device)
    filled(zero)
    return Direct(zero)


class Direct:
    """A ZeRO wrapper driven as `train` drives a Holding."""

    def __init__(self, zero: dtrain.ZeRO) -> None:
        self.zero = zero

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            self.zero.backward(self.zero(x, y)[1])

    def step(self) -> None:
        self.zero.step()

    def zero_grad(self) -> None:
        self.zero.zero_grad()


def holding(config: Any, mesh: Mesh, direct: bool) -> Any:
    if direct:
        return sharded_lora(config, mesh)
    return layouts.build(skeleton(config), mesh, config)


def shards_the_base(held: Any) -> bool:
    """Whether a Holding's ZeRO-3 shards the frozen base (its `frozen` units)."""
    zero = getattr(held, "zero", None)
    return bool(zero is not None and zero.frozen)


def capped(kind: str, n_layer: int, width: int, batch: int, rank: int, cap: int | None,
           direct: bool) -> int:
    """One rank of a probe of (b): warm-up outside the cap, then build and train 3 steps
    under it; this rank's peak."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    world = dtrain.world.current()
    parallel = {"nproc": world.world_size, "zero": 3}
    warm = config_of(llama(1, width, 64), kind, parallel, batch, rank, "full")
    mesh = Mesh(dims_of(warm, world.world_size))
    x, y = tokens(mesh.coords["dp"], batch, 64)
    train(holding(warm, mesh, direct), x, y, 1)
    config = config_of(llama(n_layer, width, 64), kind, parallel, batch, rank, "full")
    tracker = LiveBytes(limit=cap)
    with tracker:
        train(holding(config, mesh, direct), x, y, 3)
    return tracker.peak


def _wired(width: int, batch: int, rank: int) -> bool:
    world = dtrain.world.current()
    config = config_of(llama(1, width, 64), "lora", {"nproc": world.world_size, "zero": 3},
                       batch, rank, "full")
    return shards_the_base(layouts.build(skeleton(config), Mesh(dims_of(
        config, world.world_size)), config))


def largest(args: argparse.Namespace, direct: bool, log: list[dict]) -> dict[str, int]:
    cap = args.cap_mib * MiB
    found: dict[str, int] = {}

    def fits(kind: str, n: int) -> bool:
        begin = time.perf_counter()
        peaks = under_cap(capped, 4, kind, n, args.cap_width, args.batch, args.rank, cap,
                          direct and kind == "lora")
        ok = peaks is not None
        log.append({"kind": kind, "n_layer": n, "trains": ok,
                    "peak": max(peaks) if ok else None})
        print(f"{kind:>5} n_layer={n:4d}: "
              f"{'trains, peak %.1f MiB' % (max(peaks) / MiB) if ok else 'over the cap'} "
              f"({time.perf_counter() - begin:.0f} s)", flush=True)
        return ok

    found["full"] = search(lambda n: fits("full", n), args.start, 2.0, "full")
    found["lora"] = search(lambda n: fits("lora", n), 3 * found["full"], 1.25, "lora")
    return found


# ------------------------------------------------------------------ the report
def middle(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of median step time."""
    return sorted(runs, key=lambda r: r["step_s"])[len(runs) // 2]


def report(args: argparse.Namespace, same: dict[str, dict[str, list[dict]]],
           found: dict[str, int], log: list[dict], direct: bool,
           loads: tuple[float, float], minutes: float) -> list[str]:
    model = llama(args.layers, args.width, args.block)
    total, trained = count(config_of(model, "lora", {"nproc": 1}, args.batch, args.rank))
    rows = []
    ratios = {}
    for layout, by_kind in same.items():
        pick = {k: middle(v) for k, v in by_kind.items()}
        ratios[layout] = (pick["full"]["peak"] / pick["lora"]["peak"],
                          pick["lora"]["step_s"] / pick["full"]["step_s"])
        for kind in KINDS:
            r = pick[kind]
            every = ", ".join(f"{x['step_s'] * 1e3:.0f}" for x in by_kind[kind])
            rows.append(f"| {layout.replace('_', ' ')} | {kind} | {r['peak'] / MiB:.1f} | "
                        f"{r['build'] / MiB:.1f} | {r['step_s'] * 1e3:.0f} | {every} |")
    mem1, time1 = ratios["one_process"]
    lines = [
        "## LoRA vs full fine-tuning: memory and time in one layout, the largest model "
        "under a cap",
        "",
        f"Full fine-tuning's peak live tensor bytes are **{mem1:.2f}x** LoRA's in one "
        f"process ({ratios['zero2'][0]:.2f}x under ZeRO-2 over 2 ranks); LoRA takes "
        f"**{time1:.2f}x** its time per step ({ratios['zero2'][1]:.2f}x under ZeRO-2)",
    ]
    if found:
        cap_total = {k: count(config_of(llama(n, args.cap_width, 64), k, {"nproc": 4},
                                        args.batch, args.rank))[0] for k, n in found.items()}
        lines[-1] += (f"; under {args.cap_mib} MiB per rank on 4 ranks of ZeRO-3 it "
                      f"fine-tunes a **{cap_total['lora'] / cap_total['full']:.2f}x** larger "
                      f"Llama ({found['lora']} layers against {found['full']})")
    lines[-1] += "."
    lines += [
        "",
        f"Command: `python benchmarks/lora.py --layers {args.layers} --width {args.width} "
        f"--block {args.block} --batch {args.batch} --rank {args.rank} --steps {args.steps} "
        f"--rounds {args.rounds} --cap-mib {args.cap_mib} --cap-width {args.cap_width} "
        "--write`  ",
        f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}. Machine: {os.cpu_count()} cores, "
        f"{platform.machine()}, torch {torch.__version__}, gloo, 1 thread per rank; load "
        f"average {loads[0]:.1f} before, {loads[1]:.1f} after; {minutes:.0f} min in all.  ",
        f"(a) dtrain Llama, {args.layers} layers of {args.width} ({total / 1e6:.2f}M "
        f"parameters; LoRA rank {args.rank}, alpha {2 * args.rank}, on q, k, v, o, gate, "
        f"up, down: {trained / 1e6:.3f}M trained), {args.batch} sequences of {args.block} "
        f"tokens per rank, AdamW, built in split form; peak live tensor bytes of the "
        f"busiest rank over {TRACKED_STEPS} steps (construction apart), median step time "
        f"over {args.steps} steps (the first 2 left out), {args.rounds} rounds alternating "
        "LoRA and full.",
        "",
        "| layout | fine-tuning | peak per rank, steps (MiB) | peak, construction (MiB) | "
        "time per step, median round (ms) | every round (ms) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    if found:
        lines += [
            "",
            f"(b) The largest Llama of width {args.cap_width} (block 64, {args.batch} "
            f"sequences per rank) that builds and fine-tunes 3 steps (AdamW) under "
            f"{args.cap_mib} MiB of live tensors on each of 4 ranks, ZeRO-3, full "
            "recomputation, split-form construction included"
            + ("; the LoRA probes wrap the model in `dtrain.ZeRO(..., stage=3, frozen=<the "
               "base>)` directly: `layouts.build` did not shard a LoRA run's base yet"
               if direct else "; both through `layouts.build`, as the Trainer builds them")
            + ".",
            "",
            "| fine-tuning | largest n_layer | parameters | x full | peak per rank (MiB) |",
            "|---|---|---|---|---|",
        ]
        for kind in KINDS:
            n = found[kind]
            peak = next(p["peak"] for p in log if p["kind"] == kind and p["n_layer"] == n
                        and p["trains"])
            lines.append(f"| {CAPPED[kind]} | {n} | {cap_total[kind] / 1e6:.2f}M | "
                         f"{cap_total[kind] / cap_total['full']:.2f}x | {peak / MiB:.1f} |")
        lines += ["", "Every probe (n_layer: peak MiB of the busiest rank, or over the cap):",
                  "", *(f"- {kind}: " + ", ".join(
                      f"{p['n_layer']}: {p['peak'] / MiB:.1f}" if p["trains"]
                      else f"{p['n_layer']}: over" for p in log if p["kind"] == kind)
                      for kind in KINDS)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--rank", type=int, default=16, help="LoRA's rank")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap-mib", type=int, default=64)
    parser.add_argument("--cap-width", type=int, default=256)
    parser.add_argument("--start", type=int, default=4, help="(b): full's first n_layer")
    parser.add_argument("--skip-cap", action="store_true", help="(a) only")
    parser.add_argument("--quick", action="store_true", help="a smoke check of both parts")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.block, args.batch, args.rank = 2, 128, 32, 2, 4
        args.steps, args.rounds, args.cap_mib, args.cap_width, args.start = 4, 1, 3, 64, 4
    load = os.getloadavg()[0]
    started = time.time()
    same: dict[str, dict[str, list[dict]]] = {layout: {k: [] for k in KINDS}
                                              for layout in LAYOUTS}
    for r in range(args.rounds):
        for layout in LAYOUTS:
            for kind in KINDS:
                same[layout][kind].append(same_layout_round(kind, layout, args))
                last = same[layout][kind][-1]
                print(f"round {r + 1} {layout:>11} {kind:>4}: peak {last['peak'] / MiB:.1f} "
                      f"MiB, {last['step_s'] * 1e3:.0f} ms a step", flush=True)
    found: dict[str, int] = {}
    log: list[dict] = []
    direct = False
    if not args.skip_cap:
        direct = not run_ranks(_wired, 4, args.cap_width, args.batch, args.rank,
                               timeout=600)[0]
        if direct:
            print("layouts.build does not shard a LoRA run's base under ZeRO-3 yet: the LoRA "
                  "probes build dtrain.ZeRO(..., frozen=...) directly", flush=True)
        found = largest(args, direct, log)
    lines = report(args, same, found, log, direct, (load, os.getloadavg()[0]),
                   (time.time() - started) / 60)
    print("\n".join(lines))
    if args.write and not args.quick:
        replace_section("lora", lines)


if __name__ == "__main__":
    main()
