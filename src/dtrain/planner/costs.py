"""Arithmetic both planners share: the bytes of a parameter, and what a pipeline's schedule
costs in idle time, messages and live micro-batches.

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


def placed(schedule: str, pp: int, chunks: int) -> Placement:
    """Where each (rank, chunk) runs under `schedule` (dtrain.pipeline.schedules.Placement)."""
    return Placement.of(schedule_of(schedule, chunks), pp, chunks)


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

