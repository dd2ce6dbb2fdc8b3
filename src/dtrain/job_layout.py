"""The Layout: how a job uses its ranks, as plain numbers.

One type serves the planner (the layouts it compares), checkpoint metadata (the layout
that saved), the banner of `dtrain train`, and the degrees a job builds its Mesh from
(where the ranks sit on the grid is the Mesh's arithmetic: dtrain.mesh).

A `Split` says how one tensor maps to the blocks tensor-parallel ranks hold, which the
layers (dtrain.tensor_parallel) and the layout-free checkpoints (dtrain.checkpoint) share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dtrain.errors import ConfigError

MODES = ("collective", "ps")


@dataclass(frozen=True)
class Layout:
    """dp x cp x tp x pp ranks, a ZeRO stage, a pipeline schedule, and how replicas agree.

    Args:
        dp, tp, pp: the degrees of data, tensor and pipeline parallelism.
        zero: the ZeRO stage over dp (0: plain data parallelism).
        microbatches, schedule, virtual_stages: the pipeline's (when pp > 1).
        mode: "collective" (replicas exchange gradients among themselves) or "ps"
            (parameter servers hold the model).
        ep: the expert-parallel degree, carved from dp (it does not add ranks).
        cp: the context-parallel degree: ranks that split every sequence between them
            (the model is replicated over them, as over dp).
    """

    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    mode: str = "collective"
    ep: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def __str__(self) -> str:
        """Short form, as the planner's table shows it: `dp2 x tp2 x pp2 (1f1b, m=4) zero1`
        (`dp2 x cp2 x tp2` with context parallelism)."""
        parts = [f"dp{self.dp}"] if self.dp > 1 or (self.tp == self.pp == self.cp == 1) else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp} ({self.schedule}{v}, m={self.microbatches})")
        text = " x ".join(parts) + (f" ep{self.ep}" if self.ep > 1 else "")
        return f"{text} zero{self.zero}" if self.zero else text

    def describe(self, replicas: str = "") -> str:
        """The layout in words, outermost axis first, as the banner of `dtrain train` says
        it; `replicas` names how the replicas train (default: data parallel or ZeRO)."""
        how = replicas or (f"ZeRO stage {self.zero}" if self.zero else "data parallel")
        if self.tp > 1:
            how = f"tensor parallel over {self.tp} x {how}"
        if self.cp > 1:
            how = f"context parallel over {self.cp} x {how}"
        if self.pp > 1:
            how = (f"pipeline of {self.pp} stages ({self.schedule}, {self.microbatches} "
                   f"micro-batches) x {how}")
        experts = f" (experts split over {self.ep})" if self.ep > 1 else ""
        return f"{how} over {self.dp}{experts}"

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON values, and the world size: what checkpoints record
        (their `layout` entry) and an elastic round sends (`from_dict` reads it back)."""
        return {"world_size": self.world_size, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "zero": self.zero, "microbatches": self.microbatches,
                "schedule": self.schedule, "virtual_stages": self.virtual_stages,
                "mode": self.mode, "ep": self.ep, "cp": self.cp}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Layout:
        """The Layout `to_dict` gave; fields it lacks take their defaults (a checkpoint
        written before micro-batches and the schedule were recorded).

        Raises:
            ValueError: `world_size` is not dp x cp x tp x pp.
        """
        layout = cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})
        if values.get("world_size", layout.world_size) != layout.world_size:
            raise ValueError(f"layout {values} says world_size={values['world_size']}, but "
                             f"dp x cp x tp x pp = {layout.world_size}")
        return layout


def resolve_layout(world_size: int, dp: int | None, tp: int = 1, pp: int = 1, cp: int = 1,
                   **options: Any) -> Layout:
    """Check degrees against the world size and fill in `dp` when it is None; `options`
    are the Layout's other fields.

    Raises:
        ConfigError: a degree is below 1 or the product does not equal the world size.
    """
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    names = "cp*tp*pp" if cp > 1 else "tp*pp"
    factors = f"{cp}*{tp}*{pp}" if cp > 1 else f"{tp}*{pp}"
    others = cp * tp * pp
    if dp is None:
        if world_size % others:
            raise ConfigError(
                f"{names} = {factors} = {others} does not divide the world size {world_size}: "
                f"choose degrees whose product divides {world_size}")
        dp = world_size // others
    if dp * others != world_size:
        raise ConfigError(
            f"dp*{names} = {dp}*{factors} = {dp * others} but the world has {world_size} "
            f"ranks: make the product equal {world_size} (or leave dp unset to infer it)")
    return Layout(dp=dp, tp=tp, pp=pp, cp=cp, **options)


@dataclass(frozen=True)
class Split:
    """Where a parameter is cut: along `dim`, in `chunks` fused parts.

    A `Split(dim, chunks)` cuts the tensor along `dim` into `chunks` equal parts (a fused
    weight such as attention's QKV has three) and each part into `size` equal blocks; rank
    r holds block r of every part, concatenated. With chunks = 1 this is a plain contiguous
    split.
    """

    dim: int
    chunks: int = 1

    def shard(self, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s block of `whole` (a new contiguous tensor)."""
        parts = whole.chunk(self.chunks, dim=self.dim)
        return torch.cat([p.chunk(size, dim=self.dim)[rank] for p in parts],
                         dim=self.dim).contiguous()

    def block_shape(self, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        """The shape of each rank's block of a tensor of `shape`."""
        return tuple(n // size if d == self.dim else n for d, n in enumerate(shape))

    def join(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's block, in rank order (inverse of `shard`)."""
        per_rank = [b.chunk(self.chunks, dim=self.dim) for b in blocks]
        return torch.cat([torch.cat([p[j] for p in per_rank], dim=self.dim)
                          for j in range(self.chunks)], dim=self.dim)
