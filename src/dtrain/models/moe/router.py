"""The router of a mixture-of-experts layer: which `k` of the `E` experts each token goes
to, and with what weight.

Two rules (`MoEConfig.router`):

- `softmax_topk` (Mixtral, Qwen3-MoE): p = softmax(x W^T) over the experts; a token goes
  to its k most probable experts, weighted by their probabilities, renormalized to sum to
  one when `norm_topk_prob` (Mixtral always, Qwen3 per its config).
- `sigmoid_bias` (DeepSeek-V3's auxiliary-loss-free balancing): s = sigmoid(x W^T); a
  token goes to the k experts of largest s + b, weighted by their s (renormalized), where
  b is a per-expert bias that takes no gradient: after each optimizer step it moves by
  `bias_update_rate` toward even load, up for an expert that received fewer tokens than
  the mean and down for one that received more (`update_bias`). The bias steers the
  choice, never the weights.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

RouterName = Literal["softmax_topk", "sigmoid_bias"]
"""How a MoE layer routes tokens (`[model] router`)."""
ROUTERS: tuple[str, ...] = get_args(RouterName)


class Router(nn.Module):
    """x (tokens, dim) -> (weights (tokens, k) in float32, experts (tokens, k), and the
    per-expert probabilities (tokens, E) in float32 that the load-balancing loss reads).

    Its parameters are `weight` (E, dim) (a MoE layer's `gate.weight`, the name Hugging
    Face's MoE models give it) and `expert_bias` (E,), zero and unused under softmax_topk.
    """

    def __init__(self, dim: int, n_experts: int, k: int, rule: str, norm_topk_prob: bool
                 ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.k, self.rule, self.norm_topk_prob = k, rule, norm_topk_prob
        # A parameter that takes no gradient (no optimizer steps it) rather than a buffer, so
        # that checkpoints save and restore it with the weights.
        self.expert_bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """normal(0, std) weights, as the Linear layers of dtrain's Llama; a zero bias."""
        if not self.weight.is_meta:
            nn.init.normal_(self.weight, std=std)
            nn.init.zeros_(self.expert_bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight).float()
        if self.rule == "sigmoid_bias":
            probs = torch.sigmoid(logits)
            experts = torch.topk(probs + self.expert_bias, self.k, dim=-1).indices
            weights = probs.gather(-1, experts)
        else:
            probs = torch.softmax(logits, dim=-1)
            weights, experts = torch.topk(probs, self.k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, probs

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Nudge the bias toward even load: + rate for an expert below the mean load (token
        assignments, counted over the whole global batch of the step), - rate above it."""
        load = load.to(self.expert_bias)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))
