"""The training loop of `dtrain train`: one rank's view of a run in any layout.

    dtrain train                                  # built-in GPT on 2 local ranks
    dtrain train my.toml --set train.steps=500    # your config, one key overridden

Every rank reads the data (dtrain.data), builds the same model in split form (dtrain.models:
dtrain's GPT or Llama, a Hugging Face causal LM, or a user's module, its parameters on the
meta device) and hands it to dtrain.layouts, which lays it out as `[parallel]` says (tp,
then pp, then DataParallel or ZeRO over dp; or parameter-server workers), allocates only
what this rank holds and fills it from the initial values for the seed, a Hugging Face
folder's weights or the checkpoint resumed; it returns a Holding: the one interface this
loop drives, whatever the layout.
Every rank writes the pieces of the state it owns into universal checkpoints
(dtrain.checkpoint), which resume in any layout. Rank 0 prints progress, writes metrics,
and finally prints a sample of generated text.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dtrain import comm, faults, layouts, models, timeline
from dtrain import world as world_mod
from dtrain.checkpoint import training
from dtrain.checkpoint.universal import Checkpoint
from dtrain.config import Config, OptimizerConfig, layout_of, per_rank_batch, replicas_of
from dtrain.data import Tokenizer, TokenSequences, batches, open_data
from dtrain.layouts import Holding
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.models.config import ModelConfig
from dtrain.models.generate import generate
from dtrain.models.weights import weights_of
from dtrain.parallel.live_rounds import RunFinished
from dtrain.train import elastic
from dtrain.train.live import incarnation, open_live
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
def evaluate(held: Holding, data: TokenSequences, batch_size: int, n_batches: int,
             mesh: Mesh, device: torch.device) -> float:
    """Mean loss over the first `n_batches` held-out batches of every dp rank's shard."""
    dp_size, dp_rank = mesh.size("dp"), mesh.coords["dp"]
    held.module.eval()
    stream = batches(data, batch_size * dp_size, dp_size, dp_rank, seed=0, shuffle=False)
    total = 0.0
    for _, (x, y) in zip(range(n_batches), stream, strict=False):
        total += held.evaluate(x.to(device), y.to(device)).item()
    held.module.train()
    mine = mean_over(total / n_batches, mesh.group("dp"), device)
    return mean_over(mine, mesh.across, device)  # and over the replicas, if any


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
    live = open_live(config, world)  # live replicas: each a world (dtrain.train.live)
    note = ""
    most = elastic.max_ranks(world)
    if most:  # this round's ranks: the layout and accumulation fit them
        config, note = elastic.adapt(config, world.world_size, most, elastic.agreed(world))
    tc, mc = config.train, config.model
    layout = layout_of(config, world.world_size)
    mesh = Mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp,
                replicas=replicas_of(config, world.world_size))
    # replicas synchronized every sync_every steps each keep checkpoints of their own
    run_dir = Path(tc.out_dir) / (f"replica-{mesh.replica}" if mesh.replica else "")
    resume_from = training.resume_path(config.checkpoint.resume, run_dir)
    if mesh.replicas > 1:
        resume_from = training.agreed_resume(resume_from, world.device)
    resume = open_checkpoint(resume_from, config) if resume_from else None
    start = resume.step if resume is not None else 0

    dc = config.data
    data = open_data(dc.path, dc.format, dc.tokenizer, dc.max_bytes, dc.val_fraction,
                     mc.block_size)
    train_data, val_data = data.train, data.val
    # (data shards, this rank's): the batch splits over the replicas, and the dp inside each
    count, replica = (live.slots, live.replica_id) if live else (mesh.replicas, mesh.replica)
    shards = (count * layout.dp, replica * layout.dp + mesh.coords["dp"])
    per_rank = per_rank_batch(config, shards[0])  # sequences per forward

    shape = models.resolve(mc, data.vocab_size)
    torch.manual_seed(tc.seed)
    model = init.skeleton(lambda: models.build(shape))  # each rank makes what it holds
    n_params = sum(p.numel() for p in model.parameters())
    weights = weights_of(shape, model) if shape.init_from and resume is None else None
    held = layouts.build(model, mesh, layout, config, weights=weights, live=live)

    def stream_from(step: int):
        return batches(train_data, tc.batch_size, *shards, tc.seed, shuffle=True,
                       accum=held.accum, start=step)

    stream = stream_from(start)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: lr_factor(s, tc.steps, config.optimizer)) for o in held.optimizers]
    if resume is not None:  # the options, schedule and RNG too
        training.restore(resume, held, schedulers, layout)
    held.start()
    if live:  # what a replacement is sent besides the model and optimizer state
        live.track(optimizer=held.optimizers[0],
                   save_extra=lambda: {"schedule": schedulers[0].state_dict()},
                   load_extra=lambda extra: schedulers[0].load_state_dict(extra["schedule"]))

    main = world.is_main and (live is None or live.replica_id == 0)
    progress = Progress(tc.steps, config.logging.log_every, enabled=main)
    # Of live replicas, the first of each step's quorum records it (replica 0 may be gone).
    metrics = MetricsLog(metrics_path or config.logging.metrics, enabled=world.is_main,
                         resumed=(resume is not None and not config.checkpoint.resume)
                         or (live is not None and (incarnation() > 0 or live.replica_id > 0)))
    who = f"{world.world_size} rank(s), {held.describe()}"
    if live:  # each replica: one rank, or a world of dp x tp x pp
        each = "data-parallel replica(s)" if world.world_size == 1 else f"replica(s) of {who}"
        who = f"{live.slots} live {each} (step timeout {config.parallel.step_timeout:g}s)"
    progress.write(f"dtrain: {who}; "
                   f"{describe_model(shape, model)} {n_params / 1e6:.2f}M parameters; "
                   f"{len(train_data):,} training sequences of {mc.block_size} tokens "
                   f"({data.tokenizer.name}); global batch {tc.batch_size}")
    if world.source not in ("single", "dtrain"):  # started by torchrun, srun or mpirun
        progress.write(f"dtrain: {world.describe()}")
    if note:
        progress.write(note)
    if resume is not None:
        progress.write(f"resumed from {resume.path} (step {start})")
    elif weights is not None:
        progress.write(f"weights from {weights.path}")
    tokenizer_file = data.tokenizer.path and str(Path(data.tokenizer.path).resolve())
    described = {"model": dataclasses.asdict(shape), "tokenizer": tokenizer_file,
                 **model_meta(model)}
    tokens_per_step = tc.batch_size * mc.block_size
    losses: list[float] = []
    eval_losses: list[tuple[int, float]] = []

    def writes() -> bool:  # of live replicas, the first of the step's quorum records and saves
        return live is None or live.replica_id == min(live.members or (live.replica_id,))

    def run_eval(step: int) -> None:
        with timeline.span("eval", "eval", step=step):
            loss = evaluate(held, val_data, per_rank, tc.eval_batches, mesh, world.device)
        eval_losses.append((step, loss))
        progress.write(f"step {step:>5}: held-out loss {loss:.4f}")
        if writes():
            metrics.write({"step": step, "eval_loss": loss})

    def save(step: int, background: bool = False) -> Any:
        """The checkpoint of `step`: its folder, or in the background (training goes on
        while it is written) its PendingSave (dtrain.checkpoint.background)."""
        if not writes():
            return run_dir / "checkpoints"
        how = training.save_in_background if background else training.save
        with timeline.span("checkpoint", "checkpoint", step=step):
            return how(run_dir / "checkpoints", step, held, schedulers, config.to_dict(),
                       config.checkpoint.keep_last, described)

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
            if live is None or live.committed:  # a dropped replica is sent the state anew
                held.step()
                for scheduler in schedulers:
                    scheduler.step()
            held.zero_grad()
        return mean_over(mean_over(loss.item(), held.loss_group, world.device), mesh.across,
                         world.device)

    path = resume.path if resume is not None else run_dir / "checkpoints"
    step = start
    while step < tc.steps:
        step += 1
        if live:
            try:
                if live.begin_step(step) != step:  # a replacement, at its peers' step
                    step = live.step
                    stream = stream_from(step - 1)
            except RunFinished as exc:  # nothing left to rejoin
                print(f"dtrain: {exc}", file=sys.stderr, flush=True)
                live.close()
                return {"losses": losses, "eval_losses": eval_losses, "checkpoint": ""}
        faults.at("step", step)
        begin = time.perf_counter()
        with timeline.span("step", "step", step=step):
            step_loss = train_step()
        elapsed = time.perf_counter() - begin
        losses.append(step_loss)
        progress.step(step, step_loss, tokens_per_step / elapsed)
        if writes():
            metrics.write({"step": step, "time": time.time(), "loss": step_loss,
                           "lr": schedulers[0].get_last_lr()[0], "step_time_s": elapsed,
                           "tokens_per_s": tokens_per_step / elapsed,
                           **({"replicas": len(live.participants)} if live else {})})
        if tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
            run_eval(step)
        if config.checkpoint.every and step % config.checkpoint.every == 0 and step < tc.steps:
            if config.checkpoint.background:
                save(step, background=True)
            else:
                path = save(step)
    progress.close()
    held.finish_rounds()
    held.close()
    if live:
        live.finish()
        live.close()
    run_eval(tc.steps)
    if start < tc.steps:
        path = save(tc.steps)
    if main:
        progress.write(f"checkpoint: {path}")
    if config.logging.sample_tokens and main:  # from the checkpoint: whole, here
        progress.write("sample:\n" + sample(shape, Checkpoint(path), data.tokenizer,
                                             config.logging, world.device))
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


