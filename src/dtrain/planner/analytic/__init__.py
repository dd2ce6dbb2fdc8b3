"""The analytic planner: layouts of GPU clusters this machine is not, by arithmetic on a
model's shape and the hardware's figures (`dtrain plan --hardware`).

    shape = parse_shape("layers=80,hidden=12288,heads=96,seq=2048,vocab=51200")
    cluster = Cluster(hardware("a100-80gb"), nodes=192, gpus_per_node=8)
    best = rank(shape, cluster, batch=2304)[0]        # every layout, fastest first
    one = evaluate(shape, cluster, 2304, planned_layout(2304, tp=8, pp=8, dp=24))

`hardware` holds the accelerators' figures and reads cluster files, `cluster` costs one
layout (memory per GPU, step time, tokens/s, MFU), `dispatch` a MoE layer's all-to-all
(experts folded over dp x cp x tp, a plain or DeepEP-class exchange, the share hidden under
compute), `software` what the training code does beyond the layout (kernels, precision,
dispatch, overlap, framework), `search` ranks every layout and chooses each one's options,
and `published` holds the runs it is checked against. Nothing is traced, so a model of any
size plans in seconds.
"""

from __future__ import annotations

from dtrain.planner.analytic.cluster import ClusterEstimate, Software, evaluate, planned_layout
from dtrain.planner.analytic.hardware import Cluster, Hardware, hardware
from dtrain.planner.analytic.search import best_layout, check_layout, rank, recommend

__all__ = ["Cluster", "ClusterEstimate", "Hardware", "Software", "best_layout",
           "check_layout", "evaluate", "hardware", "planned_layout", "rank", "recommend"]
