"""The layer order of the package, bottom to top: the one place it is written down.

A module may import modules of its own layer or of a lower one, never a higher one, and
the imports never form a cycle; tests/package/test_import_order.py parses every import and enforces
both. A module belongs to the layer of the longest name below that is the module itself or
a package holding it; the top-level package `dtrain` names its own `__init__` only (else it
would hold every module, and a module nobody placed would land in the top layer unseen).
"""

from __future__ import annotations

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("definitions", ("dtrain.errors", "dtrain.sizes", "dtrain.split", "dtrain.schema",
                     "dtrain.import_order",
                     "dtrain.env", "dtrain.graph_break", "dtrain.masks")),
    ("timeline", ("dtrain.timeline",)),
    ("world", ("dtrain.world", "dtrain.agreed_port", "dtrain.store")),
    ("collectives", ("dtrain.comm",)),
    ("fault injection", ("dtrain.faults",)),
    ("mesh", ("dtrain.mesh",)),
    ("context parallel", ("dtrain.context_parallel",)),
    ("checkpoint", ("dtrain.checkpoint",)),
    ("data", ("dtrain.data",)),
    ("models", ("dtrain.models",)),
    ("adapters", ("dtrain.adapters",)),
    ("optimizers", ("dtrain.optim",)),
    ("data parallel", ("dtrain.data_parallel", "dtrain.sync")),
    ("tensor parallel", ("dtrain.tensor_parallel",)),
    ("pipeline, parameter servers", ("dtrain.pipeline", "dtrain.ps")),
    ("config", ("dtrain.config",)),
    ("layouts", ("dtrain.layouts",)),
    ("planner", ("dtrain.planner",)),
    ("fault tolerance", ("dtrain.ft",)),
    ("training job", ("dtrain.train",)),
    ("launcher", ("dtrain.launch",)),
    ("tools", ("dtrain.tools",)),
    ("front", ("dtrain.cli", "dtrain.testing", "dtrain")),
]


ROOT = "dtrain"
"""The top-level package: in LAYERS it names its `__init__` alone, not what it holds."""


def _names(prefix: str, module: str) -> bool:
    """Whether the LAYERS entry `prefix` names `module`: it is the module, or a package
    other than the top-level one that holds it."""
    return module == prefix or (prefix != ROOT and module.startswith(prefix + "."))


def layer_of(module: str) -> int:
    """The index in LAYERS of `module` (a dotted name inside dtrain).

    Raises:
        KeyError: no layer names the module (a new module or subpackage of dtrain goes
            into LAYERS by name).
    """
    best, found = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _names(prefix, module) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise KeyError(f"{module} is in no layer of dtrain.import_order.LAYERS: add it there")
    return found
