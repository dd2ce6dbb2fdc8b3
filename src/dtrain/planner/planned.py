"""What a planner chooses: the job's Dims and the recomputation it is planned with.

Both planners (dtrain.planner.traced for this machine's ranks, dtrain.planner.analytic for
GPU clusters) answer with one `PlannedLayout`, and so does an elastic job's new round
(dtrain.ft.elastic), which sends it from rank 0 to the others as `to_dict()`:

    PlannedLayout(Dims(2, tp=2, pp=2, microbatches=4), recompute="selective")
    str(...)   # "dp2 x tp2 x pp2 (1f1b, m=4)", as `dtrain plan` shows it (the cluster
               # table keeps Megatron-LM's order: dtrain.planner.analytic.cluster_label)

The degrees, ZeRO stage, pipeline schedule, sequence parallelism and context
parallelism's attention method are the Dims' (dtrain.mesh.dims); recomputation (`[memory]
recompute`) changes no rank's place, only what it holds, so it sits beside them.
`micro_batch` (sequences per micro-batch) is the analytic planner's: it plans a global
batch of any size, which the traced planner's layouts cut into `dp x microbatches` (or
accumulated) parts.

A plan becomes a config by `parallel_section` (the `[parallel]` table: dp the whole
data-parallel degree, dp_replicate its replicas under hybrid sharding) and `overrides`
(those keys and `memory.recompute` as `--set` names them), which both planners' `--json`
output carries beside each layout and the planner's own check runs by
(dtrain.planner.traced.measure).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.errors import ConfigError
from dtrain.mesh import Dims
from dtrain.mesh.dims import CP_METHODS

RECOMPUTE = ("none", "selective", "full")
"""The recomputation modes, from the least memory saved (and time spent) to the most."""

__all__ = ["CP_METHODS", "RECOMPUTE", "PlannedLayout", "parallel_section"]


def parallel_section(dims: Dims) -> dict[str, object]:
    """The `[parallel]` keys (dtrain.mesh.config.ParallelConfig) that make `dims` on its
    world size (`Dims.of` reads them back to the same degrees and options): dp is the
    whole data-parallel degree, dp_replicate x dp_shard, and dp_replicate the replicas of
    hybrid sharding (1 without). The launch's `nproc`, the sync groups and parameter
    servers are not a planner's and are left out."""
    return {"dp": dims.dp, "dp_replicate": dims.dp_replicate, "tp": dims.tp, "pp": dims.pp,
            "cp": dims.cp, "ep": dims.ep, "zero": dims.zero,
            "microbatches": dims.microbatches, "schedule": dims.schedule,
            "virtual_stages": dims.virtual_stages, "cp_method": dims.cp_method,
            "sequence_parallel": dims.sequence_parallel}


@dataclass(frozen=True)
class PlannedLayout:
    """A layout as a planner chose it.

    Args:
        dims: the ranks' degrees, ZeRO stage, pipeline schedule, sequence parallelism and
            cp method.
        recompute: activation recomputation, one of RECOMPUTE.
        micro_batch: sequences per micro-batch; 0 when the global batch decides (the
            traced planner's layouts).

    Raises:
        ConfigError: an unknown recomputation mode.
    """

    dims: Dims
    recompute: str = "none"
    micro_batch: int = 0

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute {self.recompute!r}: use none, selective or full")

    @property
    def sequence_parallel(self) -> bool:
        return self.dims.sequence_parallel

    @property
    def cp_method(self) -> str:
        return self.dims.cp_method

    def with_options(self, recompute: str | None = None, sequence_parallel: bool | None = None,
                     cp_method: str | None = None) -> PlannedLayout:
        """This layout planned with other options (those given). The Dims are made anew
        only when an option of theirs changes (the planners' searches call this for every
        option of every layout they weigh)."""
        changed = {name: value for name, value in (("sequence_parallel", sequence_parallel),
                                                   ("cp_method", cp_method))
                   if value is not None and value != getattr(self.dims, name)}
        dims = self.dims.replace(**changed) if changed else self.dims
        return PlannedLayout(dims, self.recompute if recompute is None else recompute,
                             self.micro_batch)

    def __str__(self) -> str:
        """The layout's short form, with ` mbB` for B sequences per micro-batch, the cp
        method where cp > 1 and ` sp` under sequence parallelism:
        `dp24 x tp8 x pp8 (1f1b, m=12) zero1 mb8 sp`, `dp2 x cp2 x tp2 ring sp`."""
        batch = f" mb{self.micro_batch}" if self.micro_batch else ""
        method = f" {self.cp_method}" if self.dims.cp > 1 else ""
        return f"{self.dims}{batch}{method}{' sp' if self.sequence_parallel else ''}"

    def overrides(self) -> dict[str, object]:
        """The config keys that choose this layout, as `--set` names them
        (`parallel.dp`, `parallel.dp_replicate`, ..., `memory.recompute`): with
        `parallel.nproc` (or a launcher's world) of the layout's world size, `dtrain
        train` runs it."""
        section = {f"parallel.{key}": value for key, value in
                   parallel_section(self.dims).items()}
        return {**section, "memory.recompute": self.recompute}

    def to_dict(self) -> dict[str, object]:
        """Plain JSON values: the Dims' `to_dict()` and the options."""
        return {"dims": self.dims.to_dict(), "recompute": self.recompute,
                "micro_batch": self.micro_batch}

    @classmethod
    def from_dict(cls, values: dict) -> PlannedLayout:
        """The inverse of `to_dict`."""
        return cls(Dims.from_dict(values["dims"]), str(values["recompute"]),
                   int(values["micro_batch"]))
