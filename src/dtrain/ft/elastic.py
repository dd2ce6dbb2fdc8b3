"""An elastic job's layout for the ranks each round brings (`dtrain train --nnodes MIN:MAX`).

The launcher sets DTRAIN_ELASTIC_MAX_RANKS (`env.ELASTIC_MAX_RANKS`) to the most ranks the
job can have (rank 0's launcher's count is the job's). Each round, the ranks re-derive the
layout for the ranks that came: tensor and pipeline parallelism are kept when they still
divide the world, and data parallelism takes the rest; else the planner (dtrain.planner)
chooses the layout for the new world: the fastest it estimates that fits this machine's
memory, with its ZeRO stage, micro-batches, recomputation and sequence parallelism (rank 0
plans, on its own machine's figures, and sends the others its `PlannedLayout` as
`to_dict()`'s JSON); if none fits, data parallel over every rank is tried. The global batch
is kept: gradient accumulation grows so that no rank's forward holds more sequences than it
did with every rank there (under a planned layout, the planner's memory check speaks
instead). The run then resumes from the newest checkpoint (universal: any layout reads it)
on the very batches it would have seen (dtrain.data.batches draws each step's global batch
whatever the layout).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import TypeVar

import torch

from dtrain import comm, env
from dtrain.config import Config, config_from_dict
from dtrain.data import vocab_of
from dtrain.errors import ConfigError
from dtrain.models import resolve
from dtrain.planner import RECOMPUTE, PlannedLayout, plan, profile_model, recommend
from dtrain.planner.traced import machine
from dtrain.world import World

SENT_BYTES = 1024
"""Room for a PlannedLayout's JSON as rank 0 sends it (about 250 bytes)."""

_J = TypeVar("_J")  # a JSON value: rank 0's is of the kind every rank passes

Chooser = Callable[[Config, int, int], "PlannedLayout | None"]
"""(config, ranks, gradient accumulation) -> the layout for that many ranks, or None."""


def max_ranks(world: World | None = None) -> int:
    """The most ranks of this elastic job; 0 when the job is not elastic. Given the world,
    rank 0's figure, sent to every rank (a collective call): launchers starting different
    numbers of ranks count differently, and every rank must cut the batch alike."""
    most = env.ELASTIC_MAX_RANKS.get()
    if world is None or not most or world.world_size == 1:
        return most
    return _rank0s(world, [most])[0]


def _rank0s(world: World, values: list[int]) -> list[int]:
    """Rank 0's `values` on every rank (a collective call; the others pass as many)."""
    sent = torch.tensor(values, dtype=torch.int64, device=world.device)
    comm.broadcast(sent, 0)
    return sent.tolist()


def _rank0s_json(world: World, value: _J) -> _J:
    """Rank 0's `value` (plain JSON values) on every rank, as the bytes of its JSON text (a
    collective call; the others' `value` is not read). JSON, never pickle: nothing
    received can run code."""
    text = json.dumps(value).encode() if world.rank == 0 else b""
    if len(text) > SENT_BYTES:
        raise ValueError(f"{len(text)} bytes of JSON to send, more than {SENT_BYTES}")
    received = _rank0s(world, list(text.ljust(SENT_BYTES, b" ")))
    sent: _J = json.loads(bytes(received).decode())
    return sent


def _said(planned: PlannedLayout) -> str:
    """A planned layout as the banner's note says it ("dp=3, tp=1, pp=1, zero=1")."""
    layout = planned.dims
    parts = [f"dp={layout.dp}", f"tp={layout.tp}", f"pp={layout.pp}"]
    parts += [f"zero={layout.zero}"] if layout.zero else []
    parts += [f"{layout.microbatches} micro-batches"] if layout.pp > 1 else []
    parts += [f"recomputing {planned.recompute}"] if planned.recompute != "none" else []
    parts += ["sequence parallel"] if planned.sequence_parallel else []
    return ", ".join(parts)


