"""The `[optimizer]` section.

    [optimizer]  name = "adamw", lr = 3e-3, warmup_steps = 20
    [optimizer]  name = "muon", lr = 3e-3      # Muon on the hidden matrices, AdamW elsewhere
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dtrain.errors import ConfigError
from dtrain.schema import non_negative, positive


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "adam", "sgd", "muon"] = "adamw"
    """One of adamw, adam, sgd, muon (Muon on the hidden weight matrices, AdamW on the rest:
    embeddings, the output head, norms, biases; see muon_exclude and muon_include)."""
    lr: float = positive(3e-3)
    """Peak learning rate (muon: AdamW's, and Muon's unless muon_lr is set)."""
    weight_decay: float = non_negative(0.01)
    """Decoupled weight decay (adamw, and both halves of muon) or L2 penalty (adam, sgd)."""
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
    muon_lr: float = non_negative(0.0)
    """Muon's peak learning rate; 0: the same as lr (with muon_adjust_lr =
    "match_rms_adamw" Muon's updates have AdamW's size, so one rate serves both)."""
    muon_momentum: float = non_negative(0.95)
    """Muon's momentum (torch.optim.Muon's default)."""
    muon_nesterov: bool = True
    """Muon's Nesterov momentum: orthogonalize the gradient looked ahead along the momentum."""
    muon_ns_steps: int = positive(5)
    """Newton-Schulz iterations that orthogonalize each update matrix."""
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    """The quintic Newton-Schulz iteration's (a, b, c) (Keller Jordan's)."""
    muon_eps: float = positive(1e-7)
    """Floor of the update's norm before Newton-Schulz divides by it."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """How a matrix's shape scales Muon's rate: match_rms_adamw (0.2 sqrt(max(A, B)),
    Moonlight's: the update's RMS that of AdamW, so AdamW's lr and weight decay carry over)
    or original (sqrt(max(1, A / B)), Keller Jordan's, with a rate of its own, ~0.02)."""
    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The dtype Newton-Schulz computes in: bfloat16 (torch.optim.Muon's and Keller
    Jordan's; under ZeRO the matrices also travel in it, half the bytes) or float32
    (exact comparisons; CPUs without fast bfloat16 products)."""
    muon_exclude: list[str] = field(default_factory=list)
    """Parameter names (fnmatch patterns, e.g. "blocks.*.attn.*") that AdamW trains though
    the automatic rule gives them to Muon."""
    muon_include: list[str] = field(default_factory=list)
    """Parameter names (fnmatch patterns) that Muon trains though the rule gives them to
    AdamW (e.g. "head.weight"); each must be a matrix (2-D)."""

    def check(self) -> None:
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.betas = {self.betas} must be two numbers in [0, 1), "
                              "e.g. [0.9, 0.95]")
        if len(self.muon_ns_coefficients) != 3:
            raise ConfigError(f"optimizer.muon_ns_coefficients = {self.muon_ns_coefficients} "
                              "must be three numbers (a, b, c), e.g. [3.4445, -4.775, 2.0315]")
        if self.muon_momentum >= 1:
            raise ConfigError(f"optimizer.muon_momentum = {self.muon_momentum} must be below "
                              "1, e.g. 0.95")
