"""What a planner chooses: a Layout and the options it is planned with.

Both planners (dtrain.planner.traced for this machine's ranks, dtrain.planner.analytic for
GPU clusters) answer with one `PlannedLayout`, and so does an elastic job's new round
(dtrain.ft.elastic), which sends it from rank 0 to the others as `to_dict()`:

    PlannedLayout(Layout(dp=2, tp=2, pp=2, microbatches=4), recompute="selective")
    str(...)   # "dp2 x tp2 x pp2 (1f1b, m=4)", as `dtrain plan` shows it (the cluster
               # table keeps Megatron-LM's order: dtrain.planner.analytic.cluster_label)

The degrees, ZeRO stage and pipeline schedule are the Layout's; recomputation
(`[memory] activation_checkpointing`), sequence parallelism and, under context
parallelism, its attention method (`[parallel] cp_method`) change no rank's place, only
what it holds and sends, so they sit beside it. `micro_batch` (sequences per
micro-batch) is the analytic planner's: it plans a global batch of any size, which the
traced planner's layouts cut into `dp x microbatches` (or accumulated) parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.context_parallel import METHODS
from dtrain.errors import ConfigError
from dtrain.job_layout import Layout

RECOMPUTE = ("none", "selective", "full")
"""The recomputation modes, from the least memory saved (and time spent) to the most."""
CP_METHODS = METHODS
"""How context parallelism's ranks attend over the whole sequence (`[parallel] cp_method`,
dtrain.context_parallel.METHODS): a ring of key/value blocks, one all-gather of keys and
values, or Ulysses' all-to-all."""


@dataclass(frozen=True)
class PlannedLayout:
    """A layout as a planner chose it.

    Args:
        layout: the ranks' degrees, ZeRO stage and pipeline schedule.
        recompute: activation recomputation, one of RECOMPUTE.
        sequence_parallel: sequence parallelism over tp (needs tp > 1).
        micro_batch: sequences per micro-batch; 0 when the global batch decides (the
            traced planner's layouts).
        cp_method: context parallelism's attention, one of
            dtrain.context_parallel.METHODS (read where layout.cp > 1).

    Raises:
        ConfigError: an unknown recomputation mode or cp method.
    """

    layout: Layout
    recompute: str = "none"
    sequence_parallel: bool = False
    micro_batch: int = 0
    cp_method: str = "ring"

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute {self.recompute!r}: use none, selective or full")
        if self.cp_method not in CP_METHODS:
            raise ConfigError(f"cp_method {self.cp_method!r}: use {', '.join(CP_METHODS)}")

    def __str__(self) -> str:
        """The layout's short form, with ` mbB` for B sequences per micro-batch, the cp
        method where cp > 1 and ` sp` under sequence parallelism:
        `dp24 x tp8 x pp8 (1f1b, m=12) zero1 mb8 sp`, `dp2 x cp2 x tp2 ring sp`."""
        batch = f" mb{self.micro_batch}" if self.micro_batch else ""
        method = f" {self.cp_method}" if self.layout.cp > 1 else ""
        return f"{self.layout}{batch}{method}{' sp' if self.sequence_parallel else ''}"

    def to_dict(self) -> dict[str, object]:
        """Plain JSON values: the layout's `Layout.to_dict()` and the options."""
        return {"layout": self.layout.to_dict(), "recompute": self.recompute,
                "sequence_parallel": self.sequence_parallel, "micro_batch": self.micro_batch,
                "cp_method": self.cp_method}

    @classmethod
    def from_dict(cls, values: dict) -> PlannedLayout:
        """The inverse of `to_dict` (without a `cp_method`: ring)."""
        return cls(Layout.from_dict(values["layout"]), str(values["recompute"]),
                   bool(values["sequence_parallel"]), int(values["micro_batch"]),
                   str(values.get("cp_method", "ring")))
