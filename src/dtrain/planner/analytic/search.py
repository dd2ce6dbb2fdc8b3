"""Which layout to run on a GPU cluster: every valid one, ranked by the cost model.

    estimates = rank(shape, cluster, batch=2304)    # one per layout, fastest first
    best, why = recommend(estimates)
    one = best_of(shape, cluster, 2304, planned_layout(2304, tp=8, pp=8, dp=24))  # its options

A layout is tp x pp x dp = the cluster's GPUs with tp dividing the heads and the key/value
heads and staying inside a node, pp at most the layers, and dp x micro-batch dividing the
global batch; a mixture-of-experts model's experts are split over ep of the dp GPUs (ep
dividing dp and the experts: every such ep is a layout of its own); it may take a ZeRO
stage (3 only without pipelining),
virtual stages (the interleaved schedule: pp > 1, the layers dividing pp x v and the
micro-batches pp). Each layout is planned with the fastest recomputation mode and sequence
parallelism setting that fit (cluster.evaluate); a layout nothing makes fit keeps its
smallest.
"""

from __future__ import annotations

import dataclasses
import math

from dtrain.errors import ConfigError
from dtrain.planner.analytic.cluster import (
    CHUNKS,
    MICRO_SIZES,
    ZERO_STAGES,
    ClusterEstimate,
    Software,
    cluster_label,
    evaluate,
    planned_layout,
)
from dtrain.planner.analytic.hardware import Cluster
from dtrain.planner.planned import RECOMPUTE, PlannedLayout
from dtrain.planner.shape import ModelShape

DEFAULT = Software()


def check_layout(shape: ModelShape, cluster: Cluster, batch: int, c: PlannedLayout) -> None:
    """Raise a one-line ConfigError if `c` cannot run `shape` on `cluster` at `batch`."""
    layout = c.layout
    tp, pp, dp, v, ep = layout.tp, layout.pp, layout.dp, layout.virtual_stages, layout.ep
    if min(tp, pp, dp, c.micro_batch, v, ep) < 1:
        raise ConfigError(f"--layout {cluster_label(c)}: degrees, micro-batch and virtual "
                          "stages must be positive")
    if tp * pp * dp != cluster.gpus:
        raise ConfigError(f"--layout tp={tp},pp={pp},dp={dp} uses "
                          f"{tp * pp * dp} GPUs, but the cluster has {cluster.gpus} "
                          f"({cluster.nodes} nodes x {cluster.gpus_per_node}): make "
                          "tp x pp x dp equal it")
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
    if v > 1:
        m = batch // (dp * c.micro_batch)
        if pp == 1 or shape.layers < pp * v or m % pp:
            raise ConfigError(f"--virtual-stages {v} needs pp > 1, at least pp x v "
                              f"= {pp * v} layers (the model has {shape.layers}) "
                              f"and the micro-batches ({m}) in groups of pp")
    if c.sequence_parallel and tp == 1:
        raise ConfigError("sequence parallelism needs tp > 1")
    if ep > 1 and not shape.experts:
        raise ConfigError(f"--layout ep={ep} splits experts, and this model has none: give "
                          "the shape experts= and top_k=, or leave ep out")
    if ep > 1 and (dp % ep or shape.experts % ep):
        which = f"dp={dp}" if dp % ep else f"the model's {shape.experts} experts"
        raise ConfigError(f"--layout ep={ep} does not divide {which}: pick an ep that "
                          "divides both dp and the experts")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: ModelShape, cluster: Cluster, batch: int) -> list[PlannedLayout]:
    """Every layout the search considers, before recomputation and sequence parallelism."""
    found = []
    gpus = cluster.gpus
    for tp in _divisors(min(gpus, cluster.gpus_per_node)):
        if gpus % tp or shape.heads % tp or shape.kv_heads % tp:
            continue
        for pp in _divisors(gpus // tp):
            if pp > shape.layers:
                continue
            dp = gpus // (tp * pp)
            for b in MICRO_SIZES:
                if batch % (dp * b):
                    continue
                m = batch // (dp * b)
                chunks = [v for v in CHUNKS if v == 1 or (
                    pp > 1 and shape.layers >= pp * v and m % pp == 0)]
                for v in chunks:
                    for zero in range(4 if pp == 1 else 3) if dp > 1 else (0,):
                        found += [planned_layout(batch, tp, pp, dp, zero, b, v, ep=ep)
                                  for ep in shape.expert_degrees(dp)]
    return found


def best_of(shape: ModelShape, cluster: Cluster, batch: int, planned: PlannedLayout,
            recompute: tuple[str, ...] = RECOMPUTE, sequence_parallel: tuple[bool, ...] =
            (False, True), soft: Software = DEFAULT) -> ClusterEstimate:
    """`planned` with the fastest of the recomputation modes and sequence-parallel settings
    asked for that fits, or the one needing the least memory if none fits."""
    options = [dataclasses.replace(planned, recompute=r, sequence_parallel=s)
               for r in recompute for s in dict.fromkeys(sequence_parallel)
               if not s or planned.layout.tp > 1] or \
        [dataclasses.replace(planned, recompute=recompute[0])]
    return fastest([evaluate(shape, cluster, batch, c, soft) for c in options])


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
                soft: Software = DEFAULT, ep: int = 1) -> ClusterEstimate | None:
    """tp x pp x dp (the experts over `ep` of the dp GPUs) with the fastest of the
    micro-batch sizes, virtual stages, ZeRO stages, recomputation modes and
    sequence-parallel settings asked for (`fastest` of the valid combinations,
    `check_layout`); None if no combination is valid."""
    found = []
    for b in microbatches:
        for v in chunks:
            for zero in zeros:
                choice = planned_layout(batch, tp, pp, dp, zero, b, v, recompute[0], ep=ep)
                try:
                    check_layout(shape, cluster, batch, choice)
                except ConfigError:
                    continue
                found.append(best_of(shape, cluster, batch, choice, recompute,
                                     sequence_parallel, soft))
    return fastest(found) if found else None


def rank(shape: ModelShape, cluster: Cluster, batch: int,
         recompute: tuple[str, ...] = RECOMPUTE,
         sequence_parallel: tuple[bool, ...] = (False, True),
         soft: Software = DEFAULT) -> list[ClusterEstimate]:
    """Every layout (see `layouts`), those that fit first, fastest first."""
    estimates = [best_of(shape, cluster, batch, c, recompute, sequence_parallel, soft)
                 for c in layouts(shape, cluster, batch)]
    return sorted(estimates, key=lambda e: (not e.fits, e.step_s, e.memory["total"]))


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
