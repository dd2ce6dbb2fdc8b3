"""One run of benchmarks/hsdp.py, on each of 4 ranks under `dtrain run`.

    dtrain run -n 4 benchmarks/hsdp_worker.py speed --steps 5 --out speed.json
    dtrain run -n 4 benchmarks/hsdp_worker.py quality --steps 200 --out quality.json

speed: every variant below built side by side, on the same GPT (SPEED_MODEL), the same
batch on each rank (zero_vs_fsdp's: 8 x 128 tokens) and the same AdamW, in fp32 or under
bf16 mixed precision (`--precision`):

    zero3           dtrain.ZeRO stage 3 over all 4 ranks
    hsdp            dtrain.ZeRO stage 3 over a host's 2 ranks (dp_shard), each gradient
                    shard averaged across the 2 hosts (replicate_group=dp_replicate)
    fsdp2_hsdp      PyTorch FSDP2: `fully_shard` on each block and the root over a 2 x 2
                    device mesh ("replicate", "shard"): HSDP
    fsdp2           FSDP2 over a 1-D mesh of all 4 ranks
    zero3_int8      zero3 with its weight gathers and gradient reduce-scatters in int8
                    (gather_dtype, reduce_dtype: ZeRO++'s qwZ and qgZ)
    zero3_bf16      zero3 with both in bf16 (fp32 only: under bf16 mixed precision this
                    is zero3 itself)

After one warm-up step each, they take turns (dtrain.comm.timing.time_turns: one step of
each per round, `--steps` rounds; the median over rounds of the slowest rank's time).
Then each makes `--count-steps` more steps with the counters around them: the bytes each
rank handed to collectives on each of its groups (dtrain.comm.traffic; FSDP2's go through
torch's own and are not seen), and the bytes each host's device sent (its namespace's
/proc/net/dev, read by the host's first rank: IP packets, headers, the barriers and TCP
acknowledgements included) when GLOO_SOCKET_IFNAME names one (the emulated hosts set it).

quality: the default job's GPT, data, AdamW and learning-rate schedule for `--steps` steps
of the global batch (32), ZeRO stage 3 over the 4 ranks under bf16 mixed precision, once
with the compute dtype on the wire, once with int8 gathers and reduce-scatters, and once
with fp8 gathers where the device computes in fp8 (`dtrain.comm.check_wire_dtype`); no
gradient clip (the default job's is not ZeRO's to apply here). Each step's training loss
(the mean over ranks) and the held-out loss every `--eval-every` steps, both in fp32 from
the bf16 logits.

Rank 0 writes the JSON `--out`; variants that cannot run here are listed under "skipped"
with the reason (e.g. a dtrain without ZeRO's gather_dtype).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from zero_vs_fsdp import PER_RANK, adamw, data, fsdp_step, zero_step

import dtrain
from dtrain import comm
from dtrain.comm.timing import time_turns
from dtrain.config import Config
from dtrain.data import batches, open_data
from dtrain.errors import ConfigError
from dtrain.models import build, resolve
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.optim import build_optimizer, lr_factor

SPEED_MODEL = GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=128)
"""zero_vs_fsdp's GPT with 4 blocks instead of 6 (3.2M parameters): a fp32 ZeRO-3 step
sends about 40 MB across hosts, some 3 s at 100 Mbit/s."""
SPEED_VARIANTS = ("zero3", "hsdp", "fsdp2_hsdp", "fsdp2", "zero3_int8", "zero3_bf16")
QUALITY_VARIANTS = ("bf16", "int8", "fp8_gather")
WIRES = {"zero3_int8": ("int8", "int8"), "zero3_bf16": ("bf16", "bf16"),
         "bf16": (None, None), "int8": ("int8", "int8"), "fp8_gather": ("fp8", None)}
"""The (gather_dtype, reduce_dtype) of each variant; None: the compute dtype."""

FSDP2_MESHES = {"fsdp2_hsdp": ((2, 2), ("replicate", "shard")), "fsdp2": ((4,), ("shard",))}
"""Each FSDP2 variant's device mesh: its shape and its dimensions' names."""

Step = Callable[[], None]


def quantized_wires() -> bool:
    """Whether this dtrain's ZeRO takes gather_dtype and reduce_dtype."""
    return {"gather_dtype", "reduce_dtype"} <= set(inspect.signature(dtrain.ZeRO).parameters)


