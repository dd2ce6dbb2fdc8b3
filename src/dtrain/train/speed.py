"""How well a run uses its hardware, step by step: achieved TFLOP/s, MFU, peak memory and
the slowest rank.

    flops = flops_per_token(shape, n_params)          # the planner's 6N + 12·l·h·s
    achieved_tflops(flops.per_token, tokens_per_s, ranks=8)   # per rank
    mfu(flops.per_token, tokens_per_s, ranks=8, peak_tflops=989.0)

Model FLOPs per token are the planner's (dtrain.planner.shape.ModelShape
.model_flops_per_token: 6 per weight that multiplies a token plus attention's 12·l·h·s,
recomputation not counted), so `dtrain train`, `dtrain plan` and the cluster planner
report the same MFU for the same step time. A Hugging Face or custom model has no shape
for the planner: it counts 6 x its parameters (the attention term left out).

Each step `StepSpeed.measure` gathers every rank's busy time and peak memory over the
world in one small all-gather (a rank's busy time is its step time less what it spent
blocked in dtrain.comm's collectives: in a synchronous step every rank's wall time is the
slowest one's, so only what it did itself tells the slow rank apart).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from dtrain import comm
from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig
from dtrain.planner.shape import ModelShape
from dtrain.train.hardware import Peak, peak_memory_bytes

STRAGGLER_RATIO = 1.2
"""A rank busy this many times the median is named in a `straggler:` line."""

GiB = 2**30


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs per token of the model (MFU's numerator) and how they were counted."""

    per_token: float
    source: str


def flops_per_token(shape: ModelConfig, n_params: int) -> ModelFlops:
    """The planner's model FLOPs per token for dtrain's GPT or Llama (`shape`, resolved);
    6 x `n_params` for a Hugging Face or custom model, which the planner cannot shape."""
    try:
        planned = ModelShape.of(shape)
    except ConfigError:
        return ModelFlops(6.0 * n_params, "6 x parameters")
    return ModelFlops(planned.model_flops_per_token(), "6N + 12·l·h·s")


def achieved_tflops(flops_per_token: float, tokens_per_s: float, ranks: int) -> float:
    """Model TFLOP/s each of `ranks` ranks computes when the job trains `tokens_per_s`."""
    return flops_per_token * tokens_per_s / ranks / 1e12


def mfu(flops_per_token: float, tokens_per_s: float, ranks: int, peak_tflops: float) -> float:
    """Model FLOPs utilization: achieved TFLOP/s per rank over the peak of one rank."""
    return achieved_tflops(flops_per_token, tokens_per_s, ranks) / peak_tflops


@dataclass(frozen=True)
class Straggler:
    """The busiest rank of a step, its busy seconds and their ratio to the median's."""

    rank: int
    seconds: float
    ratio: float

    def line(self) -> str:
        return (f"straggler: rank {self.rank} took {self.seconds:.3g} s, "
                f"{self.ratio:.1f}x the median")


def slowest(busy: list[float]) -> Straggler:
    """The rank with the most busy seconds in `busy` (one entry per rank)."""
    rank = max(range(len(busy)), key=busy.__getitem__)
    median = statistics.median(busy)
    return Straggler(rank, busy[rank], busy[rank] / median if median > 0 else 1.0)


class StepSpeed:
    """Each step's speed figures for the metrics, and now and then a straggler line.

    Args:
        flops: the model's FLOPs per token.
        peak: one rank's peak rate (unknown: no MFU).
        ranks: the ranks that share the global batch.
        device: this rank's device.
        group: the ranks whose busy times and memory are gathered (None: the world).
        gather: False where the ranks never wait on each other (parameter-server workers):
            this rank's own figures, no collective.
        every: at most one straggler line per this many steps.
    """

    def __init__(self, flops: ModelFlops, peak: Peak, ranks: int, device: torch.device,
                 group: comm.GroupLike, gather: bool, every: int) -> None:
        self.flops, self.peak, self.ranks, self.device = flops, peak, ranks, device
        self.group, self.gather, self.every = group, gather, every
        self.window: list[float] = []  # each rank's busy seconds since the last check
        self.window_steps = 0
        self.waited = comm.waited()

    def begin(self) -> None:
        """Mark the start of a step (time blocked in collectives counts from here)."""
        self.waited = comm.waited()

    def measure(self, step: int, seconds: float, tokens_per_s: float
                ) -> tuple[dict[str, float | int], str]:
        """This step's figures (every rank calls it: a collective) and, every `every`
        steps, a straggler line when one rank's busy time over those steps passes
        STRAGGLER_RATIO x the median's (else "")."""
        busy = max(seconds - (comm.waited() - self.waited), 0.0)
        mine = torch.tensor([busy, float(peak_memory_bytes(self.device))], dtype=torch.float64)
        if self.gather:
            # 16 bytes a rank: the backend's own, never auto's first-call measurement
            every_rank = comm.all_gather(mine.to(self.device), group=self.group,
                                         algorithm="native").cpu().view(-1, 2)
        else:
            every_rank = mine.view(1, 2)
        busy_all = every_rank[:, 0].tolist()
        worst = slowest(busy_all)
        figures: dict[str, float | int] = {
            "tflops": achieved_tflops(self.flops.per_token, tokens_per_s, self.ranks),
            "peak_memory_gib": every_rank[:, 1].max().item() / GiB,
            "slowest_rank": worst.rank, "slowest_busy_s": worst.seconds,
            "slowest_vs_median": worst.ratio}
        if self.peak.known:
            figures["mfu"] = mfu(self.flops.per_token, tokens_per_s, self.ranks,
                                 self.peak.tflops)
        if len(self.window) != len(busy_all):  # the first step of a window
            self.window, self.window_steps = [0.0] * len(busy_all), 0
        self.window = [a + b for a, b in zip(self.window, busy_all, strict=True)]
        self.window_steps += 1
        line = ""
        if step % self.every == 0:  # over the window: one step's jitter is no straggler
            window = slowest([b / self.window_steps for b in self.window])
            self.window, self.window_steps = [], 0
            if window.ratio > STRAGGLER_RATIO:
                line = window.line()
        return figures, line

    def describe(self) -> str:
        """One line for the banner: the FLOPs counted and the peak divided by."""
        peak = f"peak {self.peak.tflops:g} TFLOP/s per rank ({self.peak.source})" \
            if self.peak.known else f"no peak known ({self.peak.source})"
        return (f"MFU: {self.flops.per_token / 1e6:.4g} MFLOP per token "
                f"({self.flops.source}); {peak}")
