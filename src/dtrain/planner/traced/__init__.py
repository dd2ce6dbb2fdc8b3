"""The traced planner: every layout of this machine's ranks, from the model traced on fake
tensors.

    cfg = GPTConfig(n_layer=24, n_embd=1024, n_head=16)
    estimates = plan(lambda b: profile_gpt(cfg, b), devices=8, memory=80e9, batch=64,
                     flops=300e12, links=Links.given(100, 10))
    best, why = recommend(estimates)

The model is traced once per activation-recomputation mode and micro-batch size
(`profile`, `trace`, counting live bytes with `tracker.LiveBytes`); each layout's figures
follow dtrain's own strategies (`estimate`), with sequence parallelism where asked and the
peak while the layout builds its share (`construction`); collectives cost what
dtrain.comm measured (`links`), on this machine's figures unless told (`machine`).
`slow_links` weighs ways to synchronize a data-parallel layout over slow links, and
`measure` runs a layout for real to check the figures. A mixture-of-experts model's
layouts also take each expert-parallel degree `ep` dividing dp and the experts (the
table's `dp4 ep2`): its routed experts split over ep of the dp ranks, as dtrain's ep
splits them. dtrain's GPT and Llama without dropout also take each context-parallel degree
`cp` dividing the devices whose 2 x cp chunks cut the sequence (ep = 1 there; the table's
`dp2 x cp2 ring`): dp = devices / (cp x tp x pp), each rank traced on its block_size / cp
tokens of every sequence, attending by the cp method planned. A ZeRO layout also takes
each hybrid-sharding degree `dp_replicate` the ranks' machines allow (the table's `dp2x4
zero3`: 2 replicas of 4 ranks; dtrain.planner.costs): a replica part of one machine or
whole machines, on `links.machine` ranks each (every rank on one machine unless the links
say otherwise, `Links.across_machines`).

A pipeline's schedule, recomputation, sequence parallelism and the cp method are choices
per layout: `plan(..., schedules=("1f1b", "zb1p", "zbv", "dualpipev"),
recompute=("none", "selective", "full"), sequence_parallel=(False, True),
cp_method="ring")` plans each layout with the fastest of them that fits (a zero-bubble
schedule idles less and holds micro-batches until their W; recomputation costs a forward
of what it recomputes; sequence parallelism a few more calls), so a layout that fits as it
is keeps everything, and one that does not falls back to sequence parallelism, then to
recomputing the attention cores, then whole blocks. cp layouts are planned where
`cp_method` names a method or more (none by default).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

from dtrain.mesh import Dims
from dtrain.mesh.dims import V_SHAPED
from dtrain.planner.costs import replica_degrees
from dtrain.planner.traced.estimate import Estimate, estimate
from dtrain.planner.traced.links import Links
from dtrain.planner.traced.profile import Profile

MICROBATCHES = (1, 2, 4)  # pipelines try m = pp times these
SCHEDULES = ("1f1b", "zb1p", "zbv", "dualpipev")
"""The pipeline schedules `dtrain plan` weighs by default: those needing no choice of
chunks beyond the V's two (gpipe holds more than 1f1b for the same bubble; interleaved
is weighed when asked, at two chunks a rank)."""


def chunks_of(schedule: str) -> int:
    """The chunks per rank a plan gives `schedule`: two for the V-shaped and interleaved
    schedules, one for the others."""
    return 2 if schedule in V_SHAPED or schedule == "interleaved" else 1


def runs(schedule: str, pp: int, microbatches: int, blocks: int) -> bool:
    """Whether `schedule` can run on `pp` ranks with `microbatches` (in groups of pp) over
    `blocks` blocks: a block for each chunk, and DualPipeV's 2 x pp micro-batches."""
    if pp * chunks_of(schedule) > blocks:
        return False
    return schedule != "dualpipev" or microbatches >= 2 * pp


