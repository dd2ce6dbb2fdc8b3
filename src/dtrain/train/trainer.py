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
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch

from dtrain import adapters, comm, env, faults, layouts, models, timeline
from dtrain import world as world_mod
from dtrain.adapters import AdapterConfig, checkpoints
from dtrain.adapters.peft import PeftFolder
from dtrain.checkpoint import training
from dtrain.checkpoint.background import PendingSave
from dtrain.checkpoint.copies import HostCopies
from dtrain.checkpoint.universal import Checkpoint
from dtrain.config import Config, LoggingConfig, dims_of
from dtrain.context_parallel import chunks
from dtrain.data import Tokenizer, batches
from dtrain.data.dataset import data_of
from dtrain.data.sequences import Batch, Sequences, check_pairs
from dtrain.errors import ConfigError
from dtrain.ft import elastic
from dtrain.ft.live.job import open_live
from dtrain.ft.membership import Fixed, Membership, RunOver
from dtrain.layouts import Holding
from dtrain.mesh import Mesh
from dtrain.models import compiled, init, moe
from dtrain.models.config import ModelConfig
from dtrain.models.generate import generate
from dtrain.models.weights import SlicedWeights, weights_of
from dtrain.optim import lr_factor
from dtrain.train import hardware
from dtrain.train.check import check_rows
from dtrain.train.generation import generate_split, splits_model
from dtrain.train.metrics import Progress
from dtrain.train.objective import Preference
from dtrain.train.sinks import Value, open_sinks
from dtrain.train.speed import StepSpeed, flops_per_token


def mean_over(value: float, group: comm.GroupLike, device: torch.device) -> float:
    """`value` averaged over `group` (None: this rank's own)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    return comm.all_reduce(t, op="avg", group=group).item()


def _world_ranks(group: comm.GroupLike) -> list[int]:
    """The world ranks of `group`'s members, in its order (None: this rank alone)."""
    if group is None:
        return [comm.resolve(None).rank]
    g = comm.resolve(group)
    return [g.global_rank(i) for i in range(g.size)]


class StepLoss:
    """A step's reported loss: each rank's own averaged over the Holding's loss group, then
    over the sync groups.

    Where the world's ranks meet after every step (`gathered`), each rank keeps its own loss
    and the losses of the steps since the last log travel with their speed figures in one
    all-gather over the world (dtrain.train.speed.StepSpeed.take); `of` averages them as
    `mean_over`'s two all-reduces would: a sum of a few float32 losses is exact in float64
    in any order, so the mean is the same number. Elsewhere (live replicas, whose worlds
    may change between steps, and parameter-server workers) each step's loss is averaged
    at once by those all-reduces, as it always was, and kept averaged.

    Args:
        loss_group: the Holding's `loss_group`.
        sync_group: this rank's counterparts in the other sync groups.
        device: where collectives take their tensors.
        gathered: whether the losses are gathered with the speed figures.
    """

    def __init__(self, loss_group: comm.GroupLike, sync_group: comm.GroupLike,
                 device: torch.device, gathered: bool) -> None:
        self.loss_group, self.sync_group, self.device = loss_group, sync_group, device
        self.gathered = gathered
        # the world ranks averaged: for each sync group (this rank's counterpart in it), its
        # ranks of this rank's loss group. sync is the mesh's outermost axis, so a
        # counterpart's group is this rank's shifted by the distance between the two.
        self.ranks: list[list[int]] = []
        if gathered:
            me, members = comm.resolve(None).rank, _world_ranks(loss_group)
            self.ranks = [[q + other - me for q in members]
                          for other in _world_ranks(sync_group)]

    def now(self, own: float) -> float:
        """`own` averaged over the groups at once (collectives over both)."""
        return mean_over(mean_over(own, self.loss_group, self.device), self.sync_group,
                         self.device)

    def kept(self, own: float) -> float:
        """What this rank keeps of a step's loss until its figures are taken: its own where
        the losses are gathered, else the average (collectives, now)."""
        return own if self.gathered else self.now(own)

    def of(self, carried: list[float]) -> float:
        """The step's loss from what the ranks kept of it (by world rank where gathered;
        this rank's average alone elsewhere)."""
        if not self.gathered:
            return carried[0]
        means = [sum(carried[r] for r in ranks) / len(ranks) for ranks in self.ranks]
        return sum(means) / len(means)


