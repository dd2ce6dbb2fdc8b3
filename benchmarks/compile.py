"""Regional compilation (torch.compile, CPU inductor) against eager on dtrain's Llama: tokens/s
on 1 and 2 ranks, the compile time, DataParallel's all-reduce hidden behind backward, and
the MFU `dtrain train` prints for its built-in job, checked by hand.

    python benchmarks/compile.py [--rounds 7 --warmup 2 --traced 3 --write]

1. Tokens/s. For 1 and then 2 ranks, one world under `dtrain run -n N` (this file, with
   --worker; the launcher gives each rank cores // N torch threads: 2 on 1 rank, 1 each on
   2) builds the Llama SHAPE twice from the same seed, one eager and one with
   `dtrain.models.compiled.compile_blocks` (inductor, its kernels cached in a fresh folder,
   so the compile is cold), each wrapped in dtrain's DataParallel on 2 ranks. The global
   batch is BATCH sequences of SHAPE's block_size random byte tokens (vocabulary 256), split
   over the ranks; AdamW. The compiled model's first step is timed on its own (what
   compiling costs, with dynamo's own count of its compile seconds,
   `compiled.compile_stats()`, the figure `dtrain train`'s `compile:` line prints); then
   `--warmup` rounds untimed and `--rounds` timed rounds of one step of each model, the
   order reversed every round so the shared machine's noise hits both alike, a barrier
   before each step. A step's time is its slowest rank's (forward, backward with the
   gradient all-reduce, AdamW step); the figure is the median over rounds.
2. Overlap (2 ranks). After the timed rounds each model trains `--traced` more steps with a
   timeline recorder installed (dtrain.timeline.Recorder, spans "forward" and "backward" as
   `dtrain train` records them; every all-reduce a span from its issue to the end of its
   `wait()`). DataParallel waits for its buckets at the end of backward, inside the
   "backward" span, so "all-reduce inside backward" would be 100% by construction: backward's
   compute is taken to end when the last bucket is issued (the bucket holding the first
   layer's gradients, launched when autograd produces them, or by the end-of-backward
   callback). Hidden = the time an all-reduce is in flight before that instant; exposed =
   after it (backward waiting for the network); the share hidden = hidden / in flight, all
   ranks and traced steps summed, unions of spans by dtrain.timeline.summarize.
   Then the same for DataParallel, ZeRO-2 and ZeRO-3 (each eager and compiled, built from
   the same seed, one untraced step first), from the spans the layouts record themselves:
   "finish backward" starts when backward's compute has ended (the end-of-backward
   callback) and ends with the gradients in place, so its length is the communication
   backward waited for; ZeRO-3's "gather for backward" spans are a block waiting for its
   parameters. Exposed = the "finish backward" of the rank whose compute ended last;
   alone = the layout's gradient collectives (DataParallel's buckets, ZeRO's units'
   reduce-scatters) on their own, blocking; share hidden = 1 - exposed / alone. Completed
   before compute ended: the bytes of the all-reduces whose transfer (the timeline's
   `completed_us`) ended before that instant, on that rank. ZeRO-3's prefetch lead: of
   each block's backward, the share during which the next block's all-gather was in
   flight before it was needed (the first block in backward has no prefetch).
3. MFU. `dtrain train` with no config (the built-in GPT job, 2 ranks) for 40 steps without
   samples; the MFU its metrics report, against the planner's FLOPs per token x tokens/s /
   ranks / the calibrated CPU peak of ~/.cache/dtrain/cpu_peak.json, computed here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_md import replace_section, run_summary

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"arch": "llama", "n_layer": 8, "n_embd": 256, "n_head": 4, "block_size": 512}
BATCH = 16
VOCAB = 256
MODES = ("eager", "compiled")
LAYOUTS = ("dp", "zero2", "zero3")
DEFAULT_STEPS = 40
SKIP = 5
"""The default job's first steps left out of its medians (the first step's allocations and
collective-algorithm measurements)."""


# ------------------------------------------------------------------ one rank of a world
def build(compiled: bool, cache: str, size: int, layout: str = "dp"):  # noqa: ANN201
    """The Llama of SHAPE (seed 0), compiled or not, DataParallel (or ZeRO-2, ZeRO-3:
    `layout`) on several ranks; and what steps it."""
    import dtrain
    from dtrain import models
    from dtrain.config import OptimizerConfig
    from dtrain.models.compiled import compile_blocks
    from dtrain.optim import build_optimizer

    torch.manual_seed(0)
    model = models.build(models.resolve(models.ModelConfig(**SHAPE), VOCAB))
    if compiled:
        compile_blocks(model, cache_dir=cache)
    if layout != "dp":
        zero = dtrain.ZeRO(model, lambda p: build_optimizer(p, OptimizerConfig()),
                           stage=int(layout[-1]))
        return zero, zero
    wrapped = dtrain.DataParallel(model) if size > 1 else model
    return wrapped, build_optimizer(model.parameters(), OptimizerConfig())


def step(model, optimizer, x: torch.Tensor, y: torch.Tensor) -> None:  # noqa: ANN001
    from dtrain import timeline

    with timeline.span("forward", "forward"):
        loss = model(x, y)[1]
    with timeline.span("backward", "backward"):
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def overlap(events: list[dict], rank: int) -> tuple[float, float, float]:
    """(seconds of all-reduce in flight, of which before backward's compute ended: before
    the last all-reduce's issue, and that instant in microseconds since the epoch) of one
    rank's traced step."""
    from dtrain import timeline

    backward = [e for e in events if e.get("ph") == "X" and e["name"] == "backward"]
    reduces = [e for e in events if e.get("ph") == "X" and e.get("cat") == "comm"
               and e["name"] == "all_reduce"]
    if not reduces:
        return 0.0, 0.0, 0.0
    start, compute_end = backward[0]["ts"], max(e["ts"] for e in reduces)
    before = [{**e, "ts": max(e["ts"], start),
               "dur": max(0.0, min(e["ts"] + e["dur"], compute_end) - max(e["ts"], start))}
              for e in reduces]
    in_flight = timeline.summarize(reduces)[rank]["comm"]
    hidden = timeline.summarize(before)[rank]["comm"]
    return in_flight, hidden, compute_end


def finish(events: list[dict], op: str) -> dict:
    """One rank's traced step of a layout, from the spans it records itself: when
    backward's compute ended (`end`, µs since the epoch), how long backward then waited
    for its collectives (`exposed`, s), the share of `op`'s bytes whose transfer completed
    before `end`, the time ZeRO-3's blocks waited for their parameters after the first
    (`gather_wait`, s), and the prefetch's lead over each block's backward (`lead`)."""
    spans = [e for e in events if e.get("ph") == "X"]
    done = next(e for e in spans if e["name"] == "finish backward")
    sent = [e for e in spans if e.get("cat") == "comm" and e["name"] == op]
    before = sum(e["args"]["bytes"] for e in sent
                 if e["ts"] + e["args"]["completed_us"] <= done["ts"])
    needs = sorted((e["ts"], e["dur"]) for e in spans if e["name"] == "gather for backward")
    start = next(e["ts"] for e in spans if e["name"] == "backward")
    lead = window = 0.0
    for gather in (e for e in spans if e.get("cat") == "comm" and e["name"] == "all_gather"
                   and e["ts"] >= start and needs):
        j = next((j for j, (t, _) in enumerate(needs) if t >= gather["ts"]), 0)
        if j:
            lead += needs[j][0] - gather["ts"]
            window += needs[j][0] - needs[j - 1][0]
    return {"end": done["ts"], "exposed": done["dur"] / 1e6,
            "completed_share": before / max(1, sum(e["args"]["bytes"] for e in sent)),
            "gather_wait": sum(d for _, d in needs[1:]) / 1e6,
            "lead": lead / window if window else None}


def alone_seconds(sizes: list[tuple[int, torch.dtype]], op: str, steps: int) -> list[float]:
    """`op` ("all_reduce", "reduce_scatter") over buffers of `sizes`, blocking, one after
    the other: the transfers' own time, once per step after a warm-up."""
    from dtrain import comm

    buffers = [torch.zeros(n, dtype=dtype) for n, dtype in sizes]
    seconds = []
    for i in range(steps + 1):  # the first: warm-up
        comm.barrier()
        begin = time.perf_counter()
        for buffer in buffers:
            getattr(comm, op)(buffer)
        if i:
            seconds.append(time.perf_counter() - begin)
    return seconds


def traced_layouts(args: argparse.Namespace, rank: int, x: torch.Tensor, y: torch.Tensor
                   ) -> dict[str, dict]:
    """Each layout eager and compiled: its traced steps (`finish`) and its gradient
    collectives alone."""
    from dtrain import comm, timeline

    out: dict[str, dict] = {}
    for layout in LAYOUTS:
        op = "all_reduce" if layout == "dp" else "reduce_scatter"
        for mode in MODES:
            model, optimizer = build(mode == "compiled", args.cache, 2, layout)
            step(model, optimizer, x, y)  # untraced: a new model's first step
            steps = []
            for _ in range(args.traced):
                recorder = timeline.Recorder("unused.json", rank)
                comm.barrier()
                timeline.install(recorder)
                try:
                    step(model, optimizer, x, y)
                finally:
                    timeline.install(None)
                steps.append(finish(recorder.events(), op))
            sizes = model.bucket_sizes() if layout == "dp" else \
                [(u.flat.padded, u.full.dtype) for u in model.units]
            out[f"{layout} {mode}"] = {"steps": steps,
                                       "alone": alone_seconds(sizes, op, args.traced)}
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank: the compile, the alternating rounds, the traced steps; its record to
    `args.out`.rank-R.json."""
    import dtrain
    from dtrain import comm, timeline
    from dtrain.models import compiled

    world = dtrain.init()
    rank, size = world.rank, world.world_size
    ids = torch.randint(0, VOCAB, (BATCH, SHAPE["block_size"] + 1),
                        generator=torch.Generator().manual_seed(0))
    mine = ids.chunk(size)[rank]
    x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    held = {mode: build(mode == "compiled", args.cache, size) for mode in MODES}
    first = {}
    for mode in MODES:  # compiled: the cold compile happens in this step
        comm.barrier()
        start = time.perf_counter()
        step(*held[mode], x, y)
        first[mode] = time.perf_counter() - start
    stats = compiled.compile_stats()
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.warmup + args.rounds):
        for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
            comm.barrier()
            start = time.perf_counter()
            step(*held[mode], x, y)
            if r >= args.warmup:
                seconds[mode].append(time.perf_counter() - start)
    traced: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    for mode in MODES if size > 1 else ():
        for _ in range(args.traced):  # a recorder per step, never closed: nothing written
            recorder = timeline.Recorder("unused.json", rank)
            comm.barrier()
            timeline.install(recorder)
            try:
                step(*held[mode], x, y)
            finally:
                timeline.install(None)
            traced[mode].append(overlap(recorder.events(), rank))
    alone = []
    if size > 1:  # the same buckets' all-reduces on their own, blocking: the transfer time
        buffers = [torch.zeros(n, dtype=dtype) for n, dtype in held["eager"][0].bucket_sizes()]
        for i in range(args.traced + 1):  # the first: warm-up
            comm.barrier()
            start = time.perf_counter()
            for buffer in buffers:
                comm.all_reduce(buffer)
            if i:
                alone.append(time.perf_counter() - start)
    after = compiled.compile_stats()["frames"]
    layouts = traced_layouts(args, rank, x, y) if size > 1 else {}
    record = {"rank": rank, "threads": torch.get_num_threads(), "first": first,
              "compile": stats, "seconds": seconds, "traced": traced, "alone": alone,
              "after": after, "layouts": layouts}
    Path(f"{args.out}.rank-{rank}.json").write_text(json.dumps(record))
    dtrain.shutdown()


# ------------------------------------------------------------------ the launcher
def world(ranks: int, args: argparse.Namespace, folder: Path) -> dict:
    """Run the worker on `ranks` ranks; the step times of the slowest rank and the rest."""
    out, cache = folder / f"world{ranks}", folder / f"cache{ranks}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT),
                                                      env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "dtrain.cli", "run", "-n", str(ranks),
               str(Path(__file__).resolve()), "--worker", "--out", str(out), "--cache",
               str(cache), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
               "--traced", str(args.traced)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{ranks} rank(s) failed:\n{done.stdout}{done.stderr}")
    records = [json.loads(Path(f"{out}.rank-{r}.json").read_text()) for r in range(ranks)]
    print(f"  {ranks} rank(s): {time.perf_counter() - started:.0f} s", flush=True)
    slowest = {m: [max(ts) for ts in zip(*(r["seconds"][m] for r in records), strict=True)]
               for m in MODES}
    tokens = BATCH * SHAPE["block_size"]
    result = {"ranks": ranks, "threads": records[0]["threads"], "slowest": slowest,
              "tokens_per_s": {m: tokens / statistics.median(slowest[m]) for m in MODES},
              "first": {m: max(r["first"][m] for r in records) for m in MODES},
              "compile_s": max(r["compile"]["seconds"] for r in records),
              "graphs": records[0]["compile"]["frames"],
              "breaks": records[0]["compile"]["breaks"],
              "recompiled": max(r["after"] - r["compile"]["frames"] for r in records)}
    result["speedup"] = result["tokens_per_s"]["compiled"] / result["tokens_per_s"]["eager"]
    result["round_ratios"] = [e / c for e, c in zip(slowest["eager"], slowest["compiled"],
                                                    strict=True)]
    if ranks > 1:
        result["overlap"] = {}
        for m in MODES:
            in_flight = sum(f for r in records for f, _, _ in r["traced"][m])
            hidden = sum(h for r in records for _, h, _ in r["traced"][m])
            per_step = [sum(r["traced"][m][i][1] for r in records)
                        / sum(r["traced"][m][i][0] for r in records)
                        for i in range(args.traced)]
            steps = args.traced * ranks
            # exposed: the rank whose compute ended last; the others' tail also waits for it
            last = [max((r["traced"][m][i] for r in records), key=lambda t: t[2])
                    for i in range(args.traced)]
            exposed = statistics.mean(f - h for f, h, _ in last)
            alone = statistics.median(max(ts) for ts in zip(*(r["alone"] for r in records),
                                                              strict=True))
            result["overlap"][m] = {"in_flight_s": in_flight / steps,
                                    "hidden_s": hidden / steps, "exposed_s": exposed,
                                    "skew_s": (in_flight - hidden) / steps - exposed,
                                    "alone_s": alone, "share": max(0.0, 1 - exposed / alone),
                                    "span_share": hidden / in_flight, "per_step": per_step,
                                    "steps": steps}
        result["layouts"] = {name: layout_figures([r["layouts"][name] for r in records])
                             for name in records[0]["layouts"]}
    return result


def layout_figures(ranks: list[dict]) -> dict:
    """One layout and mode over its ranks and traced steps: each step's figures from the
    rank whose compute ended last (the other's tail also waits for it), then their means;
    the collectives alone, the median of the slowest rank."""
    last = [max(steps, key=lambda s: s["end"]) for steps in zip(*(r["steps"] for r in ranks),
                                                                strict=True)]
    alone = statistics.median(max(ts) for ts in zip(*(r["alone"] for r in ranks),
                                                    strict=True))
    exposed = statistics.mean(s["exposed"] for s in last)
    leads = [s["lead"] for s in last if s["lead"] is not None]
    return {"exposed_s": exposed, "alone_s": alone, "share": max(0.0, 1 - exposed / alone),
            "completed_share": statistics.mean(s["completed_share"] for s in last),
            "gather_wait_s": statistics.mean(s["gather_wait"] for s in last),
            "lead": statistics.mean(leads) if leads else None}


def default_job(folder: Path) -> dict:
    """`dtrain train` with no config for DEFAULT_STEPS steps: its printed MFU and the check."""
    from dtrain import models
    from dtrain.config import ModelConfig
    from dtrain.planner.shape import ModelShape
    from dtrain.train.hardware import cache_path, cpu_name

    metrics = folder / "default.jsonl"
    command = [sys.executable, "-m", "dtrain.cli", "train", "--set",
               f"train.steps={DEFAULT_STEPS}", "--set", "logging.sample_tokens=0", "--set",
               f"train.out_dir='{folder / 'default'}'", "--metrics", str(metrics)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"dtrain train failed:\n{done.stdout}{done.stderr}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if "mfu" in r and r["step"] > SKIP]
    header = next(line for line in done.stdout.splitlines() if line.startswith("MFU:"))
    shape = ModelShape.of(models.resolve(ModelConfig(), VOCAB))
    per_token = shape.model_flops_per_token()
    ranks = 2
    peaks = json.loads(cache_path().read_text())
    peak = peaks[f"{cpu_name()} | 1 threads"]  # 2 ranks on 2 cores: 1 thread each
    by_hand = [per_token * r["tokens_per_s"] / ranks / 1e12 / peak for r in rows]
    middle = sorted(rows, key=lambda r: r["tokens_per_s"])[len(rows) // 2]
    return {"header": header, "per_token": per_token, "peak": peak, "ranks": ranks,
            "layers": shape.layers, "hidden": shape.hidden, "seq": shape.seq,
            "vocab": shape.vocab, "weights": shape.active_block_matmul_params()
            + shape.vocab * shape.hidden, "steps": len(rows), "middle": middle,
            "middle_by_hand": per_token * middle["tokens_per_s"] / ranks / 1e12 / peak,
            "mfu": statistics.median(r["mfu"] for r in rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "worst_gap": max(abs(r["mfu"] - h) for r, h in zip(rows, by_hand, strict=True)),
            "line": next((line for line in done.stdout.splitlines()
                          if re.match(r"step\s+40/", line)), "")}


# ------------------------------------------------------------------ the section
def section(results: list[dict], mfu: dict, summary: dict, args: argparse.Namespace
            ) -> list[str]:
    from dtrain import models
    from dtrain.planner.shape import ModelShape

    shape = models.resolve(models.ModelConfig(**SHAPE), VOCAB)
    params = sum(p.numel() for p in models.build(shape).parameters())
    planned = ModelShape.of(shape)
    shape.ffn_hidden = planned.ffn  # 0 in the config: Llama's rule, applied by the planner
    lines = [
        "## Compiled vs eager (torch.compile, CPU inductor)",
        "",
        f"Command: `python benchmarks/compile.py --rounds {args.rounds} --warmup "
        f"{args.warmup} --traced {args.traced} --write`  ",
        f"Date: {summary['date']}. Machine: {os.cpu_count()} cores, {platform.machine()}, torch "
        f"{torch.__version__}; load average {summary['load_before']:.1f} before, "
        f"{summary['load_after']:.1f} after (shared with other work); "
        f"{summary['minutes']:.1f} min in all.  ",
        f"Model: dtrain's Llama, {shape.n_layer} layers, width {shape.n_embd}, "
        f"{shape.n_head} heads, SwiGLU {shape.ffn_hidden}, vocabulary {VOCAB}, "
        f"{params / 1e6:.1f}M parameters, {planned.model_flops_per_token() / 1e6:.1f} MFLOP "
        f"per token; global batch {BATCH} x {shape.block_size} tokens, AdamW; dtrain's "
        "DataParallel on 2 ranks. Eager and compiled (`compile_blocks`: each block's forward "
        "through inductor, a fresh kernel cache) built from one seed in one world, one step "
        f"each per round in alternating order; median over {args.rounds} rounds of the "
        f"slowest rank's step after {args.warmup} warm-up rounds.",
        "",
        "| ranks | torch threads per rank | eager tok/s | compiled tok/s | compiled / eager | "
        "each round's ratio | first compiled step | compiling (dynamo) | graphs, breaks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratios = ", ".join(f"{x:.2f}" for x in r["round_ratios"])
        lines.append(
            f"| {r['ranks']} | {r['threads']} | {r['tokens_per_s']['eager']:,.0f} | "
            f"{r['tokens_per_s']['compiled']:,.0f} | **{r['speedup']:.2f}** | {ratios} | "
            f"{r['first']['compiled']:.0f} s (eager's: {r['first']['eager']:.1f} s) | "
            f"{r['compile_s']:.0f} s | {r['graphs']}, {r['breaks']} "
            f"(+{r['recompiled']} after step 1) |")
    two = next(r for r in results if r["ranks"] == 2)
    one = next(r for r in results if r["ranks"] == 1)
    speedups = ", ".join(f"{r['speedup']:.2f} on {r['ranks']} rank(s)" for r in results)
    lines += [
        "",
        f"The shape. The issue asks for the largest shape whose step takes a minute; this one "
        f"takes {statistics.median(one['slowest']['eager']):.0f} s eager on 1 rank here "
        "(about 5 s on a quiet machine). A one-minute step, eager and compiled, on 1 and 2 "
        "ranks, with a warm-up and at least 3 timed steps each, is over 20 minutes of steps "
        "alone before 4 cold compiles, and this machine's load (other jobs on its 2 cores) "
        "stretches every step by up to 5x; so a shape of seconds, with rounds to take a "
        "median over. The width is kept small on purpose: what compiling can speed up on a "
        "CPU is the elementwise work around the matrix products (RMSNorm, rotary, SwiGLU's "
        "gate, residual adds), whose share falls as the width grows (T·h against T·h²).",
        "",
        f"Target >= 1.15x: {'met' if min(r['speedup'] for r in results) >= 1.15 else 'not met'}"
        f" ({speedups}). "
        "The rounds' own ratios scatter widely (the column above), the machine's noise "
        "(see the load average) being larger than the effect. What the CPU figure says: "
        "inductor turns each block's elementwise chains into generated C++/OpenMP loops "
        "(fewer passes over memory, no intermediate tensors), and that is all it can win "
        "here: the matrix products go to the same BLAS (oneDNN/MKL) compiled or not, and "
        "attention to the same SDPA kernel, so at a width where the products are most of "
        "the step the gain is small. What it does not say: on a GPU the gain comes from "
        "fusing the memory-bound ops around cuBLAS and flash attention and from launching "
        "far fewer kernels (each eager op is a launch, and launches dominate small "
        "ops), neither of which a CPU measures; torchtitan reports +15.7% tokens/s for "
        "Llama 3 8B on 8 H100s with per-block compilation. The compile time (about "
        f"{one['compile_s']:.0f} s for one block here, shared by all {shape.n_layer}) and the "
        "zero recompilations after step 1 carry over; the speed-up does not.",
    ]
    lines += [
        "",
        "DataParallel's gradient all-reduce hidden behind backward (2 ranks; per rank and "
        f"step, means over the {args.traced} traced steps of each model on both ranks). In "
        "flight: from an all-reduce's issue to the end of its `wait()` (an upper bound of "
        "its transfer: a gloo all-reduce is seen to end only when waited on); exposed: the "
        "part after the last bucket's issue, the end of backward's compute, on the rank whose "
        "compute ended last (backward waiting for the network; the other rank's tail also "
        "waits for its peer: the skew column, the mean over both ranks less it); alone: "
        "the same buckets all-reduced on their own, "
        "blocking (median of the slowest rank), the transfer's own time; share hidden = 1 - "
        "exposed / alone.",
        "",
        "| model | all-reduce in flight | of it before compute ended | exposed | skew | "
        "all-reduce alone | share hidden | in-flight share before compute ended, per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in MODES:
        o = two["overlap"][m]
        lines.append(
            f"| {m} | {o['in_flight_s'] * 1e3:.0f} ms | {o['hidden_s'] * 1e3:.0f} ms | "
            f"{o['exposed_s'] * 1e3:.0f} ms | {o['skew_s'] * 1e3:.0f} ms | "
            f"{o['alone_s'] * 1e3:.0f} ms | "
            f"**{o['share']:.0%}** | {', '.join(f'{s:.0%}' for s in o['per_step'])} |")
    lines += [
        "",
        "Eager and compiled side by side in DataParallel, ZeRO-2 and ZeRO-3 (2 ranks, "
        f"{args.traced} traced steps each after an untraced one), from the spans the "
        "layouts record: exposed = how long backward waited for its collectives after its "
        "compute ended (the span \"finish backward\", on the rank whose compute ended "
        "last); alone = the same gradient collectives on their own, blocking (DataParallel's "
        "buckets all-reduced, ZeRO's units reduce-scattered); share hidden = 1 - exposed / "
        "alone; all-reduce done before compute ended = the bytes whose transfer (the "
        "timeline's `completed_us`) ended before it (gloo's reduce-scatter says so only when "
        "waited for: not shown); ZeRO-3's parameter waits = the blocks after the first in "
        "backward waiting for their all-gather, and the prefetch lead = the share of each "
        "block's backward during which the next block's all-gather was in flight.",
        "",
        "| layout | model | exposed | gradient collectives alone | share hidden | "
        "all-reduce done before compute ended | ZeRO-3 parameter waits | prefetch lead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, o in two["layouts"].items():
        layout, mode = name.split()
        done = f"{o['completed_share']:.0%}" if layout == "dp" else "-"
        waits = f"{o['gather_wait_s'] * 1e3:.0f} ms" if layout == "zero3" else "-"
        lead = "-" if o["lead"] is None else f"{o['lead']:.0%}"
        lines.append(
            f"| {layout} | {mode} | {o['exposed_s'] * 1e3:.0f} ms | {o['alone_s'] * 1e3:.0f} ms "
            f"| **{o['share']:.0%}** | {done} | {waits} | {lead} |")
    w = mfu
    lines += [
        "",
        f"MFU of the built-in job (`dtrain train --set train.steps={DEFAULT_STEPS} --set "
        "logging.sample_tokens=0`, no config: byte-level GPT on the standard library, 2 ranks, "
        f"1 torch thread each), median of steps {SKIP + 1}-{DEFAULT_STEPS} of its metrics: "
        f"**{w['mfu']:.1%}** at {w['tokens_per_s']:,.0f} tokens/s. Its header: "
        f"`{w['header']}`.",
        "",
        f"By hand, for the step of median tokens/s (step {w['middle']['step']}, "
        f"{w['middle']['tokens_per_s']:,.1f} tokens/s, printed MFU "
        f"{w['middle']['mfu']:.4%}): the default GPT is {w['layers']} layers of width "
        f"{w['hidden']}, sequence {w['seq']}, vocabulary {w['vocab']}; the weights that "
        f"multiply a token are 12·l·h² + V·h = 12·{w['layers']}·{w['hidden']}² + "
        f"{w['vocab']}·{w['hidden']} = {w['weights']:,}, so the planner's 6N + 12·l·h·s = "
        f"6·{w['weights']:,} + 12·{w['layers']}·{w['hidden']}·{w['seq']} = "
        f"{w['per_token']:,.0f} FLOP per token. Times {w['middle']['tokens_per_s']:,.1f} "
        f"tokens/s over {w['ranks']} ranks = "
        f"{w['per_token'] * w['middle']['tokens_per_s'] / w['ranks'] / 1e9:.4f} GFLOP/s per "
        f"rank, over the calibrated peak of ~/.cache/dtrain/cpu_peak.json for 1 thread, "
        f"{w['peak'] * 1e3:.2f} GFLOP/s: **{w['middle_by_hand']:.4%}**, the printed value "
        f"(largest gap over all {w['steps']} steps: {w['worst_gap']:.1e}).",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--traced", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    load = os.getloadavg()[0]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        results = [world(ranks, args, Path(tmp)) for ranks in (1, 2)]
        mfu = default_job(Path(tmp))
    summary = run_summary(load, started)
    print(json.dumps({"results": results, "mfu": mfu}, default=str)[:4000])
    lines = section(results, mfu, summary, args)
    print("\n".join(lines))
    if args.write:
        replace_section("compile", lines)


if __name__ == "__main__":
    main()
