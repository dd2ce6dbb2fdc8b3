"""The parts every attention of dtrain's Llama family shares: RMSNorm and rotary positions.

Grouped-query attention (dtrain.models.llama), multi-head latent attention
(dtrain.models.mla) and the multi-token prediction modules (dtrain.models.mtp) normalize
with the same RMSNorm and rotate with the same angles, computed as Hugging Face's Llama
computes them, so that weights map one to one and logits agree to float rounding. A module
of its own so that the attentions and the model that holds them import it without
importing each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back, as Hugging Face's Llama (in
    float64 for float64 inputs: never below the input's precision). The normalization is
    torch's `F.rms_norm`, one fused kernel on CUDA where the written-out form is four
    (the same values: bit for bit on a CPU, tests/models/test_llama.py); the weight is
    applied after the cast back, as Hugging Face's Llama applies it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(h, (h.shape[-1],), eps=self.eps).to(x.dtype)


def rotary(t: int, head_dim: int, theta: float, device: torch.device,
           dtype: torch.dtype, positions: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of positions 0..t-1 (or the `t` given `positions`), each (t, head_dim):
    the frequencies repeated across the two halves of a head, as Hugging Face's
    rotate-half convention pairs them. The angles are float32, as Hugging Face's; their
    cos and sin float32 too, or float64 for a float64 `dtype`."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    at = torch.arange(t, device=device) if positions is None else positions
    freqs = at.float()[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1).to(torch.promote_types(dtype, torch.float32))
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(-second half, first half) of the last dimension: the sine's partner in a rotation
    that pairs element i with element i + d/2."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` rotated by the angles whose (cos, sin) `rotary` gave (rotate-half pairs)."""
    return x * cos + rotate_half(x) * sin
