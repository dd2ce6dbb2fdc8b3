"""A tool this machine lacks (etcd, Open MPI, SLURM, network namespaces, a torchft
lighthouse): its tests skip, saying what to install. Where CI says the tools are there
(DTRAIN_REQUIRE_TOOLS=1, set by .ci/run after it installs them) the session turns such a
skip into a failure (tests/conftest.py), so a CI run whose install broke cannot pass by
skipping what it was meant to run."""

from __future__ import annotations

from typing import NoReturn

import pytest

REQUIRE = "DTRAIN_REQUIRE_TOOLS"


def missing(reason: str) -> NoReturn:
    """Skip the test for `reason`: a tool not found (a failure under DTRAIN_REQUIRE_TOOLS=1)."""
    pytest.skip(reason)
