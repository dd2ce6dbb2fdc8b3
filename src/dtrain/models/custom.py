"""A user's own module (`arch = "custom"`, `factory = "package.module:function"`).

The module is imported from the Python path or the current folder. The function is
called with no arguments, or with the resolved `ModelConfig` when it
takes one, and returns an nn.Module whose forward(idx, targets) gives (logits, loss) or a
Hugging Face-style output with `.loss`. DataParallel and ZeRO take it as it is; tensor
parallelism needs `[model] tp_plan`, the pipeline the `Stages` methods.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig


def load_factory(spec: str, where: str = ""):
    """The function `spec` ("package.module:function") names; errors start with `where`
    (default: `model.factory = 'spec'`).

    Raises:
        ConfigError: the spec is malformed, the module does not import, or the name is not
            a function in it.
    """
    where = where or f"model.factory = {spec!r}"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where}: use package.module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would find it
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the user's to fix
        raise ConfigError(f"{where}: cannot import {module_name}: "
                          f"{type(exc).__name__}: {exc}") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ConfigError(f"{where}: {module_name} has no function {attr!r}")
    return function


def build_custom(cfg: ModelConfig) -> nn.Module:
    """Call the factory and check it gave a module.

    Raises:
        ConfigError: no factory given, or it fails or returns something else.
    """
    if not cfg.factory:
        raise ConfigError("model.arch = \"custom\" needs model.factory = "
                          "\"package.module:function\"")
    function = load_factory(cfg.factory)
    takes_config = len(inspect.signature(function).parameters) >= 1
    model = function(cfg) if takes_config else function()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory = {cfg.factory!r} returned {type(model).__name__}, "
                          "not an nn.Module: return the model")
    return model
