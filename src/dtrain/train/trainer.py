"""The training loop of `dtrain train`: one rank's view of a run in any layout.

    dtrain train                                  # built-in GPT on 2 local ranks
    dtrain train my.toml --set train.steps=500    # your config, one key overridden

Every rank builds the same model and lays it out as `[parallel]` says, in one order: tp
splits every layer over consecutive ranks (dtrain.tensor_parallel), pp cuts the split
model into stages fed with micro-batches (dtrain.pipeline), and dp wraps the model or each
piece in DataParallel, or with `zero = 1|2|3` in dtrain.ZeRO, over the remaining axis.
With `mode = "ps"` the ranks are workers of parameter servers (dtrain.ps) that hold the
model and its optimizer. Every rank writes the pieces of the state it owns into universal
checkpoints (dtrain.universal), which resume in any layout. Rank 0 prints progress, writes
metrics, and finally prints a sample of generated text.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain import checkpoint, comm, faults, pipeline, ps, tensor_parallel, timeline, universal
from dtrain import world as world_mod
from dtrain.errors import ConfigError, DtrainError
from dtrain.mesh import Mesh
from dtrain.models.gpt import GPT
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.zero import ZeRO
from dtrain.train.config import Config, OptimizerConfig, per_rank_batch
from dtrain.train.data import ByteSequences, batches, read_corpus, split
from dtrain.train.holding import Holding
from dtrain.train.metrics import MetricsLog, Progress
from dtrain.train.state import collect, restore
from dtrain.universal import MODEL


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
    stream = batches(data, batch_size * dp_size, dp_size, dp_rank, seed=0, shuffle=False)
    total = 0.0
    for _, (x, y) in zip(range(n_batches), stream, strict=False):
        total += loss_of(x.to(device), y.to(device)).item()
    model.train()
    return _mean_over(total / n_batches, group, device)


def _build_gpt(config: Config, mesh: Mesh, device: torch.device) -> tuple[GPT, int]:
    """The whole model, identical on every rank, its layers split over tp if tp > 1; and
    its parameter count."""
    torch.manual_seed(config.train.seed)
    gpt = GPT(config.model).to(device)
    n_params = sum(p.numel() for p in gpt.parameters())
    if config.parallel.tp > 1:
        tensor_parallel.parallelize(gpt, tensor_parallel.gpt_plan(config.model), mesh.group("tp"))
    return gpt, n_params


def _open_resume(config: Config) -> universal.Checkpoint | None:
    """The checkpoint to resume from: `checkpoint.resume` ("auto": the newest in this run's
    folder, if any; or a path), and after an elastic restart the newest one here."""
    resume = config.checkpoint.resume
    if not resume and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        resume = "auto"
    if not resume:
        return None
    if resume == "auto":
        resume = str(Path(config.train.out_dir) / "checkpoints")
        if not checkpoint.read_index(resume):
            return None
    return open_checkpoint(resume, config)


def open_checkpoint(path: str, config: Config) -> universal.Checkpoint:
    """The checkpoint at `path`, checked to hold the configured model.

    Raises:
        ConfigError: no checkpoint there, a damaged one, or one of another model.
    """
    try:
        ckpt = universal.Checkpoint(path)
    except DtrainError as exc:
        raise ConfigError(f"checkpoint.resume: {exc}") from None
    saved = ckpt.meta.get("config", {}).get("model")
    wanted = config.to_dict()["model"]
    if saved is not None and saved != wanted:
        diff = [f"model.{k} = {saved[k]!r} there, {wanted[k]!r} here" for k in wanted
                if saved.get(k) != wanted[k]]
        raise ConfigError(f"checkpoint {ckpt.path} holds another model ({'; '.join(diff)}): "
                          "resume with the config it was trained with")
    return ckpt


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
    pc, tc, mc = config.parallel, config.train, config.model
    mesh = Mesh(dp=pc.dp or None, tp=pc.tp, pp=pc.pp)
    dp_size, dp_rank, dp_group = mesh.size("dp"), mesh.coords["dp"], mesh.group("dp")
    groups = {axis: mesh.group(axis) for axis in ("dp", "tp", "pp")}
    per_rank = per_rank_batch(config, dp_size)
    resume = _open_resume(config)
    start = resume.step if resume is not None else 0

    train_bytes, val_bytes = split(
        read_corpus(config.data.path, config.data.max_bytes), config.data.val_fraction,
        mc.block_size,
    )
    train_data = ByteSequences(train_bytes, mc.block_size)
    val_data = ByteSequences(val_bytes, mc.block_size)
    accum = 1 if pc.pp > 1 else tc.grad_accum  # a pipeline accumulates its micro-batches
    stream = batches(train_data, tc.batch_size, dp_size, dp_rank, tc.seed, shuffle=True,
                     accum=accum, start=start)

    gpt, n_params = _build_gpt(config, mesh, world.device)
    held = Holding(gpt, tp=(mesh.coords["tp"], pc.tp), dp=(dp_rank, dp_size))
    mixed = None if pc.mixed_precision == "fp32" else pc.mixed_precision

    def zero_of(module: torch.nn.Module) -> ZeRO:
        return ZeRO(module, lambda _: build_optimizer(module, config.optimizer), stage=pc.zero,
                    group=dp_group, bucket_mb=pc.bucket_mb, mixed_precision=mixed)

    def dp_of(module: torch.nn.Module) -> DataParallel:
        return DataParallel(module, group=dp_group, bucket_mb=pc.bucket_mb,
                            grad_dtype=pc.grad_dtype)

    pipe = None
    if pc.pp > 1:  # this rank's pieces, each data-parallel over dp, driven by the schedule
        pp_group = mesh.group("pp")
        mine = pipeline.pieces_for(pipeline.gpt_pieces(gpt, pc.pp * pc.virtual_stages), pp_group)
        wrapped = [zero_of(p) if pc.zero else dp_of(p) for p in mine]
        tied = pipeline.tied_weights(gpt, mine, pp_group)
        pipe = pipeline.Pipeline(wrapped, pp_group, microbatches=pc.microbatches,
                                 schedule=pc.schedule, loss_fn=pipeline.gpt_loss_of(gpt),
                                 tied=tied)
        held.skip = {id(p) for p, peer in tied if peer < pp_group.rank()}
        model = torch.nn.ModuleList(wrapped)
        if pc.zero:
            held.zeros = wrapped
            optimizers = [z.optimizer for z in wrapped]
        else:
            optimizers = [build_optimizer(torch.nn.ModuleList(mine), config.optimizer)]
            held.params = list(torch.nn.ModuleList(mine).parameters())
    elif pc.mode == "ps":  # no collective per step: async workers must not wait on each other
        model = gpt
        worker = ps.Worker(gpt, ps_settings(config), overlap=config.optimizer.grad_clip == 0)
        optimizers = [ps.RemoteOptimizer(worker)]  # step() pushes and pulls; lr rides along
        held.params, held.dp = list(gpt.parameters()), (0, 1)  # worker 0 saves alone
    elif pc.zero:
        model = zero_of(gpt)
        held.zeros = [model]
        optimizers = [model.optimizer]
    else:
        model = dp_of(gpt)
        optimizers = [build_optimizer(model, config.optimizer)]
        held.params = list(gpt.parameters())
    if held.params and pc.mode != "ps":
        held.optimizer = optimizers[0]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: lr_factor(s, tc.steps, config.optimizer)) for o in optimizers]
    if resume is not None:
        _restore(resume, held, optimizers, schedulers, mesh, world.world_size)
    if pc.mode == "ps":
        worker.start()  # worker 0 seeds the servers with the (restored) weights

    out_dir = Path(tc.out_dir)
    progress = Progress(tc.steps, config.logging.log_every, enabled=world.is_main)
    metrics = MetricsLog(metrics_path or config.logging.metrics, enabled=world.is_main)
    progress.write(f"dtrain: {world.world_size} rank(s), {describe(config, dp_size)}; GPT "
                   f"{n_params / 1e6:.2f}M parameters; {len(train_data):,} training sequences "
                   f"of {mc.block_size} bytes; global batch {tc.batch_size}")
    if resume is not None:
        progress.write(f"resumed from {resume.path} (step {start})")
    tokens_per_step = tc.batch_size * mc.block_size
    losses: list[float] = []
    eval_losses: list[tuple[int, float]] = []

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return pipe.evaluate(x, y) if pipe else model(x, y)[1]

    def run_eval(step: int) -> None:
        with timeline.span("eval", "eval", step=step):
            loss = evaluate(model, loss_of, val_data, per_rank, tc.eval_batches,
                            (dp_size, dp_rank, dp_group), world.device)
        eval_losses.append((step, loss))
        progress.write(f"step {step:>5}: held-out loss {loss:.4f}")
        metrics.write({"step": step, "eval_loss": loss})

    def save(step: int) -> Path:
        with timeline.span("checkpoint", "checkpoint", step=step):
            return save_checkpoint(out_dir / "checkpoints", step, held, schedulers, config,
                                   group=None if pc.mode == "ps" else "world",
                                   writes=world.is_main or pc.mode != "ps")

    def train_step() -> float:
        """Forward and backward of one global batch, the optimizer step; the mean loss."""
        for micro in range(accum):
            with timeline.span("data", "data"):
                x, y = (t.to(world.device) for t in next(stream))
            if pipe:  # its forwards and backwards interleave: spans of their own inside
                loss = pipe.step(x, y)
                break
            last = micro == accum - 1
            if pc.mode == "ps":
                accumulating = contextlib.nullcontext() if last else worker.accumulate()
            else:
                accumulating = contextlib.nullcontext() if last else model.no_sync()
            with accumulating:
                with timeline.span("forward", "forward"):
                    loss = model(x, y)[1].float() / accum
                with timeline.span("backward", "backward"):
                    model.backward(loss) if pc.zero else loss.backward()
        with timeline.span("optimizer", "optimizer"):
            optimizer_step()
        step_loss = loss.item() * accum
        if pc.mode != "ps":
            step_loss = _mean_over(step_loss, dp_group, world.device)
        return step_loss

    def optimizer_step() -> None:
        """Clip the gradient, step, zero the gradients, advance the schedule."""
        clip = config.optimizer.grad_clip
        if pc.mode == "ps":
            if clip > 0:  # each worker's own gradient (pushes then wait for the clipping)
                torch.nn.utils.clip_grad_norm_(gpt.parameters(), clip)
        elif clip > 0 and pc.zero and not pipe and pc.tp == 1:
            model.clip_grad_norm_(clip)  # ZeRO's own: the global norm (and fp16 overflow)
        elif clip > 0:
            held.clip_grad_norm_(clip, groups)  # the whole model's norm, whatever the layout
        if held.zeros:
            for z in held.zeros:
                z.step()
                z.zero_grad()
        else:
            optimizers[0].step()
            optimizers[0].zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()

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
    if pc.mode == "ps":
        worker.close()
    run_eval(tc.steps)
    if start < tc.steps:
        path = save(tc.steps)
    if world.is_main:
        progress.write(f"checkpoint: {path}")
    if config.logging.sample_tokens:  # from the checkpoint: the whole model, in one place
        if world.is_main:
            plain = GPT(mc).to(world.device)
            ckpt = universal.Checkpoint(path)
            plain.load_state_dict({n: ckpt.tensor(MODEL + n) for n in ckpt.names(MODEL)}
                                  | {a: ckpt.tensor(MODEL + n) for a, n in
                                     ckpt.meta["aliases"].items()})
            progress.write("sample:\n" + sample(plain, config.logging.sample_tokens,
                                                world.device))
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


def describe(config: Config, dp_size: int) -> str:
    """The layout in words, outermost axis first."""
    pc = config.parallel
    how = f"ZeRO stage {pc.zero}" if pc.zero else "data parallel"
    if pc.mode == "ps":
        how = f"{pc.consistency} parameter-server training with {pc.servers} server(s) per machine"
    if pc.tp > 1:
        how = f"tensor parallel over {pc.tp} x {how}"
    if pc.pp > 1:
        how = (f"pipeline of {pc.pp} stages ({pc.schedule}, {pc.microbatches} micro-batches) "
               f"x {how}")
    return f"{how} over {dp_size}"


def _layout(config: Config, world_size: int) -> dict[str, Any]:
    pc = config.parallel
    return {"world_size": world_size, "dp": world_size // (pc.tp * pc.pp), "tp": pc.tp,
            "pp": pc.pp, "zero": pc.zero, "virtual_stages": pc.virtual_stages,
            "mode": pc.mode}


def save_checkpoint(folder: Path, step: int, held: Holding,
                    schedulers: list[torch.optim.lr_scheduler.LRScheduler], config: Config,
                    group: Any = "world", writes: bool = True) -> Path:
    """Every rank writes the pieces of the model and optimizer state it owns into a
    universal checkpoint (dtrain.universal), with its RNG state; the first rank adds the
    run's description. Under mode = "ps" the first worker writes its replica alone (the
    optimizer state lives in the servers' snapshots)."""
    target = folder / f"step-{step:08d}"
    if not writes:
        return target
    pieces, extra = collect(held)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    optimizer = schedulers[0].optimizer
    meta = {"config": config.to_dict(), "layout": _layout(config, world_size),
            "aliases": held.aliases(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in optimizer.param_groups],
            "scheduler": schedulers[0].state_dict(),
            "loss_scale": held.zeros[0].loss_scale if held.zeros else 1.0}
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return universal.save(folder, step, pieces, extra, json.loads(json.dumps(meta, default=str)),
                          config.checkpoint.keep_last, group=group, rank_tensors=rng)