def layouts(profile: Profile, devices: int, batch: int, accum: int = 1,
            schedules: tuple[str, ...] = ("1f1b",), per_node: int = 0) -> list[Dims]:
    """Every layout of `devices` ranks the model and a global batch of `batch` allow: a
    mixture of experts' with each expert-parallel degree dividing dp and the experts, and
    each context-parallel degree the model and the sequence allow (not with ep > 1); a
    pipeline's with each of `schedules` that can run it (`runs`: the V-shaped and
    interleaved ones on two chunks a rank); a ZeRO layout's also with each hybrid-sharding
    degree dp_replicate its replicas allow on machines of `per_node` ranks (0: all of
    them on one; dtrain.planner.costs.replica_degrees)."""
    found = []
    for cp in profile.context_degrees(devices):
        for tp in profile.tp_degrees(devices // cp):
            for pp in range(1, devices // (cp * tp) + 1):
                if (devices // (cp * tp)) % pp or (pp > 1 and pp > profile.n_layer):
                    continue
                dp = devices // (cp * tp * pp)
                # ZeRO shards over dp x cp (or a replica's); experts split over dp alone,
                # and not under cp
                for zero, ep in itertools.product(range(4) if dp * cp > 1 else (0,),
                                                  profile.expert_degrees(dp) if cp == 1
                                                  else [1]):
                    hybrid = replica_degrees(dp, cp * tp, per_node or devices, ep) \
                        if zero else []
                    for replicas in [1, *hybrid]:
                        found += _variants(profile, batch, accum, schedules,
                                           Dims(dp // replicas, tp, pp, zero, ep=ep, cp=cp,
                                                dp_replicate=replicas))
    return found


def _variants(profile: Profile, batch: int, accum: int, schedules: tuple[str, ...],
              layout: Dims) -> list[Dims]:
    """`layout` as it may run a global batch of `batch`: whole when the batch splits into
    its dp ranks x `accum`; a pipeline with pp times each of MICROBATCHES micro-batches
    under each of `schedules` that runs it."""
    dp, pp = layout.dp, layout.pp
    if pp == 1:
        return [layout] if batch % (dp * accum) == 0 else []
    return [layout.replace(microbatches=m, schedule=schedule,
                           virtual_stages=chunks_of(schedule))
            for m in (pp * k for k in MICROBATCHES) if batch % (dp * m) == 0
            for schedule in schedules if runs(schedule, pp, m, profile.n_layer)]


def choices(profile: Profile, layout: Dims, recompute: tuple[str, ...],
            sequence_parallel: tuple[bool, ...], cp_method: tuple[str, ...] = ()
            ) -> list[tuple[str, bool, str]]:
    """The (recomputation mode, sequence parallelism, cp method) triples `layout` can
    take of those asked, in the order asked: modes the model has, sequence parallelism
    where tp allows, cp methods the heads allow at the layout's cp (a cp layout none of
    them runs has no choice; at cp = 1 the method is "ring", and means nothing)."""
    modes = [m for m in recompute if m in profile.modes] or ["none"]
    seq = [s for s in sequence_parallel
           if not s or profile.sequence_parallel(layout.tp, layout.cp)]
    methods = profile.context_methods(layout.tp, layout.cp, cp_method) if layout.cp > 1 \
        else ["ring"]
    return [(m, s, c) for m in modes for s in dict.fromkeys(seq or [False]) for c in methods]


def _speed(e: Estimate) -> int:
    """Steps within 1% of each other are a tie."""
    return round(math.log(max(e.step_s, 1e-12)) * 100)


def plan(trace: Callable[..., Profile], devices: int, memory: float, batch: int,
         flops: float, links: Links, optimizer: str = "adamw", accum: int = 1,
         bucket_mb: float = 25.0, schedules: tuple[str, ...] = ("1f1b",),
         recompute: str | tuple[str, ...] = "none",
         sequence_parallel: bool | tuple[bool, ...] = False,
         cp_method: str | tuple[str, ...] = (), stage_layers: str = "") -> list[Estimate]:
    """The estimate of every layout (see `layouts`), fastest first. `trace(b)` profiles
    the model on a micro-batch of b sequences (activations are not quite linear in b:
    kernels differ by size, so each size is traced), `trace(b, cp, method)` on a
    context-parallel rank's share of each, attending by `method` (for cp layouts only:
    `profile_model(cfg, b, cp=cp, cp_method=method)`).

    `schedules` (a pipeline's: those of them that run it, `runs`), `recompute` (modes of
    RECOMPUTE), `sequence_parallel` and `cp_method` (dtrain.context_parallel.METHODS;
    none, the default: no cp layouts) are the choices each layout may take, preferred
    first: a layout gets the fastest that fits (the first of those within 1%), or, if none
    fits, the one needing the least memory.
    `stage_layers` cuts a pipeline's blocks into stages (`[parallel] stage_layers`: "",
    "auto", or sizes, which only the layouts of as many stages take; the others cut
    evenly).
    """
    modes = (recompute,) if isinstance(recompute, str) else tuple(recompute)
    seq = (sequence_parallel,) if isinstance(sequence_parallel, bool) else \
        tuple(sequence_parallel)
    methods = (cp_method,) if isinstance(cp_method, str) else tuple(cp_method)
    profile = functools.cache(trace)  # layouts share micro-batch sizes
    first = profile(max(1, batch // devices))  # the model's modes and shape
    out = []
    # a pipeline's schedules are its choices too: one row per layout, its fastest schedule
    groups: dict[Dims, list[Dims]] = {}
    for layout in layouts(first, devices, batch, accum, schedules, links.machine):
        groups.setdefault(layout.replace(schedule="1f1b", virtual_stages=1), []).append(layout)
    for variants in groups.values():
        per_micro = batch // (variants[0].dp * (accum if variants[0].pp == 1
                                                else variants[0].microbatches))
        candidates = [estimate(profile(per_micro, layout.cp, method) if layout.cp > 1
                               else profile(per_micro), layout, memory, flops, links,
                               optimizer, accum if layout.pp == 1 else 1, bucket_mb, mode, sp,
                               _cut(stage_layers, layout))
                      for layout in variants
                      for mode, sp, method in choices(first, layout, modes, seq, methods)]
        if not candidates:
            continue  # a cp layout none of the methods asked for runs
        fitting = [e for e in candidates if e.fits]
        out.append(min(fitting, key=_speed) if fitting
                   else min(candidates, key=lambda e: e.total))
    # Steps within 1% of each other are a tie: then less traffic, then less memory.
    return sorted(out, key=lambda e: (not e.fits, _speed(e), sum(e.traffic.values()), e.total))


def _cut(stage_layers: str, layout: Dims) -> str:
    """`stage_layers` where it fits `layout`'s stages: explicit sizes only at their count."""
    if stage_layers in ("", "auto") or layout.pp == 1:
        return stage_layers
    count = len(stage_layers.split(","))
    return stage_layers if count == layout.pp * layout.virtual_stages else ""


def _options(e: Estimate) -> str:
    return f", recomputing {e.recompute}" if e.recompute != "none" else ""


def recommend(estimates: list[Estimate]) -> tuple[Estimate | None, str]:
    """The fastest layout that fits, and why; None if none fits."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        least = min(estimates, key=lambda e: e.total) if estimates else None
        need = (f"; the smallest needs {least.total / 2**30:.2f} GiB per device "
                f"({least.label}{_options(least)})") if least else ""
        return None, f"no layout fits{need}: add devices or memory, or shrink the batch"
    best = fitting[0]
    again = f", {best.recompute_s * 1e3:.1f} recomputation" if best.recompute_s else ""
    why = (f"{best.label}{_options(best)}: the fastest estimated step "
           f"({best.step_s * 1e3:.1f} ms: {best.compute_s * 1e3:.1f} compute{again}, "
           f"{best.comm_s * 1e3:.1f} communication) of the {len(fitting)} layouts that fit, "
           f"at {best.total / 2**30:.2f} GiB per device")
    if len(fitting) > 1:
        second = fitting[1]
        why += f"; next: {second.label}{_options(second)} at {second.step_s * 1e3:.1f} ms"
    unfit = [e for e in estimates if not e.fits]
    if unfit:
        why += f"; {len(unfit)} layouts do not fit"
    return best, why
