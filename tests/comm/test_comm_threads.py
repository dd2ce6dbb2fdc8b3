"""dtrain.comm on the in-process backend: every op x algorithm x dtype x group size 1..5."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dtrain
from dtrain import comm
from dtrain.comm import cost
from dtrain.testing import run_threads
from tests.support.comm_cases import (
    FLOATS,
    INTS,
    all_gather_in_place,
    cases,
    check,
    check_in_place,
    exercise,
)

LENGTHS = (0, 1, 7, 1_000_003)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tests/conftest.py


# 3, 4 and 5 ranks (non-powers of two and 4) run with `make test-slow`.
@pytest.mark.parametrize("size", [1, 2, pytest.param(3, marks=pytest.mark.slow),
                                  pytest.param(4, marks=pytest.mark.slow),
                                  pytest.param(5, marks=pytest.mark.slow)])
def test_matrix(size: int) -> None:
    todo = cases(FLOATS + INTS, LENGTHS)
    check(run_threads(exercise, size, size, todo, timeout=120), size, todo)


def test_all_gather_in_place() -> None:
    """`tensor` as this rank's own part of `out`, by every algorithm (ZeRO's refresh)."""
    check_in_place(run_threads(all_gather_in_place, 3, 3, timeout=60), 3)


def test_async_handles_complete_in_order() -> None:
    def body(rank: int) -> list:
        handles = [comm.all_reduce(torch.full((5,), float(rank + i)), async_op=True,
                                   algorithm=algo)
                   for i, algo in enumerate(["ring", "native", "tree", "halving_doubling"])]
        gathered = comm.all_gather(torch.tensor([rank]), async_op=True)
        return [h.wait() for h in handles] + [gathered.wait()]

    results = run_threads(body, 3)
    for i in range(4):
        assert torch.equal(results[0][i], torch.full((5,), 3.0 + 3 * i))
    assert results[2][4].tolist() == [0, 1, 2]


def test_send_recv_in_a_ring() -> None:
    def body(rank: int) -> torch.Tensor:
        out = torch.empty(2)
        comm.send(torch.tensor([rank, rank * 10.0]), dst=(rank + 1) % 3)
        return comm.recv(out, src=(rank - 1) % 3)

    results = run_threads(body, 3)
    assert results[0].tolist() == [2.0, 20.0] and results[1].tolist() == [0.0, 0.0]


def test_explain_names_a_choice_with_reasons() -> None:
    def body(rank: int):
        return comm.explain("all_reduce", 16 << 20), comm.explain("scatter", 10)

    big, scatter = run_threads(body, 2)[0]
    assert big.algorithm in comm.AVAILABLE["all_reduce"]
    assert set(big.predicted_us) == set(comm.AVAILABLE["all_reduce"])
    assert big.algorithm in big.reason and "measured" in big.reason
    assert scatter.algorithm == "native"


def test_unknown_algorithm_is_named() -> None:
    def body(rank: int):
        comm.broadcast(torch.ones(2), algorithm="ring")

    with pytest.raises(RuntimeError, match="broadcast has no algorithm 'ring'"):
        run_threads(body, 2)


def test_missing_rank_is_named_on_timeout() -> None:
    def body(rank: int):
        if rank != 1:
            comm.all_reduce(torch.ones(3), algorithm="native")

    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] never arrived"):
        run_threads(body, 3, timeout=1)


def test_debug_mode_names_the_rank_and_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTRAIN_DEBUG", "1")

    def body(rank: int):
        try:
            comm.all_reduce(torch.ones(4 if rank != 2 else 5))
        except comm.CollectiveMismatch as exc:
            return str(exc)

    messages = run_threads(body, 3)
    assert all("rank 2 has size of dim 0 5 but rank 0 has 4" in m for m in messages)


def _linear() -> torch.nn.Linear:
    # Threads share torch's global RNG, so the weights are set, not drawn.
    layer = torch.nn.Linear(4, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-1, 1, 8).view(2, 4))
        layer.bias.copy_(torch.tensor([0.5, -0.5]))
    return layer


def _dp_step(rank: int, size: int) -> dict:
    model = dtrain.DataParallel(_linear(), bucket_mb=1e-5)
    x = torch.arange(8 * 4, dtype=torch.float32).view(8, 4) / 10
    model(x.chunk(size)[rank]).pow(2).mean().backward()
    return {n: p.grad for n, p in model.module.named_parameters()}


def test_data_parallel_runs_on_threads() -> None:
    reference = _linear()
    x = torch.arange(8 * 4, dtype=torch.float32).view(8, 4) / 10
    torch.stack([reference(c).pow(2).mean() for c in x.chunk(2)]).mean().backward()
    for grads in run_threads(_dp_step, 2, 2):
        torch.testing.assert_close(grads["weight"], reference.weight.grad)
        torch.testing.assert_close(grads["bias"], reference.bias.grad)


def _probed(sizes: list[int]) -> list[list[int]]:
    """Each call's all_reduce of `sizes[i]` bytes by auto, and then the probe sizes its
    cost curves hold."""
    group = dtrain.comm.resolve(None)
    seen = []
    for nbytes in sizes:
        dtrain.comm.all_reduce(torch.ones(nbytes // 4), algorithm="auto")
        seen.append([b for b, _ in group.cost_models["all_reduce"]["native"].points])
    return seen


def test_auto_never_probes_beyond_the_message_in_hand(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """`auto` measures its candidates on probes no larger than the message in hand (a
    model being built, holding its shards, probes no 16 MiB tensor), and measures the next
    probes when a larger message comes; an all_to_all, whose ranks may send different sizes,
    probes every size at once."""
    monkeypatch.setenv("DTRAIN_CALIBRATION", str(tmp_path / "none.json"))  # nothing saved
    small, medium, large = 40, 100_000, 5 << 20
    for seen in run_threads(lambda rank: _probed([small, medium, small, large]), 2):
        assert seen == [[4096], [4096, 65536], [4096, 65536], [4096, 65536, 1 << 20, 4 << 20]]
    assert cost.probes(up_to=None) == list(cost.PROBE_BYTES)
    assert "all_to_all" not in cost.SIZE_AGREED
