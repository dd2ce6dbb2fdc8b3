"""dtrain.tensor_parallel on a GPT block against PyTorch's DTensor tensor parallelism, and a
model that trains only when split.

    dtrain run -n 2 benchmarks/tp_vs_dtensor.py --write

Two tables from one run on 2 ranks:
1. step time (forward, backward, AdamW) of one GPT block split tp=2 by dtrain
   (`parallelize` with the GPT plan) and by DTensor (`parallelize_module` with
   ColwiseParallel on QKV and fc, RowwiseParallel on the projections), taking turns in
   rounds; the fused QKV weight is permuted for DTensor so its contiguous split gives each
   rank whole Q, K and V heads, and both are checked to compute the same output;
2. memory: each rank's data segment is capped (RLIMIT_DATA) at what the split model needs;
   the whole model fails to train under that cap, the tp=2 model trains. Model state
   (parameters, gradients, AdamW) and peak resident memory per rank for both.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import platform
import resource
from pathlib import Path

import torch
import torch.distributed as dist
from results_md import replace_section

import dtrain
from dtrain import comm
from dtrain import tensor_parallel as tp
from dtrain.comm.timing import time_turns
from dtrain.models.gpt import GPT, Block, GPTConfig

BLOCK = GPTConfig(n_layer=1, n_head=8, n_embd=512, block_size=128)
BIG = GPTConfig(n_layer=6, n_head=12, n_embd=768, block_size=64)
MiB = 2**20


def block_plan() -> dict:
    return {k.removeprefix("blocks.*."): v for k, v in tp.gpt_plan(BLOCK).items()
            if k.startswith("blocks.")}


def dtensor_block(block: Block, mesh) -> Block:
    """DTensor TP on the same block. ColwiseParallel cuts QKV's rows contiguously, so its
    rows are first reordered [q0 k0 v0 | q1 k1 v1] to give rank r whole heads of each."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = mesh.size()
    with torch.no_grad():
        for name in ("weight", "bias"):
            t = getattr(block.attn.qkv, name)
            parts = [p.chunk(n) for p in t.chunk(3)]
            t.copy_(torch.cat([parts[j][r] for r in range(n) for j in range(3)]))
    return parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(),
                                            "attn.proj": RowwiseParallel(),
                                            "mlp.fc": ColwiseParallel(),
                                            "mlp.proj": RowwiseParallel()})


