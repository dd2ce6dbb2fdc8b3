"""One training run of benchmarks/slow_links.py, on every rank under `dtrain run`.

    dtrain run -n 4 benchmarks/slow_links_worker.py --method diloco --sync-every 50 \\
        --steps 300 --out run.json

The default job's GPT and data (`dtrain train`'s), its AdamW and learning-rate schedule,
trained `--steps` steps on the global batch, one way:

    ddp        torch's DistributedDataParallel over every rank (the reference)
    dtrain     dtrain.DataParallel, fp32 gradients
    powersgd   dtrain.DataParallel(compression="powersgd")
    int8       dtrain.DataParallel(compression="int8")
    local_sgd  sync groups of --group-ranks ranks (a host's), each data parallel inside,
    diloco     synchronized every --sync-every steps (dtrain.sync.diloco)

Rank 0 writes JSON: each step's seconds (training only: the held-out evaluations every
`--eval-every` steps are not timed), the held-out losses, and the bytes this rank handed
to collectives on groups that cross hosts (dtrain.comm.traffic; DDP's, which dtrain does
not see, as the all-reduce of its gradients; not a sync group's ZeRO inside its host).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dtrain
from dtrain import comm
from dtrain.config import Config
from dtrain.data import batches, open_data
from dtrain.models import build, resolve
from dtrain.optim import build_optimizer, lr_factor
from dtrain.sync import compression
from dtrain.sync.diloco import DiLoCo

METHODS = ("ddp", "dtrain", "powersgd", "int8", "local_sgd", "diloco")


class Run:
    """The model as a method runs it: forward, step, and the groups whose bytes count."""

    def __init__(self, method: str, model: torch.nn.Module, config: Config, steps: int,
                 sync_every: int, group_ranks: int, compress_from: int | None) -> None:
        self.outer, self.zero, self.groups = None, None, [None]
        warmup = config.optimizer.warmup_steps if compress_from is None else compress_from
        make = lambda params: build_optimizer(params, config.optimizer)  # noqa: E731
        if method == "ddp":
            self.module, self.groups = DistributedDataParallel(model), []
        elif method in ("dtrain", "powersgd", "int8"):  # PowerSGD after warm-up, as in train
            self.module = dtrain.DataParallel(model, compression=None if method == "dtrain" else
                                              compression.make(method, start_iter=warmup))
        else:  # sync groups of a host's ranks, ZeRO-1 inside: each rank sends its shard
            mesh = dtrain.Mesh(sync=dist.get_world_size() // group_ranks)
            self.module = self.zero = dtrain.ZeRO(model, lambda _: make(model.parameters()),
                                                  stage=1, group=mesh.group("dp"))
            # what crosses hosts: the dp group is inside one sync group
            self.groups = [mesh.group("sync")]
        self.optimizer = self.zero.optimizer if self.zero else make(model.parameters())
        if method in ("local_sgd", "diloco"):
            shards = [p for g in self.optimizer.param_groups for p in g["params"]]
            self.outer = DiLoCo(model, mesh.group("sync"), sync_every=sync_every,
                                mode=method, params=shards, outer_lr=config.sync.outer_lr,
                                outer_momentum=config.sync.outer_momentum)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, steps, config.optimizer))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.module(x, y)[1].backward()
        if self.zero is not None:
            self.zero.step()
            self.zero.zero_grad()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        if self.outer is not None and self.outer.step() and self.zero is not None:
            self.zero.refresh_parameters()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--group-ranks", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--compress-from", type=int, help="PowerSGD's first compressed step "
                        "(default: after the learning-rate warm-up, as dtrain train)")
    parser.add_argument("--outer-lr", type=float, default=Config().sync.outer_lr)
    parser.add_argument("--outer-momentum", type=float, default=Config().sync.outer_momentum)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = dtrain.init()
    config = Config()
    config.sync.outer_lr, config.sync.outer_momentum = args.outer_lr, args.outer_momentum
    tc, mc = config.train, config.model
    data = open_data("", block_size=mc.block_size, max_bytes=config.data.max_bytes)
    torch.manual_seed(tc.seed)
    model = build(resolve(mc, data.vocab_size))
    n = world.world_size
    run = Run(args.method, model, config, args.steps, args.sync_every, args.group_ranks,
              args.compress_from)
    stream = batches(data.train, tc.batch_size, n, world.rank, tc.seed, shuffle=True)
    held_out = list(zip(range(args.eval_batches),
                        batches(data.val, tc.batch_size, n, world.rank, 0, shuffle=False),
                        strict=False))
    step_s, evals = [], []
    for step in range(1, args.steps + 1):
        x, y = next(stream)
        dist.barrier()
        begin = time.perf_counter()
        run.step(x, y)
        dist.barrier()
        step_s.append(time.perf_counter() - begin)
        if step == 1:  # bytes from here: the first step's setup (and broadcasts) not counted
            for g in run.groups:
                comm.traffic(g, reset=True)
        if step % args.eval_every == 0 or step == args.steps:
            evals.append((step, evaluate(model, held_out)))
    counted = max(args.steps - 1, 1)
    sent = sum(sum(comm.traffic(g).values()) for g in run.groups)
    if args.method == "ddp":  # its gradients' all-reduce, as dtrain.comm counts one
        sent = counted * 4 * sum(p.numel() for p in model.parameters()) * 2 * (n - 1) / n
    if world.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"method": args.method, "sync_every": args.sync_every, "ranks": n,
                       "step_s": step_s, "evals": evals, "bytes_per_step": sent / counted,
                       "parameters": sum(p.numel() for p in model.parameters())}, f)
    dist.barrier()  # every rank leaves together
    dtrain.shutdown()


@torch.no_grad()
def evaluate(model: torch.nn.Module, held_out: list) -> float:
    """The held-out loss of this rank's copy, averaged over every rank (sync groups in the
    middle of a round hold different copies: their mean loss)."""
    model.eval()
    total = sum(model(x, y)[1].item() for _, (x, y) in held_out) / len(held_out)
    model.train()
    t = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size() if math.isfinite(t.item()) else math.inf


if __name__ == "__main__":
    main()
