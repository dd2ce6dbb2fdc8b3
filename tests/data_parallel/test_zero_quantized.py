"""ZeRO's collectives in a lower precision (`[comm] gather_dtype`, `reduce_dtype`: ZeRO++'s
qwZ and qgZ): the weights every rank gathers within the stated bound of each block, the
master shards exact, the bytes on the wire exactly the formula's, training close to the
exact run, and mistakes one line. (The primitives themselves: tests/comm/test_quantized.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain.testing import run_ranks
from tests.data_parallel.test_hsdp import CONFIG
from tests.support.cli import assert_refused, train_rows_together

BLOCK = 64


class _Blocks(nn.Module):
    """Blocks in a ModuleList (units of their own at stage 3), weights with outliers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(24, 24) for _ in range(2)])
        self.head = nn.Linear(24, 5)
        with torch.no_grad():
            self.blocks[0].weight[3, 7] = 4.0  # one outlier spoils its own block only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _quantized_step(stage: int, gather: str | None, reduce: str | None) -> dict[str, object]:
    """One step of ZeRO over 2 ranks with the given wires: what the step's collectives
    sent, the weights every rank computes with against the exact masters, per block."""
    from dtrain import ZeRO, comm
    from dtrain.comm import quantized

    torch.manual_seed(0)
    zero = ZeRO(_Blocks(), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=stage,
                gather_dtype=gather, reduce_dtype=reduce, quant_block=BLOCK, bucket_mb=0.001)
    comm.traffic(reset=True)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(comm.resolve(None).rank))
    zero(x).square().mean().backward()
    zero.step()
    sent = comm.traffic()
    gathers = 2 if stage == 3 else 1  # stage 3: forward and backward (the root once)
    expect: dict[str, int] = {}
    for numel in (u.flat.padded for u in zero.units):
        wire = reduce or "fp32"
        key = "all_to_all" if quantized.WireDtype.parse(wire).blockwise else "reduce_scatter"
        expect[key] = expect.get(key, 0) + quantized.quantized_bytes(
            "reduce_scatter", wire, numel, 2, BLOCK)
        if stage < 3:
            expect["all_gather"] = expect.get("all_gather", 0) + quantized.quantized_bytes(
                "all_gather", gather or "fp32", numel, 2, BLOCK)
    if stage == 3:  # forward and backward each gather every block unit; the root once
        for u in zero.units:
            times = 1 if u.module is zero.module else gathers
            expect["all_gather"] = expect.get("all_gather", 0) + times * \
                quantized.quantized_bytes("all_gather", gather or "fp32", u.flat.padded, 2,
                                          BLOCK)
    exact = []  # every rank's exact master shards, gathered to compare with `full`
    for u in zero.units:
        if stage == 3:
            u.gather("auto")
        whole = comm.all_gather(u.master.clone())
        exact.append((whole.reshape(-1), u.full.detach().clone()))
    return {"sent": sent, "expect": expect, "exact": exact,
            "residual": [u.residual is not None for u in zero.units]}


def _within_block_bound(exact: torch.Tensor, got: torch.Tensor, wire: str) -> None:
    """Each rank's shard in blocks from its start (the last one shorter)."""
    shard = exact.numel() // 2
    starts = [lo + k for lo in (0, shard) for k in range(0, shard, BLOCK)]
    for lo in starts:
        hi = min(lo + BLOCK, shard * (1 + lo // shard))
        e, g = exact[lo:hi], got[lo:hi]
        m = e.abs().max()
        bound = m / 254 if wire == "int8" else e.abs() / 16 + m / 458752
        assert ((g - e).abs() <= bound + 1e-7).all(), (lo, (g - e).abs().max(), m)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("wire", ["int8", "fp8"])
def test_quantized_gathers_stay_within_each_blocks_bound(stage: int, wire: str) -> None:
    """Every rank computes with the same gathered weights, each within the wire's bound of
    its block's exact master (int8: absmax / 254; fp8: |x| / 16 + absmax / 458752), and the
    bytes each collective sent are the formula's exactly."""
    results = run_ranks(_quantized_step, 2, stage, wire, "int8", timeout=80)
    for r in results:
        assert r["sent"] == r["expect"]
        assert all(r["residual"])  # int8 reductions keep what they dropped
        for exact, got in r["exact"]:
            _within_block_bound(exact, got[:exact.numel()], wire)
            assert not torch.equal(exact, got[:exact.numel()])  # quantized, not exact
    for (_, first), (_, second) in zip(results[0]["exact"], results[1]["exact"], strict=True):
        torch.testing.assert_close(first, second, rtol=0, atol=0)  # the same model


@pytest.mark.timeout(90)
def test_a_bf16_reduction_of_fp32_gradients_sends_half_the_bytes() -> None:
    """reduce_dtype = "bf16" under fp32 compute: a reduce-scatter of half the bytes, with
    error feedback (narrower than the compute dtype); the gathers untouched."""
    for r in run_ranks(_quantized_step, 2, 2, None, "bf16", timeout=80):
        assert r["sent"] == r["expect"] and all(r["residual"])
        for exact, got in r["exact"]:
            torch.testing.assert_close(got[:exact.numel()], exact, rtol=0, atol=0)




@pytest.mark.timeout(200)
def test_dtrain_train_with_int8_gathers_and_reductions_tracks_the_exact_run(
        tmp_path: Path) -> None:
    """ZeRO-3 on 2 ranks, int8 both ways: every step's loss within 1% of the exact run's,
    and the metrics' `sent_bytes` per step under a third of it."""
    zero3 = ["parallel.zero=3"]
    (exact, _), (quantized, _) = train_rows_together([
        (tmp_path / "exact", CONFIG, zero3, 6),
        (tmp_path / "int8", CONFIG, [*zero3, "comm.gather_dtype='int8'",
                                     "comm.reduce_dtype='int8'"], 6)], 2)
    torch.testing.assert_close([r["loss"] for r in quantized], [r["loss"] for r in exact],
                               rtol=1e-2, atol=0)
    assert [r["loss"] for r in quantized] != [r["loss"] for r in exact]
    for q, e in zip(quantized, exact, strict=True):
        assert 0 < q["sent_bytes"] < e["sent_bytes"] / 3, (q["sent_bytes"], e["sent_bytes"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides, message", [
    (["parallel.zero=2", "comm.gather_dtype='fp8'"], "comm.gather_dtype = \"fp8\" needs a GPU "
     "with FP8"),
    (["comm.reduce_dtype='int8'"], "comm.reduce_dtype = 'int8' is the dtype ZeRO's reduces "
     "travel in: set parallel.zero = 1, 2 or 3"),
], ids=["fp8-on-cpu", "without-zero"])
def test_quantized_communication_mistakes_are_one_line(tmp_path: Path, overrides: list[str],
                                                        message: str) -> None:
    assert_refused(tmp_path, CONFIG, overrides, message)
