"""An elastic job's layout for the ranks each round brings (`dtrain train --nnodes MIN:MAX`).

The launcher sets `ELASTIC_ENV` to the most ranks the job can have. Each round, every rank
re-derives the layout for the ranks that came: tensor and pipeline parallelism are kept
when they still divide the world, else dropped (data parallel over every rank); data
parallelism takes the rest. The global batch is kept: gradient accumulation grows so that
no rank's forward holds more sequences than it did with every rank there. The run then
resumes from the newest checkpoint (universal: any layout reads it) on the very batches it
would have seen (dtrain.data.batches draws each step's global batch whatever the layout).
"""

from __future__ import annotations

import dataclasses
import os

from dtrain.config import Config
from dtrain.errors import ConfigError

ELASTIC_ENV = "DTRAIN_ELASTIC_MAX_RANKS"


def max_ranks() -> int:
    """The most ranks of this elastic job; 0 when the job is not elastic."""
    return int(os.environ.get(ELASTIC_ENV, "0") or 0)


def adapt(config: Config, world_size: int, most: int) -> tuple[Config, str]:
    """`config` for `world_size` ranks of a job that may have up to `most`, and a note for
    the banner ("" when the layout is the configured one).

    Raises:
        ConfigError: the global batch cannot be cut evenly for this many ranks.
    """
    p, t = config.parallel, config.train
    keep = world_size % (p.tp * p.pp) == 0
    tp, pp = (p.tp, p.pp) if keep else (1, 1)
    dp, dp_most = world_size // (tp * pp), max(1, most // (p.tp * p.pp))
    micro = p.microbatches if pp > 1 else 1
    largest = t.batch_size // (dp_most * t.grad_accum)  # sequences per forward at full size
    for accum in range(t.grad_accum, t.batch_size + 1):
        if t.batch_size % (dp * accum * micro) == 0 and t.batch_size // (dp * accum) <= largest:
            break
    else:
        raise ConfigError(
            f"train.batch_size = {t.batch_size} cannot be cut evenly for {world_size} ranks "
            f"(data parallel over {dp}): make it a multiple of every data-parallel size the "
            "job may have (say the least common multiple of them)")
    if (tp, pp, accum) == (p.tp, p.pp, t.grad_accum) and p.dp in (0, dp):
        return config, ""
    changed = dataclasses.replace(
        config, parallel=dataclasses.replace(p, dp=0, tp=tp, pp=pp),
        train=dataclasses.replace(t, grad_accum=accum))
    dropped = "" if keep else f"; tp={p.tp} x pp={p.pp} does not divide it: dropped"
    note = (f"elastic: {world_size} of up to {most} ranks{dropped}; gradient accumulation "
            f"{accum} keeps the global batch of {t.batch_size}")
    return changed, note
