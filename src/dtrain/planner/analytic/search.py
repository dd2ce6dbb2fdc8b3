"""Which layout to run on a GPU cluster: every valid one, ranked by the cost model.

    estimates = rank(shape, cluster, batch=2304)    # one per layout, fastest first
    best, why = recommend(estimates)
    one = best_of(shape, cluster, 2304, planned_layout(2304, tp=8, pp=8, dp=24))  # its options

A layout is tp x cp x pp x dp = the cluster's GPUs with tp dividing the heads and the
key/value heads and staying inside a node, cp cutting each sequence into 2 x cp chunks
(the sequence divides by 2 x cp), pp at most the layers, and dp x micro-batch dividing the
global batch; a mixture-of-experts model's experts are split over ep consecutive GPUs of
dp x cp x tp (folded, each expert whole: ep dividing those GPUs and the experts, every
such ep a layout of its own; dtrain.planner.analytic.dispatch); it may take a ZeRO
stage (3 only without pipelining) and, with pp > 1, each pipeline schedule asked for
(`SCHEDULES` by default): 1f1b; interleaved over v virtual stages (at least pp x v - 2
layers, the two end chunks may hold only the embedding and the head, and the
micro-batches in groups of pp); zb1p (a layer on every stage); zbv and dualpipev (two
chunks a GPU in a V, a layer on each; dualpipev at least 2 x pp micro-batches); a ZeRO
layout also with each hybrid-sharding degree dp_replicate whose replicas are part of one
node or whole nodes (dtrain.planner.costs.replica_degrees: `dp4x8`, 4 replicas of 8 GPUs,
ZeRO inside each and their gradient shards all-reduced across them). Each
layout is planned with the fastest
recomputation mode, sequence parallelism setting and (cp > 1) context-parallel method
that fit (cluster.evaluate; "alltoall" only where tp x cp divides the query and the
key/value heads); a layout nothing makes fit keeps its smallest.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from dtrain.errors import ConfigError
from dtrain.mesh.dims import V_SHAPED
from dtrain.planner.analytic.cluster import (
    CHUNKS,
    DEFAULT_CP_METHOD,
    MICRO_SIZES,
    SCHEDULES,
    ZERO_STAGES,
    ClusterEstimate,
    Software,
    attention_seconds,
    cluster_label,
    context_seconds,
    evaluate,
    memory_of,
    planned_layout,
)
from dtrain.planner.analytic.hardware import Cluster
from dtrain.planner.costs import replica_degrees
from dtrain.planner.planned import CP_METHODS, RECOMPUTE, PlannedLayout
from dtrain.planner.shape import ModelShape

DEFAULT = Software()
MIN_CHUNK = 128  # tokens: the shortest of a sequence's 2 x cp chunks the search considers
Measured = tuple[PlannedLayout, dict[str, float]]
"""An option of a layout and its memory figures (`memory_of`)."""


def check_layout(shape: ModelShape, cluster: Cluster, batch: int, c: PlannedLayout) -> None:
    """Raise a one-line ConfigError if `c` cannot run `shape` on `cluster` at `batch`."""
    layout = c.dims
    tp, pp, dp, v, ep = layout.tp, layout.pp, layout.dp, layout.virtual_stages, layout.ep
    cp = layout.cp
    if min(tp, pp, dp, c.micro_batch, v, ep, cp) < 1:
        raise ConfigError(f"--layout {cluster_label(c)}: degrees, micro-batch and virtual "
                          "stages must be positive")
    if layout.world_size != cluster.gpus:
        given = f"tp={tp},cp={cp},pp={pp},dp={dp}" if cp > 1 else f"tp={tp},pp={pp},dp={dp}"
        raise ConfigError(f"--layout {given} uses {layout.world_size} GPUs, but the cluster "
                          f"has {cluster.gpus} ({cluster.nodes} nodes x "
                          f"{cluster.gpus_per_node}): make "
                          f"{'tp x cp x pp x dp' if cp > 1 else 'tp x pp x dp'} equal it")
    if shape.heads % tp or shape.kv_heads % tp:
        which = "heads" if shape.heads % tp else "kv_heads"
        raise ConfigError(f"--layout tp={tp} does not divide the model's {which} "
                          f"({getattr(shape, which)}): pick a tp that divides it")
    if pp > shape.layers:
        raise ConfigError(f"--layout pp={pp} is more than the model's {shape.layers} "
                          "layers: use pp <= layers")
    if batch % (dp * c.micro_batch):
        raise ConfigError(f"--batch {batch} is not divisible by dp x micro-batch = "
                          f"{dp} x {c.micro_batch}: pick a batch that is a multiple of "
                          f"{dp * c.micro_batch}")
    if layout.zero not in (0, 1, 2, 3) or (layout.zero == 3 and pp > 1):
        raise ConfigError(f"--zero {layout.zero}: use 0-3 (3 only without pipeline "
                          "parallelism)")
    if layout.dp_replicate > 1 and not layout.zero:
        raise ConfigError(f"dp_replicate={layout.dp_replicate}: hybrid sharding shards the "
                          "model state inside each replica: give a ZeRO stage 1-3 (--zero)")
    m = batch // (dp * c.micro_batch)
    if layout.schedule == "interleaved" and not _interleaves(shape, pp, v, m):
        raise ConfigError(f"--virtual-stages {v} needs pp > 1, at least pp x v - 2 "
                          f"= {pp * v - 2} layers (the model has {shape.layers}) "
                          f"and the micro-batches ({m}) in groups of pp")
    if pp > 1 and not _runs(shape, pp, m, layout.schedule, v):
        raise ConfigError(_why_not(shape, pp, m, layout.schedule, v))
    _check_context(shape, c)
    if c.sequence_parallel and tp == 1:
        raise ConfigError("sequence parallelism needs tp > 1")
    if ep > 1 and not shape.experts:
        raise ConfigError(f"--layout ep={ep} splits experts, and this model has none: give "
                          "the shape experts= and top_k=, or leave ep out")
    if ep > 1 and shape.experts % ep:  # the GPUs it is folded over: the Dims check them
        raise ConfigError(f"--layout ep={ep} does not divide the model's {shape.experts} "
                          "experts: pick an ep that divides them")


def _check_context(shape: ModelShape, c: PlannedLayout) -> None:
    """cp cuts every sequence into 2 x cp chunks; Ulysses splits the heads over it too."""
    cp, tp = c.dims.cp, c.dims.tp
    if cp == 1:
        return
    if c.cp_method not in CP_METHODS:
        raise ConfigError(f"--cp-method {c.cp_method}: use {', '.join(CP_METHODS)}")
    if shape.seq % (2 * cp):
        raise ConfigError(f"--layout cp={cp} cuts each sequence into 2 x cp = {2 * cp} "
                          f"chunks, which do not divide seq={shape.seq}: pick a cp with "
                          "2 x cp dividing the sequence")
    if c.cp_method == "alltoall" and (shape.heads % (tp * cp) or shape.kv_heads % (tp * cp)):
        raise ConfigError(f"--cp-method alltoall splits the heads over tp x cp = {tp * cp}, "
                          f"which does not divide the model's {shape.heads} heads and "
                          f"{shape.kv_heads} key/value heads: use ring or allgather")


def _runs(shape: ModelShape, pp: int, m: int, schedule: str, v: int) -> bool:
    """Whether `schedule` runs on pp > 1 GPUs with v chunks each and m micro-batches."""
    if schedule == "interleaved":
        return _interleaves(shape, pp, v, m)
    if schedule in V_SHAPED:
        return v == 2 and shape.layers >= 2 * pp and (schedule == "zbv" or m >= 2 * pp)
    return v == 1


def _why_not(shape: ModelShape, pp: int, m: int, schedule: str, v: int) -> str:
    """Why `_runs` refuses, in one line naming what to change."""
    if schedule in V_SHAPED and v != 2:
        return (f"--schedules {schedule} runs two chunks per GPU in a V: give "
                "--virtual-stages 2")
    if schedule in V_SHAPED and shape.layers < 2 * pp:
        return (f"--schedules {schedule} puts a layer at least on each of 2 x pp = "
                f"{2 * pp} stages, and the model has {shape.layers}: use pp <= "
                f"{shape.layers // 2}")
    if schedule == "dualpipev":
        return (f"--schedules dualpipev needs at least 2 x pp = {2 * pp} micro-batches, and "
                f"the batch leaves {m}: raise --batch or lower --microbatch")
    return f"--schedules {schedule} runs one chunk per GPU: leave --virtual-stages out"


def _pipelines(shape: ModelShape, pp: int, m: int, chunks: tuple[int, ...],
               schedules: tuple[str, ...]) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs of `schedules` that run a pipeline of pp GPUs
    with m micro-batches, v among `chunks` (the V-shaped schedules take 2; no pipeline:
    1f1b alone)."""
    if pp == 1:
        return [("1f1b", 1)] if 1 in chunks else []
    return [(schedule, v) for schedule in schedules for v in chunks
            if (schedule != "interleaved" or v > 1) and _runs(shape, pp, m, schedule, v)]


