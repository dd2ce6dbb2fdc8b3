"""Gradient compressors (dtrain.sync.compression) against the exact average: PowerSGD
exact within its rank, int8 within its bound, error feedback keeping what was dropped,
bytes as comm.traffic counts them, state through a checkpoint, and bad input."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.errors import DtrainError
from dtrain.sync.compression import Int8, PowerSGD, make
from dtrain.testing import run_ranks, run_threads

# At rank 1 to 3 the 24 x 16 and 8 x (2*3) matrices are compressed, the vector and the
# 2 x 2 matrix ((2 + 2) r >= 4) are sent whole.
SHAPES = [torch.Size([24, 16]), torch.Size([16]), torch.Size([2, 2]), torch.Size([8, 2, 3])]
COMPRESSED = [(0, 24, 16), (404, 8, 6)]  # (start, rows, cols) in the bucket
WHOLE = slice(384, 404)
NUMEL = 452
NATIVE = {"algorithm": "native"}  # "auto" would time the candidates on each new group first


def _random(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _low_rank_grads(rank: int, r: int) -> torch.Tensor:
    """This rank's bucket: each compressed matrix A_rank B with B shared (k = r columns),
    so their sum over ranks has rank <= r; the rest random."""
    grads = _random(100 + rank, NUMEL)
    for i, (start, rows, cols) in enumerate(COMPRESSED):
        a = _random(rank * 10 + i, rows * r).view(rows, r)
        b = _random(1000 + i, r * cols).view(r, cols)
        grads[start : start + rows * cols] = (a @ b).view(-1)
    return grads


def _reduce_steps(rank: int, make_compressor, grads_of, steps: int) -> dict:
    """`steps` reduces of `grads_of(rank, step)` on the world: every output, the state after
    the first and the last, and the bytes sent."""
    compressor = make_compressor()
    outputs, states = [], []
    for step in range(steps):
        grads = grads_of(rank, step).clone()
        compressor.reduce(0, grads, SHAPES if grads.numel() == NUMEL else [grads.shape], None)
        outputs.append(grads)
        states.append(compressor.state_dict())
    return {"outputs": outputs, "first": states[0], "last": states[-1],
            "traffic": comm.traffic()}


def _mean(grads_of, world: int, step: int = 0) -> torch.Tensor:
    return torch.stack([grads_of(r, step) for r in range(world)]).mean(0)


def _same_on_every_rank(results: list[dict]) -> None:
    for other in results[1:]:
        for a, b in zip(results[0]["outputs"], other["outputs"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world, r", [(2, 2), (3, 1), (4, 3)])
def test_powersgd_is_exact_within_its_rank(world: int, r: int) -> None:
    def grads_of(rank: int, step: int) -> torch.Tensor:
        return _low_rank_grads(rank, r)

    results = run_threads(_reduce_steps, world, lambda: PowerSGD(rank=r, **NATIVE), grads_of, 1)
    _same_on_every_rank(results)
    torch.testing.assert_close(results[0]["outputs"][0], _mean(grads_of, world),
                               rtol=1e-4, atol=1e-4)


def _full_rank(rank: int, step: int) -> torch.Tensor:
    return _random(rank, NUMEL)


@pytest.mark.timeout(30)
def test_powersgd_error_feedback_keeps_what_was_lost() -> None:
    """Rank 1 of full-rank matrices is inexact; residual = M - approx on every rank; over
    steps of one gradient the updates add up to the true ones less the residual, and their
    average converges to the true gradient (the residual stays bounded)."""
    world, steps = 3, 200
    results = run_threads(_reduce_steps, world, lambda: PowerSGD(rank=1, **NATIVE), _full_rank,
                          steps)
    _same_on_every_rank(results)
    mean = _mean(_full_rank, world)
    first = results[0]["outputs"][0]
    parts = [slice(start, start + rows * cols) for start, rows, cols in COMPRESSED]
    for part in parts:
        assert (first[part] - mean[part]).abs().max() > 0.1  # not exact
    for rank, result in enumerate(results):
        residual = result["first"]["residual/0"]
        for part in parts:
            torch.testing.assert_close(residual[part], _full_rank(rank, 0)[part] - first[part],
                                       rtol=0, atol=1e-6)
        assert torch.equal(residual[WHOLE], torch.zeros(20))  # sent whole: nothing lost
        torch.testing.assert_close(first[WHOLE], mean[WHOLE])
    total = torch.stack(results[0]["outputs"]).sum(0)
    residuals = torch.stack([r["last"]["residual/0"] for r in results]).mean(0)
    torch.testing.assert_close(total, steps * mean - residuals, rtol=0, atol=1e-3)
    half = torch.stack(results[0]["outputs"][: steps // 2]).sum(0)
    late, early = ((total / steps - mean).abs().max(), (half * 2 / steps - mean).abs().max())
    assert late < 0.1 * (first - mean).abs().max() and late < 0.6 * early  # error ~ 1 / steps


def _chunk_max(x: torch.Tensor, world: int, chunk: int) -> torch.Tensor:
    """max |x| over each element's int8 chunk (shards of ceil(N / world), chunked from the
    start of each shard)."""
    shard = -(-x.numel() // world)
    chunks = -(-shard // chunk)
    rows = torch.zeros(world, chunks * chunk)
    padded = torch.zeros(world * shard)
    padded[: x.numel()] = x.abs()
    rows[:, :shard] = padded.view(world, shard)
    maxima = rows.view(world, chunks, chunk).amax(2, keepdim=True).expand(-1, -1, chunk)
    return maxima.reshape(world, -1)[:, :shard].reshape(-1)[: x.numel()]


def _scaled(rank: int, step: int, numel: int) -> torch.Tensor:
    return _random(10 * rank + step, numel) * torch.linspace(0.01, 3.0, numel)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world, numel, chunk", [
    (3, NUMEL, 64), (4, 1021, 100), (3, 1, 256), (2, 5, 2), (5, 13, 1)])
def test_int8_error_within_bound(world: int, numel: int, chunk: int) -> None:
    """One reduce errs by at most mean over ranks of (max |x| over the chunk) / 127 per
    element: half a scale in each phase, phase 2's scale at most phase 1's mean."""
    def grads_of(rank: int, step: int) -> torch.Tensor:
        return _scaled(rank, step, numel)

    results = run_threads(_reduce_steps, world, lambda: Int8(chunk=chunk, **NATIVE), grads_of, 1)
    _same_on_every_rank(results)
    error = (results[0]["outputs"][0] - _mean(grads_of, world)).abs()
    bound = torch.stack([_chunk_max(grads_of(r, 0), world, chunk)
                         for r in range(world)]).mean(0) / 127
    assert (error <= bound * (1 + 1e-5) + 1e-7).all()
    for rank, result in enumerate(results):  # phase 1's error is kept, within half a scale
        kept = result["first"]["residual/0"].abs()
        assert (kept <= _chunk_max(grads_of(rank, 0), world, chunk) / 254 * 1.0001).all()


@pytest.mark.timeout(30)
def test_int8_error_feedback_keeps_what_was_lost() -> None:
    """Summed over steps, the averages handed out equal the true averages less the mean of
    the ranks' phase-1 residuals and the phase-2 residuals of the shards; the average
    update converges to the true gradient."""
    world, steps, numel = 3, 100, 1021

    def grads_of(rank: int, step: int) -> torch.Tensor:
        return _scaled(rank, 0, numel)

    results = run_threads(_reduce_steps, world, lambda: Int8(chunk=64, **NATIVE), grads_of, steps)
    mean = _mean(grads_of, world)
    total = torch.stack(results[0]["outputs"]).sum(0)
    first = torch.stack([r["last"]["residual/0"] for r in results]).mean(0)
    second = torch.cat([r["last"]["shard_residual/0"] for r in results])[:numel]
    torch.testing.assert_close(total, steps * mean - first - second, rtol=0, atol=1e-3)
    one_step = (results[0]["outputs"][0] - mean).abs().max()
    assert (total / steps - mean).abs().max() < 0.05 * one_step


def _bytes_case(rank: int, compressor, shapes: list[torch.Size]) -> tuple[dict, dict]:
    numel = sum(s.numel() for s in shapes)
    comm.traffic(reset=True)
    compressor.reduce(0, _random(rank, numel), shapes, None)
    compressed = comm.traffic(reset=True)
    comm.all_reduce(_random(rank, numel), algorithm="native")
    return compressed, comm.traffic()


@pytest.mark.timeout(30)
def test_bytes_sent_are_predicted() -> None:
    """PowerSGD r = 2 sends (m + n) r floats per compressed matrix and the rest whole, in
    two all-reduces; int8 about a quarter of an fp32 all-reduce; both as predicted."""
    world = 4
    powersgd = PowerSGD(rank=2)
    sent, fp32 = run_threads(lambda rank: _bytes_case(rank, PowerSGD(rank=2, **NATIVE), SHAPES),
                             world)[1]
    p_floats = 24 * 2 + 8 * 2 + 16 + 4
    q_floats = 16 * 2 + 6 * 2
    share = 2 * (world - 1) / world
    assert sent == {"all_reduce": int(share * 4 * p_floats) + int(share * 4 * q_floats)}
    assert sent["all_reduce"] == powersgd.bytes_per_step(SHAPES, world)
    assert fp32 == {"all_reduce": int(share * 4 * NUMEL)}

    shapes = [torch.Size([250, 400])]
    sent, fp32 = run_threads(lambda rank: _bytes_case(rank, Int8(chunk=256, **NATIVE), shapes),
                             world)[2]
    assert set(sent) == {"all_to_all", "all_gather"}
    assert sum(sent.values()) == Int8(chunk=256).bytes_per_step(shapes, world)
    assert 0.25 < sum(sent.values()) / fp32["all_reduce"] < 0.25 * (1 + 4 / 256) * 1.001
    assert Int8().bytes_per_step(shapes, 1) == PowerSGD().bytes_per_step(shapes, 1) == 0


def _resumed(rank: int, make_compressor) -> tuple[list, list]:
    """Steps 3-5 of a compressor that ran steps 0-5, and of one restored from its state
    (through torch.save) after step 2."""
    def grads(step: int) -> torch.Tensor:
        return _random(10 * rank + step, NUMEL)

    whole, resumed = make_compressor(), make_compressor()
    for step in range(3):
        whole.reduce(7, grads(step), SHAPES, None)
    saved = io.BytesIO()
    torch.save(whole.state_dict(), saved)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved))
    outputs: tuple[list, list] = ([], [])
    for step in range(3, 6):
        for compressor, out in zip((whole, resumed), outputs, strict=True):
            g = grads(step)
            compressor.reduce(7, g, SHAPES, None)
            out.append(g)
    return outputs


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name, options", [("powersgd", {"rank": 1, "start_iter": 2, **NATIVE}),
                                           ("int8", {"chunk": 16, **NATIVE})])
def test_state_dict_resumes_bit_exactly(name: str, options: dict) -> None:
    for whole, resumed in run_threads(_resumed, 2, lambda: make(name, **options)):
        for a, b in zip(whole, resumed, strict=True):
            assert torch.equal(a, b)


def _on_gloo() -> dict:
    """Both compressors over real processes: outputs, the exact mean, bytes predicted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    found = {}
    for compressor, grads in ((PowerSGD(rank=2, **NATIVE), _low_rank_grads(rank, 2)),
                              (Int8(chunk=64, **NATIVE), _random(rank, NUMEL))):
        comm.traffic(reset=True)
        out = grads.clone()
        compressor.reduce(0, out, SHAPES, None)
        mean = grads.clone()
        comm.all_reduce(mean, op="avg", algorithm="native")
        predicted = compressor.bytes_per_step(SHAPES, world)
        found[compressor.name] = (out, mean, sum(comm.traffic().values()), predicted)
    return found


