"""Optimizer offload in ZeRO: the optimizer state the compute device keeps, and the step
time, without and with `offload_device="cpu"` (`[memory] offload = "optimizer"`).

    python benchmarks/offload.py [--rounds 10 --steps 3 --stage 2 --write]

One process (a ZeRO group of one: every shard is this rank's), dtrain's Llama in the
llama-tiny shape (vocabulary 256; `--layers`, `--width` to grow it), 8 sequences x 128
tokens, AdamW, clip 1.0, on the GPU when there is one, else the CPU; fp32 and bf16 mixed
precision (fp32 masters), each without and with offload.

Device bytes are counted from the tensors ZeRO registers on the compute side
(`ZeRO.state_bytes()`: "optimizer", the optimizer's per-element state, and "master", the
master shards that are not views of the parameters; with offload both move to the
"host_*" entries). On a CPU the host and the "device" are the same memory: the figure
says what a GPU would be spared, and the time what the extra copies and per-unit steps
cost there. On a GPU the table adds torch.cuda.memory_allocated() after a step (all live
CUDA tensors the model and its wrapper added: parameters, gradients, optimizer state).

Time: a step is forward, backward, clip, ZeRO's step, zero_grad; "step()" is ZeRO's step
alone (on the GPU synchronized before and after). The two settings take turns in rounds,
their order reversed every round, each figure the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from results_md import replace_section, run_summary

import dtrain
from dtrain import models
from dtrain.config import OptimizerConfig
from dtrain.optim import build_optimizer

MiB = 2**20
SETTINGS = {"none": None, "optimizer": "cpu"}


def build(args: argparse.Namespace, device: torch.device, mixed: str | None,
          offload: str | None) -> dtrain.ZeRO:
    sizes = {k: v for k, v in (("n_layer", args.layers), ("n_embd", args.width)) if v}
    shape = models.resolve(models.ModelConfig(arch="llama", preset="llama-tiny", **sizes), 256)
    torch.manual_seed(0)
    model = models.build(shape).to(device)
    return dtrain.ZeRO(model, lambda p: build_optimizer(p, OptimizerConfig()),
                       stage=args.stage, mixed_precision=mixed, offload_device=offload)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(z: dtrain.ZeRO, data: tuple[torch.Tensor, torch.Tensor], device: torch.device,
            step_times: list[float]):
    def step() -> None:
        loss = z(*data)[1]
        z.backward(loss)
        z.clip_grad_norm_(1.0)
        sync(device)
        start = time.perf_counter()
        z.step()
        sync(device)
        step_times.append(time.perf_counter() - start)
        z.zero_grad()
    return step


def compare(mixed: str | None, args: argparse.Namespace, device: torch.device) -> dict:
    ids = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(0))
    data = (ids[:, :-1].to(device), ids[:, 1:].to(device))
    out: dict[str, dict] = {}
    steps, inner = {}, {}
    for name, offload in SETTINGS.items():
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        z = build(args, device, mixed, offload)
        inner[name] = []
        steps[name] = step_fn(z, data, device, inner[name])
        steps[name]()  # the optimizer state exists from here on
        sync(device)
        out[name] = {"bytes": z.state_bytes(),
                     "cuda": torch.cuda.memory_allocated(device) - before
                     if device.type == "cuda" else None,
                     "params": sum(p.numel() for p in z.module.parameters())}
        del z
    # rebuild both so that they live side by side for the timing
    inner = {name: [] for name in SETTINGS}
    steps = {name: step_fn(build(args, device, mixed, offload), data, device, inner[name])
             for name, offload in SETTINGS.items()}
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for step in steps.values():
        step()
    for name in SETTINGS:
        inner[name].clear()
    for r in range(args.rounds):
        for name in list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS)):
            sync(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[name]()
            sync(device)
            times[name].append((time.perf_counter() - start) / args.steps)
    for name in SETTINGS:
        out[name]["ms"] = statistics.median(times[name]) * 1e3
        out[name]["step_ms"] = statistics.median(inner[name]) * 1e3
    return {"mixed": mixed or "fp32", **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="", help="also write the figures here")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    load = os.getloadavg()[0]
    started = time.time()
    results = [compare(mixed, args, device) for mixed in (None, "bf16")]
    summary = run_summary(load, started, device=str(device),
                          gpu=torch.cuda.get_device_name() if device.type == "cuda" else "")
    lines = section(results, summary, args)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "summary": summary}, f, indent=1)
    if args.write:
        replace_section("offload_gpu" if summary["gpu"] else "offload", lines)


def section(results: list[dict], summary: dict, args: argparse.Namespace) -> list[str]:
    flags = "".join(f" --{k} {getattr(args, k)}" for k in ("layers", "width")
                    if getattr(args, k) is not None)
    flags += f" --threads {args.threads}" if args.threads != 1 else ""
    where = (f"GPU {summary['gpu']}" if summary["gpu"] else
             f"CPU ({os.cpu_count()} cores, {platform.machine()})")
    shape = "llama-tiny shape" + (f", {args.layers or 4} layers x {args.width or 128}"
                                  if args.layers or args.width else "")
    params = results[0]["none"]["params"]
    lines = [
        f"## Optimizer offload (ZeRO-{args.stage}, one process, {where})",
        "",
        f"Command: `python benchmarks/offload.py --rounds {args.rounds} --steps {args.steps} "
        f"--stage {args.stage}{flags} --write`  ",
        f"Date: {summary['date']}. torch {torch.__version__}; load average "
        f"{summary['load_before']:.1f} before, {summary['load_after']:.1f} after (shared with "
        f"other work); {summary['minutes']:.1f} min in all.  ",
        f"Model: dtrain's Llama, {shape} ({params / 1e6:.2f}M parameters), 8 x 128 tokens, "
        f"AdamW, clip 1.0; {args.threads} host thread(s). Device bytes: what "
        "ZeRO.state_bytes() counts on the compute side for the optimizer (its per-element "
        "state, and master shards that are "
        "not views of the parameters); host: the same moved to host memory (with the host's "
        "gradient buffers). Time: median of rounds, the two settings in turns.",
        "",
        "| precision | offload | device optimizer + master (MiB) | host (MiB) | "
        + ("CUDA allocated (MiB) | " if summary["gpu"] else "")
        + "ms/step | step() ms | time / none |",
        "|---|---|---|---|---|---|---|" + ("---|" if summary["gpu"] else ""),
    ]
    for r in results:
        for name in SETTINGS:
            b = r[name]["bytes"]
            device = b["optimizer"] + b["master"]
            host = sum(v for k, v in b.items() if k.startswith("host_"))
            cuda = f"{r[name]['cuda'] / MiB:.1f} | " if summary["gpu"] else ""
            lines.append(f"| {r['mixed']} | {name} | {device / MiB:.2f} | {host / MiB:.2f} | "
                         f"{cuda}{r[name]['ms']:.1f} | {r[name]['step_ms']:.1f} | "
                         f"{r[name]['ms'] / r['none']['ms']:.2f} |")
    return lines


if __name__ == "__main__":
    main()
