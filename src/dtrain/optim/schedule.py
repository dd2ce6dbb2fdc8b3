"""The learning rate over a run: linear warm-up, then cosine decay or constant."""

from __future__ import annotations

import math

from dtrain.optim.config import OptimizerConfig


def lr_factor(step: int, total: int, cfg: OptimizerConfig) -> float:
    """The learning rate at `step` of `total`, as a fraction of `cfg.lr`: linear warm-up,
    then cosine decay to `min_lr_ratio` (or constant)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
