"""The training loop of `dtrain train`: one rank's view of a data-parallel run.

    dtrain train                                  # built-in GPT on 2 local ranks
    dtrain train my.toml --set train.steps=500    # your config, one key overridden

Every rank builds the same model, takes its shard of each global batch, and averages
gradients through DataParallel, or with `[parallel] zero = 1|2|3` shards the model state
with dtrain.ZeRO (each rank then writes its own shard of every checkpoint). With
`[parallel] tp = N` each layer is first split across N consecutive ranks
(dtrain.tensor_parallel; tp inside, data parallel outside over the rest); with `pp = N` the
blocks are cut into N pipeline stages fed with micro-batches (dtrain.pipeline), each
stage's pieces data-parallel over the dp axis. With `mode = "ps"` the ranks are workers of
parameter servers (dtrain.ps) that hold the model and its optimizer. Rank 0 prints
progress, writes metrics and checkpoints, and finally prints a sample of generated text.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain import checkpoint, comm, pipeline, ps, tensor_parallel
from dtrain import world as world_mod
from dtrain.mesh import Mesh
from dtrain.models.gpt import GPT
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.zero import ZeRO
from dtrain.train.config import Config, OptimizerConfig, per_rank_batch
from dtrain.train.data import ByteSequences, batches, read_corpus, split
from dtrain.train.metrics import MetricsLog, Progress


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Weight decay on matrices only (not on biases, norms), as in GPT-2 training."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    optimizer = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return optimizer(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def ps_settings(config: Config) -> ps.Settings:
    """The parameter servers' rules from the config (the optimizer runs on the servers)."""
    o, p = config.optimizer, config.parallel
    return ps.Settings(p.consistency, p.staleness if p.consistency == "ssp" else 0,
                       optimizer=o.name, lr=o.lr, momentum=o.momentum, betas=tuple(o.betas),
                       weight_decay=o.weight_decay)


