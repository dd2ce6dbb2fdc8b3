"""Muon against AdamW at equal tokens, and what distributed Muon adds to a ZeRO-2 step.

    python benchmarks/muon.py [--steps 400 --sweep-steps 100 --write]

Quality: the built-in job (a 4-layer GPT of width 128 on the stdlib's bytes) and a 4-layer
Llama (preset llama-tiny), each trained by `dtrain train` on 2 ranks with AdamW and with
Muon (`[optimizer] name = "muon"`: Muon on the blocks' matrices, AdamW on the rest), the
same data, batches, schedule and steps: equal tokens. Each optimizer's learning rate is
tuned first by a small sweep: `--sweep-steps` steps at each rate of `--lrs` (a factor of
about 3 apart), the rate with the lowest held-out loss kept; Muon's sweep moves `lr`,
which with muon_adjust_lr = "match_rms_adamw" is both halves' rate (Moonlight's setting,
where AdamW's rate carries over), so both optimizers get the same sweep. Then the full
run at each kept rate: the training loss (mean of the last 20 steps), the held-out loss.

Step time: the built-in job on 4 ranks under ZeRO-2 with AdamW, with Muon (each matrix
sent to its owner rank, orthogonalized there, and sent back), and under DataParallel with
Muon (every rank orthogonalizes every matrix: nothing sent), in alternating rounds; the
median step time of each, and Muon's extra over AdamW. Timing wants a quiet machine.

Tiny check (seconds): `--steps 4 --sweep-steps 2 --lrs 3e-3 --rounds 1 --timing-steps 3`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_md import replace_section

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "GPT, 4 layers (the built-in job)": [],
    "Llama, 4 layers (llama-tiny)": ["model.arch='llama'", "model.preset='llama-tiny'"],
}
OPTIMIZERS = {"AdamW": ["optimizer.name='adamw'"], "Muon": ["optimizer.name='muon'"]}
TIMED = {
    "ZeRO-2, AdamW": ["parallel.zero=2", "optimizer.name='adamw'"],
    "ZeRO-2, Muon": ["parallel.zero=2", "optimizer.name='muon'"],
    "DataParallel, Muon": ["optimizer.name='muon'"],
}


def train(folder: Path, ranks: int, steps: int, overrides: list[str]) -> list[dict]:
    """One `dtrain train` run of the built-in job with `overrides`: its metrics rows."""
    out = folder / f"run-{len(list(folder.glob('run-*')))}"
    metrics = out.with_suffix(".jsonl")
    sets = [*overrides, f"train.steps={steps}", f"train.out_dir='{out}'",
            "logging.sample_tokens=0", f"train.eval_every={steps}"]
    command = [sys.executable, "-m", "dtrain.cli", "train", "-n", str(ranks),
               *[arg for s in sets for arg in ("--set", s)], "--metrics", str(metrics)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        raise SystemExit(f"dtrain train {' '.join(sets)} failed:\n{result.stdout}"
                         f"{result.stderr}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def held_out(rows: list[dict]) -> float:
    return [r["eval_loss"] for r in rows if "eval_loss" in r][-1]


def quality(folder: Path, model: list[str], optimizer: list[str], args: argparse.Namespace
            ) -> dict:
    """The sweep's held-out loss at each rate, the kept rate, and the full run's losses."""
    swept = {lr: held_out(train(folder, 2, args.sweep_steps,
                                [*model, *optimizer, f"optimizer.lr={lr}"]))
             for lr in args.lrs}
    best = min(swept, key=lambda lr: swept[lr])
    rows = train(folder, 2, args.steps, [*model, *optimizer, f"optimizer.lr={best}"])
    losses = [r["loss"] for r in rows if "loss" in r]
    return {"swept": swept, "lr": best, "loss": statistics.mean(losses[-20:]),
            "eval": held_out(rows)}


def step_times(folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """The median step time (seconds) of each TIMED layout on 4 ranks, over alternating
    rounds (the first steps of each run left out: warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in TIMED}
    for _ in range(args.rounds):
        for name, overrides in TIMED.items():
            rows = train(folder, 4, args.timing_steps, overrides)
            steps = [r["step_time_s"] for r in rows if "step_time_s" in r]
            times[name] += steps[min(len(steps) - 1, 5):]
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sweep-steps", type=int, default=100)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timing-steps", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results = {(m, o): quality(folder, model, optimizer, args)
                   for m, model in MODELS.items() for o, optimizer in OPTIMIZERS.items()}
        timed = step_times(folder, args)
    for (m, o), r in results.items():
        swept = ", ".join(f"{lr:g}: {loss:.4f}" for lr, loss in r["swept"].items())
        print(f"{m}, {o}: lr {r['lr']:g} (sweep {swept}); last-20 loss {r['loss']:.4f}, "
              f"held-out {r['eval']:.4f}")
    base = timed["ZeRO-2, AdamW"]
    for name, t in timed.items():
        print(f"{name}: {t * 1000:.1f} ms a step ({t / base:.2f}x ZeRO-2 AdamW)")
    if args.write:
        write(results, timed, args)


