"""dtrain.pipeline: measured bubbles against theory, a timeline plot, and step time against
torch.distributed.pipelining.

    dtrain run -n 2 benchmarks/pipeline_bubbles.py --write
    dtrain run -n 4 benchmarks/pipeline_bubbles.py --write    # p = 4: a section of its own

From one run on p ranks, one stage each or two in a V (p = 2, the cores this machine has,
or 4: the GPT's 8 layers in 2p chunks, m = 8 in groups of p for the interleaved timeline):
1. bubble fraction per schedule (GPipe, 1F1B, interleaved with v = 2, ZB-H1, and on v = 2
   chunks per rank placed in a V, ZB-V and DualPipeV) and micro-batch count m in
   {2, 4, 8, 16}, those the schedule can run (interleaved: m a multiple of p; DualPipeV:
   m >= 2p): each rank's idle time (the step's time minus its compute, waiting for
   messages included as idle) over the step's time, from the Pipeline's own per-action
   timeline; median of steps, mean of ranks; against the planner's prediction
   (dtrain.planner.costs.bubble: each schedule's own action lists run on equal F, B and W
   times: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1)
   for ZB-H1, (p-1)/(6m+p-1) for ZB-V and DualPipeV at m >= 2p). Beside it each
   schedule's peak of live micro-batches (`Pipeline.peak_live`, the most of any rank).
   Each micro-batch has the same size, so steps grow with m;
2. benchmarks/pipeline_timeline.png (pipeline_timeline_pp4.png at p = 4): one 1F1B, one
   interleaved and one ZB-V step, forward, backward and W blocks per rank, like the
   figures of the GPipe, Megatron-LM and zero-bubble papers;
3. step time of dtrain's GPipe and 1F1B against torch.distributed.pipelining's
   ScheduleGPipe and Schedule1F1B on the same GPT pieces, and of dtrain's ZB-V and
   DualPipeV against ScheduleZBVZeroBubble and ScheduleDualPipeV on the same pieces of a
   Llama whose head is not tied to its embedding (torch's schedules cannot sum the
   gradient of a weight two stages hold; GPT always ties it), in rounds.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from results_md import replace_section
from torch import nn

import dtrain
from dtrain import comm, pipeline
from dtrain.comm.timing import time_turns
from dtrain.errors import ConfigError
from dtrain.models import ModelConfig, build, resolve
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.pipeline.schedules import V_SHAPED, check
from dtrain.planner import bubble as planned_bubble

CONFIG = GPTConfig(n_layer=8, n_head=8, n_embd=256, block_size=128)
UNTIED = resolve(ModelConfig(arch="llama", n_layer=CONFIG.n_layer, n_head=CONFIG.n_head,
                             n_embd=CONFIG.n_embd, block_size=CONFIG.block_size,
                             tie_embeddings=False), CONFIG.vocab_size)
"""The model of the V-shaped comparison: a Llama of the GPT's shape, its head untied."""
MICRO = 2  # sequences per micro-batch
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1), ("zbv", 2),
             ("dualpipev", 2))
"""Each schedule measured, with its chunks per rank."""
SIZES = (2, 4, 8, 16)  # micro-batches per step in the bubble table
COMPARED = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zbv": "ScheduleZBVZeroBubble",
            "dualpipev": "ScheduleDualPipeV"}
"""dtrain's schedules timed against torch.distributed.pipelining's of these names."""
PLOT = Path(__file__).with_name("pipeline_timeline.png")


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def make_untied() -> nn.Module:
    torch.manual_seed(0)
    return build(UNTIED)