def _interleaves(shape: ModelShape, pp: int, v: int, m: int) -> bool:
    """Whether v virtual stages per pipeline GPU can run: pp > 1, a layer for every chunk
    but the two ends (the embedding's and the head's, `stage_layers`), and the
    micro-batches in groups of pp."""
    return pp > 1 and shape.layers + 2 >= pp * v and m % pp == 0


def context_methods(shape: ModelShape, tp: int, cp: int) -> tuple[str, ...]:
    """The context-parallel methods a plan compares for tp x cp: ring and all-gather, and
    Ulysses' all-to-all where tp x cp divides the query and key/value heads (none but the
    default without cp)."""
    if cp == 1:
        return (DEFAULT_CP_METHOD,)
    heads = not (shape.heads % (tp * cp) or shape.kv_heads % (tp * cp))
    return tuple(m for m in CP_METHODS if m != "alltoall" or heads)


def context_degrees(shape: ModelShape, gpus: int) -> list[int]:
    """The cp degrees the search gives a layout of `gpus` GPUs (after tp): those dividing
    them whose 2 x cp chunks divide the sequence, each chunk at least MIN_CHUNK tokens
    (flash attention's tile of queries: on thinner shards neither it nor the matrix
    multiplies reach the rate this planner counts; `--layout` may still give any)."""
    return [cp for cp in _divisors(gpus) if cp == 1 or (
        shape.seq % (2 * cp) == 0 and shape.seq // (2 * cp) >= MIN_CHUNK)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: ModelShape, cluster: Cluster, batch: int,
            schedules: tuple[str, ...] = SCHEDULES) -> list[PlannedLayout]:
    """Every layout the search considers, before recomputation and sequence parallelism
    (each pipeline with each of `schedules` that runs it; a ZeRO layout also with each
    hybrid-sharding degree its nodes allow, right after it, fewest replicas first: the
    order in which they hold more, which `rank` counts on)."""
    found = []
    gpus = cluster.gpus
    for tp in _divisors(min(gpus, cluster.gpus_per_node)):
        if gpus % tp or shape.heads % tp or shape.kv_heads % tp:
            continue
        for cp, pp in ((c, p) for c in context_degrees(shape, gpus // tp)
                       for p in _divisors(gpus // (tp * c))):
            if pp > shape.layers:
                continue
            dp = gpus // (tp * cp * pp)
            for b in MICRO_SIZES:
                if batch % (dp * b):
                    continue
                m = batch // (dp * b)
                for schedule, v in _pipelines(shape, pp, m, CHUNKS, schedules):
                    for zero in range(4 if pp == 1 else 3) if dp * cp > 1 else (0,):
                        found += [planned_layout(batch, tp, pp, dp, zero, b, v, ep=ep, cp=cp,
                                                 schedule=schedule, replicas=r)
                                  for ep in shape.expert_degrees(dp * cp * tp)
                                  for r in _replicas(dp, tp * cp, cluster, ep, zero)]
    return found


def _replicas(dp: int, inner: int, cluster: Cluster, ep: int, zero: int) -> list[int]:
    """1, and with ZeRO the hybrid-sharding degrees of dp GPUs, each with `inner` (cp x
    tp) beside it, on the cluster's nodes (dtrain.planner.costs.replica_degrees), whose
    replicas' dp x cp x tp GPUs the experts can be folded over (ep dividing them)."""
    if not zero:
        return [1]
    return [1, *(r for r in replica_degrees(dp, inner, cluster.gpus_per_node)
                 if dp // r * inner % ep == 0)]


def best_of(shape: ModelShape, cluster: Cluster, batch: int, planned: PlannedLayout,
            recompute: tuple[str, ...] = RECOMPUTE, sequence_parallel: tuple[bool, ...] =
            (False, True), soft: Software = DEFAULT,
            cp_methods: tuple[str, ...] | None = None) -> ClusterEstimate:
    """`planned` with the fastest of the recomputation modes, sequence-parallel settings
    and context-parallel methods asked for (by default every one `context_methods`
    allows) that fits, or the one needing the least memory if none fits."""
    fitting, smallest = _measured(shape, cluster, batch, planned, recompute,
                                  sequence_parallel, soft, cp_methods)
    return _fastest_of(shape, cluster, batch, fitting or [smallest], soft)


def _measured(shape: ModelShape, cluster: Cluster, batch: int, planned: PlannedLayout,
              recompute: tuple[str, ...], sequence_parallel: tuple[bool, ...],
              soft: Software, cp_methods: tuple[str, ...] | None
              ) -> tuple[list[Measured], Measured]:
    """(the options of `best_of` that fit, each with its memory; the one needing the least
    memory among those that do not, or the first that fits if all do)."""
    layout = planned.dims
    methods = tuple(dict.fromkeys(cp_methods or context_methods(shape, layout.tp, layout.cp)))
    if soft.flash_attention and "none" in recompute:  # selective keeps as much then, slower
        recompute = tuple(r for r in recompute if r != "selective")
    options = [planned.with_options(recompute=r, sequence_parallel=s)
               for r in recompute for s in dict.fromkeys(sequence_parallel)
               if not s or layout.tp > 1] or [dataclasses.replace(planned,
                                                                   recompute=recompute[0])]
    # memory first (it is cheap): only what fits needs its time, or if nothing fits the
    # smallest; the cp method changes only the exchanges' time and a few key/value blocks
    # of memory, so an option's fastest method that fits is its first in order of time
    fitting, smallest = [], None
    for option in options:
        for method in _by_speed(shape, option, methods, cluster, soft):
            choice = option.with_options(cp_method=method)
            memory = memory_of(shape, cluster, batch, choice, soft)
            if memory["total"] <= cluster.hardware.memory:
                fitting.append((choice, memory))
                break
            if smallest is None or memory["total"] < smallest[1]["total"]:
                smallest = (choice, memory)
    smallest = smallest or fitting[0]  # none fits: the one needing the least memory
    return fitting, smallest


def _fastest_of(shape: ModelShape, cluster: Cluster, batch: int, options: list[Measured],
                soft: Software) -> ClusterEstimate:
    """The `fastest` of the measured `options`, evaluated."""
    return fastest([evaluate(shape, cluster, batch, c, soft, memory) for c, memory in options])


def _by_speed(shape: ModelShape, planned: PlannedLayout, methods: tuple[str, ...],
              cluster: Cluster, soft: Software) -> tuple[str, ...]:
    """`methods` in order of the seconds their exchanges expose per layer (stable: ring
    before all-gather on a tie, needing less memory)."""
    if len(methods) == 1:
        return methods
    layout = planned.dims
    return _ordered(shape, layout.tp, layout.cp, planned.micro_batch, planned.recompute,
                    methods, cluster, soft)


@functools.cache
def _ordered(shape: ModelShape, tp: int, cp: int, micro_batch: int, recompute: str,
             methods: tuple[str, ...], cluster: Cluster, soft: Software) -> tuple[str, ...]:
    one = planned_layout(micro_batch, tp, 1, 1, 0, micro_batch, 1, recompute, cp=cp)
    attention = attention_seconds(shape, one, cluster.hardware, soft)
    return tuple(sorted(methods, key=lambda k: context_seconds(
        shape, one.with_options(cp_method=k), attention, cluster)))


def fastest(estimates: list[ClusterEstimate]) -> ClusterEstimate:
    """The fastest of `estimates` that fits, or the one needing the least memory if none
    fits."""
    fitting = [e for e in estimates if e.fits]
    if fitting:
        return min(fitting, key=lambda e: e.step_s)
    return min(estimates, key=lambda e: e.memory["total"])


def best_layout(shape: ModelShape, cluster: Cluster, batch: int, tp: int, pp: int, dp: int,
                microbatches: tuple[int, ...] = MICRO_SIZES, chunks: tuple[int, ...] = CHUNKS,
                zeros: tuple[int, ...] = ZERO_STAGES, recompute: tuple[str, ...] = RECOMPUTE,
                sequence_parallel: tuple[bool, ...] = (False, True),
                soft: Software = DEFAULT, ep: int = 1, cp: int = 1,
                cp_methods: tuple[str, ...] | None = None,
                schedules: tuple[str, ...] = SCHEDULES,
                replicas: tuple[int, ...] = (1,)) -> ClusterEstimate | None:
    """tp x cp x pp x dp (the experts over `ep` of the dp GPUs) with the fastest of the
    micro-batch sizes, pipeline schedules and their virtual stages, ZeRO stages,
    hybrid-sharding degrees (`replicas`: dp_replicate; by default 1, ZeRO over all dp
    GPUs), recomputation modes, sequence-parallel settings and context-parallel methods
    asked for (`fastest` of the valid combinations, `check_layout`); None if no
    combination is valid."""
    found = []
    methods = cp_methods or context_methods(shape, tp, cp)
    for b in microbatches:
        m = batch // (dp * b) if dp * b else 0
        for schedule, v in _pipelines(shape, pp, m, chunks, schedules) if m else []:
            for zero, r in ((z, r) for z in zeros for r in replicas):
                try:
                    choice = planned_layout(batch, tp, pp, dp, zero, b, v, recompute[0],
                                            ep=ep, cp=cp, cp_method=methods[0],
                                            schedule=schedule, replicas=r)
                    check_layout(shape, cluster, batch, choice)
                except ConfigError:
                    continue
                found.append(best_of(shape, cluster, batch, choice, recompute,
                                     sequence_parallel, soft, methods))
    return fastest(found) if found else None


def rank(shape: ModelShape, cluster: Cluster, batch: int,
         recompute: tuple[str, ...] = RECOMPUTE,
         sequence_parallel: tuple[bool, ...] = (False, True),
         soft: Software = DEFAULT,
         schedules: tuple[str, ...] = SCHEDULES) -> list[ClusterEstimate]:
    """Every layout (see `layouts`: pipelines with each of `schedules`), those that fit
    first, fastest first; of hybrid sharding's only those that fit (the same layout
    sharded over every dp GPU needs less memory, and is there) and could be faster: where
    the layout sharded over every dp GPU exposes none of its data-parallel traffic, its
    hybrid forms, which change only that traffic (and hold more, so recompute no less),
    cannot win and are not weighed."""
    estimates = []
    unfit: set[PlannedLayout] = set()  # layouts that, over some replicas or none, do not fit
    exposed: dict[PlannedLayout, float] = {}  # plain layout -> its exposed dp seconds
    for c in layouts(shape, cluster, batch, schedules):
        plain = _plain(c)
        if plain in unfit:  # more replicas, smaller: they hold more, and do not fit either
            continue
        if c.dims.dp_replicate > 1 and exposed.get(plain) == 0.0:
            continue
        fitting, smallest = _measured(shape, cluster, batch, c, recompute, sequence_parallel,
                                      soft, None)
        if fitting or c.dims.dp_replicate == 1:
            estimates.append(_fastest_of(shape, cluster, batch, fitting or [smallest], soft))
            if c.dims.dp_replicate == 1:  # `layouts` gives a plain layout before its replicas
                exposed[plain] = estimates[-1].parts.get("dp", 0.0)
        if not fitting:
            unfit.add(plain)
    return sorted(estimates, key=lambda e: (not e.fits, e.step_s, e.memory["total"]))


def _plain(c: PlannedLayout) -> PlannedLayout:
    """`c` sharded over all its dp GPUs, without hybrid sharding's replicas."""
    if c.dims.dp_replicate == 1:
        return c
    return dataclasses.replace(c, dims=c.dims.replace(dp_shard=c.dims.dp, dp_replicate=1))


def recommend(estimates: list[ClusterEstimate]) -> tuple[ClusterEstimate | None, str]:
    """The fastest layout that fits, and why; None if none fits."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        least = min(estimates, key=lambda e: e.memory["total"]) if estimates else None
        need = (f"; the smallest needs {least.memory['total'] / 2**30:.1f} GiB per GPU "
                f"({least.label}, recomputing {least.planned.recompute})") if least else ""
        return None, f"no layout fits{need}: add GPUs, shrink the micro-batch or the model"
    best = fitting[0]
    why = (f"{best.label}, recomputing {best.planned.recompute}: {best.step_s:.2f} s per "
           f"step, {best.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {best.mfu:.1%}, "
           f"{best.memory['total'] / 2**30:.1f} GiB per GPU; the fastest of "
           f"{len(fitting)} layouts that fit")
    if len(fitting) > 1:
        why += f"; next: {fitting[1].label} at {fitting[1].step_s:.2f} s"
    return best, why


def training_time(estimate: ClusterEstimate, tokens: float, batch: int, seq: int,
                  gpus: int) -> dict[str, float]:
    """Steps, days and GPU-hours to train on `tokens` tokens at `estimate`'s speed."""
    steps = math.ceil(tokens / (batch * seq))
    seconds = steps * estimate.step_s
    return {"tokens": tokens, "steps": steps, "days": seconds / 86400,
            "gpu_hours": seconds * gpus / 3600}
