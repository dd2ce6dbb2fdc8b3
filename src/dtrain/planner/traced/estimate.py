"""Per-rank memory, traffic and step time of one layout, from a model's profile.

A layout is dp x cp x tp x pp ranks with a ZeRO stage and, for pipelines, micro-batches
and a schedule; a mixture of experts' also an expert-parallel degree ep, carved from dp.
The figures follow what dtrain's own strategies hold (fp32 parameters, Ψ of them on a rank
after tp and pp split the model and ep its experts, N = dp x cp, the ranks holding the
same parameters (under hybrid sharding a replica's dp_shard x cp, the ranks ZeRO shards
over: dtrain.planner.costs), K bytes of optimizer state per parameter: 8 for Adam, 4 for
SGD with momentum):

    zero 0 (DataParallel)  params 4Ψ   grads 4Ψ (the buckets)     optimizer KΨ
    zero 1                 params 4Ψ   grads 4Ψ + 4Ψ/N (shard)    optimizer KΨ/N
    zero 2                 params 4Ψ   grads 4Ψ/N                 optimizer KΨ/N
    zero 3                 params 4Ψ/N + the root unit and two blocks gathered at once
                                       grads 4Ψ/N                 optimizer KΨ/N
                           (no block is gathered while backward goes through the head: when
                           that is the peak, as with a large vocabulary, the figure is its)

Under expert parallelism a rank holds E / ep of each MoE block's routed experts, whole on
each tp rank (dtrain.models.moe), and Ψ counts those; ZeRO shards them over the dp / ep
ranks holding the same experts (the mesh's edp), so that in the rows divided by N the
experts are every expert's over N, as the dense parts are. Context parallelism (cp ranks
splitting every sequence, dtrain.context_parallel) splits no parameter: the model is
replicated over cp as over dp, hence N = dp x cp.

The gradient shards come as backward ends and go when the training loop's `zero_grad`
releases them, so the peak is the larger of backward's and the optimizer step's (every
gradient the table lists, no activations): `Estimate.total`. Backward's holds the
activations and the gradients then alive (`grads_in_backward`): DataParallel's buckets
(none at dp = 1: there autograd's own gradients, at most all of them, are the grads row;
and, over micro-batches or accumulated batches, the parameters' own gradients, which
`zero_grad` released and backward made anew outside the buckets until the last one),
ZeRO 1's unsharded gradients, with the gradient backward has just computed beside either,
until it is copied in (the largest parameter's, at most); ZeRO 2's unit being reduced (its
full gradient, a bucket), ZeRO 3's root unit's full gradient (from the head's backward to
the embedding's) and the block's whose backward is under way.

Activations are the profile's, per micro-batch, with the recomputation mode planned
(`[memory] recompute`: the profile traces each), times the micro-batches a stage holds at
once: the most that the schedule (dtrain.pipeline.schedules, the very lists the runtime
executes) leaves between a forward and its backward (its W, under the schedules that
split backward: zb1p, zbv, dualpipev), each chunk's own, plus what backward adds at its
peak. A pipeline's blocks are cut into stages as `[parallel] stage_layers` cuts them
(`stage_blocks`) and placed as the schedule places them: under the V-shaped schedules
rank 0 holds the first stage and the last, the embedding and the head. Tensor parallelism
divides the split part by tp; sequence parallelism also divides the part between its
regions (norms, dropouts, residuals, and what pipeline stages send each other), leaving
whole each column-parallel layer's gathered input. Under context parallelism the profile
is a cp rank's, traced on its 1/cp of every sequence with the cp method's own attention
(dtrain.planner.traced.profile): every activation is 1/cp of one process's, plus what the
method holds of the other ranks' keys and values and, for the ring, its scores, block by
block.

Traffic per step, in bytes of the buffers each collective is given: dp all-reduces the
gradients once (ZeRO 1-2: reduce-scatter then all-gather the parameters; ZeRO 3 gathers
each unit for every forward and backward; with ep > 1 the split experts' go over edp
instead, the "edp" keys, and nowhere at ep = dp; under hybrid sharding these span a
replica, and each unit's reduced shard, 1/N of its bytes, is all-reduced across the
dp_replicate replicas: "dp_replicate all_reduce", 2(R-1)/R of it sent), tp all-reduces a
micro-batch's activations twice per block forward and twice backward (sequence
parallelism: an all-
gather and a reduce-scatter each instead, moving the same bus bytes, and an all-reduce
per replicated parameter's gradient), full recomputation repeats the forward's, pp sends
each micro-batch's activations forward and their gradients back at each stage boundary
between two ranks (the V-shaped schedules twice 1F1B's: two chunks a rank, the turn at
the last rank local; dtrain.planner.costs.sends), and the first and last stage sum the
tied embedding when two ranks hold them. With ep > 1 every MoE block (the stage's blocks
in the model's proportion of MoE ones) all-to-alls each micro-batch's tokens over ep:
tokens x k x hidden fp32 elements out to the experts and as many back (dispatch and
combine) in forward, the same two in backward, and forward's again under full
recomputation ("ep all_to_all"; the all-to-all of E token counts before each dispatch is
left out, a few bytes). With cp > 1 the gradients' "dp" collectives span dp x cp, and
each attention layer exchanges, per micro-batch, a rank's key/value block of 2 x
tokens/cp x kv heads/tp x head dim fp32 elements: the ring sends it n - 1 times forward,
and backward n - 1 times with n sends of its gradients ("cp send"); "allgather" all-
gathers keys and values forward (two calls, the whole gathered buffer cp times the block)
and reduce-scatters their gradients backward ("cp all_gather", "cp reduce_scatter");
"alltoall" all-to-alls q, k, v and the output forward, tokens/cp x heads/tp (kv heads for
k and v) x head dim each, and their gradients backward ("cp all_to_all"). Selective and
full recomputation both run attention's forward again, and its exchanges.

Step time = compute + recomputation + the communication it does not hide. Compute is 6
flops per parameter per token (of a mixture of experts', the active ones) plus attention
(6·layers·seq·width per token), at the given rate, stretched by the pipeline bubble:
the schedule's own action lists simulated with its forward, input-gradient and
weight-gradient flops (`pass_flops`; dtrain.planner.costs.bubble: (p-1)/(m+p-1) for
1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) for zb1p at equal F, B and W);
every rank of a cp group does 1/cp of it.
Recomputation is one more forward of what is recomputed: 2 flops per block parameter per
token plus attention's 2·layers·seq·width ("full"), or attention's alone ("selective").
Each collective costs its calls times alpha plus its bus bytes times beta
(dtrain.planner.traced.links; an all-to-all sends (n-1)/n of its buffer); dp's, edp's and
the replicas' gradient collectives overlap backward (2/3 of compute, and the recomputation; only the
excess counts); the ring's sends overlap its steps, each a 1/cp share of a layer's
attention (forward 2·seq·width per token, backward twice that), so per step only
max(0, send - step) counts (backward: a key/value send and a gradient send beside each
step, and the last gradients' send home alone); tp's, ep's, pp's and cp's all-gathers,
reduce-scatters and all-to-alls sit on the critical path and count whole.

The construction peak (dtrain.planner.traced.construction) is each rank's while the layout builds
it from a skeleton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dtrain.errors import ConfigError
from dtrain.mesh import Dims
from dtrain.pipeline.partition import balanced_sizes
from dtrain.pipeline.schedules import build, stage_balance
from dtrain.planner.costs import (
    PARAM_BYTES,
    Times,
    bubble,
    chunk_sizes,
    holds_ends,
    placed,
    sends,
)
from dtrain.planner.planned import PlannedLayout
from dtrain.planner.traced.construction import construction_peak
from dtrain.planner.traced.links import Links
from dtrain.planner.traced.profile import Activation, Params, Profile

STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}
RING = "cp send"
"""The ring's key/value blocks and their gradients, rank to rank."""
GRADIENT_AXES = ("dp", "edp", "dp_replicate")
"""The axes whose collectives carry gradients and parameters, behind backward."""


