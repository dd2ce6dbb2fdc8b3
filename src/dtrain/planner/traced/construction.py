"""A rank's peak memory while `dtrain.layouts.build` makes its share of a model from a
skeleton (split-form construction, dtrain.models.init), per layout.

The skeleton holds no parameter memory. The layout allocates what the rank holds (its tp
blocks, its pipeline pieces, or its ZeRO shards) and fills it from the initial values
(`Initial`), drawn in generator groups of whole rows of at most `CHUNK` elements, one
group at a time, its rows copied straight into place: one tensor's filling needs one group
on top of what the rank holds (fp32, 4 bytes each; Ψ is what the rank holds after tp and
pp split the model and ep its experts, N = dp x cp, the ranks holding the same
parameters, or a replica's dp_shard x cp under hybrid sharding; ZeRO 3's shards hold a
rank's experts over the dp_shard / ep ranks holding the same ones, every expert's over
N):

    dp (DataParallel)   parameters 4Ψ, then each tensor in turn (the gradient buckets
                        are allocated at the first backward)
    ZeRO 1, ZeRO 2      the unit buffers 4Ψ (stage 1's unsharded gradients: at the first
                        backward)
    ZeRO 3              this rank's shards 4Ψ/N (a unit is allocated at its first gather)

A ZeRO rank reads each parameter's span of its shard in turn, a group of rows at a time
(a tensor tp divides: its whole block, then the span from it); ZeRO 1 and 2 then
all-gather the units into their buffers straight from the fp32 shards (under mixed
precision from a compute-dtype copy of a few shards, which this model leaves out). Before
split-form construction every rank built the whole model first: its peak was at least the
whole model, 4 bytes per parameter, whatever the layout (`whole_model`).
"""

from __future__ import annotations

from dtrain.mesh import Dims
from dtrain.models import init
from dtrain.planner.costs import PARAM_BYTES
from dtrain.planner.traced.profile import Params, ParamTensor


def group_elements(t: ParamTensor, chunk: int) -> int:
    """Elements of one generator group of `t`: whole rows, at most `chunk` (one row)."""
    row = max(t.row, 1)
    return min(t.numel, max(1, chunk // row) * row)


def piece(t: ParamTensor, layout: Dims) -> float:
    """Elements of `t` a rank reads into a buffer of their own beside the group they come
    from: a ZeRO rank's whole tp block of a tensor tp divides (its span is taken from the
    block); nothing otherwise (the rows are copied from the group straight into place)."""
    return t.per_rank(layout.tp, layout.ep) if layout.zero and t.split and layout.tp > 1 \
        else 0.0


def construction_peak(layout: Dims, held: Params, tensors: list[ParamTensor],
                      chunk: int | None = None) -> float:
    """Bytes a rank peaks at while its share is built: it holds the parameters `held`
    (elements before tp divides them) and fills them from `tensors` one at a time.
    `chunk`: elements per generator group (default dtrain.models.init.CHUNK)."""
    chunk = init.CHUNK if chunk is None else chunk
    psi, n = held.per_rank(layout.tp, layout.ep), layout.dp_shard * layout.cp
    sharded = held.per_rank(layout.tp) / n  # split experts: E / ep over dp_shard / ep ranks
    # a group, and a tp block read from it whole
    draw = max((group_elements(t, chunk) + piece(t, layout) for t in tensors), default=0.0)
    if not layout.zero:
        return PARAM_BYTES * (psi + draw)
    state = sharded if layout.zero == 3 else psi
    # ZeRO 1 and 2 then all-gather the units from their fp32 shards themselves (no copy;
    # under mixed precision a compute-dtype copy of a few shards, not counted here)
    return PARAM_BYTES * (state + draw)


def whole_model(params: Params) -> float:
    """Bytes of the whole model in fp32: what every rank built before split form."""
    return PARAM_BYTES * params.total