def data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    x = torch.randint(0, CONFIG.vocab_size, (m * MICRO, CONFIG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


@functools.cache
def lanes() -> dtrain.Mesh:
    """A pipeline mesh whose groups have their twins (DualPipeV's overlapped pairs)."""
    mesh = dtrain.Mesh(pp=dist.get_world_size())
    mesh.second_lane()
    return mesh


def ours(schedule: str, m: int, chunks: int, timeline: bool = False,
         make: Callable[[], nn.Module] = make_gpt, overlap: bool = False):
    """dtrain's Pipeline on this rank's chunks of `make()` cut into p x `chunks` pieces."""
    pp = dist.get_world_size()
    mine = pipeline.pieces_for(pipeline.cut(make(), pp * chunks), schedule=schedule)
    if overlap:  # DualPipeV's pairs: the backward in a second thread
        lanes()
    pipe = pipeline.Pipeline(mine, microbatches=m, schedule=schedule, loss_fn=pipeline.lm_loss,
                             timeline=timeline, overlap=overlap)
    opt = torch.optim.AdamW(nn.ModuleList(mine).parameters(), lr=1e-4)
    x, y = data(m)

    def step() -> None:
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()

    return pipe, step


def theirs(schedule: str, m: int) -> Callable[[], None]:
    """torch.distributed.pipelining's schedule of the same name on the same pieces: one
    stage per rank (GPT), or two in a V, rank r holding stages r and 2p-1-r (the untied
    Llama). Its loss per micro-batch is their mean, as dtrain's, and it divides the
    gradients by m (scale_grads) where dtrain divides each micro-batch's loss."""
    from torch.distributed import pipelining

    rank, pp = dist.get_rank(), dist.get_world_size()
    v_shaped = schedule in V_SHAPED
    pieces = pipeline.cut(make_untied(), 2 * pp) if v_shaped else pipeline.cut(make_gpt(), pp)
    held = [rank, 2 * pp - 1 - rank] if v_shaped else [rank]
    stages = [pipelining.PipelineStage(pieces[s], s, len(pieces), torch.device("cpu"))
              for s in held]
    kind = getattr(pipelining, COMPARED[schedule])
    sched = kind(stages if v_shaped else stages[0], n_microbatches=m,
                 loss_fn=pipeline.lm_loss)
    opt = torch.optim.AdamW(nn.ModuleList(pieces[s] for s in held).parameters(), lr=1e-4)
    x, y = data(m)
    inputs = [x] if 0 in held else []
    targets = {"target": y, "losses": []} if len(pieces) - 1 in held else {}

    def step() -> None:
        sched.step(*inputs, **targets)
        opt.step()
        opt.zero_grad()

    return step


def bubble(pipe: pipeline.Pipeline) -> float:
    """This rank's idle share of the step: the step lasts until the slowest rank ends; a
    rank is busy while any of its actions computes (DualPipeV's overlapped pairs count
    once)."""
    end = torch.tensor([max(e[4] for e in pipe.events)], dtype=torch.float64)
    comm.all_reduce(end, op="max")
    busy, reached = 0.0, 0.0
    for start, stop in sorted((e[3], e[4]) for e in pipe.events):
        busy += max(0.0, stop - max(start, reached))
        reached = max(reached, stop)
    return 1 - busy / end.item()


def theory(schedule: str, pp: int, m: int, chunks: int) -> float:
    """The planner's bubble of equal stages (dtrain.planner.costs.bubble: the schedule's
    own action lists run with F, B and W taking equal time, messages free)."""
    return planned_bubble(pp, m, chunks, schedule)


def measure_bubbles(args) -> tuple[list[tuple[str, int, float, float, int]], list[str]]:
    """Rows (schedule, m, measured bubble, theory, peak live), and what could not run."""
    pp = dist.get_world_size()
    rows, skipped = [], []
    for schedule, chunks in SCHEDULES:
        for m in SIZES:
            try:
                check(schedule, pp, m, chunks)
            except ConfigError as exc:
                skipped.append(f"{schedule} m={m} ({exc})")
                continue
            pipe, step = ours(schedule, m, chunks, timeline=True)
            step()
            values = []
            for _ in range(args.steps):
                dist.barrier()
                step()
                values.append(bubble(pipe))
            mine = torch.tensor([statistics.median(values)], dtype=torch.float64)
            mean = comm.all_reduce(mine, op="avg").item()
            peak = torch.tensor([pipe.peak_live], dtype=torch.float64)
            comm.all_reduce(peak, op="max")
            rows.append((schedule if chunks == 1 else f"{schedule} (v={chunks})", m, mean,
                         theory(schedule, pp, m, chunks), int(peak.item())))
    return rows, skipped


def timeline_events(schedule: str, chunks: int, m: int) -> list[list[tuple]]:
    """Every rank's events of one step (gathered as tensors: nothing is unpickled)."""
    pipe, step = ours(schedule, m, chunks, timeline=True)
    step()
    dist.barrier()
    step()
    rows = torch.tensor([["FBW".index(e[0]), e[1], e[2], e[3], e[4]] for e in pipe.events],
                        dtype=torch.float64)
    everyone = comm.all_gather(rows.unsqueeze(0))
    return [[("FBW"[int(r[0])], int(r[1]), int(r[2]), r[3].item(), r[4].item())
             for r in rank] for rank in everyone]


COLORS = {("F", 0): "#4c72b0", ("B", 0): "#55a868", ("W", 0): "#dd8452",
          ("F", 1): "#8fb0e0", ("B", 1): "#a5d6a7", ("W", 1): "#f0b98d"}
"""Each action's colour on its rank's first chunk, lighter on its second."""


def plot(panels: list[tuple[str, list[list[tuple]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = len(panels[0][1])
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, (0.4 * ranks + 0.8) * len(panels)
                                                      + 0.6))
    for ax, (title, everyone) in zip(axes, panels, strict=True):
        for r, events in enumerate(everyone):
            for kind, micro, chunk, start, end in events:
                ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (r - 0.4, 0.8),
                               facecolors=COLORS[(kind, chunk)], edgecolors="white",
                               linewidth=0.5)
                ax.text((start + end) / 2 * 1e3, r, str(micro), ha="center", va="center",
                        fontsize=7, color="white")
        ax.set_yticks(range(len(everyone)), [f"rank {r}" for r in range(len(everyone))])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlabel("ms (blue: forward, green: backward, orange: W, blank: idle)",
                      fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare(args) -> dict[str, float]:
    candidates = {}
    for schedule in COMPARED:
        chunks, make = (2, make_untied) if schedule in V_SHAPED else (1, make_gpt)
        candidates[f"dtrain {schedule}"] = ours(schedule, args.m, chunks, make=make)[1]
        candidates[f"torch {schedule}"] = theirs(schedule, args.m)
    candidates["dtrain dualpipev overlapped"] = ours("dualpipev", args.m, 2, make=make_untied,
                                                    overlap=True)[1]
    for run in candidates.values():
        run()
    counts = {name: args.rounds * args.steps for name in candidates}
    return time_turns(candidates, counts, args.rounds, comm.resolve(None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-m", type=int, default=8, help="micro-batches in the comparison")
    parser.add_argument("--write", action="store_true",
                        help="update benchmarks/RESULTS.md and the timeline PNG")
    args = parser.parse_args()
    world = dtrain.init()
    pp = world.world_size
    if pp not in (2, 4):
        raise SystemExit("run with 2 or 4 ranks: dtrain run -n 2 benchmarks/pipeline_bubbles.py")
    if args.m < 2 * pp:
        parser.error(f"-m {args.m}: DualPipeV, in the comparison, needs at least 2 x {pp} "
                     "micro-batches")
    rows, skipped = measure_bubbles(args)
    panels = [(f"1F1B, p = {pp}, m = 8", timeline_events("1f1b", 1, 8)),
              (f"interleaved 1F1B, p = {pp}, v = 2, m = 8 (light: second chunk)",
               timeline_events("interleaved", 2, 8)),
              (f"ZB-V, p = {pp}, v = 2 in a V, m = 8 (light: second chunk, stages "
               f"2p-1-rank)", timeline_events("zbv", 2, 8))]
    medians = compare(args)
    if world.rank == 0:
        lines = section(rows, skipped, medians, args, pp)
        print("\n".join(lines))
        if args.write:
            plot(panels, plot_path(pp))
            replace_section("pipeline" if pp == 2 else f"pipeline-pp{pp}", lines)
    dtrain.shutdown()


def plot_path(pp: int) -> Path:
    return PLOT if pp == 2 else PLOT.with_name(f"{PLOT.stem}_pp{pp}{PLOT.suffix}")


def section(rows, skipped: list[str], medians, args, pp: int) -> list[str]:
    lines = [
        "## Pipeline: bubbles against theory, and step time against torch.distributed."
        f"pipelining ({pp} ranks)",
        "",
        f"Command: `dtrain run -n {pp} benchmarks/pipeline_bubbles.py --steps {args.steps} "
        f"--rounds {args.rounds} -m {args.m} --write`  ",
        f"Machine: {torch.get_num_threads()} thread(s) per rank, {platform.machine()}, torch "
        f"{torch.__version__}, gloo; GPT n_layer={CONFIG.n_layer}, n_embd={CONFIG.n_embd}, "
        f"{MICRO} x {CONFIG.block_size} tokens per micro-batch, AdamW. Bubble: a rank's "
        "idle time (waiting for messages included) over the step's time, from the "
        f"Pipeline's timeline; median of steps, mean of the {pp} ranks. Peak live: the most "
        "micro-batches whose activations one rank holds at once (`Pipeline.peak_live`, "
        "from a micro-batch's forward to its backward B), counted per chunk: one is a "
        f"chunk's activations for one micro-batch, 1/{pp} of the model's under a "
        f"schedule of one chunk per rank, 1/{2 * pp} under v = 2.",
        "",
        "| schedule | m | measured bubble | theory | difference (points) | peak live |",
        "|---|---|---|---|---|---|",
    ]
    for name, m, measured, expected, peak in rows:
        lines.append(f"| {name} | {m} | {measured:.3f} | {expected:.3f} | "
                     f"{(measured - expected) * 100:+.1f} | {peak} |")
    lines += [
        "",
        "Theory: the planner's prediction (`dtrain.planner.costs.bubble`: each schedule's "
        "own action lists run with F, B and W of equal time, messages free): "
        "(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) "
        "for ZB-H1 (`zb1p`), (p-1)/(6m+p-1) for ZB-V (`zbv`) and DualPipeV (`dualpipev`, "
        "m >= 2p), two chunks per rank in a V. "
        f"Timeline of one step: `benchmarks/{plot_path(pp).name}`.",
    ]
    if skipped:
        lines += ["", "Not run (the schedule cannot): " + "; ".join(skipped) + "."]
    lines += [
        "",
        f"Step time, same pieces on both sides, {args.m} micro-batches, median of "
        f"{args.rounds} rounds of {args.steps} steps, slowest rank. GPipe and 1F1B: the "
        "GPT, one piece per rank. ZB-V and DualPipeV: a Llama of the GPT's shape whose "
        "head is not tied to its embedding (torch's schedules cannot sum a weight two "
        "stages hold), two pieces per rank in a V; torch divides the accumulated "
        "gradients by m where dtrain divides each micro-batch's loss, the same step.",
        "",
        "| schedule | dtrain ms/step | torch.distributed.pipelining ms/step | ratio |",
        "|---|---|---|---|",
    ]
    for schedule, theirs_name in COMPARED.items():
        a, b = medians[f"dtrain {schedule}"], medians[f"torch {schedule}"]
        lines.append(f"| {schedule} vs {theirs_name} | {a * 1e3:.1f} | "
                     f"{b * 1e3:.1f} | **{a / b:.2f}** |")
    a, b = medians["dtrain dualpipev overlapped"], medians["torch dualpipev"]
    lines += [f"| dualpipev, pairs overlapped (`overlap_pairs = \"on\"`) vs ScheduleDualPipeV "
              f"| {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f} |", "",
              "Both halves of a DualPipeV pair run one after the other unless overlapped: "
              "torch's by default, dtrain's where `overlap_pairs` is off (its default on "
              "CPU cores). Overlapped, a pair's backward computes in a second thread, which "
              "on this machine competes with the forward for the same cores."]
    return lines


if __name__ == "__main__":
    main()
