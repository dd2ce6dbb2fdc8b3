"""Layouts: one builder per way of holding a model, all returning the same `Holding`.

    held = dtrain.layouts.build(model, mesh, config)   # as `[parallel]` says
    loss = held.forward_backward(batches); held.clip_grad_norm_(1.0); held.step()

The composition order is fixed: tp splits every layer of the model first
(dtrain.tensor_parallel), then pp cuts the split model into stages (dtrain.pipeline), then
dp wraps the model or each piece in DataParallel or ZeRO over the remaining axis. With
`mode = "ps"` the ranks are workers of parameter servers instead.

| kind     | module                     | Holding           |
|----------|----------------------------|-------------------|
| dp       | layouts/data_parallel.py   | Replicated        |
| zero     | layouts/zero.py            | Sharded           |
| pp       | layouts/pipeline.py        | Pipelined         |
| ps       | layouts/parameter_server.py| ParameterServer   |
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dtrain.layout import Layout
from dtrain.layouts.data_parallel import Replicated
from dtrain.layouts.holding import Holding, build_optimizer
from dtrain.layouts.parameter_server import ParameterServer
from dtrain.layouts.pipeline import Pipelined
from dtrain.layouts.zero import Sharded
from dtrain.mesh import Mesh
from dtrain.tensor_parallel.plan_of import split_model

HOLDINGS: dict[str, type[Holding]] = {
    "dp": Replicated, "zero": Sharded, "pp": Pipelined, "ps": ParameterServer}

__all__ = ["HOLDINGS", "Holding", "ParameterServer", "Pipelined", "Replicated", "Sharded",
           "build", "build_optimizer", "kind_of"]


def kind_of(layout: Layout) -> str:
    """Which Holding implements `layout` (a key of HOLDINGS)."""
    if layout.mode == "ps":
        return "ps"
    return "pp" if layout.pp > 1 else "zero" if layout.zero else "dp"


def build(model: nn.Module, mesh: Mesh, layout: Layout, config: Any) -> Holding:
    """This rank's Holding of `model` (the same whole model on every rank) in `layout`
    over `mesh`; `config` gives the options (`[parallel]`, `[optimizer]`, `[train]`).

    tp > 1 splits `model`'s layers in place first, by its family's plan or `[model]
    tp_plan` (dtrain.tensor_parallel.plan_of).
    """
    if layout.tp > 1:
        split_model(model, mesh.group("tp"), config.model.tp_plan)
    return HOLDINGS[kind_of(layout)](model, mesh, layout, config)