def lr_factor(step: int, total: int, cfg: OptimizerConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` (or constant)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _mean_over(value: float, group: dist.ProcessGroup, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    return comm.all_reduce(t, op="avg", group=group).item()


@torch.no_grad()
def evaluate(model: torch.nn.Module, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             data: ByteSequences, batch_size: int, n_batches: int,
             mesh_dp: tuple[int, int, dist.ProcessGroup], device: torch.device) -> float:
    """Mean loss over the first `n_batches` held-out batches of every rank's shard."""
    dp_size, dp_rank, group = mesh_dp
    model.eval()
    stream = batches(data, batch_size, dp_size, dp_rank, seed=0, shuffle=False)
    total = 0.0
    for _, (x, y) in zip(range(n_batches), stream, strict=False):
        total += loss_of(x.to(device), y.to(device)).item()
    model.train()
    return _mean_over(total / n_batches, group, device)


def train(config: Config, metrics_path: str = "") -> dict[str, Any]:
    """Run the configured job on this rank; returns a summary (losses, checkpoint path).


    Raises:
        ConfigError: the batch does not divide across ranks, or the data is too small.
    """
    backend = None if config.parallel.backend == "auto" else config.parallel.backend
    world = world_mod.init(backend=backend)
    mesh = Mesh(dp=config.parallel.dp or None, tp=config.parallel.tp, pp=config.parallel.pp)
    dp_size, dp_rank, dp_group = mesh.size("dp"), mesh.coords["dp"], mesh.group("dp")
    tc, mc = config.train, config.model
    per_rank = per_rank_batch(config, dp_size)

    train_bytes, val_bytes = split(
        read_corpus(config.data.path, config.data.max_bytes), config.data.val_fraction,
        mc.block_size,
    )
    train_data = ByteSequences(train_bytes, mc.block_size)
    val_data = ByteSequences(val_bytes, mc.block_size)
    stream = batches(train_data, per_rank, dp_size, dp_rank, tc.seed, shuffle=True)

    torch.manual_seed(tc.seed)
    gpt = GPT(mc).to(world.device)
    pc = config.parallel
    n_params = sum(p.numel() for p in gpt.parameters())
    if pc.tp > 1:
        tensor_parallel.parallelize(gpt, tensor_parallel.gpt_plan(mc), mesh.group("tp"))
    pipe = None
    if pc.pp > 1:  # this rank's pieces, each data-parallel over dp, driven by the schedule
        pp_group = mesh.group("pp")
        mine = pipeline.pieces_for(pipeline.gpt_pieces(gpt, pc.pp * pc.virtual_stages), pp_group)
        pipe = pipeline.Pipeline(
            [DataParallel(p, group=dp_group, bucket_mb=pc.bucket_mb, grad_dtype=pc.grad_dtype)
             for p in mine], pp_group, microbatches=pc.microbatches, schedule=pc.schedule,
            loss_fn=pipeline.gpt_loss, tied=pipeline.tied_weights(gpt, mine, pp_group))
        model = torch.nn.ModuleList(mine)
        optimizer = build_optimizer(model, config.optimizer)
    elif pc.mode == "ps":  # no collective per step: async workers must not wait on each other
        model = gpt
        worker = ps.Worker(gpt, ps_settings(config), overlap=config.optimizer.grad_clip == 0)
        optimizer = ps.RemoteOptimizer(worker)  # step() pushes and pulls; lr rides along
        worker.start()
    elif pc.zero:
        model = ZeRO(gpt, lambda _: build_optimizer(gpt, config.optimizer), stage=pc.zero,
                     group=dp_group, bucket_mb=pc.bucket_mb,
                     mixed_precision=None if pc.mixed_precision == "fp32" else pc.mixed_precision)
        optimizer = model.optimizer
    else:
        model = DataParallel(gpt, group=dp_group, bucket_mb=pc.bucket_mb,
                             grad_dtype=pc.grad_dtype)
        optimizer = build_optimizer(model, config.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, tc.steps, config.optimizer)
    )

    out_dir = Path(tc.out_dir)
    progress = Progress(tc.steps, config.logging.log_every, enabled=world.is_main)
    metrics = MetricsLog(metrics_path or config.logging.metrics, enabled=world.is_main)
    how = f"ZeRO stage {pc.zero}" if pc.zero else "data parallel"
    if pc.mode == "ps":
        how = f"{pc.consistency} parameter-server training with {pc.servers} server(s) per machine"
    if pc.tp > 1:
        how = f"tensor parallel over {pc.tp} x {how}"
    if pipe:
        how = (f"pipeline of {pc.pp} stages ({pc.schedule}, {pc.microbatches} micro-batches) "
               f"x {how}")
    progress.write(
        f"dtrain: {world.world_size} rank(s), {how} over {dp_size}; GPT "
        f"{n_params / 1e6:.2f}M parameters; {len(train_data):,} training sequences of "
        f"{mc.block_size} bytes; global batch {tc.batch_size}"
    )
    tokens_per_step = tc.batch_size * mc.block_size
    losses: list[float] = []
    eval_losses: list[tuple[int, float]] = []

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return pipe.evaluate(x, y) if pipe else model(x, y)[1]

    def run_eval(step: int) -> None:
        loss = evaluate(model, loss_of, val_data, per_rank, tc.eval_batches,
                        (dp_size, dp_rank, dp_group), world.device)
        eval_losses.append((step, loss))
        progress.write(f"step {step:>5}: held-out loss {loss:.4f}")
        metrics.write({"step": step, "eval_loss": loss})

    for step in range(1, tc.steps + 1):
        start = time.perf_counter()
        for micro in range(tc.grad_accum):
            x, y = (t.to(world.device) for t in next(stream))
            if pipe:  # grad_accum is 1: the pipeline's micro-batches accumulate
                loss = pipe.step(x, y)
                break
            last = micro == tc.grad_accum - 1
            if pc.mode == "ps":
                accumulating = contextlib.nullcontext() if last else worker.accumulate()
            else:
                accumulating = contextlib.nullcontext() if last else model.no_sync()
            with accumulating:
                loss = model(x, y)[1].float() / tc.grad_accum
                model.backward(loss) if pc.zero else loss.backward()
        clip = config.optimizer.grad_clip
        if pipe:
            if clip > 0:
                pipe.clip_grad_norm_(clip)  # over every stage, the tied weight once
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elif pc.zero:
            if clip > 0:
                model.clip_grad_norm_(clip)  # the global norm, across the shards
            model.step()
            model.zero_grad()
        elif pc.mode == "ps":
            if clip > 0:  # each worker's own gradient (pushes then wait for the clipping)
                torch.nn.utils.clip_grad_norm_(gpt.parameters(), clip)
            optimizer.step()
        else:
            if clip > 0:  # averaged gradients: the same norm on every data-parallel rank
                tensor_parallel.clip_grad_norm_(gpt, clip)  # split layers counted whole
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step_loss = loss.item() * tc.grad_accum
        if pc.mode != "ps":
            step_loss = _mean_over(step_loss, dp_group, world.device)
        elapsed = time.perf_counter() - start
        losses.append(step_loss)
        progress.step(step, step_loss, tokens_per_step / elapsed)
        metrics.write({"step": step, "loss": step_loss, "lr": scheduler.get_last_lr()[0],
                       "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed})
        if tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
            run_eval(step)
        if config.checkpoint.every and step % config.checkpoint.every == 0 and step < tc.steps:
            save_checkpoint(out_dir, step, model, optimizer, config, world.is_main)
    progress.close()
    if pc.mode == "ps":
        worker.close()
    run_eval(tc.steps)
    path = save_checkpoint(out_dir, tc.steps, model, optimizer, config, world.is_main)
    if (pc.zero or pc.tp > 1 or pipe) and config.logging.sample_tokens:  # a whole copy
        if pipe:
            weights = pipeline.full_state_dict(gpt, model, mesh.group("pp"))
        else:
            weights = model.state_dict() if pc.zero else tensor_parallel.full_state_dict(gpt)
        if world.is_main:
            gpt = GPT(mc).to(world.device)
            gpt.load_state_dict(weights)
    if world.is_main:
        progress.write(f"checkpoint: {path}")
        if config.logging.sample_tokens:
            progress.write("sample:\n" + sample(gpt, config.logging.sample_tokens, world.device))
    metrics.close()
    return {"losses": losses, "eval_losses": eval_losses, "checkpoint": str(path)}


def save_checkpoint(out_dir: Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, config: Config, is_main: bool) -> Path:
    """Rank 0 writes the (replicated) state; the others wait so nobody reads a half file.
    Under ZeRO every rank writes its shard (dtrain.checkpoint.save_shards); under
    tensor parallelism the split tensors are gathered first, so the checkpoint holds the
    whole model and optimizer state by the unsplit model's names."""
    folder = out_dir / "checkpoints"
    if isinstance(optimizer, ps.RemoteOptimizer):  # its state is in the servers' snapshots
        path = folder / f"step-{step:08d}.pt"
        if is_main:
            state = {"step": step, "model": model.state_dict(), "config": config.to_dict()}
            path = checkpoint.save(folder, step, state, config.checkpoint.keep_last)
        return path
    if isinstance(model, torch.nn.ModuleList):  # pipeline pieces: each rank writes its own
        pieces = {k: v for piece in model for k, v in piece.state_dict().items()}
        state = {"step": step, "pipeline": {"model": pieces, "optimizer": optimizer.state_dict()},
                 "config": config.to_dict()}
        return checkpoint.save_shards(folder, step, state, config.checkpoint.keep_last, None)
    if isinstance(model, ZeRO):
        state = {"step": step, "zero": model.sharded_state_dict(), "config": config.to_dict()}
        return checkpoint.save_shards(folder, step, state, config.checkpoint.keep_last,
                                      model.group)
    path = folder / f"step-{step:08d}.pt"
    inner = model.module  # DataParallel's; tensor_parallel's gathers are collective
    weights = tensor_parallel.full_state_dict(inner)
    optimizer_state = tensor_parallel.full_optimizer_state(inner, optimizer)
    if is_main:
        state = {"step": step, "model": weights, "optimizer": optimizer_state,
                 "config": config.to_dict()}
        path = checkpoint.save(folder, step, state, config.checkpoint.keep_last)
    comm.barrier()
    return path


def sample(model: GPT, n_tokens: int, device: torch.device, prompt: str = "def ") -> str:
    """Generate `n_tokens` bytes after `prompt` and decode them as text."""
    model.eval()
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
    out = model.generate(idx, n_tokens, generator=torch.Generator(device).manual_seed(0))
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")
