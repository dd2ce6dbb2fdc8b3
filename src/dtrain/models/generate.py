"""Sampling text from any of dtrain's models (the sample `dtrain train` prints at the end)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, new_tokens: int, block_size: int,
             temperature: float = 0.8, generator: torch.Generator | None = None) -> torch.Tensor:
    """Append `new_tokens` sampled tokens to each row of `idx`, the model seeing at most
    the last `block_size` tokens (its forward(idx) gives logits, or an output with
    `.logits`)."""
    model.eval()
    for _ in range(new_tokens):
        out = model(idx[:, -block_size:])
        logits = getattr(out, "logits", out)[:, -1, :] / temperature
        probs = F.softmax(logits.float(), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return idx
