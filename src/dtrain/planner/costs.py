"""Arithmetic both planners share: the bytes of a parameter, and what a pipeline's bubble
costs.

A pipeline of p stages runs m micro-batches, each stage holding v virtual stages (chunks)
under the interleaved schedule (dtrain.pipeline.schedules). The last micro-batch cannot
start on the last stage before it has crossed the others, and the first backward waits
for the forward to fill the pipeline: each stage sits idle for the other stages' share of
one micro-batch, divided by v since a chunk is 1/v of a stage. With every stage taking s
seconds per micro-batch, a step lasts

    m·s + (p-1)·s/v,   idle (the bubble) for (p-1)/(v·m + p-1) of it

(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters",
section 2.2). `bubble` is that share; `pipeline_seconds` the step for stages of unequal
time (the analytic planner's: the last stage also runs the output head), where the
slowest stage sets the pace and the others fill and drain.
"""

from __future__ import annotations

PARAM_BYTES = 4
"""Bytes of one fp32 parameter (or gradient): what dtrain's strategies hold and send."""


def bubble(pp: int, microbatches: int, chunks: int = 1, schedule: str = "1f1b") -> float:
    """Idle share of a pipeline step of equal stages: (p-1)/(v·m+p-1); 0 without a
    pipeline. ZB-H1 ("zb1p": backward split in B and W, each as long as a forward) idles
    (p-1)(F+B-W) of m(F+B+W): (p-1)/(3m+p-1) (Qi et al., 2023)."""
    if pp == 1:
        return 0.0
    if schedule == "zb1p":
        return (pp - 1) / (3 * microbatches + pp - 1)
    return (pp - 1) / (chunks * microbatches + pp - 1)


def pipeline_seconds(stages: list[float], microbatches: int, chunks: int = 1) -> float:
    """Seconds of a pipeline step whose stages take `stages` seconds per micro-batch:
    `microbatches` of the slowest, and the others' fill and drain, 1/`chunks` of theirs.
    For p equal stages of s seconds this is m·s / (1 - bubble(p, m, v))."""
    slowest = max(stages)
    return microbatches * slowest + (sum(stages) - slowest) / chunks