@pytest.mark.timeout(120)
def test_on_gloo_processes() -> None:
    """gloo carries the int8 messages (as bytes) and both averages agree across ranks."""
    results = run_ranks(_on_gloo, 2)
    for name in ("powersgd", "int8"):
        out, mean, _, _ = results[0][name]
        assert torch.equal(out, results[1][name][0])
        tolerance = 1e-5 if name == "powersgd" else 0.1
        torch.testing.assert_close(out, mean, rtol=0, atol=tolerance)
        for result in results:
            out, mean, sent, predicted = result[name]
            assert sent == predicted + int(4 * NUMEL)  # the reference all-reduce's bytes too


@pytest.mark.timeout(30)
@pytest.mark.parametrize("build, message", [
    (lambda: make("powersgd", rank=0), "powersgd rank=0 must be an integer of at least 1"),
    (lambda: make("topk"), "unknown compression 'topk': use one of none, powersgd, int8"),
    (lambda: make("int8", chunk=0), "int8 chunk=0 must be a positive integer"),
    (lambda: make("int8", chunks=8), "unknown compression option(s) chunks: int8 takes chunk"),
    (lambda: PowerSGD(min_compression_rate=0.5), "min_compression_rate=0.5 must be at least 1"),
    (lambda: make("int8", algorithm="tree"), "int8 algorithm='tree' is not one of its all_gather"),
    (lambda: PowerSGD().reduce(0, torch.zeros(5), [torch.Size([2, 2])]),
     "of 4 elements (its shapes'), not torch.float32 (5,)"),
    (lambda: Int8().load_state_dict({"q/0": torch.zeros(3)}), "'q/0' is not int8 compression"),
])
def test_bad_input_is_one_clear_line(build, message: str) -> None:
    with pytest.raises(DtrainError) as caught:
        build()
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.timeout(30)
def test_state_of_another_bucket_size_is_named() -> None:
    def body(rank: int) -> None:
        compressor = Int8(**NATIVE)
        compressor.load_state_dict({"residual/0": torch.zeros(3)})
        compressor.reduce(0, torch.zeros(5), [torch.Size([5])])

    with pytest.raises(RuntimeError, match="int8 state residual/0 holds 3 elements where "
                                           "bucket 0 needs 5: resume with the model"):
        run_threads(body, 2)


@pytest.mark.timeout(30)
def test_none_and_options_for_other_compressors() -> None:
    assert make("none") is None
    assert isinstance(make("int8", rank=4), Int8)  # one config carries every compressor's
