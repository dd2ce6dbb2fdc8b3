"""A rank's peak memory while `dtrain.layouts.build` makes its share of a model from a
skeleton (split-form construction, dtrain.models.init), per layout.

The skeleton holds no parameter memory. The layout allocates what the rank holds (its tp
blocks, its pipeline pieces, or its ZeRO shards) and fills it from the initial values
(`Initial`), drawn in generator groups of whole rows of at most `CHUNK` elements and read
a few rows at a time (about as many elements), so that one tensor's filling needs one
group and the rows read from it (twice: the pieces and the rows joined), on top of what
the rank holds (fp32, 4 bytes each; Ψ is what the rank holds after tp and pp split the
model and ep its experts, N = dp x cp, the ranks holding the same parameters; ZeRO 3's
shards hold a rank's experts over the dp / ep ranks holding the same ones, every expert's
over N):

    dp (DataParallel)   parameters 4Ψ, then each tensor in turn (the gradient buckets
                        are allocated at the first backward)
    ZeRO 1, ZeRO 2      the unit buffers 4Ψ (stage 1's unsharded gradients: at the first
                        backward)
    ZeRO 3              this rank's shards 4Ψ/N (a unit is allocated at its first gather)

A ZeRO rank reads each parameter's span of its shard in turn (a tensor tp divides: its
whole block); ZeRO 1 and 2 then all-gather the units into their buffers straight from the
fp32 shards (under mixed precision from a compute-dtype copy of a few shards, which this
model leaves out). Before
split-form construction every rank built the whole model first: its peak was at least the
whole model, 4 bytes per parameter, whatever the layout (`whole_model`).
"""

from __future__ import annotations

from dtrain.job_layout import Layout
from dtrain.models import init
from dtrain.models.weights import ROWS_AT_ONCE
from dtrain.planner.costs import PARAM_BYTES
from dtrain.planner.traced.profile import Params, ParamTensor


def group_elements(t: ParamTensor, chunk: int) -> int:
    """Elements of one generator group of `t`: whole rows, at most `chunk` (one row)."""
    row = max(t.row, 1)
    return min(t.numel, max(1, chunk // row) * row)


def piece(t: ParamTensor, layout: Layout, shard: float) -> float:
    """Elements of `t` a rank reads at once: a few rows of its tp block or its experts
    (DataParallel, pipelines), or its span of the shard (ZeRO: up to the tensor, or its
    whole tp block)."""
    divided = t.split and layout.tp > 1
    block = t.per_rank(layout.tp, layout.ep)
    if layout.zero:
        return block if divided else min(block, shard)
    return min(block, max(ROWS_AT_ONCE, t.row))


def construction_peak(layout: Layout, held: Params, tensors: list[ParamTensor],
                      unit: float, chunk: int | None = None) -> float:
    """Bytes a rank peaks at while its share is built: it holds the parameters `held`
    (elements before tp divides them), in ZeRO units of at most `unit` elements, and
    fills them from `tensors` one at a time.
    `chunk`: elements per generator group (default dtrain.models.init.CHUNK)."""
    chunk = init.CHUNK if chunk is None else chunk
    psi, n = held.per_rank(layout.tp, layout.ep), layout.dp * layout.cp
    sharded = held.per_rank(layout.tp) / n  # split experts: E / ep over dp / ep ranks
    # a unit's shard: over dp, or a split expert's over the dp / ep ranks holding it
    pieces = [piece(t, layout, unit / n * (layout.ep if t.expert else 1))
              for t in tensors] or [0.0]
    # a group and the piece read from it, joined
    draw = max(group_elements(t, chunk) + 2 * p for t, p in zip(tensors, pieces, strict=False))
    if not layout.zero:
        return PARAM_BYTES * (psi + draw)
    state = sharded if layout.zero == 3 else psi
    # ZeRO 1 and 2 then all-gather the units from their fp32 shards themselves (no copy;
    # under mixed precision a compute-dtype copy of a few shards, not counted here)
    return PARAM_BYTES * (state + draw)


def whole_model(params: Params) -> float:
    """Bytes of the whole model in fp32: what every rank built before split form."""
    return PARAM_BYTES * params.total