def model_meta(model: torch.nn.Module) -> dict[str, Any]:
    """What an export needs beyond the config: a Hugging Face model's own config."""
    hf = getattr(model, "hf", None)
    return {"hf_config": hf.config.to_dict()} if hf is not None else {}


def describe_model(shape: ModelConfig, model: torch.nn.Module) -> str:
    """The model in a few words, for the banner."""
    if shape.arch == "hf":
        return f"Hugging Face {type(model.hf).__name__}"
    if shape.arch == "custom":
        return type(model).__name__
    return {"gpt": "GPT", "llama": "Llama"}[shape.arch] + (f" ({shape.preset})"
                                                          if shape.preset else "")


def sample(shape: ModelConfig, ckpt: Checkpoint, tokenizer: Tokenizer, cfg: Any,
           device: torch.device) -> str:
    """Generate `cfg.sample_tokens` tokens after `cfg.sample_prompt` with the model saved
    in `ckpt` (built whole here, straight from the checkpoint), decoded as text."""
    torch.manual_seed(0)
    plain = init.materialized(init.skeleton(lambda: models.build(shape)), ckpt, device)
    prompt = tokenizer.encode(cfg.sample_prompt) or tokenizer.separator
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    out = generate(plain, idx, cfg.sample_tokens, shape.block_size,
                   generator=torch.Generator(device).manual_seed(0))
    return tokenizer.decode(out[0].tolist())