@dataclass
class Estimate:
    """One layout's figures for its busiest rank (bytes, seconds), with the recomputation
    mode they assume (sequence parallelism and the cp method are its Dims');
    `construction`: the most any of its ranks holds while the layout builds it."""

    dims: Dims
    params: float
    grads: float
    optimizer: float
    activations: float
    fits: bool = True
    traffic: dict[str, float] = field(default_factory=dict)  # collective -> buffer bytes
    bubble: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    recompute: str = "none"
    recompute_s: float = 0.0
    construction: float = 0.0
    grads_in_backward: float | None = None  # of `grads`, what backward's peak holds

    @property
    def total(self) -> float:
        """The peak: parameters and optimizer state, and the more of backward's
        activations with its gradients and the step's gradients (see the module doc)."""
        backward = self.grads if self.grads_in_backward is None else self.grads_in_backward
        return self.params + self.optimizer + max(backward + self.activations, self.grads)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.recompute_s + self.comm_s

    @property
    def planned(self) -> PlannedLayout:
        """The layout with the recomputation, sequence parallelism and cp method it is
        planned with."""
        return PlannedLayout(self.dims, self.recompute)

    @property
    def label(self) -> str:
        """The layout, with its cp method where cp > 1 and " sp" under sequence
        parallelism (`str(self.planned)`)."""
        return str(self.planned)

    def to_dict(self) -> dict:
        layout = self.dims
        return {
            "layout": self.label, "dp": layout.dp, "dp_replicate": layout.dp_replicate,
            "tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "cp": layout.cp,
            "zero": layout.zero,
            "microbatches": layout.microbatches,
            "schedule": layout.schedule if layout.pp > 1 else None,
            "recompute": self.recompute, "sequence_parallel": layout.sequence_parallel,
            "cp_method": layout.cp_method if layout.cp > 1 else None,
            "memory_bytes": {"params": int(self.params), "grads": int(self.grads),
                             "grads_in_backward": int(self.grads if self.grads_in_backward
                                                      is None else self.grads_in_backward),
                             "optimizer": int(self.optimizer),
                             "activations": int(self.activations), "total": int(self.total)},
            "construction_bytes": int(self.construction),
            "fits": self.fits, "traffic_bytes": {k: int(v) for k, v in self.traffic.items()},
            "bubble": self.bubble, "compute_s": self.compute_s,
            "recompute_s": self.recompute_s, "comm_s": self.comm_s, "step_s": self.step_s,
            "config": self.planned.overrides(),
        }


