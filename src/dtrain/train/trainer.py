"""The training loop of `dtrain train`: one rank's view of a run in any layout.

    dtrain train                                  # built-in GPT on 2 local ranks
    dtrain train my.toml --set train.steps=500    # your config, one key overridden

Every rank builds the same model and hands it to dtrain.layouts, which lays it out as
`[parallel]` says (tp, then pp, then DataParallel or ZeRO over dp; or parameter-server
workers) and returns a Holding: the one interface this loop drives, whatever the layout.
Every rank writes the pieces of the state it owns into universal checkpoints
(dtrain.checkpoint), which resume in any layout. Rank 0 prints progress, writes metrics,
and finally prints a sample of generated text.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from dtrain import comm, faults, layouts, timeline
from dtrain import world as world_mod
from dtrain.checkpoint import training
from dtrain.checkpoint.universal import MODEL, Checkpoint
from dtrain.config import Config, OptimizerConfig, layout_of, per_rank_batch
from dtrain.layouts import Holding
from dtrain.mesh import Mesh
from dtrain.models.gpt import GPT
from dtrain.train.data import ByteSequences, batches, read_corpus, split
from dtrain.train.metrics import MetricsLog, Progress


def lr_factor(step: int, total: int, cfg: OptimizerConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` (or constant)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def mean_over(value: float, group: Any, device: torch.device) -> float:
    """`value` averaged over `group` (None: this rank's own)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    return comm.all_reduce(t, op="avg", group=group).item()


@torch.no_grad()
def evaluate(held: Holding, data: ByteSequences, batch_size: int, n_batches: int,
             mesh: Mesh, device: torch.device) -> float:
    """Mean loss over the first `n_batches` held-out batches of every dp rank's shard."""
    dp_size, dp_rank = mesh.size("dp"), mesh.coords["dp"]
    held.module.eval()
    stream = batches(data, batch_size * dp_size, dp_size, dp_rank, seed=0, shuffle=False)
    total = 0.0
    for _, (x, y) in zip(range(n_batches), stream, strict=False):
        total += held.evaluate(x.to(device), y.to(device)).item()
    held.module.train()
    return mean_over(total / n_batches, mesh.group("dp"), device)


def open_checkpoint(path: str, config: Config) -> Checkpoint:
    """The checkpoint at `path`, checked to hold the configured model.

    Raises:
        ConfigError: no checkpoint there, a damaged one, or one of another model.
    """
    return training.open_checkpoint(path, config.to_dict()["model"])


def train(config: Config, metrics_path: str = "") -> dict[str, Any]:
    """Run the configured job on this rank; returns a summary (losses, checkpoint path).

    Raises:
        ConfigError: the batch does not divide across ranks, the data is too small, or the
            checkpoint to resume from holds another model.
    """
    backend = None if config.parallel.backend == "auto" else config.parallel.backend
    # Under dtrain's launcher with a timeline (env DTRAIN_TIMELINE) the launcher merges it.
    own_timeline = "" if os.environ.get("DTRAIN_TIMELINE") else config.logging.timeline
    world = world_mod.init(backend=backend, timeline=own_timeline or None)
    tc, mc = config.train, config.model
    layout = layout_of(config, world.world_size)
    mesh = Mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp)
    resume_from = training.resume_path(config.checkpoint.resume, tc.out_dir)
    resume = open_checkpoint(resume_from, config) if resume_from else None
    start = resume.step if resume is not None else 0

    train_bytes, val_bytes = split(
        read_corpus(config.data.path, config.data.max_bytes), config.data.val_fraction,
        mc.block_size,
    )
    train_data = ByteSequences(train_bytes, mc.block_size)
    val_data = ByteSequences(val_bytes, mc.block_size)
    per_rank = per_rank_batch(config, layout.dp)  # sequences per forward

    torch.manual_seed(tc.seed)
    gpt = GPT(mc).to(world.device)
    n_params = sum(p.numel() for p in gpt.parameters())
    held = layouts.build(gpt, mesh, layout, config)
    stream = batches(train_data, tc.batch_size, layout.dp, mesh.coords["dp"], tc.seed,
                     shuffle=True, accum=held.accum, start=start)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: lr_factor(s, tc.steps, config.optimizer)) for o in held.optimizers]
    if resume is not None:
        training.restore(resume, held, schedulers, layout)
    held.start()

    out_dir = Path(tc.out_dir)
    progress = Progress(tc.steps, config.logging.log_every, enabled=world.is_main)
    metrics = MetricsLog(metrics_path or config.logging.metrics, enabled=world.is_main)
    progress.write(f"dtrain: {world.world_size} rank(s), {held.describe()}; GPT "
                   f"{n_params / 1e6:.2f}M parameters; {len(train_data):,} training sequences "
                   f"of {mc.block_size} bytes; global batch {tc.batch_size}")
    if resume is not None:
        progress.write(f"resumed from {resume.path} (step {start})")
    tokens_per_step = tc.batch_size * mc.block_size
    losses: list[float] = []
    eval_losses: list[tuple[int, float]] = []

    def run_eval(step: int) -> None:
        with timeline.span("eval", "eval", step=step):
            loss = evaluate(held, val_data, per_rank, tc.eval_batches, mesh, world.device)
        eval_losses.append((step, loss))
        progress.write(f"step {step:>5}: held-out loss {loss:.4f}")
        metrics.write({"step": step, "eval_loss": loss})

    def save(step: int) -> Path:
        with timeline.span("checkpoint", "checkpoint", step=step):
            return training.save(out_dir / "checkpoints", step, held, schedulers,
                                 config.to_dict(), config.checkpoint.keep_last)

    def train_step() -> float:
        """Forward and backward of one global batch, the optimizer step; the mean loss."""
        data = []
        for _ in range(held.accum):
            with timeline.span("data", "data"):
                data.append(tuple(t.to(world.device) for t in next(stream)))
        loss = held.forward_backward(data)
        with timeline.span("optimizer", "optimizer"):
            if config.optimizer.grad_clip > 0:
                held.clip_grad_norm_(config.optimizer.grad_clip)
            held.step()
            held.zero_grad()
            for scheduler in schedulers:
                scheduler.step()
        return mean_over(loss.item(), held.loss_group, world.device)

    path = resume.path if resume is not None else out_dir / "checkpoints"
    for step in range(start + 1, tc.steps + 1):
        faults.at("step", step)
        begin = time.perf_counter()
        with timeline.span("step", "step", step=step):
            step_loss = train_step()
        elapsed = time.perf_counter() - begin
        losses.append(step_loss)
        progress.step(step, step_loss, tokens_per_step / elapsed)
        metrics.write({"step": step, "loss": step_loss, "lr": schedulers[0].get_last_lr()[0],
                       "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed})
        if tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
            run_eval(step)
        if config.checkpoint.every and step % config.checkpoint.every == 0 and step < tc.steps:
            path = save(step)
    progress.close()
    held.close()
    run_eval(tc.steps)
    if start < tc.steps:
        path = save(tc.steps)
    if world.is_main:
        progress.write(f"checkpoint: {path}")
    if config.logging.sample_tokens and world.is_main:  # from the checkpoint: whole, here
        plain = GPT(mc).to(world.device)
        ckpt = Checkpoint(path)
        plain.load_state_dict({n: ckpt.tensor(MODEL + n) for n in ckpt.names(MODEL)}
                              | {a: ckpt.tensor(MODEL + n) for a, n in
                                 ckpt.meta["aliases"].items()})
        progress.write("sample:\n" + sample(plain, config.logging.sample_tokens, world.device))
    metrics.close()
    if own_timeline:
        progress.write(f"timeline: {_write_own_timeline(world)}")
    return {"losses": losses, "eval_losses": eval_losses, "checkpoint": str(path)}


def _write_own_timeline(world: world_mod.World) -> str:
    """Write the timeline of a job no dtrain launcher merges (`dtrain train` as one process,
    or under torchrun or srun): each rank its part, then rank 0 merges the parts it can
    see (all of them on one host or a shared filesystem). Returns the timeline's path."""
    out = world.timeline.out
    world_mod.close_timeline()  # a one-process world writes the whole file right away
    if world.source != "single":
        comm.barrier()  # every rank's part is written
        if world.is_main:
            timeline.merge_ranks(out, range(world.world_size))
    return out


def sample(model: GPT, n_tokens: int, device: torch.device, prompt: str = "def ") -> str:
    """Generate `n_tokens` bytes after `prompt` and decode them as text."""
    model.eval()
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
    out = model.generate(idx, n_tokens, generator=torch.Generator(device).manual_seed(0))
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")
