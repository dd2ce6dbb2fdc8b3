"""ZeRO-3 over dp x tensor parallelism with sequence parallelism, the layout that crashed
the thread backend, equals one process; and a tensor whose memory was released is refused
by the backends' checks instead of crashing the process.

The crash (a SIGSEGV of the whole test process): after a step ZeRO-3 has released its
units' parameters (their storage resized to nothing, their shapes kept), and the test
read them (`tp.full_state_dict(model)`); the thread backend's copy of such a tensor reads
through a dangling pointer, as gloo's does. Under ZeRO-3 the weights are read through
`ZeRO.state_dict()`, and every dtrain.comm collective checks the tensor it is handed, on
every backend, as the thread backend checks its messages too (dtrain.comm.ops.check_held).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import dtrain
from dtrain import comm
from dtrain import tensor_parallel as tp
from dtrain.testing import run_ranks, run_threads
from tests.support.cli import EXACT_OPTIMIZER, TINY_MODEL, assert_same_steps, train_rows_together
from tests.tensor_parallel.test_sequence_parallel import (
    ALGORITHM,
    STEPS,
    adamw,
    build,
    in_grid,
    split,
    tokens,
    train_serial,
)


def zero3_over_dp(rank: int, base: nn.Module) -> dict[str, torch.Tensor]:
    """dp=2 x tp=2 on threads: the sequence-parallel model under ZeRO-3 over dp, STEPS
    steps; the whole model's weights, read from ZeRO's master shards (its parameters'
    memory is released after the step) into a split copy, then gathered over tp."""
    def body(tp_group: comm.Group, dp_group: comm.Group) -> dict[str, torch.Tensor]:
        model = split(copy.deepcopy(base), tp_group)
        zero = dtrain.ZeRO(model, adamw, stage=3, group=dp_group, algorithm=ALGORITHM)
        half = slice(dp_group.rank * 2, dp_group.rank * 2 + 2)
        for step in range(STEPS):
            x, y = tokens(step)
            zero(x[half], y[half])[1].backward()
            zero.step()
            zero.zero_grad()
        trained = split(copy.deepcopy(base), tp_group)
        trained.load_state_dict(zero.state_dict())
        return tp.full_state_dict(trained)

    return in_grid(rank, "dp", body)


@pytest.mark.timeout(90)
def test_zero3_over_dp_with_sequence_parallelism_on_threads_equals_one_process() -> None:
    base = build("llama")
    serial = copy.deepcopy(base)
    train_serial(serial, clip=False)
    for state in run_threads(functools.partial(zero3_over_dp, base=base), 4):
        torch.testing.assert_close(state, serial.state_dict())


def _released(n: int = 64) -> torch.Tensor:
    """A tensor of `n` elements whose storage holds none (as ZeRO-3 leaves a parameter)."""
    tensor = torch.ones(n)
    tensor.untyped_storage().resize_(0)
    return tensor


def _refusals(calls: dict[str, Callable[[], object]]) -> list[str]:
    """Each call's refusal of a released tensor, "name: message"."""
    errors = []
    for name, call in calls.items():
        with pytest.raises(ValueError, match="whose memory was released") as caught:
            call()
        errors.append(f"{name}: {caught.value}")
    return errors


def _every_path_refuses(rank: int) -> list[str]:
    """On a thread rank: a native all-gather, all-reduce and point-to-point messages with
    a released tensor, each refused (ValueError) rather than read."""
    group = comm.resolve(None)
    calls = {
        "all_gather": lambda: comm.all_gather(_released(), algorithm="native"),
        "all_reduce": lambda: comm.all_reduce(_released(), algorithm="native"),
        "send": lambda: group.isend(_released(), 1 - rank),
        "recv": lambda: group.irecv(_released(), 1 - rank),
    }
    return _refusals(calls)


def _refused_in_a_process_of_its_own() -> list[list[str]]:
    return run_threads(_every_path_refuses, 2, timeout=10)


@pytest.mark.timeout(60)
def test_a_released_tensor_is_refused_by_the_thread_backend() -> None:
    """In a process of its own (a regression would crash it, not the test session)."""
    (per_rank,) = run_ranks(_refused_in_a_process_of_its_own, 1, timeout=50)
    for errors in per_rank:
        assert len(errors) == 4
        assert errors[0].startswith("all_gather: all_gather on group 'world' (rank ")
        assert "shape (64,)" in errors[0] and "ZeRO.state_dict()" in errors[0]


def _refused_on_gloo() -> list[str]:
    """On a gloo rank: gloo's own all-reduce and all-gather and dtrain's ring with a
    released tensor, each refused before anything is sent."""
    calls = {
        "all_reduce": lambda: comm.all_reduce(_released(), algorithm="native"),
        "all_gather": lambda: comm.all_gather(_released(), algorithm="native"),
        "ring": lambda: comm.all_reduce(_released(), algorithm="ring"),
    }
    return _refusals(calls)


@pytest.mark.timeout(60)
def test_a_released_tensor_is_refused_on_gloo() -> None:
    """Every dtrain.comm collective checks its tensor on every backend: on gloo such a
    tensor gave a connection closed by its peer (or a crash), named as a slow network."""
    for rank, errors in enumerate(run_ranks(_refused_on_gloo, 2, timeout=50)):
        assert len(errors) == 3
        assert errors[0].startswith(f"all_reduce: all_reduce on group '0' (rank {rank})")


@pytest.mark.slow  # 4 ranks, two runs: ~20 s on 2 cores
@pytest.mark.timeout(300)
def test_dtrain_train_zero3_tp2_sequence_parallel_equals_one_process(tmp_path: Path) -> None:
    """`dtrain train` with parallel.zero=3, dp=2, tp=2 and sequence_parallel on (gloo, 4
    ranks): every step's loss and gradient norm those of one process on the same global
    batches."""
    config = TINY_MODEL + EXACT_OPTIMIZER
    (one, _), = train_rows_together([(tmp_path / "one", config, [], 4)], 1)
    (split_run, _), = train_rows_together([(tmp_path / "zero3", config, [
        "parallel.zero=3", "parallel.tp=2", "parallel.sequence_parallel=true"], 4)], 4)
    assert_same_steps(split_run, one)
