"""Arithmetic both planners share: the bytes of a parameter, what a pipeline's schedule
costs in idle time, messages and live micro-batches, and which hybrid-sharding degrees a
layout may take (the last section).

A pipeline of p ranks runs m micro-batches; under the interleaved and the V-shaped
schedules each rank holds v chunks (virtual stages), a chunk 1/v of the rank's layers
(dtrain.pipeline.schedules). Let F, B and W be the seconds a rank spends on one
micro-batch's forward, its backward's input gradient and its weights' gradients (1F1B,
GPipe and interleaved run B and W as one backward). With S = F + B + W, every rank is
busy m·S seconds a step; the rest of the step is its idle share, the bubble:

    schedule      idle per step                        bubble at equal F, B, W
    gpipe, 1f1b   (p-1)·S                              (p-1)/(m+p-1)
    interleaved   (p-1)·S/v                            (p-1)/(v·m+p-1)
    zb1p          (p-1)·max(F, F+B-W)  = (p-1)·S/3     (p-1)/(3m+p-1)
    zbv           (p-1)·F/2            = (p-1)·S/6     (p-1)/(6m+p-1)
    dualpipev     (p-1)·max(F, F+B-W)/2 = (p-1)·S/6    (p-1)/(6m+p-1)

(Narayanan et al. 2021 for 1F1B and interleaved; Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", Table 2 for ZB-H1, dtrain's zb1p, and section 6 for ZB-V: its only idle
time is the last rank's wait for the first micro-batch's forward, (p-1) chunk forwards.)

`bubble` does not use that table: it runs the schedule's own action lists (the very
lists the runtime executes, `dtrain.pipeline.schedules.build`) on given F, B and W, with
`comm` seconds for each message between ranks, as the Zero Bubble paper computes its
bubble rates (its section 5.3: cost = the longest rank's time, each F waiting for the
stage before's F plus T_comm, each B for the stage after's B plus T_comm). This is what
the traced planner and `dtrain plan --schedule-table` report, exact for dtrain's lists.
Those of zbv are not quite the paper's ZB-V: they are made once on equal F, B and W
(`schedules.zb_v`), and run with W shorter than F and B they idle more than the table's
(p-1)·F/2, more with every micro-batch (docs/choosing-a-layout.md gives figures).

The cluster planner plans thousands of layouts of up to hundreds of ranks, where running
the lists costs too much; it takes the table (`fill_share`: the fill and drain of a
schedule as a share of 1F1B's), which tests/planner check against the lists: equal for
every schedule at equal F, B and W, and for zb1p at any; at unequal ones dtrain's
dualpipev lists idle up to 1.6 times the table's (a pair of a forward and a backward
waits for both their messages), its zbv lists more. `pipeline_seconds` stretches the
table over stages of unequal time, where the slowest sets the pace and the others fill
and drain.

`sends` counts the messages a rank sends per micro-batch (each chunk's output forward and
its input's gradient back, unless the neighbouring stage is on the same rank: the V's turn
at the last rank); `live_micro_batches` the most micro-batches a rank holds at once.

Hybrid sharding (HSDP, `[parallel] dp_replicate = R` with `zero = 1, 2 or 3`;
dtrain.mesh.dims): the dp data-parallel ranks split into R replicas of S = dp / R ranks.
ZeRO shards the model state over a replica's S x cp ranks and keeps its gathers and
reduce-scatters there; each rank's reduced gradient shard, Ψ/(S·cp) elements of the Ψ
parameters it holds after tp and pp split the model (the split experts: over the S·cp /
ep ranks holding them), is then all-reduced with the same shard of the other R - 1
replicas, once per step. Per rank and step, against ZeRO over all dp x cp ranks:

    across the replicas   2(R-1)/R x Ψ/(S·cp) x bytes of a gradient, in one all-reduce
                          (ZeRO over all ranks: its gathers and reduce-scatters span them)
    inside a replica      ZeRO's own traffic over S·cp ranks instead of dp·cp
    memory                ZeRO's over S·cp ranks: the sharded state divided by S·cp, not
                          dp·cp

A replica is S x cp x tp consecutive ranks (the mesh puts dp_replicate outside dp_shard,
cp and tp). The planners weigh every R of at least 2 dividing dp whose replica is part of
one machine or whole machines: S x cp x tp divides the ranks of a machine or is a multiple
of them (`replica_degrees`). Whole machines are the point: ZeRO's many collectives stay on
a machine's fast links (NVLink) and only the all-reduce of one shard per step crosses the
slow ones between machines. Part of a machine is weighed too, though it rarely pays: its
shards are larger (S smaller) and its all-reduce crosses machines as much. Replicas
straddling a machine boundary are not weighed (their gathers would cross it, without the
shard all-reduce getting any smaller), nor S = 1 (ZeRO over one rank is DataParallel,
`zero = 0`), nor R = 1 (plain ZeRO, which every ZeRO layout already is).

HSDP wins where the links between machines are slow against those inside one and the
model state fits S x cp ranks: ZeRO-3 over every rank gathers the weights across
machines for each micro-batch's forward and backward and reduce-scatters its gradients
there, where HSDP sends one shard's all-reduce per step. Where the state does not fit S
ranks, the layout does not fit and is not picked; where the network is as fast as the
machine's links, the extra all-reduce buys nothing and plain ZeRO (or another layout)
wins. Each planner costs the all-reduce on its own links, as one more of the step's
data-parallel collectives: the cluster planner (dtrain.planner.analytic.cluster)
hierarchically, NVLink inside a node and the network across, beside the last
micro-batch's; the traced one (dtrain.planner.traced.estimate) at its links' alpha and
beta, the network's where the replicas span machines (dtrain.planner.traced.links),
behind backward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from dtrain.errors import DtrainError
from dtrain.pipeline.schedules import Action, Placement, build, simulate

PARAM_BYTES = 4
"""Bytes of one fp32 parameter (or gradient): what dtrain's strategies hold and send."""