def step(block: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    out.pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return out


def time_blocks(args: argparse.Namespace) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    base = Block(BLOCK)
    x = torch.randn(args.batch, BLOCK.block_size, BLOCK.n_embd,
                    generator=torch.Generator().manual_seed(1))
    ours = {alg: tp.parallelize(copy.deepcopy(base), block_plan(), algorithm=alg)
            for alg in ("auto", "native")}
    theirs = dtensor_block(copy.deepcopy(base), init_device_mesh("cpu", (dist.get_world_size(),)))
    with torch.no_grad():
        torch.testing.assert_close(ours["auto"](x), theirs(x))
        torch.testing.assert_close(ours["auto"](x), base(x), rtol=1e-4, atol=1e-5)
    candidates = {f"dtrain ({alg})": (m, torch.optim.AdamW(m.parameters(), lr=1e-4))
                  for alg, m in ours.items()}
    candidates["DTensor"] = (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-4))
    for model, opt in candidates.values():
        step(model, opt, x)
    calls = {name: (lambda m=model, o=opt: step(m, o, x)) for name, (model, opt) in
             candidates.items()}
    medians = time_turns(calls, {name: args.rounds * args.steps for name in calls},
                         args.rounds, comm.resolve(None))
    return medians


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(t for s in opt.state.values() for t in s.values() if t.dim() > 0)]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def train_big(split: bool, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Build the big GPT (split tp=2 or whole), take two AdamW steps; state and peak RSS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed memory back, so RSS counts from here
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak-RSS count
    rss0 = _status("VmRSS")
    torch.manual_seed(0)
    model = GPT(BIG)
    if split:
        tp.parallelize(model, tp.gpt_plan(BIG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients: count them
    state = _state_bytes(model, opt)
    return {"state": state, "peak": _status("VmHWM") - rss0}


def memory(args: argparse.Namespace) -> dict:
    """Cap the data segment at the split model's needs; only the split model trains."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, BIG.vocab_size, (2, BIG.block_size), generator=g)
    y = torch.roll(x, -1, dims=1)
    psi = sum(p.numel() for p in GPT(BIG).parameters())
    cap = int(args.cap_per_param * psi)  # bytes per parameter of the whole model
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    gc.collect()
    resource.setrlimit(resource.RLIMIT_DATA, (_status("VmData") + cap, hard))
    try:
        whole_error = ""
        if dist.get_rank() == 0:  # alone: a collective-free model
            try:
                train_big(False, x, y)
                whole_error = "trained"
            except (RuntimeError, MemoryError) as exc:
                message = str(exc)
                whole_error = ("out of memory" if "allocate memory" in message
                               else message.splitlines()[0][:80])
            gc.collect()
        dist.barrier()
        split = train_big(True, x, y)
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    whole = train_big(False, x, y) if dist.get_rank() == 0 else None  # uncapped, to measure
    return {"psi": psi, "cap": cap, "whole_error": whole_error, "split": split, "whole": whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cap-per-param", type=float, default=11.0,
                        help="data-segment cap per rank, in bytes per whole-model parameter")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    world = dtrain.init()
    if world.world_size != 2:
        raise SystemExit("run with 2 ranks: dtrain run -n 2 benchmarks/tp_vs_dtensor.py")
    medians = time_blocks(args)
    mem = memory(args)
    if world.rank == 0:
        lines = section(medians, mem, args)
        print("\n".join(lines))
        if args.write:
            replace_section("tp_vs_dtensor", lines)
    dtrain.shutdown()


def section(medians: dict, mem: dict, args: argparse.Namespace) -> list[str]:
    base = medians["DTensor"]
    lines = [
        "## Tensor parallelism vs DTensor, and a model that trains only when split (2 ranks)",
        "",
        f"Command: `dtrain run -n 2 benchmarks/tp_vs_dtensor.py --rounds {args.rounds} "
        f"--steps {args.steps} --write`  ",
        f"Machine: {torch.get_num_threads()} thread(s) per rank, {platform.machine()}, torch "
        f"{torch.__version__}, gloo. Block: GPT n_embd={BLOCK.n_embd}, {BLOCK.n_head} heads, "
        f"input {args.batch} x {BLOCK.block_size} tokens; step = forward, backward of "
        "mean(out^2), AdamW; median of rounds, slowest rank. Outputs of both checked equal.",
        "",
        "| split by | ms/step | ratio to DTensor |",
        "|---|---|---|",
    ]
    for name, value in medians.items():
        lines.append(f"| {name} | {value * 1e3:.1f} | **{value / base:.2f}** |")
    split, whole = mem["split"], mem["whole"]
    fits = "yes" if mem["whole_error"] == "trained" else f"no: {mem['whole_error']}"
    lines += [
        "",
        f"GPT n_layer={BIG.n_layer}, n_embd={BIG.n_embd}, {BIG.n_head} heads "
        f"(Ψ = {mem['psi'] / 1e6:.1f}M parameters), AdamW, 2 x {BIG.block_size} tokens; each "
        f"rank's data segment capped at {mem['cap'] / MiB:.0f} MiB "
        f"({args.cap_per_param:g} bytes per parameter) above its start.",
        "",
        "| model | trains under the cap | model state per rank (MiB) | peak RSS per rank "
        "(MiB) |",
        "|---|---|---|---|",
        f"| whole (1 rank) | {fits} | {whole['state'] / MiB:.0f} | "
        f"{whole['peak'] / MiB:.0f} (uncapped) |",
        f"| tp=2 | yes | {split['state'] / MiB:.0f} ({split['state'] / whole['state']:.2f}x) | "
        f"{split['peak'] / MiB:.0f} ({split['peak'] / whole['peak']:.2f}x) |",
        "",
        "Model state = parameters + gradients + AdamW moments (16 bytes per parameter held). "
        "The split model holds 1/2 of every split weight plus the replicated LayerNorms, "
        "position embedding and row-parallel biases; its peak includes building the whole "
        "model once before `parallelize` keeps this rank's half.",
    ]
    return lines


if __name__ == "__main__":
    main()
