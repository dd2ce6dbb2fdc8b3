"""The `[optimizer]` section.

    [optimizer]  name = "adamw", lr = 3e-3, warmup_steps = 20
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dtrain.errors import ConfigError
from dtrain.schema import non_negative, positive


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "adam", "sgd"] = "adamw"
    """One of adamw, adam, sgd."""
    lr: float = positive(3e-3)
    """Peak learning rate."""
    weight_decay: float = non_negative(0.01)
    """Decoupled weight decay (adamw) or L2 penalty (adam, sgd)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam's beta1 and beta2."""
    momentum: float = non_negative(0.9)
    """SGD momentum."""
    warmup_steps: int = non_negative(20)
    """Linear warm-up from 0 to lr over this many steps."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warm-up: cosine (decay to min_lr_ratio * lr) or constant."""
    min_lr_ratio: float = non_negative(0.1)
    """Final learning rate as a fraction of lr, for cosine."""
    grad_clip: float = non_negative(1.0)
    """Clip the global gradient norm to this; 0 disables clipping."""

    def check(self) -> None:
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.betas = {self.betas} must be two numbers in [0, 1), "
                              "e.g. [0.9, 0.95]")