Times = tuple[float, float, float]
"""Seconds (or any unit) of one micro-batch's F, B and W on one rank, all its chunks."""
EQUAL: Times = (1.0, 1.0, 1.0)


def schedule_of(schedule: str, chunks: int) -> str:
    """The schedule that runs: "1f1b" over several chunks is the interleaved one."""
    return "interleaved" if schedule == "1f1b" and chunks > 1 else schedule


def bubble(pp: int, microbatches: int, chunks: int = 1, schedule: str = "1f1b",
           times: Times = EQUAL, comm: float = 0.0) -> float:
    """Idle share of a pipeline step of `schedule` (0 without a pipeline): 1 - m·S / step,
    the step simulated on the schedule's own action lists (`step_length`; see the module
    doc), each rank spending `times` (F, B, W) on a micro-batch, a chunk 1/`chunks` of
    it, and each message between ranks `comm`.

    Raises:
        ConfigError: the schedule cannot run so (dtrain.pipeline.schedules.check).
    """
    if pp == 1:
        return 0.0
    step = step_length(schedule_of(schedule, chunks), pp, microbatches, chunks,
                       (float(times[0]), float(times[1]), float(times[2])), float(comm))
    return 1 - microbatches * sum(times) / step


@functools.cache
def action_lists(schedule: str, pp: int, microbatches: int, chunks: int = 1
                 ) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions for one step (dtrain.pipeline.schedules.build), kept.

    Raises:
        ConfigError: the schedule cannot run so.
    """
    return tuple(tuple(build(schedule, pp, rank, microbatches, chunks)) for rank in range(pp))


@functools.cache
def step_length(schedule: str, pp: int, microbatches: int, chunks: int = 1,
                times: Times = EQUAL, comm: float = 0.0) -> float:
    """Length of one step of `schedule`'s action lists when a rank's F, B and W of one
    micro-batch take `times` (a chunk's 1/`chunks` of them; B + W for a backward not
    split) and a message between two ranks `comm` (dtrain.pipeline.schedules.simulate:
    each action starts when its rank is done with the one before and what it needs has
    ended, plus `comm` if that was on another rank; a DualPipeV pair starts when both
    its actions could, and both end with it).

    Raises:
        ConfigError: the schedule cannot run so.
    """
    chunk = (times[0] / chunks, times[1] / chunks, times[2] / chunks)
    lists = action_lists(schedule, pp, microbatches, chunks)
    return simulate(lists, Placement.of(schedule, pp, chunks), chunk, comm)[0]


def fill_share(schedule: str, times: Times = EQUAL) -> float:
    """The fill and drain of `schedule` as a share of 1F1B's, (p-1)·S/v (the module
    doc's table): 1 for gpipe, 1f1b and interleaved; max(F, F+B-W)/S for zb1p and
    dualpipev; F/S for zbv. `times`: a rank's F, B and W of a micro-batch."""
    forward, backward, weights = times
    total = forward + backward + weights
    if schedule in ("zb1p", "dualpipev"):
        return max(forward, forward + backward - weights) / total
    if schedule == "zbv":
        return forward / total
    return 1.0


