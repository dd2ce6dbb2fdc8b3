"""dtrain.planner: which layout fits a model on some devices, and how fast it may run.

Two planners answer in one vocabulary:

- `dtrain.planner.traced` plans this machine's ranks: the model is traced on fake tensors
  and each layout's figures follow dtrain's own strategies (`dtrain plan`);
- `dtrain.planner.analytic` plans GPU clusters this machine is not, by arithmetic on the
  model's shape and the hardware's figures (`dtrain plan --hardware`).

Both know a model by its `ModelShape` (dtrain.planner.shape: from a `[model]` section, a
GPTConfig or a LlamaConfig, or `--model-shape`), answer with a `PlannedLayout`
(dtrain.planner.planned: a Dims with its recomputation mode, sequence parallelism and
micro-batch size), and share the arithmetic of dtrain.planner.costs (bytes per parameter,
the pipeline bubble).

    cfg = GPTConfig(n_layer=24, n_embd=1024, n_head=16)
    estimates = plan(lambda b: profile_gpt(cfg, b), devices=8, memory=80e9, batch=64,
                     flops=300e12, links=Links.given(100, 10))
    best, why = recommend(estimates)
    best.planned                    # its Dims, recomputation, sequence parallelism

    shape = parse_shape("layers=80,hidden=12288,heads=96,seq=2048,vocab=51200")
    cluster = Cluster(hardware("a100-80gb"), nodes=192, gpus_per_node=8)
    best = rank_layouts(shape, cluster, batch=2304)[0]
"""

from __future__ import annotations

from dtrain.mesh import Dims
from dtrain.planner.analytic import Cluster, ClusterEstimate, Hardware, hardware, planned_layout
from dtrain.planner.analytic import evaluate as evaluate_layout
from dtrain.planner.analytic import rank as rank_layouts
from dtrain.planner.costs import PARAM_BYTES, bubble
from dtrain.planner.planned import RECOMPUTE, PlannedLayout
from dtrain.planner.shape import ModelShape, parse_shape
from dtrain.planner.traced import choices, layouts, plan, recommend
from dtrain.planner.traced.estimate import Estimate, estimate
from dtrain.planner.traced.links import Links
from dtrain.planner.traced.profile import Profile, profile_factory, profile_gpt, profile_model
from dtrain.planner.traced.tracker import LiveBytes

__all__ = ["PARAM_BYTES", "RECOMPUTE", "Cluster", "ClusterEstimate", "Estimate", "Hardware",
           "Dims", "Links", "LiveBytes", "ModelShape", "PlannedLayout", "Profile", "bubble",
           "choices", "estimate", "evaluate_layout", "hardware", "layouts", "parse_shape",
           "plan", "planned_layout", "profile_factory", "profile_gpt", "profile_model",
           "rank_layouts", "recommend"]
