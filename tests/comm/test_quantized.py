"""Collectives in a lower-precision wire dtype (dtrain.comm.quantized): blockwise int8 and
fp8 within their stated bounds, the all-gather and reduce-scatter on gloo within them of
the fp32 collective, error feedback losing nothing over many steps, and the bytes sent
equal to the formula and to what comm.traffic counts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm.quantized import (
    dequantize,
    message_bytes,
    pack,
    quantize,
    quantized_bytes,
    unpack,
)
from dtrain.errors import ConfigError
from dtrain.testing import run_ranks, run_threads

BLOCK = 64
SHARD = 150  # two whole blocks and a short one: the padding is exercised
STEPS = 20
BF16_U = 2.0**-8  # bf16's unit roundoff (8 significant bits)
NATIVE = "native"  # "auto" would time the candidates on each new group first
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tests/conftest.py


def _data(seed: int, numel: int) -> torch.Tensor:
    """Normal values with outliers 40x larger every 37 elements: most blocks hold one."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    x[::37] *= 40
    return x


def _block_absmax(rows: torch.Tensor, block: int) -> torch.Tensor:
    """For each element of `rows` (count x s), the absmax of its block (blocks counted from
    each row's start), computed without the module under test."""
    count, s = rows.shape
    padded = torch.zeros(count, -(-s // block) * block)
    padded[:, :s] = rows.abs()
    per_block = padded.view(count, -1, block).amax(dim=2)
    return per_block.repeat_interleave(block, dim=1)[:, :s]


def _bound(wire: str, rows: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The module docstring's bound on each element's error, with fp32's rounding on top."""
    absmax = _block_absmax(rows, block)
    if wire == "int8":
        bound = absmax / 254
    elif wire == "fp8":
        bound = rows.abs() / 16 + absmax / 448 * 2.0**-10
    else:
        bound = rows.abs() * BF16_U
    return bound * (1 + 1e-5) + 1e-6 * rows.abs()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("wire", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("shape, block", [((3, 1000), 256), ((2, 150), 64), ((1, 5), 64),
                                          ((2, 128), 64)])
def test_each_element_errs_within_its_blocks_bound(wire: str, shape: tuple[int, int],
                                                  block: int) -> None:
    rows = _data(0, shape[0] * shape[1]).view(shape)
    rows[0, :block] = 0  # an all-zero block: scale 0, codes 0, exact
    values, scales = quantize(rows, wire, block)
    back = dequantize(values, scales, block)
    assert (back - rows).abs().le(_bound(wire, rows, block)).all()
    assert torch.equal(back[0, :block], torch.zeros(min(block, shape[1])))
    if wire != "bf16":
        assert scales.shape == (shape[0], -(-shape[1] // block))


@pytest.mark.timeout(10)
def test_fp8_bound_is_tight_and_int8_codes_are_symmetric() -> None:
    rows = _data(1, 4096).view(4, 1024)
    values, scales = quantize(rows, "int8", 256)
    assert values.abs().max().item() == 127 and values.min().item() >= -127
    error = dequantize(values, scales, 256) - rows
    assert error.abs().max() > 0.3 * _bound("int8", rows, 256).max()  # not a loose bound
    fp8, fp8_scales = quantize(rows, "fp8", 256)
    assert fp8.float().abs().max().item() == 448  # each block's absmax maps to e4m3's max


@pytest.mark.timeout(10)
@pytest.mark.parametrize("wire", ["int8", "fp8", "bf16", "fp32"])
def test_pack_carries_values_and_scales_in_one_byte_row(wire: str) -> None:
    rows = _data(2, 3 * SHARD).view(3, SHARD)
    values, scales = quantize(rows, wire, BLOCK)
    packed = pack(values, scales)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, message_bytes(SHARD, wire, BLOCK))
    got_values, got_scales = unpack(packed, SHARD, wire)
    assert torch.equal(dequantize(got_values, got_scales, BLOCK),
                       dequantize(values, scales, BLOCK))


@pytest.mark.timeout(10)
def test_bytes_formula() -> None:
    s = SHARD
    assert message_bytes(s, "int8", BLOCK) == s + 4 * 3
    assert message_bytes(s, "bf16", BLOCK) == 2 * s
    for n in (1, 2, 3, 4):
        assert quantized_bytes("all_gather", "int8", n * s, n, BLOCK) == (n - 1) * (s + 12)
        assert quantized_bytes("reduce_scatter", "fp8", n * s, n, BLOCK) == (n - 1) * (s + 12)
        assert quantized_bytes("reduce_scatter", "bf16", n * s, n) == (n - 1) * 2 * s
    with pytest.raises(ValueError, match="equal shards"):
        quantized_bytes("all_gather", "int8", 7, 2)


@pytest.mark.timeout(10)
def test_fp8_is_refused_where_it_cannot_train_in_one_line() -> None:
    for wire in ("int8", "bf16", "fp16", "fp32"):
        comm.check_wire_dtype(wire, "cpu")
    with pytest.raises(ConfigError, match=r'^comm.reduce_dtype = "fp8" needs a GPU with FP8 '
                                          r"\(compute capability >= 8.9.*cpu") as caught:
        comm.check_wire_dtype("fp8", torch.device("cpu"), key="comm.reduce_dtype")
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="comm.gather_dtype/comm.reduce_dtype"):
        comm.check_wire_dtype("fp8", "cpu")
    with pytest.raises(ConfigError, match="unknown wire dtype 'int4'"):
        comm.check_wire_dtype("int4", "cpu", key="comm.gather_dtype")


@pytest.mark.timeout(10)
def test_bad_arguments_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="block=0"):
        quantize(torch.ones(1, 4), "int8", 0)
    with pytest.raises(ValueError, match="unknown wire dtype"):
        comm.quantized_all_gather(torch.ones(4), "int3")
    with pytest.raises(ValueError, match="not sum or avg"):
        comm.quantized_reduce_scatter(torch.ones(4), "int8", op="max")
    with pytest.raises(ValueError, match="contiguous fp32 tensor of 4"):
        comm.quantized_reduce_scatter(torch.ones(4), "int8", residual=torch.zeros(3))


def _edges(rank: int) -> dict[str, object]:
    full = torch.zeros(2 * SHARD)
    try:  # in place, the shard's quantized copy would overwrite it
        comm.quantized_all_gather(full[rank * SHARD : (rank + 1) * SHARD], "int8", out=full)
    except ValueError as exc:
        in_place = str(exc)
    comm.traffic(reset=True)
    return {"in_place": in_place,
            "empty_gather": comm.quantized_all_gather(torch.empty(0), "int8"),
            "empty_reduce": comm.quantized_reduce_scatter(torch.empty(0), "fp8", op="avg"),
            "traffic": comm.traffic()}


@pytest.mark.timeout(30)
def test_one_rank_sends_nothing_and_delivers_what_the_residual_held() -> None:
    x = _data(3, SHARD)
    residual = torch.full((SHARD,), 0.25)
    got = run_threads(lambda rank: comm.quantized_reduce_scatter(
        x, "int8", op="avg", residual=residual), 1)[0]
    assert torch.equal(got, x + 0.25) and torch.equal(residual, torch.zeros(SHARD))
    gathered = run_threads(lambda rank: comm.quantized_all_gather(x, "fp8"), 1)[0]
    assert torch.equal(gathered, x)  # a group of one: exact


@pytest.mark.timeout(30)
def test_in_place_needs_exact_own_and_empty_shards_send_nothing() -> None:
    for result in run_threads(_edges, 2):
        assert "pass exact_own=True" in result["in_place"]
        assert result["empty_gather"].shape == (0,) and result["empty_reduce"].shape == (0,)
        assert result["traffic"] == {}


def _biased(n: int) -> torch.Tensor:
    """A buffer whose blocks hold 127 then 0.3s: int8's scale is 1, so each 0.3 rounds to 0
    and, without error feedback, never arrives."""
    x = torch.full((n * BLOCK,), 0.3)
    x[::BLOCK] = 127.0
    return x


def _exercise() -> dict[str, object]:
    """Every quantized collective on the world, and what comm.traffic counted for each."""
    r, n = dist.get_rank(), dist.get_world_size()
    out: dict[str, object] = {}
    shard = _data(r, SHARD)
    for wire in ("int8", "fp8", "bf16", "fp32"):
        comm.traffic(reset=True)
        out[f"gather/{wire}"] = comm.quantized_all_gather(
            shard, wire, out=torch.empty(n * SHARD), algorithm=NATIVE, block=BLOCK)
        out[f"gather_traffic/{wire}"] = comm.traffic(reset=True)
        handle = comm.quantized_all_gather(shard, wire, async_op=True, algorithm=NATIVE,
                                           block=BLOCK)
        out[f"gather_async/{wire}"] = handle.wait()
    full = torch.empty(n * SHARD)
    full[r * SHARD : (r + 1) * SHARD] = shard
    comm.quantized_all_gather(full[r * SHARD : (r + 1) * SHARD], "int8", out=full,
                              algorithm=NATIVE, block=BLOCK, exact_own=True)
    out["gather_in_place"] = full
    out["gather_bf16_out"] = comm.quantized_all_gather(
        shard, "int8", out=torch.empty(n * SHARD, dtype=torch.bfloat16), algorithm=NATIVE,
        block=BLOCK)
    grads = _data(100 + r, n * SHARD)
    for wire in ("int8", "fp8", "bf16", "fp32"):
        comm.traffic(reset=True)
        out[f"rs/{wire}"] = comm.quantized_reduce_scatter(grads, wire, op="avg",
                                                          algorithm=NATIVE, block=BLOCK)
        out[f"rs_traffic/{wire}"] = comm.traffic(reset=True)
    out["rs_sum/int8"] = comm.quantized_reduce_scatter(grads, "int8", op="sum",
                                                       algorithm=NATIVE, block=BLOCK)
    out["rs_async/int8"] = comm.quantized_reduce_scatter(
        grads.bfloat16(), "int8", op="avg", algorithm=NATIVE, block=BLOCK,
        async_op=True).wait()
    for wire in ("int8", "fp8", "bf16"):
        residual = torch.zeros(n * SHARD)
        delivered = []
        for step in range(STEPS):
            handle = comm.quantized_reduce_scatter(_data(1000 * step + r, n * SHARD), wire,
                                                   op="avg", algorithm=NATIVE, block=BLOCK,
                                                   residual=residual, async_op=True)
            delivered.append(handle.wait())
        out[f"feedback/{wire}"] = torch.stack(delivered).sum(0)
        out[f"feedback_residual/{wire}"] = residual.clone()
    comm.traffic(reset=True)
    residual = torch.zeros(n * BLOCK)
    kept, dropped = [], []
    for _ in range(STEPS):
        kept.append(comm.quantized_reduce_scatter(_biased(n), "int8", op="sum", block=BLOCK,
                                                  residual=residual, algorithm=NATIVE))
        dropped.append(comm.quantized_reduce_scatter(_biased(n), "int8", op="sum",
                                                     block=BLOCK, algorithm=NATIVE))
    out["biased_kept"] = torch.stack(kept).sum(0)
    out["biased_dropped"] = torch.stack(dropped).sum(0)
    out["biased_traffic"] = comm.traffic(reset=True)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    """(n, each rank's `_exercise` results) on n gloo ranks, run once for the module."""
    return request.param, run_ranks(_exercise, request.param, timeout=60)


@pytest.mark.timeout(90)
def test_all_gather_is_the_fp32_one_within_the_bound(ranks: tuple[int, list[dict]]) -> None:
    n, results = ranks
    shards = torch.stack([_data(r, SHARD) for r in range(n)])
    exact = shards.view(-1)
    for wire in ("int8", "fp8", "bf16"):
        got = results[0][f"gather/{wire}"]
        assert (got - exact).abs().le(_bound(wire, shards).view(-1)).all(), wire
        assert not torch.equal(got, exact)  # it was quantized
        for result in results:  # the same on every rank, sync or async
            assert torch.equal(result[f"gather/{wire}"], got)
            assert torch.equal(result[f"gather_async/{wire}"], got)
    for result in results:
        assert torch.equal(result["gather/fp32"], exact)
    for r, result in enumerate(results):  # exact_own in place: own part kept, others as sent
        own = slice(r * SHARD, (r + 1) * SHARD)
        assert torch.equal(result["gather_in_place"][own], exact[own])
        others = torch.ones(n * SHARD, dtype=torch.bool)
        others[own] = False
        assert torch.equal(result["gather_in_place"][others], results[0]["gather/int8"][others])
        into_bf16 = result["gather_bf16_out"]
        assert into_bf16.dtype == torch.bfloat16
        assert torch.equal(into_bf16, results[0]["gather/int8"].bfloat16())


def _mean_bound(wire: str, n: int, seed: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact average of `_exercise`'s gradients (n x chunk, rank r's chunk in row r) and
    the bound on each element's error: the mean over ranks of each contribution's."""
    grads = torch.stack([_data(seed + r, n * SHARD) for r in range(n)])
    exact = grads.mean(0).view(n, SHARD)
    chunks = grads.view(n, n, SHARD)  # [sender, destination, element]
    if wire == "bf16":
        bound = (n + 1) * BF16_U * grads.abs().mean(0).view(n, SHARD) * (1 + 1e-3)
    else:
        bound = torch.stack([_bound(wire, chunks[:, d]) for d in range(n)], dim=0).mean(1)
    return exact, bound


@pytest.mark.timeout(90)
def test_reduce_scatter_is_the_fp32_one_within_the_bound(ranks: tuple[int, list[dict]]) -> None:
    n, results = ranks
    for wire in ("int8", "fp8", "bf16"):
        exact, bound = _mean_bound(wire, n)
        for r, result in enumerate(results):
            got = result[f"rs/{wire}"]
            assert got.dtype == torch.float32 and got.shape == (SHARD,)
            assert (got - exact[r]).abs().le(bound[r]).all(), (wire, r)
    exact, bound = _mean_bound("int8", n)
    magnitude = torch.stack([_data(100 + r, n * SHARD) for r in range(n)]).abs().mean(0)
    for r, result in enumerate(results):
        torch.testing.assert_close(result["rs/fp32"], exact[r], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(result["rs_sum/int8"], n * result["rs/int8"])
        from_bf16 = result["rs_async/int8"]
        assert from_bf16.dtype == torch.bfloat16  # the input's dtype
        # bf16 rounds the input (u mean|x_i|), int8's bound holds for what was rounded
        # ((1 + u) bound), and the average is rounded to bf16 (u |average|)
        rounding = BF16_U * (magnitude.view(n, SHARD)[r] + exact[r].abs() + 2 * bound[r])
        assert (from_bf16.float() - exact[r]).abs().le(bound[r] + rounding).all()


@pytest.mark.timeout(90)
def test_error_feedback_loses_nothing_over_many_steps(ranks: tuple[int, list[dict]]) -> None:
    """Summed over the steps, what arrived is what was sent but for the last residuals:
    one step's quantization error, where without feedback the steps' errors add up. A cast
    wire is summed in its own dtype, by the backend: feedback recovers the cast's error,
    not that rounding (at most n u mean|x_i| a step)."""
    n, results = ranks
    total = torch.zeros(n, SHARD)
    summing = torch.zeros(n, SHARD)  # bf16's rounding in the sums, all steps together
    step_bound = {wire: torch.zeros(n, SHARD) for wire in ("int8", "fp8", "bf16")}
    for step in range(STEPS):
        exact, _ = _mean_bound("int8", n, seed=1000 * step)
        total += exact
        grads = torch.stack([_data(1000 * step + r, n * SHARD) for r in range(n)])
        summing += n * BF16_U * grads.abs().mean(0).view(n, SHARD)
        for wire, bound in step_bound.items():
            torch.maximum(bound, _mean_bound(wire, n, seed=1000 * step)[1], out=bound)
    for wire, bound in step_bound.items():
        residuals = torch.stack([res[f"feedback_residual/{wire}"] for res in results])
        for r, result in enumerate(results):
            got = result[f"feedback/{wire}"]
            owed = residuals[:, r * SHARD : (r + 1) * SHARD].mean(0)
            lost = summing[r] if wire == "bf16" else 0
            assert (got + owed - total[r]).abs().le(lost + 1e-5 * total[r].abs() + 1e-4).all()
            assert (got - total[r]).abs().le(bound[r] * 1.05 + lost + 1e-4).all(), (wire, r)
    for result in results:
        sent = _biased(1).view(-1)[:BLOCK] * n * STEPS  # every rank's, every step's
        assert torch.equal(result["biased_dropped"][1:], torch.zeros(BLOCK - 1))  # all lost
        assert (result["biased_kept"] - sent).abs().max() <= n * 0.5 + 1e-3  # all but one
        assert torch.equal(result["biased_kept"][:1], sent[:1])


@pytest.mark.timeout(90)
def test_bytes_sent_are_the_formulas_and_what_traffic_counts(
        ranks: tuple[int, list[dict]]) -> None:
    n, results = ranks
    under = {"int8": "all_to_all", "fp8": "all_to_all", "bf16": "reduce_scatter",
             "fp32": "reduce_scatter"}
    for result in results:
        for wire in ("int8", "fp8", "bf16", "fp32"):
            gathered = quantized_bytes("all_gather", wire, n * SHARD, n, BLOCK)
            assert result[f"gather_traffic/{wire}"] == {"all_gather": gathered}
            reduced = quantized_bytes("reduce_scatter", wire, n * SHARD, n, BLOCK)
            assert result[f"rs_traffic/{wire}"] == {under[wire]: reduced}
        assert gathered == (n - 1) * 4 * SHARD
        assert quantized_bytes("all_gather", "int8", n * SHARD, n, BLOCK) < gathered * 0.3
        assert result["biased_traffic"] == {
            "all_to_all": 2 * STEPS * quantized_bytes("reduce_scatter", "int8", n * BLOCK, n,
                                                      BLOCK)}