def unavailable(variant: str, device: torch.device, bf16: bool) -> str | None:
    """Why `variant` cannot run here, or None."""
    gather = WIRES.get(variant, (None, None))[0]
    if variant == "zero3_bf16" and bf16:
        return "under bf16 mixed precision the wire is bf16 already: zero3"
    if gather == "fp8":
        try:
            comm.check_wire_dtype(gather, device, "gather_dtype")
        except ConfigError as exc:
            return str(exc)
    if wire_options(variant) and not quantized_wires():
        return "this dtrain's ZeRO has no gather_dtype/reduce_dtype yet"
    return None


def wire_options(variant: str) -> dict[str, str]:
    gather, reduce = WIRES.get(variant, (None, None))
    return {k: v for k, v in (("gather_dtype", gather), ("reduce_dtype", reduce)) if v}


def speed_model() -> GPT:
    torch.manual_seed(0)
    return GPT(SPEED_MODEL)


def fsdp2_model(mesh, bf16: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 over `mesh` (1-D: fully sharded; 2-D ("replicate", "shard"): HSDP), on each
    block and then the root, as torchtitan applies it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
        if bf16 else MixedPrecisionPolicy()
    model = speed_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, adamw(model.parameters())


def speed_variant(name: str, mesh: dtrain.Mesh, bf16: bool, batch
                  ) -> tuple[Step, dict[str, comm.GroupLike]]:
    """A step of variant `name`, and the groups (by what they span) whose bytes count."""
    mixed = "bf16" if bf16 else None
    if name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh

        shape, dims = FSDP2_MESHES[name]
        model, opt = fsdp2_model(init_device_mesh("cpu", shape, mesh_dim_names=dims), bf16)
        return lambda: fsdp_step(model, opt, batch), {}
    if name == "hsdp":
        inside, across = mesh.group("dp_shard"), mesh.group("dp_replicate")
        z = dtrain.ZeRO(speed_model(), adamw, stage=3, group=inside, replicate_group=across,
                        mixed_precision=mixed)
        return lambda: zero_step(z, batch), {"in host": inside, "across hosts": across}
    everyone = mesh.group("dp")
    z = dtrain.ZeRO(speed_model(), adamw, stage=3, group=everyone, mixed_precision=mixed,
                    **wire_options(name))
    return lambda: zero_step(z, batch), {"all 4": everyone}


def device_tx_bytes(device: str) -> int:
    """Bytes `device` has sent, from this network namespace's /proc/net/dev."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, fields = line.split(":", 1)
        if name.strip() == device:
            return int(fields.split()[8])  # receive has 8 fields, then transmit bytes
    raise SystemExit(f"no device {device} in this namespace's /proc/net/dev")


def counted(step: Step, groups: dict[str, comm.GroupLike], steps: int, world: dtrain.World
            ) -> tuple[dict[str, dict[str, float]], list[float] | None]:
    """Per step: the bytes this rank handed to collectives on each of `groups`, by
    collective, and the bytes each host's device sent (None on loopback)."""
    device = os.environ.get("GLOO_SOCKET_IFNAME", "")
    for g in groups.values():
        comm.traffic(g, reset=True)
    comm.barrier()
    before = device_tx_bytes(device) if device and world.local_rank == 0 else 0
    for _ in range(steps):
        step()
    comm.barrier()
    after = device_tx_bytes(device) if device and world.local_rank == 0 else 0
    traffic = {label: {op: sent / steps for op, sent in comm.traffic(g, reset=True).items()}
               for label, g in groups.items()}
    hosts = world.world_size // world.local_world_size
    sent = torch.zeros(hosts, dtype=torch.float64)
    sent[world.node_rank] = (after - before) / steps if world.local_rank == 0 else 0.0
    comm.all_reduce(sent, algorithm="native")
    return traffic, sent.tolist() if device else None


def speed(args: argparse.Namespace, world: dtrain.World) -> dict:
    mesh = dtrain.Mesh(dp_replicate=2, dp_shard=2)
    bf16 = args.precision == "bf16"
    batch = data(world.rank)
    skipped: dict[str, str] = {}
    steps: dict[str, Step] = {}
    groups: dict[str, dict[str, comm.GroupLike]] = {}
    for name in args.variants:
        if reason := unavailable(name, world.device, bf16):
            skipped[name] = reason
        else:
            steps[name], groups[name] = speed_variant(name, mesh, bf16, batch)
    say_skipped(skipped, world)
    for step in steps.values():  # warm-up: optimizer state, gathers' buffers
        step()
    medians = time_turns(steps, dict.fromkeys(steps, args.steps), args.steps,
                         comm.resolve(None))
    results = {}
    for name, step in steps.items():
        traffic, link = counted(step, groups[name], args.count_steps, world)
        results[name] = {"step_s": medians[name], "traffic": traffic, "link_tx": link}
    return {"variants": results, "skipped": skipped,
            "parameters": sum(p.numel() for p in speed_model().parameters()),
            "model": {"n_layer": SPEED_MODEL.n_layer, "n_embd": SPEED_MODEL.n_embd,
                      "block_size": SPEED_MODEL.block_size},
            "tokens_per_rank": PER_RANK * SPEED_MODEL.block_size}


def quality_run(variant: str, args: argparse.Namespace, world: dtrain.World) -> dict:
    """`variant` trained `args.steps` steps from the same start on the same batches."""
    config = Config()
    tc, mc = config.train, config.model
    source = open_data("", block_size=mc.block_size, max_bytes=config.data.max_bytes)
    torch.manual_seed(tc.seed)
    model = build(resolve(mc, source.vocab_size))
    parameters = sum(p.numel() for p in model.parameters())
    z = dtrain.ZeRO(model, lambda _: build_optimizer(model.parameters(), config.optimizer),
                    stage=3, mixed_precision="bf16", **wire_options(variant))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        z.optimizer, lambda s: lr_factor(s, args.steps, config.optimizer))
    n = world.world_size
    stream = batches(source.train, tc.batch_size, n, world.rank, tc.seed, shuffle=True)
    held_out = [b for _, b in zip(range(args.eval_batches),
                                  batches(source.val, tc.batch_size, n, world.rank, 0,
                                          shuffle=False), strict=False)]
    losses, evals = [], []
    begin = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(stream)
        logits, loss = z(x, y)
        z.backward(loss.float())
        z.step()
        z.zero_grad()
        schedule.step()
        mean = comm.all_reduce(fp32_loss(logits.detach(), y).reshape(1), op="avg")
        losses.append(mean.item())
        if step % args.eval_every == 0 or step == args.steps:
            evals.append((step, held_out_loss(z, held_out)))
    return {"losses": losses, "evals": evals, "seconds": time.perf_counter() - begin,
            "parameters": parameters}


