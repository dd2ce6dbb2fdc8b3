"""What checkpoints cost a data-parallel training loop: no save, a blocking save every k
steps, a background save every k steps, side by side in one run.

    dtrain run -n 2 benchmarks/background_save.py [--repeats 30 --every 10 --rounds 1 --write]

Two ranks (gloo, CPU, one thread each) hold a GPT (4 layers, 256 wide, 3.2M parameters)
in the data-parallel layout with AdamW: 38 MB of parameters and optimizer state, each rank
writing its half (19 MB) per checkpoint, as `dtrain train` does (dtrain.checkpoint.training:
`save`, or `save_in_background`). A window is `--rounds` x `--every` steps, with a save
after the first step of each round, so every background save has the rest of its round to
finish; the window ends with `wait()` on the last one, so what a save costs is inside it.
The three modes take turns (order rotated every repeat); each repeat gives each mode's
time per step and its ratio to no save within that repeat; the figures are the medians
over repeats, with the quartiles of the ratios (short windows, many repeats: on a shared
machine the load changes within seconds). Beside each save call: how long it held the
loop, and its thread's CPU time (a blocking call's: the whole save's work on this rank; a
background call's: the copy). Checkpoints go to a folder
under the system's temporary directory, emptied at the end. With --write, rank 0 replaces
this benchmark's section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from results_md import replace_section

import dtrain
from dtrain import layouts, models
from dtrain.checkpoint import training
from dtrain.config import config_from_dict, dims_of
from dtrain.mesh import Mesh
from dtrain.models.config import ModelConfig

MODES = ("none", "blocking", "background")
GPT = {"arch": "gpt", "n_layer": 4, "n_head": 8, "n_embd": 256, "block_size": 64}


def build(world: dtrain.World) -> tuple:
    """This rank's model held data-parallel, its schedulers, the config (a dict), and the
    batch it trains on every step."""
    config = config_from_dict({"model": GPT, "train": {"batch_size": 4 * world.world_size},
                               "parallel": {"nproc": world.world_size}})
    mesh = Mesh(dims_of(config, world.world_size))
    torch.manual_seed(0)
    held = layouts.build(models.build(models.resolve(ModelConfig(**GPT), 256)), mesh, config)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda _: 1.0) for o in held.optimizers]
    g = torch.Generator().manual_seed(world.rank)
    tokens = torch.randint(0, 256, (4, GPT["block_size"] + 1), generator=g)
    return held, schedulers, config.to_dict(), (tokens[:, :-1], tokens[:, 1:])


def window(mode: str, held, schedulers, config: dict, folder: Path, step: int,
           args: argparse.Namespace, batch, copies=None) -> tuple[float, list[float], list[float]]:
    """Seconds per step of one window of `mode`; how long each save call held the loop,
    and the CPU seconds the call itself used (its thread's). `copies`: background saves
    copied to other hosts (dtrain.checkpoint.copies; benchmarks/replicated_save.py)."""
    calls, cpus, pending = [], [], None
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.rounds):
        for i in range(args.every):
            held.forward_backward([batch])
            held.step()
            held.zero_grad()
            step += 1
            if i == 0 and mode != "none":
                begin, cpu = time.perf_counter(), time.thread_time()
                if mode == "blocking":
                    training.save(folder, step, held.saved, schedulers, config, 2)
                else:
                    pending = training.save_in_background(folder, step, held.saved, schedulers,
                                                          config, 2, copies=copies)
                calls.append(time.perf_counter() - begin)
                cpus.append(time.thread_time() - cpu)
    if pending is not None:
        pending.wait()
    steps = args.rounds * args.every
    dist.barrier()
    return (time.perf_counter() - start) / steps, calls, cpus


def side_by_side(modes: tuple[str, ...], run, repeats: int, main: bool) -> dict[str, dict]:
    """Each mode's figures from `run(mode)` -> (seconds per step, how long each save call
    held the loop, the CPU of each call): a warm-up window of each (first-time costs out),
    then `repeats` rounds with the modes in turns, the order rotated every round. Per mode:
    median ms/step and ratio to the first mode (taken within each round, the slowest
    rank's times: a step ends when every rank's does), the ratios' quartiles, median ms
    held and CPU ms per save call. `main`: print each round."""
    for mode in modes:
        run(mode)
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    calls: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(repeats):
        seconds = {}
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            seconds[mode], held_for, cpu = run(mode)
            calls[mode] += held_for
            cpus[mode] += cpu
        every = torch.tensor([seconds[m] for m in modes], dtype=torch.float64)
        dist.all_reduce(every, op=dist.ReduceOp.MAX)
        for mode, s in zip(modes, every.tolist(), strict=True):
            times[mode].append(s)
            ratios[mode].append(s / every[0].item())
        if main:
            print(f"repeat {r + 1}: " + "  ".join(
                f"{m} {s * 1e3:.1f} ms ({s / every[0].item():.3f})"
                for m, s in zip(modes, every.tolist(), strict=True)), flush=True)
    return {m: {"ms": statistics.median(times[m]) * 1e3,
                "ratio": statistics.median(ratios[m]),
                "call_ms": statistics.median(calls[m]) * 1e3 if calls[m] else 0.0,
                "cpu_ms": statistics.median(cpus[m]) * 1e3 if cpus[m] else 0.0,
                "quartiles": statistics.quantiles(ratios[m], n=4)[::2]}
            for m in modes}


def print_rows(rows: dict[str, dict]) -> None:
    """`side_by_side`'s figures, a line per mode."""
    for m, r in rows.items():
        low, high = r["quartiles"]
        print(f"{m:>14}: {r['ms']:.1f} ms/step  ratio {r['ratio']:.3f} ({low:.3f}-{high:.3f})"
              f"  loop held per save {r['call_ms']:.0f} ms  its CPU {r['cpu_ms']:.0f} ms")


