"""A training run's checkpoints: what `dtrain train` saves and how it resumes.

A save writes every rank's pieces of the model and optimizer (its Holding's `state()`)
into a universal checkpoint (dtrain.checkpoint.universal), with the run's config, layout,
optimizer options, learning-rate schedule, fp16 loss scale and each rank's RNG state.
Restoring sets the same from a checkpoint of any layout; the RNG only when the layout is
the one that saved it (its ranks are then the same ranks). A resume from a checkpoints
folder takes the newest checkpoint there that verifies, one rank moving the damaged newer
ones aside (`fall_back`, dtrain.checkpoint.fallback). `save_in_background` copies the
same state to memory and writes it from a thread while training goes on. A run with
adapters saves only the parameters it names (`only`: the adapters, without their frozen
base, whose identity the metadata records; dtrain.adapters.checkpoints).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain import env
from dtrain.checkpoint import atomic, background, fallback, universal
from dtrain.checkpoint.background import PendingSave
from dtrain.checkpoint.checkpointable import Checkpointable, CheckpointGroup
from dtrain.checkpoint.copies import Copies
from dtrain.checkpoint.universal import FORMAT, Checkpoint
from dtrain.checkpoint.universal import save as save_pieces
from dtrain.errors import ConfigError, DtrainError
from dtrain.mesh import Dims


def resume_spec(resume: str) -> str:
    """`checkpoint.resume` as it holds for this process: "auto" after an elastic restart
    or in a later rendezvous round (env DTRAIN_ROUND, from dtrain's launcher)."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if not resume and (restarted or env.ROUND.get() > 1):
        return "auto"
    return resume


def resume_path(resume: str, out_dir: str | Path) -> str | None:
    """The checkpoint to resume from: `resume` ("auto": the newest in the run's folder,
    if any; or a path), and after an elastic restart or a later rendezvous round
    (`resume_spec`) the newest one in the run's folder."""
    resume = resume_spec(resume)
    if resume == "auto":
        resume = str(Path(out_dir) / "checkpoints")
        if not atomic.read_index(resume):
            return None
    return resume or None


def fall_back(path: str | None, device: torch.device) -> str | None:
    """`path` (as `resume_path` gave it) once the newest checkpoint there verifies: where it
    is a checkpoints folder, the first rank resuming from it moves the damaged newest
    ones aside and prints the line that says so (dtrain.checkpoint.fallback); the others
    wait for its word, so that every rank opens the same checkpoint. Collective over the
    world (a live replica's, under live replicas); returns `path` itself.

    Raises:
        ConfigError: none there verifies, or one is of another format (the same line on
            every rank, nothing moved).
    """
    from dtrain import comm
    from dtrain.checkpoint.transfer import all_gather_json

    if not dist.is_initialized():
        said, error = _fall_back_alone(path)
    else:
        world = comm.resolve(None)
        paths = all_gather_json(path or "", world, device)
        leads = bool(path) and paths.index(str(path)) == world.rank  # the first with it
        said, error = _fall_back_alone(path) if leads else ("", "")
        outcome: dict[str, object] = {"error": error}
        every = all_gather_json(outcome, world, device)
        error = next((str(e["error"]) for e in every if e["error"]), "")
    if error:
        raise ConfigError(f"checkpoint.resume: {error}")
    if said:
        print(f"dtrain: {said}", file=sys.stderr, flush=True)
    return path


def _fall_back_alone(path: str | None) -> tuple[str, str]:
    """`fallback.fall_back` of `path` if it is a checkpoints folder: (its line, "") or
    ("", the error)."""
    try:
        if not path or universal.is_checkpoint(Path(path)):
            return "", ""
        return fallback.fall_back(Path(path)), ""
    except (DtrainError, OSError) as exc:
        return "", str(exc)


def agreed_resume(path: str | None, device: torch.device) -> str | None:
    """Of replicas that keep checkpoints of their own (sync.method = local_sgd
    or diloco), `path` moved to the newest step every replica has: a crash between two
    replicas' saves leaves one a checkpoint ahead. None when some replica has none
    (collective over the world).

    Raises:
        ConfigError: a replica no longer has the agreed step (keep_last dropped it).
    """
    from dtrain import comm

    single = bool(path) and Path(str(path)).name.startswith("step-")
    entries = {} if not path or single else {
        e["step"]: e["file"] for e in atomic.read_index(path) if e.get("format") == FORMAT}
    newest = torch.tensor([Checkpoint(path).step if single and path else
                           max(entries, default=-1)],
                          dtype=torch.int64, device=device)
    step = int(comm.all_reduce(newest, op="min").item())
    if step < 0:
        return None
    if not entries or step == max(entries):
        return path
    if step not in entries:
        raise ConfigError(f"the replicas' newest common checkpoint is step {step}, which "
                          f"{path} no longer keeps: resume from a checkpoint by path")
    assert path is not None  # entries were read from its index
    return str(Path(path) / entries[step])


def open_checkpoint(path: str, model: dict[str, Any]) -> Checkpoint:
    """The checkpoint at `path` (of a checkpoints folder, the newest that verifies: nothing
    is moved here, `fall_back` does that), checked to hold the model configured as `model`
    (the config's `[model]` section).

    Raises:
        ConfigError: no checkpoint there, none that verifies, a damaged one named by its
            path, or one of another model.
    """
    try:
        ckpt = fallback.open_newest(path)
    except DtrainError as exc:
        raise ConfigError(f"checkpoint.resume: {exc}") from None
    saved = ckpt.meta.get("config", {}).get("model")
    if saved is not None and saved != model:
        diff = [f"model.{k} = {saved[k]!r} there, {model[k]!r} here" for k in model
                if saved.get(k) != model[k]]
        raise ConfigError(f"checkpoint {ckpt.path} holds another model ({'; '.join(diff)}): "
                          "resume with the config it was trained with")
    return ckpt


def save(folder: Path, step: int, held: Checkpointable, schedulers: list, config: dict[str, Any],
         keep_last: int, described: dict[str, Any] | None = None,
         copies: Copies | None = None, only: Collection[str] | None = None) -> Path:
    """Every rank of `held.checkpoint_group` writes the pieces it owns into the checkpoint
    of `step` in `folder`, with its RNG state; the first adds the run's description
    (`config`: the config as a dict; `described`: more keys for the metadata, such as the
    resolved model an export rebuilds). Returns the checkpoint's folder once it is
    published. A background save still in flight is waited for first. `copies`: hosts
    without a shared folder, each writing into its own and copying to others
    (dtrain.checkpoint.copies). `only`: the parameters saved (with their optimizer state;
    None: all): an adapter checkpoint's adapters, its frozen base left out.

    Raises:
        DtrainError: this checkpoint, or the background one before it, was not saved.
    """
    target = folder / f"step-{step:08d}"
    if not held.writes_checkpoint:
        return target
    background.finish(held.checkpoint_group)
    pieces, extra, meta, rng = _state(held, schedulers, config, described, only)
    if copies is not None:
        return copies.save(folder, step, pieces, extra, meta, keep_last, rng)
    return save_pieces(folder, step, pieces, extra, meta, keep_last,
                       group=held.checkpoint_group, rank_tensors=rng)


def save_in_background(folder: Path, step: int, held: Checkpointable, schedulers: list,
                       config: dict[str, Any], keep_last: int,
                       described: dict[str, Any] | None = None,
                       copies: Copies | None = None,
                       only: Collection[str] | None = None) -> PendingSave:
    """`save`, written by a background thread (dtrain.checkpoint.background): waits for the
    previous background save, copies this step's state to CPU memory and returns; training
    goes on while the copy is written. `wait()` on the result returns the published folder.

    Raises:
        DtrainError: the previous background save was not saved.
    """
    if not held.writes_checkpoint:
        return PendingSave(folder, step, path=folder / f"step-{step:08d}")
    background.finish(held.checkpoint_group)
    pieces, extra, meta, rng = _state(held, schedulers, config, described, only)
    return background.save(folder, step, pieces, extra, meta, keep_last,
                           group=held.checkpoint_group, rank_tensors=rng, copies=copies)


def _state(held: Checkpointable, schedulers: list, config: dict[str, Any],
           described: dict[str, Any] | None, only: Collection[str] | None = None
           ) -> tuple[list, dict, dict, dict]:
    """What a save writes: this rank's pieces (of the parameters `only` names, if given),
    the optimizer scalars, the run's metadata (JSON), and this rank's RNG state with what
    else it keeps for itself (error feedback, the outer optimizer of replicas:
    `held.rank_state()`)."""
    pieces, extra = held.state(only)
    optimizer = schedulers[0].optimizer
    meta = {"config": config, "layout": held.dims.to_dict(), "aliases": held.aliases(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in optimizer.param_groups],
            "scheduler": schedulers[0].state_dict(), "loss_scale": held.loss_scale,
            **(described or {})}
    rng = {"cpu": torch.get_rng_state(), **held.rank_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return pieces, extra, json.loads(json.dumps(meta, default=str)), rng


HOW_TO_STEP = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""A parameter group's options that say how this machine runs the step (dtrain.optim.build
`step_kernel`), not what the step does: a resume keeps its own (a checkpoint written on a
GPU, fused, resumes on a CPU with foreach kernels; one written before dtrain chose the
kernel resumes with the kernel chosen now)."""


def restore(ckpt: Checkpoint, held: Checkpointable, schedulers: list, dims: Dims,
            tensors: bool = True) -> None:
    """Model, optimizer state, options, schedule and loss scale from `ckpt`; the RNG and
    the rank's own state too when `dims` lays out its writers as the saver's did (the same
    ranks write one checkpoint: a sync group's, with the same tp and pp). `tensors`
    False: the model and optimizer state are in place already (an adapter checkpoint,
    read over its base as the Holding was built: dtrain.adapters.checkpoints)."""
    if tensors:
        held.restore(ckpt)
    for optimizer, scheduler in zip(held.optimizers, schedulers, strict=True):
        for group, options in zip(optimizer.param_groups, ckpt.meta["param_groups"],
                                  strict=False):
            group.update({k: tuple(v) if isinstance(v, list) else v
                          for k, v in options.items()
                          if k in group and k not in HOW_TO_STEP})
        scheduler.load_state_dict(ckpt.meta["scheduler"])
    held.loss_scale = ckpt.meta.get("loss_scale", 1.0)
    saved = ckpt.meta["layout"]
    writers = dims.world_size // dims.sync  # a sync group writes its own checkpoints
    if ckpt.index["world_size"] == writers and saved["tp"] == dims.tp \
            and saved["pp"] == dims.pp:
        rng = ckpt.rank_tensors(_writer_rank(held.checkpoint_group))
        torch.set_rng_state(rng.pop("cpu"))
        cuda = rng.pop("cuda", None)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda)
        held.load_rank_state(rng)


def _writer_rank(group: CheckpointGroup) -> int:
    """This rank's place among the ranks that write a checkpoint together."""
    from dtrain import comm

    if group is None or not dist.is_initialized():
        return 0
    return comm.resolve(None if group == "world" else group).rank