@dataclass(frozen=True)
class Unrecorded:
    """A step trained and not yet recorded: what its record holds besides the loss and the
    speed figures gathered at the next log (`rest`: the gradient norm, bytes sent, and the
    membership's, MoE's, tokens' and DPO's figures, in the record's order)."""

    step: int
    time: float
    lr: float
    seconds: float
    tokens_per_s: float
    rest: dict[str, Value]


@torch.no_grad()
def evaluate(holding: Holding, data: Sequences, batch_size: int, n_batches: int,
             mesh: Mesh, device: torch.device) -> float:
    """Mean loss over the first `n_batches` held-out batches of every dp rank's shard:
    each batch's loss the mean over its targets, where not every position is one (each
    rank's share weighed by its targets), and the batches' losses averaged."""
    dp_size, dp_rank = mesh.size("dp"), mesh.coords["dp"]
    holding.module.eval()
    stream = batches(data, batch_size * dp_size, dp_size, dp_rank, seed=0, shuffle=False)
    taken = [on_rank(batch, mesh, device) for _, batch in zip(range(n_batches), stream,
                                                               strict=False)]
    total = sum(holding.evaluate(batch).item() for batch in taken)
    holding.module.train()
    mine = mean_over(total / len(taken), holding.loss_group, device)
    return mean_over(mine, mesh.group("sync"), device)  # and over the sync groups


def on_rank(batch: Batch, mesh: Mesh, device: torch.device, shares: int | None = None
            ) -> Batch:
    """This rank's chunks of each row of `batch` (all of it, or under context parallelism
    its two of 2 x cp: dtrain.context_parallel.chunks) on `device`, weighed as one of
    `shares` batch shares of a step (the data shards x cp x accumulation; None: cp x
    the batches a held-out pass averages, which `batches` cuts from one global count)."""
    mine = batch.map(lambda t: chunks.shard(t, mesh.coords["cp"], mesh.size("cp")))
    # counted on the host: on a GPU a count of the moved targets would wait for the copy
    mine = mine.shared(shares if shares is not None else mesh.size("cp") * mesh.size("dp"))
    return mine.map(lambda t: t.to(device))


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
    return Trainer(config, metrics_path).run()


