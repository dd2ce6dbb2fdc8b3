"""Per-rank memory, traffic and step time of one layout, from a model's profile.

A layout is dp x tp x pp ranks with a ZeRO stage and, for pipelines, micro-batches and a
schedule. The figures follow what dtrain's own strategies hold (fp32 parameters, Ψ of them
on a rank after tp and pp split the model, N = dp, K bytes of optimizer state per
parameter: 8 for Adam, 4 for SGD with momentum):

    zero 0 (DataParallel)  params 4Ψ   grads 4Ψ (the buckets)     optimizer KΨ
    zero 1                 params 4Ψ   grads 4Ψ + 4Ψ/N (shard)    optimizer KΨ/N
    zero 2                 params 4Ψ   grads 4Ψ/N                 optimizer KΨ/N
    zero 3                 params 4Ψ/N + the root unit and two blocks gathered at once
                                       grads 4Ψ/N                 optimizer KΨ/N

(ZeRO 2 and 3 also hold a unit's full gradient until it is reduce-scattered. For ZeRO-3
(units of one block) the peak, early in backward, sees none of them. For ZeRO-2 that holds
while the model is within one bucket; a bigger model's first unit can meet the peak, and
the figure is then low by up to a unit (benchmarks/RESULTS.md measures it).)

Activations are the profile's, per micro-batch, times the micro-batches a stage holds at
once: the most that the schedule (dtrain.pipeline.schedules, the very lists the runtime
executes) leaves between a forward and its backward, plus what backward adds at its peak.

Traffic per step, in bytes of the buffers each collective is given: dp all-reduces the
gradients once (ZeRO 1-2: reduce-scatter then all-gather the parameters; ZeRO 3 gathers
each unit for every forward and backward), tp all-reduces a micro-batch's activations
twice per block forward and twice backward, pp sends each micro-batch's activations
forward and their gradients back, and the first and last stage sum the tied embedding.

Step time = compute + the communication it does not hide. Compute is 6 flops per
parameter per token plus attention (6·layers·seq·width per token), at the given rate,
stretched by the pipeline bubble (p-1)/(m+p-1), (p-1)/(v·m+p-1) interleaved. Each
collective costs its calls times alpha plus its bus bytes times beta (dtrain.planner.links);
dp's gradient collectives overlap backward (2/3 of compute; only the excess counts), tp's
and pp's messages sit on the critical path and count whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dtrain.layout import Layout
from dtrain.pipeline.partition import balanced_sizes
from dtrain.pipeline.schedules import build
from dtrain.planner.links import Links
from dtrain.planner.profile import Activation, Profile

STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}
PARAM_BYTES = 4


@dataclass
class Estimate:
    """One layout's figures for its busiest rank (bytes, seconds)."""

    layout: Layout
    params: float
    grads: float
    optimizer: float
    activations: float
    fits: bool = True
    traffic: dict[str, float] = field(default_factory=dict)  # collective -> buffer bytes
    bubble: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    def to_dict(self) -> dict:
        layout = self.layout
        return {
            "layout": str(layout), "dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
            "zero": layout.zero, "microbatches": layout.microbatches,
            "schedule": layout.schedule if layout.pp > 1 else None,
            "memory_bytes": {"params": int(self.params), "grads": int(self.grads),
                             "optimizer": int(self.optimizer),
                             "activations": int(self.activations), "total": int(self.total)},
            "fits": self.fits, "traffic_bytes": {k: int(v) for k, v in self.traffic.items()},
            "bubble": self.bubble, "compute_s": self.compute_s, "comm_s": self.comm_s,
            "step_s": self.step_s,
        }


