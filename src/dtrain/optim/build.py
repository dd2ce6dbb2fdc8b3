"""The optimizer `[optimizer]` names, over the parameters a layout gives it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from dtrain.optim.config import OptimizerConfig


def decay_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on biases, norms), as in GPT-2 training."""
    params = [p for p in params if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(params: Iterable[nn.Parameter], cfg: OptimizerConfig
                    ) -> torch.optim.Optimizer:
    """The configured optimizer (`[optimizer]`: name, lr, betas, momentum, weight_decay)."""
    groups = decay_groups(params, cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    optimizer = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    betas = cast(tuple[float, float], tuple(cfg.betas))  # two: OptimizerConfig.check
    return optimizer(groups, lr=cfg.lr, betas=betas)
