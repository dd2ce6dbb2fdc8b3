"""Optimizer offload (ZeRO's `offload_device`, `[memory] offload`) equals ZeRO without it:
the same losses, gradient norms, weights and optimizer state, bit for bit, at every stage,
in fp32 and in bf16 over fp32 masters; checkpoints cross between the two. On a CPU the
host and the "device" are one, and the same buffers, copies and per-unit steps run (the
CUDA streams and pinned memory: tests/gpu/test_gpu.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dtrain
from dtrain.errors import DtrainError
from dtrain.testing import run_threads
from tests.data_parallel.test_zero import ALGORITHM, STEPS, adamw, base_model, batch, run, sgd

EXACT = {"rtol": 0, "atol": 0}


def _assert_same(got: dict, want: dict) -> None:
    for key in ("losses", "norms", "model", "optimizer"):
        torch.testing.assert_close(got[key], want[key], **EXACT, msg=lambda m, k=key: f"{k}: {m}")
    for key in ("params", "state", "scalars"):  # the sharded state a checkpoint writes
        torch.testing.assert_close(got["shards"][key], want["shards"][key], **EXACT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mixed", [None, "bf16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_equals_no_offload(stage: int, mixed: str | None) -> None:
    """Two ranks, AdamW with two parameter groups, clipping: every figure the same."""
    want = run(2, stage, mixed=mixed)
    got = run(2, stage, mixed=mixed, offload="cpu")
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)


@pytest.mark.timeout(120)
def test_offload_with_accumulation_and_sgd_momentum() -> None:
    want = run(2, 2, accum=2, factory=sgd)
    got = run(2, 2, accum=2, factory=sgd, offload="cpu")
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 3])
def test_device_keeps_no_optimizer_state(stage: int) -> None:
    """What moves: the optimizer state and the masters are counted on the host, the
    same bytes the device held without offload; the device keeps the parameters (stage 3:
    its resident shard) and nothing of the optimizer."""
    for mixed in (None, "bf16"):
        off = run(2, stage, mixed=mixed)
        on = run(2, stage, mixed=mixed, offload="cpu")
        for a, b in zip(off, on, strict=True):
            held, moved = a["bytes"], b["bytes"]
            assert moved["optimizer"] == 0 and moved["host_optimizer"] == held["optimizer"] > 0
            assert moved["params"] == held["params"]
            if stage == 3:  # the resident shard, in the compute dtype, feeds the gathers
                assert moved["master"] == held["master"] // (2 if mixed else 1)
            else:
                assert moved["master"] == 0
            shards = sum(shard for *_, shard in b["units"])  # elements, padding included
            assert moved["host_master"] == 4 * shards  # fp32 masters, now on the host
            # by storage, not only by count: the optimizer steps the host masters, which
            # share no memory with what forward reads (without offload stages 1-2 step
            # masters that are `full`'s own shards)
            assert b["placement"] == {"pieces on masters": True,
                                      "masters apart from compute": True,
                                      "state apart from compute": True}, b["placement"]
            if stage < 3 and not mixed:
                assert not a["placement"]["masters apart from compute"]


def _resume(shards: list[dict], stage: int, offload: str | None) -> list[dict]:
    """Load every rank's sharded state into a fresh ZeRO (offloaded or not) and train one
    more step: the weights, the optimizer state and the loss."""
    base = base_model()

    def body(rank: int) -> dict:
        z = dtrain.ZeRO(copy.deepcopy(base), adamw, stage=stage, algorithm=ALGORITHM,
                        offload_device=offload)
        z.load_sharded_state_dict(shards)
        x, y = batch(STEPS, 2 * 4)
        mine = slice(rank * 4, rank * 4 + 4)
        loss = nn.functional.cross_entropy(z(x[mine]), y[mine])
        z.backward(loss)
        z.step()
        return {"loss": loss.item(), "model": z.state_dict(), "optimizer": z.optimizer_state_dict()}

    return run_threads(body, 2, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoints_cross_between_offload_and_not(stage: int) -> None:
    """Saved with offload, resumed without, and the reverse: the same next step."""
    saved = {offload: [r["shards"] for r in run(2, stage, offload=offload)]
             for offload in (None, "cpu")}
    want = _resume(saved[None], stage, None)
    for source, target in ((None, "cpu"), ("cpu", None), ("cpu", "cpu")):
        for g, w in zip(_resume(saved[source], stage, target), want, strict=True):
            torch.testing.assert_close(g, w, **EXACT)


def test_offload_to_a_device_is_refused() -> None:
    with pytest.raises(DtrainError, match="use \"cpu\""):
        dtrain.ZeRO(base_model(), adamw, stage=1, offload_device="meta")