def bubble(pp: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of a pipeline step: (p-1)/(v·m+p-1)."""
    return (pp - 1) / (chunks * microbatches + pp - 1) if pp > 1 else 0.0


def stage_blocks(profile: Profile, pp: int, chunks: int = 1) -> list[list[int]]:
    """Blocks of each virtual stage held by each pipeline rank (rank r: stages r, r+pp, ...)."""
    sizes = balanced_sizes([1.0] * profile.n_layer, pp * chunks)
    return [[sizes[c * pp + r] for c in range(chunks)] for r in range(pp)]


def in_flight(layout: Layout, rank: int, per_chunk: list[float]) -> float:
    """The most activation bytes the schedule keeps on `rank` between forwards and their
    backwards, chunk `c`'s micro-batch weighing `per_chunk[c]`."""
    if layout.pp == 1:
        return per_chunk[0]
    live, most = 0.0, 0.0
    v = layout.virtual_stages
    for action in build(layout.schedule, layout.pp, rank, layout.microbatches, v):
        live += per_chunk[action.chunk] if action.kind == "F" else -per_chunk[action.chunk]
        most = max(most, live)
    return most


def estimate(profile: Profile, layout: Layout, memory: float, flops: float, links: Links,
             optimizer: str = "adamw", accum: int = 1, bucket_mb: float = 25.0) -> Estimate:
    """The figures of `layout` for a global batch of
    `profile.micro_batch * dp * accum * microbatches` sequences (see the module doc)."""
    ranks = [_rank(profile, layout, r, optimizer, accum, bucket_mb) for r in range(layout.pp)]
    worst = max(ranks, key=lambda e: e.total)
    worst.fits = worst.total <= memory
    worst.bubble = bubble(layout.pp, layout.microbatches, layout.virtual_stages)
    busiest = max(ranks, key=lambda e: sum(e.traffic.values()))
    worst.traffic = busiest.traffic
    worst.compute_s = _compute_s(profile, layout, accum, flops)
    worst.comm_s = max(_exposed_comm_s(e, layout, links, worst.compute_s) for e in ranks)
    return worst


def _exposed_comm_s(figures: _RankFigures, layout: Layout, links: Links,
                    compute_s: float) -> float:
    """Communication time not hidden behind arithmetic: the data-parallel gradient
    collectives run while backward (about 2/3 of the compute) goes on; the rest waits."""
    def cost(keys: list[str]) -> float:
        return links.seconds({k: figures.traffic[k] for k in keys},
                             {k: figures.calls[k] for k in keys}, layout)

    overlapped = [k for k in figures.traffic if k.startswith("dp ")]
    exposed = [k for k in figures.traffic if not k.startswith("dp ")]
    return max(0.0, cost(overlapped) - 2 / 3 * compute_s) + cost(exposed)


@dataclass
class _RankFigures(Estimate):
    calls: dict[str, float] = field(default_factory=dict)


def _rank(profile: Profile, layout: Layout, rank: int, optimizer: str, accum: int,
          bucket_mb: float) -> _RankFigures:
    tp, pp, n = layout.tp, layout.pp, layout.dp
    first, last = rank == 0, rank == pp - 1
    blocks = stage_blocks(profile, pp, layout.virtual_stages)[rank] if profile.n_layer else [0]
    psi = sum(blocks) * profile.params_block.per_rank(tp)
    if first:
        psi += profile.params_embed.per_rank(tp)
    if last:
        psi += profile.params_head.per_rank(tp) + (profile.tied / tp if pp > 1 else 0)
    k = STATE_BYTES[optimizer]
    unit = min(PARAM_BYTES * psi, bucket_mb * 2**20)
    block_bytes = PARAM_BYTES * profile.params_block.per_rank(tp)
    params, grads, state = PARAM_BYTES * psi, PARAM_BYTES * psi, k * psi
    if layout.zero:
        state = k * psi / n
        shard = PARAM_BYTES * psi / n
        grads = grads + shard if layout.zero == 1 else shard
        if layout.zero == 3:  # the root unit (embedding, norm) and two blocks gathered
            root = PARAM_BYTES * psi - sum(blocks) * block_bytes
            params = shard + root + min(2, sum(blocks)) * block_bytes
    micro = _per_micro(profile, layout, first, last, blocks)
    extra = profile.peak_extra if last else profile.block_extra
    acts = in_flight(layout, rank, [m.per_rank(tp) for m in micro]) + extra.per_rank(tp)
    figures = _RankFigures(layout, params, grads, state, acts)
    figures.traffic, figures.calls = _traffic(profile, layout, psi, first, last, blocks,
                                              accum, unit)
    return figures


def _per_micro(profile: Profile, layout: Layout, first: bool, last: bool,
               blocks: list[int]) -> list[Activation]:
    """Activation bytes of one micro-batch on each chunk of the rank."""
    received = Activation(profile.micro_batch * profile.width, 0)
    out = []
    for c, count in enumerate(blocks):
        head = last and c == len(blocks) - 1
        start = profile.embed if first and c == 0 else received
        out.append(start + profile.block * count + (profile.head if head else Activation()))
    return out


def _traffic(profile: Profile, layout: Layout, psi: float, first: bool, last: bool,
             blocks: list[int], accum: int, unit: float):
    """(buffer bytes, calls) per "axis collective" (e.g. "dp all_reduce") in one step."""
    traffic: dict[str, float] = {}
    calls: dict[str, float] = {}

    def add(key: str, nbytes: float, count: float) -> None:
        traffic[key] = traffic.get(key, 0.0) + nbytes
        calls[key] = calls.get(key, 0.0) + count

    grads = PARAM_BYTES * psi
    passes = layout.microbatches if layout.pp > 1 else accum
    if layout.dp > 1:
        buckets = max(1, math.ceil(grads / unit))
        if layout.zero == 0:
            add("dp all_reduce", grads, buckets)
        else:
            add("dp reduce_scatter", grads, buckets)
            gathers = 1 if layout.zero < 3 else 2 * passes
            units = buckets if layout.zero < 3 else sum(blocks) + 1
            add("dp all_gather", grads * gathers, units * gathers)
    activation = profile.micro_batch * profile.width
    if layout.tp > 1:
        per_pass = 4 * sum(blocks) + int(first) + int(last)
        add("tp all_reduce", per_pass * activation * passes, per_pass * passes)
    if layout.pp > 1:
        sends = (2 - int(first) - int(last)) * layout.microbatches * layout.virtual_stages
        add("pp send", sends * activation, sends)
        if first or last:
            add("pp all_reduce", PARAM_BYTES * profile.tied / layout.tp, 1)
    return traffic, calls


def _compute_s(profile: Profile, layout: Layout, accum: int, flops: float) -> float:
    """Seconds of arithmetic per step on one rank, the pipeline's idle share included."""
    devices = layout.dp * layout.tp * layout.pp
    sequences = profile.micro_batch * layout.dp * accum * layout.microbatches
    tokens = sequences * max(profile.seq_len, 1)
    if profile.shape is None:
        matmul = profile.params.total
        attention = 0.0
    else:
        shape = profile.shape
        matmul = shape.n_layer * profile.params_block.total + shape.vocab_size * shape.n_embd
        attention = shape.n_layer * shape.seq_len * shape.n_embd
    work = 6 * (matmul + attention) * tokens / devices
    if layout.pp > 1:
        most = max(sum(b) for b in stage_blocks(profile, layout.pp, layout.virtual_stages))
        work *= most * layout.pp / profile.n_layer  # the busiest stage sets the pace
        work /= 1 - bubble(layout.pp, layout.microbatches, layout.virtual_stages)
    return work / flops