def _restore(ckpt: universal.Checkpoint, held: Holding, optimizers: list,
             schedulers: list, mesh: Mesh, world_size: int) -> None:
    """Model, optimizer state, options and schedule from `ckpt`; the RNG too when the
    layout is the one that saved it (ranks are then the same ranks)."""
    restore(held, ckpt)
    for optimizer, scheduler in zip(optimizers, schedulers, strict=True):
        for group, options in zip(optimizer.param_groups, ckpt.meta["param_groups"],
                                  strict=False):
            group.update({k: tuple(v) if isinstance(v, list) else v
                          for k, v in options.items() if k in group})
        scheduler.load_state_dict(ckpt.meta["scheduler"])
    for z in held.zeros:
        z.loss_scale = ckpt.meta.get("loss_scale", 1.0)
    if ckpt.index["world_size"] == world_size and ckpt.meta["layout"]["tp"] == mesh.size("tp") \
            and ckpt.meta["layout"]["pp"] == mesh.size("pp"):
        rng = ckpt.rank_tensors(dist.get_rank() if dist.is_initialized() else 0)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def sample(model: GPT, n_tokens: int, device: torch.device, prompt: str = "def ") -> str:
    """Generate `n_tokens` bytes after `prompt` and decode them as text."""
    model.eval()
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
    out = model.generate(idx, n_tokens, generator=torch.Generator(device).manual_seed(0))
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")
