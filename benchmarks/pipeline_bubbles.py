"""dtrain.pipeline: measured bubbles against theory, a timeline plot, and step time against
torch.distributed.pipelining.

    dtrain run -n 2 benchmarks/pipeline_bubbles.py --write

From one run on 2 ranks (one stage each; pp = 2, the cores this machine has):
1. bubble fraction per schedule (GPipe, 1F1B, interleaved with v = 2, ZB-H1) and micro-batch
   count m in {2, 4, 8, 16}: each stage's idle time (the step's time minus its compute,
   waiting for messages included as idle) over the step's time, from the Pipeline's own
   per-action timeline; median of steps, mean of stages; against (p-1)/(m+p-1), and
   (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) for ZB-H1. Each micro-batch has the same
   size, so steps grow with m;
2. benchmarks/pipeline_timeline.png: one 1F1B and one interleaved step, forward and
   backward blocks per stage, like the figures of the GPipe and Megatron-LM papers;
3. step time of dtrain's GPipe and 1F1B against torch.distributed.pipelining's
   ScheduleGPipe and Schedule1F1B on the same GPT pieces and micro-batches, in rounds.
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from results_md import replace_section

import dtrain
from dtrain import comm, pipeline
from dtrain.comm.timing import time_turns
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.planner import bubble as planned_bubble

CONFIG = GPTConfig(n_layer=8, n_head=8, n_embd=256, block_size=128)
MICRO = 2  # sequences per micro-batch
PLOT = Path(__file__).with_name("pipeline_timeline.png")


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    x = torch.randint(0, CONFIG.vocab_size, (m * MICRO, CONFIG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def ours(schedule: str, m: int, chunks: int, timeline: bool = False):
    gpt = make_gpt()
    mine = pipeline.pieces_for(pipeline.cut(gpt, 2 * chunks))
    pipe = pipeline.Pipeline(mine, microbatches=m, schedule=schedule, loss_fn=pipeline.lm_loss,
                             timeline=timeline)
    opt = torch.optim.AdamW(torch.nn.ModuleList(mine).parameters(), lr=1e-4)
    x, y = data(m)

    def step() -> None:
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()

    return pipe, step


def theirs(schedule: str, m: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    piece = pipeline.cut(make_gpt(), 2)[rank]
    stage = PipelineStage(piece, rank, 2, torch.device("cpu"))
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = kind(stage, n_microbatches=m, loss_fn=pipeline.lm_loss)
    opt = torch.optim.AdamW(piece.parameters(), lr=1e-4)
    x, y = data(m)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()

    return step


def bubble(pipe: pipeline.Pipeline) -> float:
    """This stage's idle share of the step: the step lasts until the slowest stage ends."""
    end = torch.tensor([max(e[4] for e in pipe.events)], dtype=torch.float64)
    comm.all_reduce(end, op="max")
    busy = sum(e[4] - e[3] for e in pipe.events)
    return 1 - busy / end.item()


def measure_bubbles(args) -> list[tuple[str, int, float, float]]:
    rows = []
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1)):
        for m in (2, 4, 8, 16):
            pipe, step = ours(schedule, m, chunks, timeline=True)
            step()
            values = []
            for _ in range(args.steps):
                dist.barrier()
                step()
                values.append(bubble(pipe))
            mine = torch.tensor([statistics.median(values)], dtype=torch.float64)
            mean = comm.all_reduce(mine, op="avg").item()
            theory = planned_bubble(2, m, chunks, schedule)  # (p-1)/(v m + p - 1), p = 2
            rows.append((schedule if chunks == 1 else f"{schedule} (v={chunks})", m, mean,
                         theory))
    return rows


def timeline_events(schedule: str, chunks: int, m: int) -> list[list[tuple]]:
    """Every stage's events of one step (gathered as tensors: nothing is unpickled)."""
    pipe, step = ours(schedule, m, chunks, timeline=True)
    step()
    dist.barrier()
    step()
    rows = torch.tensor([[e[0] == "B", e[1], e[2], e[3], e[4]] for e in pipe.events],
                        dtype=torch.float64)
    everyone = comm.all_gather(rows.unsqueeze(0))
    return [[("B" if r[0] else "F", int(r[1]), int(r[2]), r[3].item(), r[4].item())
             for r in stage] for stage in everyone]