def stage_blocks(profile: Profile, pp: int, chunks: int = 1, schedule: str = "1f1b",
                 stage_layers: str = "") -> list[list[int]]:
    """Blocks of each chunk of each pipeline rank, cut as the runtime cuts them
    (`[parallel] stage_layers`, dtrain.pipeline.schedules.stage_balance and
    dtrain.pipeline.pieces.cut): "" evenly (the blocks' parameters, which are equal), "auto"
    with the input part's parameters counted on the first stage and the output part's on
    the last (a tied head's weight too), or the sizes given, in stage order; and placed
    as `schedule` places them (rank r: stages r, r+pp, ...; under the V-shaped schedules
    r and 2pp-1-r).

    Raises:
        ConfigError: sizes that are not pp x chunks positive numbers adding up to the
            blocks, or more stages than blocks.
    """
    stages = pp * chunks
    balance = stage_balance(stage_layers, stages, profile.n_layer)
    if isinstance(balance, list):
        sizes = balance
    elif balance == "auto":
        block = float(profile.params_block.total)
        head = profile.params_head.total + (profile.tied if stages > 1 else 0)
        sizes = balanced_sizes([block] * profile.n_layer, stages,
                               float(profile.params_embed.total), float(head))
    else:
        sizes = balanced_sizes([1.0] * profile.n_layer, stages)
    return chunk_sizes(sizes, schedule, pp, chunks)


