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

Every rank keeps its own figures of each step (`StepSpeed.keep`: its busy time, its peak
memory, and one number of the caller's, the Trainer's loss), and they are gathered over
the world in one small all-gather every `log_every` steps (`StepSpeed.take`), not every
step: a collective each step costs a latency on every rank (on a GPU, a synchronization
of the host with the device too) for figures read once a log line. Each step's figures
come out as they would have been gathered that step. A rank's busy time is its step time
less what it spent blocked in dtrain.comm's collectives: in a synchronous step every
rank's wall time is the slowest one's, so only what it did itself tells the slow rank
apart.
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


@dataclass(frozen=True)
class Measured:
    """A step's figures over the ranks, as `StepSpeed.take` gives them.

    Attributes:
        step: the step.
        figures: its record's speed figures (tflops, mfu, peak_memory_gib, slowest_*).
        straggler: a `straggler:` line at the end of a window that had one, else "".
        carried: the number each rank kept with the step (`StepSpeed.keep`), in rank
            order over the group; this rank's alone where nothing is gathered.
    """

    step: int
    figures: dict[str, float | int]
    straggler: str
    carried: list[float]


@dataclass(frozen=True)
class _Kept:
    """What a rank keeps of a step until its figures are taken."""

    step: int
    tokens_per_s: float
    row: tuple[float, float, float]  # busy seconds, peak memory bytes, the carried number


class StepSpeed:
    """Each step's speed figures for the metrics, and now and then a straggler line.

    Args:
        flops: the model's FLOPs per token.
        peak: one rank's peak rate (unknown: no MFU).
        ranks: the ranks that share the global batch.
        device: this rank's device.
        group: the ranks whose busy times and memory are gathered (None: the world).
        gather: False where the ranks never meet after a step (parameter-server workers,
            live replicas): this rank's own figures, no collective.
        every: at most one straggler line per this many steps.
    """

    def __init__(self, flops: ModelFlops, peak: Peak, ranks: int, device: torch.device,
                 group: comm.GroupLike, gather: bool, every: int) -> None:
        self.flops, self.peak, self.ranks, self.device = flops, peak, ranks, device
        self.group, self.gather, self.every = group, gather, every
        self.window: list[float] = []  # each rank's busy seconds since the last check
        self.window_steps = 0
        self.waited = comm.waited()
        self.kept: list[_Kept] = []

    def begin(self) -> None:
        """Mark the start of a step (time blocked in collectives counts from here)."""
        self.waited = comm.waited()

    def keep(self, step: int, seconds: float, tokens_per_s: float, carried: float = 0.0
             ) -> None:
        """Keep this rank's figures of `step` (its busy time out of `seconds`, its peak
        memory so far) and `carried`, a number of the caller's to gather with them, until
        `take`: no collective."""
        busy = max(seconds - (comm.waited() - self.waited), 0.0)
        self.kept.append(_Kept(step, tokens_per_s,
                               (busy, float(peak_memory_bytes(self.device)), carried)))

    def take(self) -> list[Measured]:
        """The figures of every step kept since the last take, in step order (every rank
        calls it after the same steps: one all-gather of them all, where `gather`). Each
        step's are what that step alone would give; a straggler line comes with each
        `every`-th step whose window of steps had one."""
        if not self.kept:
            return []
        mine = torch.tensor([k.row for k in self.kept], dtype=torch.float64)
        if self.gather:
            # 24 bytes a rank and step: the backend's own, never auto's first-call measurement
            every_rank = comm.all_gather(mine.view(-1).to(self.device), group=self.group,
                                         algorithm="native").cpu().view(-1, *mine.shape)
        else:
            every_rank = mine.view(1, *mine.shape)
        kept, self.kept = self.kept, []
        return [self._measured(k, every_rank[:, i]) for i, k in enumerate(kept)]

    def measure(self, step: int, seconds: float, tokens_per_s: float
                ) -> tuple[dict[str, float | int], str]:
        """`keep` and `take` of one step at once (a collective, where `gather`): its
        figures and straggler line."""
        self.keep(step, seconds, tokens_per_s)
        (measured,) = self.take()
        return measured.figures, measured.straggler

    def _measured(self, kept: _Kept, every_rank: torch.Tensor) -> Measured:
        """A step's figures from each rank's row of it ([ranks, 3]), its straggler window
        advanced."""
        busy_all = every_rank[:, 0].tolist()
        worst = slowest(busy_all)
        figures: dict[str, float | int] = {
            "tflops": achieved_tflops(self.flops.per_token, kept.tokens_per_s, self.ranks),
            "peak_memory_gib": every_rank[:, 1].max().item() / GiB,
            "slowest_rank": worst.rank, "slowest_busy_s": worst.seconds,
            "slowest_vs_median": worst.ratio}
        if self.peak.known:
            figures["mfu"] = mfu(self.flops.per_token, kept.tokens_per_s, self.ranks,
                                 self.peak.tflops)
        if len(self.window) != len(busy_all):  # the first step of a window
            self.window, self.window_steps = [0.0] * len(busy_all), 0
        self.window = [a + b for a, b in zip(self.window, busy_all, strict=True)]
        self.window_steps += 1
        line = ""
        if kept.step % self.every == 0:  # over the window: one step's jitter is no straggler
            window = slowest([b / self.window_steps for b in self.window])
            self.window, self.window_steps = [], 0
            if window.ratio > STRAGGLER_RATIO:
                line = window.line()
        return Measured(kept.step, figures, line, every_rank[:, 2].tolist())

    def describe(self) -> str:
        """One line for the banner: the FLOPs counted and the peak divided by."""
        peak = f"peak {self.peak.tflops:g} TFLOP/s per rank ({self.peak.source})" \
            if self.peak.known else f"no peak known ({self.peak.source})"
        return (f"MFU: {self.flops.per_token / 1e6:.4g} MFLOP per token "
                f"({self.flops.source}); {peak}")