def planned(config: Config, world_size: int, accum: int,
            local_ranks: int = 1) -> PlannedLayout | None:
    """The planner's best layout of `config`'s model for `world_size` ranks and its global
    batch, on this machine's figures (`local_ranks` of them sharing its memory); None if
    no layout fits."""
    dc, p = config.data, config.parallel
    shape = resolve(config.model, vocab_of(dc.path, dc.format, dc.tokenizer))
    memory, _ = machine.device_memory(local_ranks)
    first = RECOMPUTE.index(config.memory.recompute)
    estimates = plan(functools.cache(lambda b: profile_model(shape, b)), world_size, memory,
                     config.train.batch_size, machine.measured_flops(), machine.links(),
                     config.optimizer.name, accum, config.comm.bucket_mb, (p.schedule,),
                     RECOMPUTE[first:], (True,) if p.sequence_parallel else (False, True))
    best, _ = recommend(estimates)
    return None if best is None else best.planned


def agreed(world: World) -> Chooser:
    """`planned` on rank 0, its choice sent to every rank as `PlannedLayout.to_dict()`
    (machines may differ in memory and speed; ranks choosing differently could not train
    together). A collective call."""
    def choose(config: Config, world_size: int, accum: int) -> PlannedLayout | None:
        chosen = planned(config, world_size, accum, world.local_world_size) \
            if world.rank == 0 else None
        values = _rank0s_json(world, None if chosen is None else chosen.to_dict())
        return None if values is None else PlannedLayout.from_dict(values)
    return choose


def adapt(config: Config, world_size: int, most: int,
          choose: Chooser = lambda config, world_size, accum: None) -> tuple[Config, str]:
    """`config` for `world_size` ranks of a job that may have up to `most`, and a note for
    the banner ("" when the layout is the configured one). `choose` picks the layout when
    the configured tp x pp does not divide the world (`agreed` in a job; by default none:
    data parallel over every rank).

    Raises:
        ConfigError: the global batch cannot be cut evenly for this many ranks.
    """
    p, t = config.parallel, config.train
    keep = world_size % (p.tp * p.pp) == 0
    tp, pp = (p.tp, p.pp) if keep else (1, 1)
    accum = _accumulation(config, world_size, world_size // (tp * pp), pp, most)
    replicas = p.dp_replicate if (world_size // (tp * pp * p.cp)) % p.dp_replicate == 0 else 1
    if keep and accum == t.grad_accum and p.dp in (0, world_size // (tp * pp)) and \
            replicas == p.dp_replicate:
        return config, ""
    choice = None if keep else choose(config, world_size, accum)
    values = config.to_dict()
    if choice is None:
        values["parallel"].update(dp=0, tp=tp, pp=pp, dp_replicate=replicas)
        values["train"]["grad_accum"] = accum
        how = "" if keep else f"; tp={p.tp} x pp={p.pp} does not divide it: dropped"
        if replicas != p.dp_replicate:
            how += f"; dp_replicate={p.dp_replicate} does not divide its ranks: one replica"
    else:
        layout = choice.dims
        values["parallel"].update(dp=layout.dp, tp=layout.tp, pp=layout.pp, zero=layout.zero,
                                  dp_replicate=layout.dp_replicate,
                                  microbatches=layout.microbatches,
                                  sequence_parallel=choice.sequence_parallel)
        values["memory"]["recompute"] = choice.recompute
        accum = accum if layout.pp == 1 else 1  # a pipeline's micro-batches cut the batch
        values["train"]["grad_accum"] = accum
        how = (f"; tp={p.tp} x pp={p.pp} does not divide it: the planner's best is "
               f"{_said(choice)}")
    note = (f"elastic: {world_size} of up to {most} ranks{how}; gradient accumulation "
            f"{accum} keeps the global batch of {t.batch_size}")
    return config_from_dict(values), note


def _accumulation(config: Config, world_size: int, dp: int, pp: int, most: int) -> int:
    """The least gradient accumulation, from the configured one up, that cuts the global
    batch evenly over `dp` data-parallel ranks (of `pp` stages) without a forward larger than with
    `most` ranks."""
    p, t = config.parallel, config.train
    dp_most = max(1, most // (p.tp * p.pp))
    micro = p.microbatches if pp > 1 else 1
    largest = t.batch_size // (dp_most * t.grad_accum)  # sequences per forward at full size
    for accum in range(t.grad_accum, t.batch_size + 1):
        if t.batch_size % (dp * accum * micro) == 0 and t.batch_size // (dp * accum) <= largest:
            return accum
    raise ConfigError(
        f"train.batch_size = {t.batch_size} cannot be cut evenly for {world_size} ranks "
        f"(data parallel over {dp}): make it a multiple of every data-parallel size the "
        "job may have (say the least common multiple of them)")