def in_flight(layout: Dims, rank: int, per_chunk: list[float]) -> float:
    """The most activation bytes the schedule keeps on `rank` between forwards and their
    backwards, chunk `c`'s micro-batch weighing `per_chunk[c]`."""
    if layout.pp == 1:
        return per_chunk[0]
    live, most = 0.0, 0.0
    actions = build(layout.schedule, layout.pp, rank, layout.microbatches,
                    layout.virtual_stages)
    ends = "W" if any(a.kind == "W" for a in actions) else "B"  # what frees them (kept
    for action in actions:  # for W: each product's input, most of a block's activations)
        live += per_chunk[action.chunk] if action.kind == "F" else \
            -per_chunk[action.chunk] if action.kind == ends else 0.0
        most = max(most, live)
    return most


@dataclass(frozen=True)
class Options:
    """What a layout is planned with beyond its degrees."""

    optimizer: str = "adamw"
    accum: int = 1
    bucket_mb: float = 25.0
    recompute: str = "none"  # [memory] recompute
    sequence_parallel: bool = False
    cp_method: str = "ring"  # [parallel] cp_method, where cp > 1
    stage_layers: str = ""  # [parallel] stage_layers: how the blocks are cut into stages


def estimate(profile: Profile, layout: Dims, memory: float, flops: float, links: Links,
             optimizer: str = "adamw", accum: int = 1, bucket_mb: float = 25.0,
             recompute: str = "none", sequence_parallel: bool = False,
             stage_layers: str = "") -> Estimate:
    """The figures of `layout` for a global batch of
    `profile.micro_batch * dp * accum * microbatches` sequences, recomputing as
    `recompute` says, with sequence parallelism if `sequence_parallel` (see the module
    doc), a pipeline's blocks cut into stages as `stage_layers` says (`stage_blocks`).
    The profile is traced at the layout's cp, attending by the cp method planned
    (`profile_model(..., cp=layout.cp, cp_method=...)`).

    Raises:
        ConfigError: the profile has no figures for `recompute`, was traced at another
            cp, or `stage_layers` does not fit the layout's stages.
    """
    if profile.cp != layout.cp:
        raise ConfigError(f"{layout}: the profile is traced for cp = {profile.cp}; trace it "
                          f"with cp = {layout.cp} (profile_model(..., cp={layout.cp}))")
    options = Options(optimizer, accum, bucket_mb, recompute,
                      sequence_parallel and profile.sequence_parallel(layout.tp, layout.cp),
                      profile.cp_method, stage_layers)
    ranks = [_rank(profile, layout, r, options) for r in range(layout.pp)]
    worst = max(ranks, key=lambda e: e.total)
    worst.fits = worst.total <= memory
    worst.bubble = bubble(layout.pp, layout.microbatches, layout.virtual_stages,
                          layout.schedule, pass_flops(profile, recompute))
    busiest = max(ranks, key=lambda e: sum(e.traffic.values()))
    worst.traffic = busiest.traffic
    worst.compute_s, worst.recompute_s = _compute_s(profile, layout, accum, flops, recompute,
                                                    stage_layers)
    step_s = _attention_s(profile, layout, flops) / layout.cp  # a ring step's, forward
    worst.comm_s = max(_exposed_comm_s(e, layout, links,
                                       worst.compute_s * 2 / 3 + worst.recompute_s, step_s)
                       for e in ranks)
    worst.construction = max(e.construction for e in ranks)
    return worst


def _exposed_comm_s(figures: _RankFigures, layout: Dims, links: Links,
                    backward_s: float, ring_step_s: float) -> float:
    """Communication time not hidden behind arithmetic: the data-parallel gradient
    collectives (dp's, and edp's of split experts) run while backward (`backward_s`) goes
    on; the ring's sends beside its steps (`_ring_exposed_s`); the rest waits."""
    def cost(keys: list[str]) -> float:
        return links.seconds({k: figures.traffic[k] for k in keys},
                             {k: figures.calls[k] for k in keys}, layout)

    overlapped = [k for k in figures.traffic if k.split(" ")[0] in GRADIENT_AXES]
    exposed = [k for k in figures.traffic if k not in overlapped and k != RING]
    ring = _ring_exposed_s(figures, layout, links, ring_step_s) if RING in figures.traffic \
        else 0.0
    return max(0.0, cost(overlapped) - backward_s) + cost(exposed) + ring