class Trainer:
    """One rank's run of `dtrain train`: `Trainer(config)` sets it up (world, layout, data,
    model, the checkpoint it resumes from), `run()` trains: `step()` after step, with
    `evaluate()` and `save()` every so often.

    Who takes part in each step is fault tolerance's answer (`membership`, a
    dtrain.ft.membership.Membership): every sync group, or the live replicas. The Trainer
    never asks which layout or which kind of membership it has: the Holding and the
    Membership say what differs for it (`lockstep`, `worlds`, `steady`).
    """

    def __init__(self, config: Config, metrics_path: str = "") -> None:
        backend = None if config.comm.backend == "auto" else config.comm.backend
        # Under dtrain's launcher with a timeline (env DTRAIN_TIMELINE) the launcher merges it.
        self.own_timeline = "" if env.TIMELINE.is_set() else config.logging.timeline
        world = self.world = world_mod.init(backend=backend, timeline=self.own_timeline or None)
        # hosts without a shared folder copy checkpoints over a group of their own, which
        # every rank makes first (dtrain.checkpoint.copies)
        self.host_copies = HostCopies.open(config.checkpoint.copies, world.node_rank) \
            if config.checkpoint.copies else None
        live = open_live(config, world)  # live replicas: each a world (dtrain.ft.live.job)
        self.note = ""
        most = elastic.max_ranks(world)
        if most:  # this round's ranks: the layout and accumulation fit them
            config, self.note = elastic.adapt(config, world.world_size, most,
                                              elastic.agreed(world))
        self.config = config
        tc, mc = config.train, config.model
        self.dims = dims_of(config, world.world_size)  # the one place they are worked out
        mesh = self.mesh = Mesh(self.dims)
        groups, group = mesh.size("sync"), mesh.coords["sync"]
        self.membership: Membership = live or Fixed(groups, group)
        # sync groups, synchronized every sync.every steps, each keep checkpoints of their own
        self.run_dir = Path(tc.out_dir) / (f"sync-group-{group}" if group else "")
        if self.host_copies is not None:  # from this host's folder, filled from the others
            self.host_copies.keep(self.run_dir / "checkpoints")  # (live replicas' keeper)
            spec = training.resume_spec(config.checkpoint.resume)
            resume_from = spec and self.host_copies.resume(
                self.run_dir / "checkpoints" if spec == "auto" else spec)
        else:
            resume_from = training.resume_path(config.checkpoint.resume, self.run_dir)
            # the newest that verifies: damaged newer ones moved aside by one rank
            resume_from = training.fall_back(resume_from, world.device)
        if groups > 1:
            resume_from = training.agreed_resume(resume_from, world.device)
        self.resume = open_checkpoint(resume_from, config) if resume_from else None
        self.start = self.resume.step if self.resume is not None else 0

        dc = config.data
        self.data = data_of(dc, mc.block_size)
        check_rows(self.data, config)
        # (data shards, this rank's): the batch splits over the copies of the model that
        # train together (sync groups or live replicas), and over the dp ranks in each
        members, dp = self.membership, self.dims.dp
        self.shards = (members.copies * dp, members.copy * dp + mesh.coords["dp"])
        if self.data.pairs:  # each rank's micro-batches hold whole pairs
            check_pairs(tc.batch_size, self.shards[0], tc.grad_accum)
        self.per_rank = self.dims.per_rank_batch(  # sequences per forward
            tc.batch_size, tc.grad_accum, live_replicas=members.worlds)

        self.shape = models.resolve(mc, self.data.vocab_size)
        self.peft = PeftFolder.read(self.shape.init_from) if self.shape.init_from else None
        if self.peft is not None:  # a PEFT folder: its adapters over its base model
            self.shape = dataclasses.replace(self.shape, init_from=self.peft.base)
            config.adapter = self.peft.adapter_config(config.adapter, self.shape)
        torch.manual_seed(tc.seed)
        # each rank allocates only what it holds; adapters, if any, beside a frozen base
        self.model = init.skeleton(lambda: adapters.built(self.shape, config.adapter))
        self.n_params = sum(p.numel() for p in self.model.parameters())  # before any split
        self.moe = moe.moe_layers(self.model)
        # adapters are saved without their base, which the checkpoint names instead
        lora = config.adapter.kind == "lora"
        self.saved_names = checkpoints.saved_names(self.model) if lora else None
        self.base = checkpoints.base_identity(self.shape, tc.seed,
                                              model_meta(self.model).get("hf_config")) \
            if lora else None
        if self.resume is not None:
            checkpoints.check_base(self.resume, self.base)
        self.weights = self._starting_weights()
        self.holding = layouts.build(self.model, mesh, config, weights=self.weights,
                                     averaging=members.averaging)
        self.stream = self._stream_from(self.start)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: lr_factor(s, tc.steps, config.optimizer))
            for o in self.holding.optimizers]
        if self.resume is not None:  # the options, schedule and RNG too
            training.restore(self.resume, self.holding.saved, self.schedulers, self.dims,
                             tensors=not checkpoints.holds_adapters_alone(self.resume))
        self.holding.start()
        self.preference = self._preference()
        members.track(self.holding.optimizers[0], self.schedulers[0])

        self.main = world.is_main and members.first
        self.progress = Progress(tc.steps, config.logging.log_every, enabled=self.main)
        self.metrics = open_sinks(  # the JSON-lines file, TensorBoard, W&B (dtrain.train.sinks)
            config, metrics_path, enabled=world.is_main,
            resumed=(self.resume is not None and not config.checkpoint.resume)
            or members.joined_late, say=self.progress.write)
        peak = hardware.peak_of(config.logging.peak_tflops, world.device) if world.is_main \
            else hardware.Peak(0.0, "rank 0 reports")
        # asynchronous workers, and live replicas (whose members change between steps),
        # report their own figures and average each step's loss at once
        gathered = self.holding.lockstep and members.steady
        self.speed = StepSpeed(flops_per_token(self.shape, self.n_params), peak,
                               ranks=world.world_size * members.worlds,
                               device=world.device, group=None, gather=gathered,
                               every=config.logging.log_every)
        self.loss = StepLoss(self.holding.loss_group, mesh.group("sync"), world.device,
                             gathered)
        self.grad_norm = 0.0  # the last step's, before clipping (recorded every step)
        self.recorded: tuple[int, dict[str, Value]] | None = None  # the last step's record
        self.unrecorded: list[Unrecorded] = []  # steps kept since the last log
        tokenizer_file = self.data.tokenizer.path and str(Path(self.data.tokenizer.path).resolve())
        self.described = {"model": dataclasses.asdict(self.shape), "tokenizer": tokenizer_file,
                          **model_meta(self.model),
                          **({checkpoints.BASE: self.base} if self.base else {})}
        self.losses: list[float] = []
        self.eval_losses: list[tuple[int, float]] = []
        self.step_rows: Batch | None = None  # the last step's first micro-batch

    def _starting_weights(self) -> Checkpoint | SlicedWeights | None:
        """What the Holding is built from: an adapter checkpoint resumed, read over its
        base; a new run's `init_from` folder (beneath the adapters of a PEFT folder, or
        the seed's); None: the seed's values (a whole checkpoint resumed is read after)."""
        shape, model, seed = self.shape, self.model, self.config.train.seed
        if self.resume is not None:
            if not checkpoints.holds_adapters_alone(self.resume):
                return None
            return checkpoints.checkpoint_weights(self.resume, shape, model, seed)
        if self.config.adapter.kind == "lora":
            over = self.peft.weights(shape, model) if self.peft is not None else None
            return checkpoints.starting_weights(shape, model, seed, over)
        return weights_of(shape, model) if shape.init_from else None

    def _stream_from(self, step: int) -> Iterator[Batch]:
        tc = self.config.train
        return batches(self.data.train, tc.batch_size, *self.shards, tc.seed, shuffle=True,
                       accum=self.holding.accum, start=step)

    def _banner(self) -> None:
        world, data, tc = self.world, self.data, self.config.train
        who = self.membership.describe(f"{world.world_size} rank(s), {self.holding.describe()}",
                                       world.world_size)
        self.progress.write(f"dtrain: {who}; "
                            f"{describe_model(self.shape, self.model)} {self.n_params / 1e6:.2f}M "
                            f"parameters; {len(data.train):,} training sequences of "
                            f"{self.config.model.block_size} tokens ({data.tokenizer.name}); "
                            f"global batch {tc.batch_size}")
        if world.source not in ("single", "dtrain"):  # started by torchrun, srun or mpirun
            self.progress.write(f"dtrain: {world.describe()}")
        if self.note:
            self.progress.write(self.note)
        for note in data.notes:
            self.progress.write(f"data: {note}")
        self.progress.write(self.speed.describe())
        if self.resume is not None:
            self.progress.write(f"resumed from {self.resume.path} (step {self.start})")
        elif self.shape.init_from:
            adapters_from = f", adapters from {self.peft.path}" if self.peft is not None else ""
            self.progress.write(f"weights from {self.shape.init_from}{adapters_from}")

    def run(self) -> dict[str, Any]:
        """Train from the step resumed to `train.steps`; evaluate, save and sample as the
        config says. Returns the losses, held-out losses and the last checkpoint's path."""
        config, tc = self.config, self.config.train
        self._banner()
        tokens_per_step = tc.batch_size * config.model.block_size
        path = self.resume.path if self.resume is not None else self.run_dir / "checkpoints"
        step = self.start
        while step < tc.steps:
            try:
                at = self.membership.begin_step(step + 1)
            except RunOver as exc:  # the run finished while this replica waited to rejoin
                print(f"dtrain: {exc}", file=sys.stderr, flush=True)
                return {"losses": self.losses, "eval_losses": self.eval_losses,
                        "checkpoint": ""}
            if at != step + 1:  # a replacement, at its peers' step
                self.stream = self._stream_from(at - 1)
            step = at
            faults.at("step", step)
            begin, sent = time.perf_counter(), comm.sent_total()
            self.speed.begin()
            with timeline.span("step", "step", step=step):
                # this rank's loss, or where the ranks are not gathered the average (as ever)
                kept_loss = self.loss.kept(self._step_here())
            elapsed, sent = time.perf_counter() - begin, comm.sent_total() - sent
            if step == self.start + 1 and config.train.compile:  # once, what compiling took
                self.progress.write(compiled.report(compiled.compile_stats()))
            self.progress.tick()
            every = config.checkpoint.every
            checkpoint = bool(every) and step % every == 0 and step < tc.steps
            evaluating = bool(tc.eval_every) and step % tc.eval_every == 0 and step < tc.steps
            compared = self.membership.compare() if checkpoint else {}
            self.speed.keep(step, elapsed, tokens_per_step / elapsed, kept_loss)
            self.unrecorded.append(Unrecorded(
                step, time.time(),
                # a float: dtrain's learning rates are not tensors
                self.schedulers[0].get_last_lr()[0],  # type: ignore[arg-type]
                elapsed, tokens_per_step / elapsed, {
                    "grad_norm": self.grad_norm, "sent_bytes": sent,
                    **self.membership.step_metrics(), **compared,
                    **self._moe_metrics(), **self._token_metrics(tokens_per_step, elapsed),
                    **self._preference_metrics(training=True)}))
            # the records go out in step order before an evaluation's, and with the state a
            # checkpoint saves (a run resumed from it misses none)
            if step % config.logging.log_every == 0 or step >= tc.steps or checkpoint \
                    or evaluating or not self.speed.gather:
                self._record_kept()
            if evaluating:
                self.evaluate(step)
            if checkpoint:
                if config.checkpoint.background:
                    self.save(step, background=True)
                else:
                    path = self.save(step)
        self.progress.close()
        self.holding.finish_rounds()
        self.holding.close()
        self.membership.finish()
        self.evaluate(tc.steps)
        if self.start < tc.steps:
            path = self.save(tc.steps)
        if self.main:
            self.progress.write(f"checkpoint: {path}")
        if config.logging.sample_tokens:
            self.print_sample(path)
        self.metrics.close()
        if self.own_timeline:
            self.progress.write(f"timeline: {_write_own_timeline(self.world)}")
        return {"losses": self.losses, "eval_losses": self.eval_losses, "checkpoint": str(path)}

    def print_sample(self, path: Path) -> None:
        """Rank 0 prints `logging.sample_tokens` tokens generated after `logging.
        sample_prompt`: by every rank from the model as it holds it when the layout splits
        it (dtrain.train.generation), else by rank 0 from the checkpoint at `path`, built
        whole there. The same seed and draws either way: the same text."""
        lc = self.config.logging
        if splits_model(self.config, self.dims) and self.membership.steady:
            tokenizer = self.data.tokenizer
            ids = generate_split(self.holding, self.model, self.mesh,
                                 tokenizer.encode(lc.sample_prompt) or tokenizer.separator,
                                 lc.sample_tokens, seed=0, temperature=0.8,
                                 vocab_size=self.shape.vocab_size)
            text, how = tokenizer.decode(ids), f" (in split form: {self.dims})"
        else:
            if self.host_copies is not None:  # this host's folder lacks other hosts' files
                resumed = self.host_copies.resume(path)
                assert resumed is not None  # a checkpoint of this run, which a host holds
                path = Path(resumed)
            how = ""
            if self.main:  # from the checkpoint: whole, here
                text = sample(self.shape, Checkpoint(path), self.data.tokenizer, lc,
                              self.world.device, self.config.adapter)
        if self.main:
            self.progress.write(f"sample{how}:\n" + text)

    def _record_kept(self) -> None:
        """Record every step kept since the last time, in step order: their speed figures
        and losses taken from every rank at once (`StepSpeed.take`, one collective), each
        step printed and written as it would have been at its end."""
        for measured, kept in zip(self.speed.take(), self.unrecorded, strict=True):
            step, loss = kept.step, self.loss.of(measured.carried)
            self.losses.append(loss)
            self.progress.step(step, loss, kept.tokens_per_s, measured.figures)
            if measured.straggler:
                self.progress.write(measured.straggler)
            record: dict[str, Value] = {
                "time": kept.time, "loss": loss, "lr": kept.lr, "step_time_s": kept.seconds,
                "tokens_per_s": kept.tokens_per_s, **measured.figures, **kept.rest}
            faults.at("record", step)
            if self.membership.writes():
                before = self.recorded
                if self.membership.took_over() and before is not None and \
                        before[0] == step - 1 and not self.metrics.has(before[0]):
                    self.metrics.record(*before)  # the writer gone may not have
                self.metrics.record(step, record)
            self.recorded = (step, record)
        self.unrecorded = []

    def step(self) -> float:
        """Forward and backward of one global batch, the optimizer step; the mean loss (a
        collective; the loop itself averages it at the next log, `_record_kept`)."""
        return self.loss.now(self._step_here())

    def _step_here(self) -> float:
        """`step`, its loss this rank's own."""
        holding, device = self.holding, self.world.device
        data = []
        shares = self.shards[0] * self.dims.cp * holding.accum
        for _ in range(holding.accum):
            with timeline.span("data", "data"):
                data.append(on_rank(next(self.stream), self.mesh, device, shares))
        self.step_rows = data[0]  # its counts of targets and padding are the step's
        loss = holding.forward_backward(data)
        with timeline.span("optimizer", "optimizer"):
            # the global norm before clipping, every step: a wrong divisor over any axis
            # shows in it whatever the optimizer (Adam's update is blind to a scale)
            clip = self.config.optimizer.grad_clip
            self.grad_norm = holding.clip_grad_norm_(clip if clip > 0 else math.inf)
            if self.membership.applies_step():  # a dropped replica is sent the state anew
                holding.step()
                for scheduler in self.schedulers:
                    scheduler.step()
            holding.zero_grad()
            if self.moe:  # the step's load over the data-parallel (and cp) ranks: biases
                moe.after_step(self.model, self.mesh.group("dp_cp"))
        return loss.item()

    def _token_metrics(self, positions: int, elapsed: float) -> dict[str, Value]:
        """Where not every position is a target: the step's target tokens (the loss's
        count), their rate, and the share of its positions that were padding."""
        rows = self.step_rows
        if rows is None or rows.targets_in_step is None:
            return {}
        filled = positions if rows.filled_in_step is None else rows.filled_in_step
        return {"target_tokens": rows.targets_in_step,
                "target_tokens_per_s": rows.targets_in_step / elapsed,
                "padding": round(1 - filled / positions, 6)}

    def _moe_metrics(self) -> dict[str, list[float]]:
        """Each MoE layer's load imbalance (max / mean assignments per expert) and dropped
        share in the last step, over the data-parallel ranks; nothing for a dense model."""
        balance = [m.balance for m in self.moe if m.balance is not None]
        if not balance:
            return {}
        return {"moe_imbalance": [round(b[0], 4) for b in balance],
                "moe_dropped": [round(b[1], 4) for b in balance]}

    def _preference(self) -> Preference | None:
        """DPO's objective, set on the holding (None: the model's own loss).

        Raises:
            ConfigError: a resumed DPO run without LoRA (its reference, the starting
                weights, is not in the checkpoint).
        """
        config = self.config
        if config.objective.kind != "dpo":
            return None
        adapted = config.adapter.kind == "lora"
        if self.resume is not None and not adapted:
            raise ConfigError('objective.kind = "dpo" without adapters does not resume yet (its '
                              'reference, the starting weights, is not in the checkpoint): '
                              'start the run again, or train adapters ([adapter] kind = "lora")')
        preference = Preference(config.objective, self.holding.module, adapted,
                                self.shape.vocab_size, self.mesh.group("tp"))
        self.holding.objective = preference
        return preference

    def _preference_metrics(self, training: bool) -> dict[str, Value]:
        """DPO's rewards and log-probabilities over the step's (or the held-out pass's)
        pairs on every data-parallel rank; nothing for other objectives."""
        if self.preference is None:
            return {}
        figures = self.preference.take(training, self.mesh.group("dp"), self.world.device)
        return {(k if training else f"eval_{k}"): v for k, v in figures.items()}

    def evaluate(self, step: int) -> None:
        """The held-out loss at `step`, printed and recorded."""
        with timeline.span("eval", "eval", step=step):
            loss = evaluate(self.holding, self.data.val, self.per_rank,
                            self.config.train.eval_batches, self.mesh, self.world.device)
        self.eval_losses.append((step, loss))
        held = self._preference_metrics(training=False)
        accuracy = (f", reward accuracy {held['eval_reward_accuracy']:.3f}"
                    if "eval_reward_accuracy" in held else "")
        self.progress.write(f"step {step:>5}: held-out loss {loss:.4f}{accuracy}")
        if self.membership.writes():
            self.metrics.record(step, {"eval_loss": loss, **held})

    @overload
    def save(self, step: int, background: Literal[False] = ...) -> Path: ...
    @overload
    def save(self, step: int, background: bool) -> Path | PendingSave: ...

    def save(self, step: int, background: bool = False) -> Path | PendingSave:
        """The checkpoint of `step`: its folder, or in the background (training goes on
        while it is written) its PendingSave (dtrain.checkpoint.background)."""
        folder = self.run_dir / "checkpoints"
        if not self.membership.writes():
            return folder
        how = training.save_in_background if background else training.save
        with timeline.span("checkpoint", "checkpoint", step=step):
            return how(folder, step, self.holding.saved, self.schedulers, self.config.to_dict(),
                       self.config.checkpoint.keep_last, self.described, self.host_copies,
                       self.saved_names)