def pipeline_seconds(stages: list[float], microbatches: int, chunks: int = 1,
                     fill: float = 1.0) -> float:
    """Seconds of a pipeline step whose stages take `stages` seconds per micro-batch:
    `microbatches` of the slowest, and the others' fill and drain, 1/`chunks` of theirs
    times the schedule's `fill` (`fill_share`). For p equal stages of s seconds under
    1F1B this is m·s / (1 - bubble(p, m, v))."""
    slowest = max(stages)
    return microbatches * slowest + fill * (sum(stages) - slowest) / chunks


def sends(schedule: str, pp: int, chunks: int, rank: int) -> int:
    """Messages rank `rank` sends per micro-batch: each chunk's output to the next stage
    and its input's gradient to the stage before, where those are on another rank
    (1F1B: 1 at the ends, 2 between; the V-shaped schedules twice that, and their turn at
    the last rank sends nothing)."""
    place = Placement.of(schedule_of(schedule, chunks), pp, chunks)
    count = 0
    for chunk in range(chunks):
        stage = place.stage(rank, chunk)
        for other in (stage - 1, stage + 1):
            if 0 <= other < place.stages and place.holder(other)[0] != rank:
                count += 1
    return count


def live_micro_batches(schedule: str, pp: int, rank: int, microbatches: int) -> int:
    """The most micro-batches rank `rank` holds at once, counted in its chunks' units
    (`dtrain.pipeline.schedules.peak_live` of its list; closed forms, which tests check
    against the lists): GPipe every one; 1F1B p - rank; interleaved is not here (its
    count depends on the chunks, see `dtrain.pipeline.schedules.interleaved`); zb1p p on
    every rank, a micro-batch kept from its F to its W; zbv 2p chunk-sized (p of the
    rank's whole stage, 1F1B's first stage's); dualpipev 2p + 1.

    Raises:
        DtrainError: the interleaved schedule, or an unknown one.
    """
    m = microbatches
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - rank, m)
    if schedule == "zb1p":
        return min(pp, m)
    if schedule == "zbv":
        return min(2 * pp, 2 * m)
    if schedule == "dualpipev":
        return 2 * pp + 1
    raise DtrainError(f"schedule {schedule!r}: its live micro-batches depend on the chunks; "
                      "count them on its action lists")


@functools.cache
def placed(schedule: str, pp: int, chunks: int) -> Placement:
    """Where each (rank, chunk) runs under `schedule` (dtrain.pipeline.schedules.Placement)."""
    return Placement.of(schedule_of(schedule, chunks), pp, chunks)


@functools.cache
def holds_ends(schedule: str, pp: int, chunks: int, rank: int) -> tuple[bool, bool]:
    """Whether rank `rank` holds the first stage (the embedding's) and the last (the
    head's): under the V-shaped schedules rank 0 holds both."""
    place = placed(schedule, pp, chunks)
    stages = [place.stage(rank, c) for c in range(chunks)]
    return 0 in stages, place.stages - 1 in stages


def chunk_sizes(sizes: Sequence[int], schedule: str, pp: int, chunks: int
                ) -> list[list[int]]:
    """Each rank's chunks' sizes, in chunk order, from `sizes` in stage order."""
    place = placed(schedule, pp, chunks)
    return [[sizes[place.stage(r, c)] for c in range(chunks)] for r in range(pp)]


def replica_degrees(dp: int, inner: int, per_node: int, ep: int = 1) -> list[int]:
    """The `dp_replicate` degrees R a planner weighs for a layout of `dp` data-parallel
    ranks, each with `inner` ranks beside it (cp x tp), on machines of `per_node` ranks:
    every R >= 2 dividing dp whose replicas of S = dp / R ranks (S >= 2, a multiple of
    `ep`: experts split inside a replica) take S x inner consecutive ranks that divide
    `per_node` (part of a machine) or are a multiple of it (whole machines); ascending
    (none where a figure is not positive)."""
    if min(dp, inner, per_node, ep) < 1:
        return []
    found = []
    for replicas in range(2, dp // 2 + 1):
        if dp % replicas:
            continue
        shard = dp // replicas
        span = shard * inner
        if shard % ep == 0 and (per_node % span == 0 or span % per_node == 0):
            found.append(replicas)
    return found