def heading(title: str, command: str) -> list[str]:
    """A results section's title and the command that made it."""
    return [f"## {title}", "", f"Command: `{command}`  "]


def machine(loads: tuple[float, float]) -> str:
    """The Machine: line of a results section, up to the model (`loads`: the load average
    before and after)."""
    return (f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, "
            f"gloo, 1 thread per rank; load average {loads[0]:.1f} before, {loads[1]:.1f} after "
            "(the machine shared with other work).")


def write_results(rows: dict, args: argparse.Namespace, world_size: int,
                  loads: tuple[float, float], state_mb: float) -> None:
    lines = [
        *heading("Background checkpoint saves (DataParallel step time, 2 ranks)",
                 f"dtrain run -n {world_size} benchmarks/background_save.py --repeats "
                 f"{args.repeats} --every {args.every} --rounds {args.rounds} --write"),
        machine(loads) + " Model: GPT 4 x 256 (3.2M parameters), AdamW, "
        f"{GPT['block_size']} tokens x 4 sequences per rank; {state_mb:.0f} MB of parameters "
        f"and optimizer state, half written by each rank. A save every {args.every} steps; "
        f"median of {args.repeats} repeats of {args.rounds * args.every} steps per mode, the "
        "ratio to no save taken within each repeat.",
        "",
        "| saves | ms/step | ratio to no save (quartiles) | loop held per save (ms) "
        "| CPU of that call (ms) |",
        "|---|---|---|---|---|",
    ]
    for mode in MODES:
        r = rows[mode]
        held, cpu = ("", "") if mode == "none" else (f"{r['call_ms']:.0f}", f"{r['cpu_ms']:.0f}")
        low, high = r["quartiles"]
        lines.append(f"| {mode} | {r['ms']:.1f} | **{r['ratio']:.3f}** ({low:.3f}-{high:.3f}) "
                     f"| {held} | {cpu} |")
    blocking, behind = rows["blocking"], rows["background"]
    lines += [
        "",
        "Target: a background save every k steps at most 5% slower than no save "
        "(ratio at most 1.05).",
        "",
        f"The loop waits {behind['call_ms']:.0f} ms per background save (copying the "
        f"rank's state to memory) against {blocking['call_ms']:.0f} ms per blocking save. "
        "The rest of a save (serializing, SHA-256, fsync: about "
        f"{blocking['cpu_ms'] - behind['cpu_ms']:.0f} ms of CPU per rank, the blocking call's "
        "less the copy) runs beside training at a lower priority: on this machine, whose "
        "2 cores the 2 ranks keep busy, that CPU still comes out of training's or the "
        "other work's share. The quartiles are the machine's noise (other jobs running): "
        "wider than the differences measured, so single repeats say little; the medians "
        "and the time the loop waits are the figures to read.",
    ]
    replace_section("background_save", lines)


def arguments(description: str, repeats: int) -> argparse.Namespace:
    """The command line of this benchmark and of those built on it (`description`: their
    first docstring line; `repeats`: the default)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--every", type=int, default=10, help="steps between saves")
    parser.add_argument("--rounds", type=int, default=1, help="saves per window")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    return parser.parse_args()


def main() -> None:
    args = arguments(__doc__.splitlines()[0], repeats=30)
    torch.set_num_threads(1)
    world = dtrain.init()
    loads = [os.getloadavg()[0]]
    folder = Path(tempfile.gettempdir()) / f"dtrain-background-save-{world.master_port}"
    held, schedulers, config, batch = build(world)
    step = 0

    def run(mode: str) -> tuple[float, list[float], list[float]]:
        nonlocal step
        step += args.rounds * args.every
        return window(mode, held, schedulers, config, folder, step - args.rounds * args.every,
                      args, batch)

    rows = side_by_side(MODES, run, args.repeats, world.is_main)
    loads.append(os.getloadavg()[0])
    pieces, _ = held.saved.state()
    state_mb = sum(p.values.numel() * p.values.element_size() for p in pieces) / 1e6
    state = torch.tensor([state_mb], dtype=torch.float64)
    dist.all_reduce(state)
    dist.barrier()
    if world.is_main:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"load average {loads[0]:.1f} before, {loads[1]:.1f} after; "
              f"state {state.item():.0f} MB")
        print_rows(rows)
        if args.write:
            write_results(rows, args, world.world_size, (loads[0], loads[1]), state.item())


if __name__ == "__main__":
    main()
