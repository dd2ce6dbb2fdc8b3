"""What copying checkpoints to another host costs a data-parallel training loop:
background saves on a shared folder (`checkpoint.copies = 0`) against background saves
where each host writes its own folder and sends a copy to the other (`replicate = 1`),
and no save, side by side in one run.

    dtrain run -n 2 benchmarks/replicated_save.py [--repeats 20 --every 10 --write]

The model, the loop and the windows are benchmarks/background_save.py's (a GPT 4 x 256,
AdamW, 2 gloo ranks on the CPU, a save after the first step of every `--every`, the last
one waited for inside the window); here each rank stands for a host of its own
(dtrain.checkpoint.copies.HostCopies with host = rank, a folder per rank), so with
replicate = 1 each save also sends each rank's two files to the other over the copies'
gloo group (loopback on one machine: the figure is the CPU and memory cost of the copy,
not a network's). Modes take turns, rotated every repeat; figures are medians over repeats,
ratios to no save taken within each repeat. Also: the bytes each rank sends per save.
With --write, rank 0 replaces this benchmark's section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from background_save import (
    arguments,
    build,
    heading,
    machine,
    print_rows,
    side_by_side,
    window,
)
from results_md import replace_section

import dtrain
from dtrain.checkpoint import atomic
from dtrain.checkpoint.copies import HostCopies

MODES = ("none", "replicate = 0", "replicate = 1")


def sent_per_save(folder: Path, rank: int) -> int:
    """The bytes rank `rank` sends per save with replicate = 1: its two files."""
    newest = folder / atomic.read_index(folder)[-1]["file"]
    return sum((newest / f"rank-{rank:05d}.{s}").stat().st_size for s in ("safetensors", "json"))


def write_results(rows: dict, args: argparse.Namespace, world_size: int,
                  loads: tuple[float, float], sent_mb: float) -> None:
    lines = [
        *heading("Checkpoint copies to other hosts (`checkpoint.copies`, background saves, "
                 "2 ranks)", f"dtrain run -n {world_size} benchmarks/replicated_save.py "
                 f"--repeats {args.repeats} --every {args.every} --write"),
        machine(loads) + " The model and loop of the section above; each rank "
        "stands for a host with its own folder, and with replicate = 1 sends its files to "
        f"the other: **{sent_mb:.1f} MB per rank per save** (its half of the parameters and "
        "optimizer state, and its description), over loopback. A background save every "
        f"{args.every} steps; median of {args.repeats} repeats of {args.every} steps per "
        "mode, the ratio to no save taken within each repeat.",
        "",
        "| saves | ms/step | ratio to no save (quartiles) | loop held per save (ms) |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        r = rows[mode]
        low, high = r["quartiles"]
        held = "" if mode == "none" else f"{r['call_ms']:.0f}"
        lines.append(f"| {mode} | {r['ms']:.1f} | **{r['ratio']:.3f}** ({low:.3f}-{high:.3f}) "
                     f"| {held} |")
    lines += [
        "",
        "The copy is sent by the save's thread after the rank's own files are written; "
        "the loop itself waits only for the state's copy to memory, as without copies. What "
        "the copies add (reading, hashing and sending each rank's files, the other rank "
        "hashing and writing them: twice the disk writes and hashing of a save) is CPU "
        "beside training, which on this machine's 2 busy cores comes out of training's "
        "share. The quartiles are the machine's noise; read the medians.",
    ]
    replace_section("replicated_save", lines)


def main() -> None:
    args = arguments(__doc__.splitlines()[0], repeats=20)
    args.rounds = 1  # one save per window, which the copies' figures assume
    torch.set_num_threads(1)
    world = dtrain.init()
    loads = [os.getloadavg()[0]]
    root = Path(tempfile.gettempdir()) / f"dtrain-replicated-save-{world.master_port}"
    folders = {"none": root / "none", "replicate = 0": root / "shared",
               "replicate = 1": root / f"host-{world.rank}"}
    copies = HostCopies.open(1, host=world.rank)
    held, schedulers, config, batch = build(world)

    step = 0

    def run(mode: str) -> tuple[float, list[float], list[float]]:
        nonlocal step
        step += args.every
        return window("none" if mode == "none" else "background", held, schedulers, config,
                      folders[mode], step - args.every, args, batch,
                      copies if mode == "replicate = 1" else None)

    rows = side_by_side(MODES, run, args.repeats, world.is_main)
    loads.append(os.getloadavg()[0])
    sent_mb = sent_per_save(folders["replicate = 1"], world.rank) / 1e6
    dist.barrier()
    if world.is_main:
        shutil.rmtree(root, ignore_errors=True)
        print(f"load average {loads[0]:.1f} before, {loads[1]:.1f} after; "
              f"{sent_mb:.1f} MB sent per rank per save with replicate = 1")
        print_rows(rows)
        if args.write:
            write_results(rows, args, world.world_size, (loads[0], loads[1]), sent_mb)


if __name__ == "__main__":
    main()
