"""Mixture of experts: the layer dtrain's Llama uses for its MoE blocks (layer.py), its
router (router.py), and its experts with the all-to-all exchange of expert parallelism
(experts.py)."""

from dtrain.models.moe.experts import Experts
from dtrain.models.moe.layer import (
    MoE,
    MoEConfig,
    after_step,
    aux_loss,
    expert_parallel,
    moe_layers,
    split_experts,
)
from dtrain.models.moe.router import ROUTERS, Router

__all__ = ["ROUTERS", "Experts", "MoE", "MoEConfig", "Router", "after_step", "aux_loss",
           "expert_parallel", "moe_layers", "split_experts"]