def plot(panels: list[tuple[str, list[list[tuple]]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.6 * len(panels) + 0.6))
    for ax, (title, stages) in zip(axes, panels, strict=True):
        for s, events in enumerate(stages):
            for kind, micro, chunk, start, end in events:
                color = ("#4c72b0" if kind == "F" else "#55a868") if chunk == 0 else (
                    "#8fb0e0" if kind == "F" else "#a5d6a7")
                ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (s - 0.4, 0.8),
                               facecolors=color, edgecolors="white", linewidth=0.5)
                ax.text((start + end) / 2 * 1e3, s, str(micro), ha="center", va="center",
                        fontsize=7, color="white")
        ax.set_yticks(range(len(stages)), [f"stage {s}" for s in range(len(stages))])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlabel("ms (blue: forward, green: backward, blank: idle)", fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def compare(args) -> dict[str, float]:
    candidates = {}
    for schedule in ("gpipe", "1f1b"):
        candidates[f"dtrain {schedule}"] = ours(schedule, args.m, 1)[1]
        candidates[f"torch {schedule}"] = theirs(schedule, args.m)
    for run in candidates.values():
        run()
    counts = {name: args.rounds * args.steps for name in candidates}
    medians = time_turns(candidates, counts, args.rounds, comm.resolve(None))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-m", type=int, default=8, help="micro-batches in the comparison")
    parser.add_argument("--write", action="store_true",
                        help="update benchmarks/RESULTS.md and the timeline PNG")
    args = parser.parse_args()
    world = dtrain.init()
    if world.world_size != 2:
        raise SystemExit("run with 2 ranks: dtrain run -n 2 benchmarks/pipeline_bubbles.py")
    rows = measure_bubbles(args)
    panels = [("1F1B, p = 2, m = 8", timeline_events("1f1b", 1, 8)),
              ("interleaved 1F1B, p = 2, v = 2, m = 8 (light: second chunk)",
               timeline_events("interleaved", 2, 8))]
    medians = compare(args)
    if world.rank == 0:
        lines = section(rows, medians, args)
        print("\n".join(lines))
        if args.write:
            plot(panels)
            replace_section("pipeline", lines)
    dtrain.shutdown()


def section(rows, medians, args) -> list[str]:
    lines = [
        "## Pipeline: bubbles against theory, and step time against torch.distributed."
        "pipelining (2 ranks)",
        "",
        f"Command: `dtrain run -n 2 benchmarks/pipeline_bubbles.py --steps {args.steps} "
        f"--rounds {args.rounds} -m {args.m} --write`  ",
        f"Machine: {torch.get_num_threads()} thread(s) per rank, {platform.machine()}, torch "
        f"{torch.__version__}, gloo; GPT n_layer={CONFIG.n_layer}, n_embd={CONFIG.n_embd}, "
        f"{MICRO} x {CONFIG.block_size} tokens per micro-batch, AdamW. Bubble: a stage's "
        "idle time (waiting for messages included) over the step's time, from the "
        "Pipeline's timeline; median of steps, mean of the two stages.",
        "",
        "| schedule | m | measured bubble | theory | difference (points) |",
        "|---|---|---|---|---|",
    ]
    for name, m, measured, theory in rows:
        lines.append(f"| {name} | {m} | {measured:.3f} | {theory:.3f} | "
                     f"{(measured - theory) * 100:+.1f} |")
    lines += [
        "",
        "Theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, "
        "(p-1)/(3m+p-1) for ZB-H1 (`zb1p`: B and W each taken as long as a forward). "
        "Timeline of one step: `benchmarks/pipeline_timeline.png`.",
        "",
        f"Step time, same GPT pieces (one per rank), {args.m} micro-batches, median of "
        f"{args.rounds} rounds of {args.steps} steps, slowest rank:",
        "",
        "| schedule | dtrain ms/step | torch.distributed.pipelining ms/step | ratio |",
        "|---|---|---|---|",
    ]
    for schedule in ("gpipe", "1f1b"):
        a, b = medians[f"dtrain {schedule}"], medians[f"torch {schedule}"]
        lines.append(f"| {schedule} | {a * 1e3:.1f} | {b * 1e3:.1f} | **{a / b:.2f}** |")
    return lines


if __name__ == "__main__":
    main()