def write(results: dict, timed: dict[str, float], args: argparse.Namespace) -> None:
    base = timed["ZeRO-2, AdamW"]
    lines = [
        "## Muon vs AdamW at equal tokens, and distributed Muon's step time (ZeRO-2, 4 ranks)",
        "",
        f"Command: `python benchmarks/muon.py --steps {args.steps} --sweep-steps "
        f"{args.sweep_steps} --lrs {' '.join(f'{lr:g}' for lr in args.lrs)} --rounds "
        f"{args.rounds} --timing-steps {args.timing_steps} --write`  ",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, gloo. Quality on 2 ranks: "
        f"the built-in job's data, batch and cosine schedule, {args.steps} steps for every "
        f"run (equal tokens); each optimizer's rate the best held-out loss of a "
        f"{args.sweep_steps}-step sweep.",
        "",
        "| model | optimizer | lr (sweep: held-out loss) | loss (mean of the last 20 steps) "
        "| held-out loss |",
        "|---|---|---|---|---|",
        *[f"| {m} | {o} | {r['lr']:g} ("
          + ", ".join(f"{lr:g}: {loss:.3f}" for lr, loss in r["swept"].items())
          + f") | {r['loss']:.4f} | {r['eval']:.4f} |" for (m, o), r in results.items()],
        "",
        *edges(results),
        "Step time of the built-in job on 4 ranks (median over "
        f"{args.rounds} alternating rounds of {args.timing_steps} steps, the first 5 of each "
        "left out):",
        "",
        "| layout, optimizer | step (ms) | vs ZeRO-2 AdamW |",
        "|---|---|---|",
        *[f"| {name} | {t * 1000:.1f} | {t / base:.2f}x |" for name, t in timed.items()],
        "",
        "ZeRO-2 with Muon adds to AdamW's step the Newton-Schulz iterations (about 1/4 of "
        "the matrices on each rank) and two all-to-alls per unit holding matrices (each "
        "piece to its matrix's owner and back, in bfloat16); DataParallel with Muon has "
        "every rank orthogonalize every matrix and sends nothing more. Load average at the "
        f"end: {os.getloadavg()[0]:.1f}.",
    ]
    replace_section("muon", lines)


def edges(results: dict) -> list[str]:
    """A line for each run whose kept rate is the sweep's largest or smallest: its best may
    lie beyond the sweep, and its comparison is then a lower bound on what it can do."""
    at_edge = [f"{m}, {o} ({r['lr']:g})" for (m, o), r in results.items()
               if len(r["swept"]) > 1 and r["lr"] in (min(r["swept"]), max(r["swept"]))]
    if not at_edge:
        return []
    return ["At the sweep's edge (their best rate may lie beyond it, so each is a lower "
            f"bound on what that optimizer reaches here): {'; '.join(at_edge)}.", ""]


if __name__ == "__main__":
    main()
