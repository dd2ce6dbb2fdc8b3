"""The environment contract (dtrain.env): the launcher<->rank contract is declared in one
module, and nothing else names a DTRAIN_* variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import dtrain
from dtrain import env
from dtrain.errors import ConfigError

SRC = Path(dtrain.__file__).parent
ROOT = SRC.parent.parent
NAME = re.compile(r"DTRAIN_[A-Z0-9_]*[A-Z0-9]")
TEST_ONLY = {"DTRAIN_SOAK_ROUNDS", "DTRAIN_SLURM_DIR", "DTRAIN_SLURMCTLD_PORT",
             "DTRAIN_SLURMD_PORT", "DTRAIN_REQUIRE_TOOLS"}
"""Variables of the test suite and its scripts, never read by dtrain itself."""


def test_only_the_contract_reads_or_writes_a_dtrain_variable() -> None:
    """A quoted `"DTRAIN_...` (a read, a write, a key of an environment being built) appears
    in dtrain.env only; elsewhere a variable is used through its `env.Var`."""
    contract = Path(env.__file__)
    offenders = [f"{path.relative_to(SRC)}:{number}: {line.strip()}"
                 for path in sorted(SRC.rglob("*.py")) if path != contract
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"[\"']" + env.PREFIX, line)]
    assert offenders == []


def test_every_variable_named_anywhere_is_declared_and_documented() -> None:
    declared = {var.name for var in env.VARIABLES}
    assert len(declared) == len(env.VARIABLES)
    named = {name for path in [*SRC.rglob("*.py"), *(ROOT / "docs").glob("*.md"),
                               ROOT / "README.md"]
             for name in NAME.findall(path.read_text())}
    assert named - declared - TEST_ONLY == set()
    table = (ROOT / "docs" / "environment.md").read_text()
    assert [var.name for var in env.VARIABLES if f"`{var.name}`" not in table] == []


def test_values_are_typed_and_a_malformed_one_is_one_line() -> None:
    assert env.TIMEOUT.get({}) is None and env.ROUND.get({}) == 1
    assert env.TIMEOUT.get({"DTRAIN_TIMEOUT": "2.5"}) == 2.5
    assert env.DEBUG.get({"DTRAIN_DEBUG": "0"}) is False
    assert env.DEBUG.get({"DTRAIN_DEBUG": "1"}) is True
    assert env.ROUND.get({"DTRAIN_ROUND": ""}) == 1  # empty is unset
    with pytest.raises(ConfigError, match=r"^DTRAIN_TIMEOUT='soon' is not a number of seconds$"):
        env.TIMEOUT.get({"DTRAIN_TIMEOUT": "soon"})
    built: dict[str, str] = {}
    env.LIVE_RANKS.set(4, built)
    assert built == env.LIVE_RANKS.pair(4) == {"DTRAIN_LIVE_RANKS": "4"}
    env.LIVE_RANKS.unset(built)
    assert built == {}


def test_data_parallel_and_zero_know_nothing_of_fault_tolerance() -> None:
    """They average through whatever `averaging` they are handed (dtrain.data_parallel.averaging);
    the live replicas' own code is dtrain.ft.live's."""
    strategies = [*sorted((SRC / "parallel" / "data_parallel").glob("*.py")),
                  *sorted((SRC / "parallel" / "zero").glob("*.py"))]
    imports_ft = ("from dtrain.ft", "import dtrain.ft")
    mentions = [f"{path.relative_to(SRC)}:{number}" for path in strategies
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if "live" in line.lower() or line.startswith(imports_ft)]
    assert mentions == []