def _ring_exposed_s(figures: _RankFigures, layout: Dims, links: Links,
                    step_s: float) -> float:
    """The ring's sends not hidden behind its steps' attention (`step_s`: one forward
    step's; backward's are twice as long). Per attention layer and micro-batch: forward's
    n - 1 steps each beside one key/value send (and again when recomputed), backward's
    n - 1 each beside a key/value send and a gradient send, and the last gradients'
    send home, alone."""
    n, forwards = layout.cp, _forwards(figures.recompute)
    sends = _ring_sends(n, figures.recompute)
    one = links.seconds({RING: figures.traffic[RING] / figures.calls[RING]}, {RING: 1}, layout)
    per_layer = forwards * (n - 1) * max(0.0, one - step_s) + \
        (n - 1) * max(0.0, 2 * one - 2 * step_s) + one
    return figures.calls[RING] / sends * per_layer


@dataclass
class _RankFigures(Estimate):
    calls: dict[str, float] = field(default_factory=dict)


def _rank(profile: Profile, layout: Dims, rank: int, options: Options) -> _RankFigures:
    # the ranks ZeRO shards over: dp x cp (cp splits only the sequences), a replica's
    # dp_shard x cp under hybrid sharding
    tp, pp, n, ep = layout.tp, layout.pp, layout.dp_shard * layout.cp, layout.ep
    sp = options.sequence_parallel
    chunks, schedule = layout.virtual_stages, layout.schedule
    # whether each chunk is the first stage (the embedding's) and the last (the head's):
    # under the V-shaped schedules rank 0 holds both
    ends = [(stage == 0, stage == pp * chunks - 1) for stage in _stages(layout, rank)]
    first, last = any(f for f, _ in ends), any(e for _, e in ends)
    blocks = stage_blocks(profile, pp, chunks, schedule, options.stage_layers)[rank] \
        if profile.n_layer else [0]
    held = profile.params_block * sum(blocks)
    # what trains (all but a LoRA run's frozen base): gradients and optimizer state
    trained = profile.trained("block") * sum(blocks)
    if first:
        held += profile.params_embed
        trained += profile.trained("embed")
    if last:
        tied = Params(0, profile.tied) if pp > 1 else Params()
        held += profile.params_head + tied
        trained += profile.trained("head") + (tied if profile.trained("embed").total else Params())
    psi, psi_trained = held.per_rank(tp, ep), trained.per_rank(tp, ep)
    k = STATE_BYTES[options.optimizer]
    unit = min(PARAM_BYTES * psi_trained, options.bucket_mb * 2**20)
    base = profile.base_bytes  # a frozen base's bytes per parameter (bf16 with LoRA: 2)

    def weights(every: float, trained_ones: float) -> float:
        return PARAM_BYTES * trained_ones + base * (every - trained_ones)

    block_bytes = weights(profile.params_block.per_rank(tp, ep),
                          profile.trained("block").per_rank(tp, ep))
    block_grad_bytes = PARAM_BYTES * profile.trained("block").per_rank(tp, ep)
    params, grads, state = weights(psi, psi_trained), PARAM_BYTES * psi_trained, \
        k * psi_trained
    parts = {"embed"} if first else set()
    parts |= ({"block"} if sum(blocks) else set()) | ({"head"} if last else set())
    tensors = [t for t in profile.tensors if t.part in parts and (pp > 1 or not t.tied)]
    fresh = PARAM_BYTES * max((t.per_rank(tp, ep) for t in tensors if t.trained), default=0)
    # DataParallel's buckets, ZeRO 1's unsharded gradients: always there; and the gradient
    # backward has just made, beside them until copied in (at most the largest parameter's)
    backward = grads + fresh
    if not layout.zero and n == 1:
        backward = grads  # no buckets: autograd's own gradients, at most all of them
    elif not layout.zero and (pp > 1 or options.accum > 1):
        backward += grads  # and the gradients micro-batches accumulate before the buckets
    root = params - sum(blocks) * block_bytes  # the input and output parts
    figures = profile.activations(options.recompute)
    micro = _per_micro(profile, figures, ends, blocks)
    flight = in_flight(layout, rank, [m.per_rank(tp, sp) for m in micro])
    extra = figures.peak_extra if last else figures.block_extra
    acts = flight + extra.per_rank(tp, sp)
    if layout.zero:
        # the dense part over N; the rank's E / ep experts over the dp_shard / ep ranks
        # holding them: every expert over dp_shard
        sharded, sharded_trained = held.per_rank(tp) / n, trained.per_rank(tp) / n
        state = k * sharded_trained
        shard = weights(sharded, sharded_trained)  # stage 3 shards a frozen base too
        grads = grads + PARAM_BYTES * sharded_trained if layout.zero == 1 \
            else PARAM_BYTES * sharded_trained
        if layout.zero == 2:  # the unit under way: its full gradient, till reduce-scattered
            backward = unit
    if layout.zero == 3:
        # Three whole blocks at most, in a block's backward (dtrain.data_parallel.zero.wrapper):
        # gathered, that block and, from its first gradient on, the next (prefetched);
        # alive as full gradients, the block's under way (autograd's own, then its packed
        # buffer as the block ends, when the block itself is freed: the next one gathered,
        # both gradients). The reduce-scatter of the block before is waited for at the
        # first gradient, before the prefetch. Besides them, the root unit (embedding,
        # norm), and its gradient from the head's backward on (the embedding's comes last).
        gathered = min(2, sum(blocks)) * block_bytes
        under_way = min(1, sum(blocks)) * block_grad_bytes
        params = shard + root + gathered
        root_grads = root * psi_trained / psi if psi else 0.0
        backward = (root_grads if last else 0.0) + under_way
        head = flight + figures.head_extra.per_rank(tp, sp)
        if last and head > flight + figures.tail_extra.per_rank(tp, sp) + gathered + under_way:
            params, backward, acts = params - gathered, root_grads, head  # the logits' gradients
    planned = layout.replace(sequence_parallel=sp, cp_method=options.cp_method)
    out = _RankFigures(planned, params, grads, state, acts, recompute=options.recompute,
                       grads_in_backward=backward)
    out.construction = construction_peak(layout, held, tensors)
    out.traffic, out.calls = _traffic(profile, layout, held, rank, blocks, options, unit)
    return out


