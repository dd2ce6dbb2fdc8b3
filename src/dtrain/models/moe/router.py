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

Group-limited routing (`n_group` > 1, DeepSeek-V3's node-limited routing: its 256 experts in
8 groups, one per node, so a token's experts span at most `topk_group` = 4 nodes): the E
experts are `n_group` consecutive groups; a token ranks the groups by the sum of each
group's two best choice scores (s + b under sigmoid_bias, p under softmax_topk), keeps
its `topk_group` best groups, and picks its k experts among theirs only. The rule is
transformers' DeepseekV3TopkRouter's.

The weights are then scaled by `scale` (DeepSeek-V3's routed_scaling_factor, 2.5): the
routed experts' sum counts that much beside the shared experts'.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.errors import ConfigError

RouterName = Literal["softmax_topk", "sigmoid_bias"]
"""How a MoE layer routes tokens (`[model] router`)."""
ROUTERS: tuple[str, ...] = get_args(RouterName)


class Router(nn.Module):
    """x (tokens, dim) -> (weights (tokens, k) in float32, experts (tokens, k), and the
    per-expert probabilities (tokens, E) in float32 that the load-balancing loss reads).

    Its parameters are `weight` (E, dim) (a MoE layer's `gate.weight`, the name Hugging
    Face's MoE models give it) and `expert_bias` (E,), zero and unused under softmax_topk.
    """

    def __init__(self, dim: int, n_experts: int, k: int, rule: str, norm_topk_prob: bool,
                 n_group: int = 1, topk_group: int = 1) -> None:
        super().__init__()
        check_groups(n_experts, k, n_group, topk_group)
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.k, self.rule, self.norm_topk_prob = k, rule, norm_topk_prob
        self.n_group, self.topk_group = n_group, topk_group
        self.scale = 1.0
        """What the k weights are multiplied by (DeepSeek-V3's routed_scaling_factor; the
        model that builds the layer sets it: dtrain.models.llama, dtrain.models.hf)."""
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
            choice = probs + self.expert_bias
        else:
            probs = choice = torch.softmax(logits, dim=-1)
        if self.n_group > 1:
            choice = self.within_groups(choice)
        experts = torch.topk(choice, self.k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights, experts, probs

    def within_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` (tokens, E) with -inf for the experts outside each token's
        `topk_group` best groups (a group's score: the sum of its two best choices)."""
        per_group = choice.shape[-1] // self.n_group
        grouped = choice.view(-1, self.n_group, per_group)
        scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        best = scores.topk(self.topk_group, dim=-1).indices
        kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
        return choice.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Nudge the bias toward even load: + rate for an expert below the mean load (token
        assignments, counted over the whole global batch of the step), - rate above it."""
        load = load.to(self.expert_bias)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))


def check_groups(n_experts: int, k: int, n_group: int, topk_group: int) -> None:
    """Group-limited routing's counts against each other: groups that split the experts
    evenly, and enough experts in the groups a token keeps for its k.

    Raises:
        ConfigError: in one line naming the key to change.
    """
    if n_group < 1 or topk_group < 1:
        raise ConfigError(f"model.n_group = {n_group} and model.topk_group = {topk_group} "
                          "must be at least 1 (1 and 1: no group limit)")
    if topk_group > n_group:
        raise ConfigError(f"model.topk_group = {topk_group} is above model.n_group = "
                          f"{n_group}: a token keeps at most every group")
    if n_experts % n_group:
        raise ConfigError(f"model.n_group = {n_group} does not divide model.n_experts = "
                          f"{n_experts}: choose a group count that divides it")
    if topk_group * (n_experts // n_group) < k:
        raise ConfigError(f"model.topk_group = {topk_group} groups of "
                          f"{n_experts // n_group} experts hold fewer than "
                          f"model.experts_per_token = {k}: keep more groups")
