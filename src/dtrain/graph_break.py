"""A function torch.compile does not trace: `@graph_break` runs it eagerly between two
compiled regions (a collective, or work whose shapes depend on the data).

It is `torch.compiler.disable`, applied at the first call made while the compiler is
loaded rather than at import: `torch.compiler.disable` imports the compiler
(torch._dynamo, seconds), which every rank would otherwise pay at start, compiling or not.
Without the compiler loaded nothing can be compiling, so the function is called as it is.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def graph_break(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, never traced by torch.compile (a graph break at each call)."""
    disabled: list[Callable[P, R]] = []

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if "torch._dynamo" not in sys.modules:  # no compiler loaded: nothing compiling
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call