def _stages(layout: Dims, rank: int) -> list[int]:
    """The virtual stage of each chunk of pipeline rank `rank`."""
    place = placed(layout.schedule, layout.pp, layout.virtual_stages)
    return [place.stage(rank, c) for c in range(layout.virtual_stages)]


def _per_micro(profile: Profile, figures, ends: list[tuple[bool, bool]],
               blocks: list[int]) -> list[Activation]:
    """Activation bytes of one micro-batch on each chunk of the rank, `ends[c]`: whether
    chunk c is the first stage (with the embedding) and the last (with the head)."""
    received = Activation(seq=profile.micro_batch * profile.width)  # a stage's input
    out = []
    for (first, last), count in zip(ends, blocks, strict=True):
        start = figures.embed if first else received
        out.append(start + figures.block * count + (figures.head if last else Activation()))
    return out


def _traffic(profile: Profile, layout: Dims, held: Params, rank: int, blocks: list[int],
             options: Options, unit: float):
    """(buffer bytes, calls) per "axis collective" (e.g. "dp all_reduce") in one step of
    pipeline rank `rank`, holding `held` (before tp and ep divide it)."""
    first, last = holds_ends(layout.schedule, layout.pp, layout.virtual_stages, rank)
    traffic: dict[str, float] = {}
    calls: dict[str, float] = {}

    def add(key: str, nbytes: float, count: float) -> None:
        if count:
            traffic[key] = traffic.get(key, 0.0) + nbytes
            calls[key] = calls.get(key, 0.0) + count

    passes = layout.microbatches if layout.pp > 1 else options.accum
    grads = PARAM_BYTES * held.per_rank(layout.tp, layout.ep)
    experts = PARAM_BYTES * held.experts / layout.ep if layout.ep > 1 else 0.0
    # (axis, its ranks, gradient bytes, ZeRO 3's units): split experts average over edp;
    # under hybrid sharding both inside a replica, each unit's shard then across replicas
    groups = [("dp", layout.dp_shard * layout.cp, grads - experts, sum(blocks) + 1),
              ("edp", layout.dp_shard // layout.ep, experts, sum(blocks))]
    for axis, size, nbytes, zero3_units in groups:
        if not nbytes:
            continue
        buckets = max(1, math.ceil(nbytes / unit))
        units = buckets if layout.zero < 3 else zero3_units
        if layout.dp_replicate > 1:
            add("dp_replicate all_reduce", nbytes / size, units)
        if size == 1:
            continue
        if layout.zero == 0:
            add(f"{axis} all_reduce", nbytes, buckets)
        else:
            add(f"{axis} reduce_scatter", nbytes, buckets)
            gathers = 1 if layout.zero < 3 else 2 * passes
            add(f"{axis} all_gather", nbytes * gathers, units * gathers)
    activation = profile.micro_batch * profile.width
    if layout.ep > 1 and profile.shape is not None:
        shape = profile.shape
        moe_blocks = sum(blocks) * shape.moe_layers / shape.layers
        exchanges = 4 + (2 if options.recompute == "full" else 0)  # dispatch and combine
        count = moe_blocks * exchanges * passes
        add("ep all_to_all", count * activation * shape.top_k, count)
    if layout.cp > 1:
        for key, nbytes, count in _context_exchanges(profile, layout, options):
            add(key, nbytes * sum(blocks) * passes, count * sum(blocks) * passes)
    if layout.tp > 1:
        count = sum(blocks)
        forwards = 2 if options.recompute == "full" else 1  # recomputed blocks' again
        regions = 2 * count * forwards + 2 * count  # two per block, forward and backward
        if options.sequence_parallel:  # an all-gather and a reduce-scatter per region
            add("tp all_gather", (regions + first + last) * activation * passes,
                (regions + first + last) * passes)
            add("tp reduce_scatter", (regions + last) * activation * passes,
                (regions + last) * passes)
            replicated = profile.params_block.whole * count + \
                (profile.params_head.whole if last else 0)
            add("tp all_reduce", (activation * first + PARAM_BYTES * replicated) * passes,
                (first + profile.replicated_block * count + last) * passes)
        else:
            per_pass = regions + int(first) + int(last)
            add("tp all_reduce", per_pass * activation * passes, per_pass * passes)
    if layout.pp > 1:
        count = sends(layout.schedule, layout.pp, layout.virtual_stages, rank) * \
            layout.microbatches
        sent = activation / (layout.tp if options.sequence_parallel else 1)
        add("pp send", count * sent, count)
        if first != last:  # the tied weight's two copies on two ranks (the V: on one)
            add("pp all_reduce", PARAM_BYTES * profile.tied / layout.tp, 1)
    return traffic, calls


def _forwards(recompute: str) -> int:
    """Forwards of each attention core per micro-batch: "selective" and "full" recompute
    it in backward."""
    return 1 if recompute == "none" else 2


def _ring_sends(n: int, recompute: str) -> int:
    """The ring's sends per attention layer and micro-batch: n - 1 key/value blocks each
    forward, and backward's n - 1 blocks and n gradients."""
    return _forwards(recompute) * (n - 1) + 2 * n - 1


def _context_exchanges(profile: Profile, layout: Dims, options: Options
                       ) -> list[tuple[str, float, float]]:
    """(key, buffer bytes, calls) of one attention layer's context-parallel exchanges for
    one micro-batch, forward (again when recomputed) and backward (the module doc)."""
    shape, n = profile.shape, layout.cp
    assert shape is not None  # cp layouts are dtrain's GPT and Llama's
    # one head's fp32 elements of a rank's tokens, in bytes (tp divides the heads)
    head = profile.micro_batch * shape.seq // n * shape.head_dim * 4 / layout.tp
    kv = 2 * shape.kv_heads * head  # a rank's key/value block
    forwards = _forwards(options.recompute)
    if options.cp_method == "ring":
        sends = _ring_sends(n, options.recompute)
        return [(RING, sends * kv, sends)]
    if options.cp_method == "allgather":  # keys and values apart, each whole gathered
        return [("cp all_gather", forwards * n * kv, 2 * forwards),
                ("cp reduce_scatter", n * kv, 2)]
    exchanged = 2 * (shape.heads + shape.kv_heads) * head  # q, k, v and the output
    return [("cp all_to_all", (forwards + 1) * exchanged, 4 * (forwards + 1))]


def _attention_s(profile: Profile, layout: Dims, flops: float) -> float:
    """Seconds of one attention layer's forward on one micro-batch on a rank (its tokens,
    its heads): 2·seq·width per token (see `_compute_s`)."""
    if profile.shape is None:
        return 0.0
    tokens = profile.micro_batch * profile.seq_len / layout.cp
    return 2 * profile.shape.seq * profile.shape.hidden * tokens / layout.tp / flops


def pass_flops(profile: Profile, recompute: str = "none") -> Times:
    """Flops per token of the whole model's forward (F), input gradient (B, with what
    `recompute` runs again) and weights' gradients (W), as `_compute_s` counts them: the
    times a pipeline's schedule is simulated on (`bubble`)."""
    blocks, matmul, attention = _matmul_flops(profile)
    again = {"none": 0.0, "selective": attention, "full": blocks + attention}[recompute]
    reference = 2 if profile.reference else 0
    return ((2 + reference) * (matmul + attention), 2 * matmul + 4 * attention + 2 * again,
            2 * profile.trained_share * matmul)


def _matmul_flops(profile: Profile) -> tuple[float, float, float]:
    """Per token, halves of a forward's flops: (the blocks' parameters that multiply it,
    with the head's, attention's layers x seq x width)."""
    if profile.shape is None:
        blocks = matmul = profile.params.total  # a user's model: all of it, once recomputed
        return blocks, matmul, 0.0
    shape = profile.shape
    # the experts a token does not go to do no arithmetic for it
    idle = shape.parameters() - shape.active_parameters()
    blocks = shape.layers * profile.params_block.total - idle
    return blocks, blocks + shape.vocab * shape.hidden, shape.layers * shape.seq * shape.hidden


def _compute_s(profile: Profile, layout: Dims, accum: int, flops: float,
               recompute: str = "none", stage_layers: str = "") -> tuple[float, float]:
    """Seconds of arithmetic per step on one rank, the pipeline's idle share included:
    (training's, recomputation's). Per parameter and token: 2 flops forward, 2 for the
    input's gradient, 2 for the weight's where it trains (a LoRA base's does not), and
    DPO's reference forward 2 more; attention's 6 (and 2) whatever trains."""
    devices = layout.world_size
    sequences = profile.micro_batch * layout.dp * accum * layout.microbatches
    tokens = sequences * max(profile.seq_len, 1)
    blocks, matmul, attention = _matmul_flops(profile)
    again = {"none": 0.0, "selective": attention, "full": blocks + attention}[recompute]
    scale = tokens / devices / flops
    if layout.pp > 1:
        most = max(sum(b) for b in stage_blocks(profile, layout.pp, layout.virtual_stages,
                                                layout.schedule, stage_layers))
        scale *= most * layout.pp / profile.n_layer  # the busiest stage sets the pace
        scale /= 1 - bubble(layout.pp, layout.microbatches, layout.virtual_stages,
                            layout.schedule, pass_flops(profile, recompute))
    reference = 2 if profile.reference else 0
    flops = (4 + 2 * profile.trained_share + reference) * matmul + (6 + reference) * attention
    return flops * scale, 2 * again * scale