def fp32_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The model's loss (mean cross-entropy) in fp32 from its bf16 logits: the loss it
    returns is bf16, whose steps (0.03 at a loss of 5) would hide the gaps measured."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def held_out_loss(z: dtrain.ZeRO, held_out: list) -> float:
    """The held-out loss, averaged over the ranks' batches (stage 3 gathers as it goes)."""
    z.eval()
    mean = sum(fp32_loss(z(x, y)[0], y).item() for x, y in held_out) / len(held_out)
    z.train()
    return comm.all_reduce(torch.tensor([mean], dtype=torch.float64), op="avg").item()


def quality(args: argparse.Namespace, world: dtrain.World) -> dict:
    skipped: dict[str, str] = {}
    runs = {}
    for variant in args.variants:
        if reason := unavailable(variant, world.device, bf16=True):
            skipped[variant] = reason
            continue
        if world.rank == 0:
            print(f"hsdp_worker: quality {variant}", flush=True)
        runs[variant] = quality_run(variant, args, world)
    say_skipped(skipped, world)
    return {"variants": runs, "skipped": skipped}


def say_skipped(skipped: dict[str, str], world: dtrain.World) -> None:
    for name, reason in skipped.items():
        if world.rank == 0:
            print(f"hsdp_worker: {name} skipped: {reason}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("speed", "quality"))
    parser.add_argument("--steps", type=int, default=5,
                        help="speed: timed steps per variant; quality: training steps")
    parser.add_argument("--count-steps", type=int, default=1,
                        help="speed: steps per variant with the byte counters around them")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--variants", nargs="+", help="default: every one of the mode's")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.variants = args.variants or list(SPEED_VARIANTS if args.mode == "speed"
                                          else QUALITY_VARIANTS)
    known = SPEED_VARIANTS if args.mode == "speed" else QUALITY_VARIANTS
    if unknown := set(args.variants) - set(known):
        parser.error(f"{args.mode}: unknown variants {sorted(unknown)}; use {known}")
    world = dtrain.init()
    if world.world_size != 4:
        raise SystemExit(f"hsdp_worker runs on 4 ranks (2 hosts x 2), not {world.world_size}")
    result = (speed if args.mode == "speed" else quality)(args, world)
    if world.rank == 0:
        result.update(mode=args.mode, precision=args.precision, steps=args.steps,
                      ranks=world.world_size, torch=torch.__version__,
                      machine=platform.machine())
        Path(args.out).write_text(json.dumps(result))
    comm.barrier()
    dtrain.shutdown()


if __name__ == "__main__":
    main()