def _write_own_timeline(world: world_mod.World) -> str:
    """Write the timeline of a job no dtrain launcher merges (`dtrain train` as one process,
    or under torchrun or srun): each rank its part, then rank 0 merges the parts it can
    see (all of them on one host or a shared filesystem). Returns the timeline's path."""
    assert world.timeline is not None  # the world was started with one (own_timeline)
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


def sample(shape: ModelConfig, ckpt: Checkpoint, tokenizer: Tokenizer, cfg: LoggingConfig,
           device: torch.device, adapter: AdapterConfig | None = None) -> str:
    """Generate `cfg.sample_tokens` tokens after `cfg.sample_prompt` with the model saved
    in `ckpt` (built whole here, straight from the checkpoint, with its `adapter`s),
    decoded as text."""
    torch.manual_seed(0)
    skeleton = init.skeleton(lambda: adapters.built(shape, adapter or AdapterConfig()))
    plain = init.materialized(skeleton, checkpoints.checkpoint_weights(ckpt, shape, skeleton),
                              device)
    prompt = tokenizer.encode(cfg.sample_prompt) or tokenizer.separator
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    out = generate(plain, idx, cfg.sample_tokens, shape.block_size,
                   generator=torch.Generator(device).manual_seed(0))
    return tokenizer.decode(out[0].tolist())
