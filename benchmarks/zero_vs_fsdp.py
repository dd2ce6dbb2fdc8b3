"""dtrain.ZeRO (stages 1-3) on the default GPT scaled up, against PyTorch FSDP2.

    dtrain run -n 2 benchmarks/zero_vs_fsdp.py --write

Three tables, all from one run on 2 ranks:
1. model-state bytes per rank, measured (tensor sizes, sampled as every block's forward
   starts, after backward and after the step; the largest) against the ZeRO paper's formulas
   adapted to what dtrain stores (p bytes per compute parameter; K = 16: fp32 master 4,
   Adam 8, fp32 gradient shard 4; in fp32 the master is the parameter shard itself);
2. bytes each rank sent per step, counted by dtrain.comm.traffic, against 2Ψp(N-1)/N
   (stages 1-2: reduce-scatter + all-gather) and 3Ψp(N-1)/N (stage 3: one more gather);
3. step time of ZeRO stage 3 and FSDP2 (`fully_shard` on each block and the root, same
   AdamW, fp32), taking turns in rounds; model-state bytes between steps of both.
"""

from __future__ import annotations

import argparse
import platform

import torch
from results_md import replace_section
from torch import nn

import dtrain
from dtrain import comm
from dtrain.comm.timing import time_turns
from dtrain.models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=6, n_head=8, n_embd=256, block_size=128)
PER_RANK = 8


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (PER_RANK, CONFIG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def zero_step(z: dtrain.ZeRO, batch, peak: list[int] | None = None) -> None:
    z.backward(z(*batch)[1].float())
    if peak is not None:
        peak.append(sum(z.state_bytes().values()))
    z.step()
    z.zero_grad()
    if peak is not None:
        peak.append(sum(z.state_bytes().values()))


def formula(stage: int, psi: int, n: int, p: int) -> int:
    """Model-state bytes per rank with p-byte parameters and gradients. K = 16 under mixed
    precision (fp32 master 4, Adam 8, fp32 gradient shard 4); in fp32 the parameter shard
    is the master, so K = 12 in stages 1-2 and stage 3 keeps 4 + 4 + 8 bytes per element."""
    k = 16 if p == 2 else 12
    if stage == 1:
        return 2 * p * psi + k * psi // n
    if stage == 2:
        return p * psi + k * psi // n
    return 16 * psi // n


def measure_stage(stage: int, mixed: str | None, batch, group) -> dict:
    z = dtrain.ZeRO(make_model(), adamw, stage=stage, group=group, mixed_precision=mixed)
    peak: list[int] = []
    for block in z.module.blocks:  # after ZeRO's own pre-hook: the block is gathered
        block.register_forward_pre_hook(lambda *_: peak.append(sum(z.state_bytes().values())))
    zero_step(z, batch)  # optimizer state exists from here on
    comm.traffic(group, reset=True)
    peak.clear()
    zero_step(z, batch, peak)
    sent = sum(comm.traffic(group, reset=True).values())
    return {"peak": max(peak), "sent": sent, "steady": sum(z.state_bytes().values())}


def fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for block in [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, adamw(model.parameters())


def fsdp_step(model, opt, batch) -> None:
    model(*batch)[1].backward()
    opt.step()
    opt.zero_grad()


def fsdp_bytes(model, opt) -> int:
    local = [p.to_local() for p in model.parameters()]
    params = sum(t.numel() * t.element_size() for t in local)
    state = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local")
                else t.numel() * t.element_size()
                for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    return params + state  # zero_grad freed the gradients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    world = dtrain.init()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world.world_size,))
    group = comm.resolve(None)
    n, batch = world.world_size, data(world.rank)
    psi = sum(p.numel() for p in make_model().parameters())

    rows = []
    for mixed, p in ((None, 4), ("bf16", 2)):
        for stage in (1, 2, 3):
            got = measure_stage(stage, mixed, batch, group)
            want = formula(stage, psi, n, p)
            volume = (2 if stage < 3 else 3) * psi * p * (n - 1) // n
            rows.append((mixed or "fp32", stage, got, want, volume))

    z = dtrain.ZeRO(make_model(), adamw, stage=3, group=group)
    model, opt = fsdp_model(mesh)
    candidates = {"zero3": lambda: zero_step(z, batch),
                  "fsdp2": lambda: fsdp_step(model, opt, batch)}
    for run in candidates.values():
        run()
    medians = time_turns(candidates, {name: args.rounds * args.steps for name in candidates},
                         args.rounds, group)
    z_bytes, f_bytes = sum(z.state_bytes().values()), fsdp_bytes(model, opt)

    if world.rank == 0:
        lines = section(rows, medians, z_bytes, f_bytes, psi, n, args)
        print("\n".join(lines))
        if args.write:
            replace_section("zero_vs_fsdp", lines)
    dtrain.shutdown()


def section(rows, medians, z_bytes, f_bytes, psi, n, args) -> list[str]:
    mb = 1 / 2**20
    lines = [
        "## ZeRO stages vs the paper's formulas, and vs FSDP2",
        "",
        f"Command: `dtrain run -n {n} benchmarks/zero_vs_fsdp.py --rounds {args.rounds} "
        f"--steps {args.steps} --write`  ",
        f"Machine: {torch.get_num_threads()} thread(s) per rank, {platform.machine()}, torch "
        f"{torch.__version__}; model: GPT n_layer={CONFIG.n_layer}, n_embd={CONFIG.n_embd} "
        f"(Ψ = {psi / 1e6:.2f}M parameters), {PER_RANK} x {CONFIG.block_size} tokens per rank, "
        "AdamW.",
        "",
        "| dtype | stage | model state, peak (MiB) | formula (MiB) | peak / formula "
        "| between steps (MiB) | sent per step (MiB) | 2Ψ or 3Ψ x p(N-1)/N (MiB) | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, stage, got, want, volume in rows:
        lines.append(
            f"| {dtype} | {stage} | {got['peak'] * mb:.2f} | {want * mb:.2f} | "
            f"{got['peak'] / want:.2f} | {got['steady'] * mb:.2f} | {got['sent'] * mb:.2f} | "
            f"{volume * mb:.2f} | {got['sent'] / volume:.2f} |")
    ratio = medians["zero3"] / medians["fsdp2"]
    lines += [
        "",
        "Formulas per rank, K = 16 (fp32 master 4 + Adam 8 + fp32 gradient shard 4): "
        "stage 1 2pΨ + KΨ/N, stage 2 pΨ + KΨ/N, stage 3 KΨ/N; in fp32 the parameter shard "
        "is the master, so K = 12 in stages 1-2 and stage 3 is 16Ψ/N. The paper's "
        "(K = 12, bf16 gradient shard) give 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N. The peak adds "
        "what is in flight: gathered units (stage 3) and unsharded gradients of units not "
        "yet reduced.",
        "",
        "| ZeRO-3 ms/step | FSDP2 ms/step | ratio (ZeRO-3 / FSDP2) | model state between steps, "
        "ZeRO-3 / FSDP2 (MiB) |",
        "|---|---|---|---|",
        f"| {medians['zero3'] * 1e3:.1f} | {medians['fsdp2'] * 1e3:.1f} | **{ratio:.2f}** | "
        f"{z_bytes * mb:.2f} / {f_bytes * mb:.2f} |",
    ]
    return lines


if __name__ == "__main__":
    main()
