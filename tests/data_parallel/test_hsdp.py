"""Hybrid sharding (HSDP: `[parallel] dp_replicate` with ZeRO): the model state sharded
inside each replica and each gradient shard averaged across the replicas, against one
process on the same global batch (SGD without a clip: a wrong divisor shows), resumed in
other layouts, and the bytes that cross the replica boundary counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain.testing import run_ranks
from tests.models.test_models_train import weights
from tests.models.test_moe import MOE_TOML
from tests.support.cli import (
    EXACT_OPTIMIZER,
    TINY_MODEL,
    assert_refused,
    assert_same_steps,
    train_rows_together,
)

CONFIG = TINY_MODEL + EXACT_OPTIMIZER + """
[train]
batch_size = 8
eval_every = 0
[data]
max_bytes = 20000
[checkpoint]
background = false
[logging]
sample_tokens = 0
"""
HSDP = ["parallel.dp_replicate=2"]
TWO_BLOCKS = CONFIG.replace("n_layer = 1", "n_layer = 2")


def _zero(stage: int) -> list[str]:
    return [f"parallel.zero={stage}"]


def assert_same_weights(got: Path, want: Path) -> None:
    torch.testing.assert_close(weights(got), weights(want), rtol=1e-4, atol=5e-5)


@pytest.mark.timeout(300)
def test_hsdp_at_each_zero_stage_equals_one_process_and_resumes_in_other_layouts(
        tmp_path: Path) -> None:
    """2 replicas x 2 sharding ranks at ZeRO 1, 2 and 3: every step's loss and gradient
    norm, and the final weights, equal one process's; the ZeRO-3 HSDP checkpoint of step 3
    resumes as ZeRO-3 over all 4 ranks and as one process, each equal to the unbroken
    run."""
    ((one, one_ckpt),) = train_rows_together([(tmp_path / "one", CONFIG, [], 5)], 1)
    runs = train_rows_together([
        *((tmp_path / f"hsdp{s}", CONFIG, [*HSDP, *_zero(s)], 5) for s in (1, 2)),
        (tmp_path / "hsdp3", CONFIG, [*HSDP, *_zero(3)], 3)], 4)
    for rows, ckpt in runs[:2]:
        assert_same_steps(rows, one)
        assert_same_weights(ckpt, one_ckpt)
    hsdp3, hsdp3_ckpt = runs[2]
    assert_same_steps(hsdp3, one[:3])
    resume = f"checkpoint.resume='{hsdp3_ckpt}'"
    ((as_zero3, zero3_ckpt),) = train_rows_together(
        [(tmp_path / "zero3", CONFIG, [*_zero(3), resume], 5)], 4)
    ((as_one, one_again),) = train_rows_together([(tmp_path / "again", CONFIG, [resume], 5)], 1)
    for rows, ckpt in ((as_zero3, zero3_ckpt), (as_one, one_again)):
        assert_same_steps(rows, one[3:])
        assert_same_weights(ckpt, one_ckpt)


LAYOUTS = {
    "cp2": (TWO_BLOCKS, ["parallel.cp=2", "parallel.zero=3"]),
    "pp2": (TWO_BLOCKS, ["parallel.pp=2", "parallel.microbatches=2", "parallel.zero=2"]),
    "ep2": (MOE_TOML, ["parallel.ep=2", "parallel.zero=2"]),
    "local-sgd": (TWO_BLOCKS, ["sync.method='local_sgd'", "sync.every=1", "sync.groups=2",
                               "parallel.zero=1"]),
}
"""Layouts on 4 ranks with 2 replicas inside (a sync group's, for local SGD):
(config, overrides)."""


@pytest.mark.timeout(300)
def test_hsdp_composes_with_cp_pp_ep_and_sync_groups(tmp_path: Path) -> None:
    """Context parallelism inside a replica (its shards over dp_shard x cp), a pipeline
    whose stages shard over their replica, experts split over ep inside a replica (sharded
    over the ranks of the replica holding the same experts), and sync groups above the
    replicas (local SGD every step, with SGD: one process): each equals one process."""
    one = {text: train_rows_together([(tmp_path / f"one{k}", text, [], 3)], 1)[0]
           for k, text in enumerate((TWO_BLOCKS, MOE_TOML))}
    runs = train_rows_together([(tmp_path / name, text, [*HSDP, *sets], 3)
                                for name, (text, sets) in LAYOUTS.items()], 4)
    for (name, (text, _)), (rows, ckpt) in zip(LAYOUTS.items(), runs, strict=True):
        want_rows, want_ckpt = one[text]
        if name == "local-sgd":  # the gradient norm is a sync group's, of its half
            torch.testing.assert_close([r["loss"] for r in rows],
                                       [r["loss"] for r in want_rows], rtol=1e-5, atol=1e-6)
        else:
            assert_same_steps(rows, want_rows)
        assert_same_weights(ckpt, want_ckpt)


@pytest.mark.slow  # 8 ranks on 2 cores, and compiling
@pytest.mark.timeout(500)
def test_hsdp_with_tensor_parallel_and_compiled_equals_one_process(tmp_path: Path) -> None:
    """tp 2 inside 2 replicas of 2 sharding ranks (8 ranks), ZeRO-3; and 2 x 2 at ZeRO-2
    compiled (`train.compile`): every step and the final weights."""
    ((one, one_ckpt),) = train_rows_together([(tmp_path / "one", CONFIG, [], 3)], 1)
    ((tp, tp_ckpt),) = train_rows_together(
        [(tmp_path / "tp", CONFIG, [*HSDP, *_zero(3), "parallel.tp=2"], 3)], 8)
    ((compiled, compiled_ckpt),) = train_rows_together(
        [(tmp_path / "compiled", CONFIG, [*HSDP, *_zero(2), "train.compile=true"], 3)], 4)
    for rows, ckpt in ((tp, tp_ckpt), (compiled, compiled_ckpt)):
        assert_same_steps(rows, one)
        assert_same_weights(ckpt, one_ckpt)


class _Blocks(nn.Module):
    """Two blocks in a ModuleList: two units at stage 3, beside the root's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _crossing_bytes(stage: int) -> dict[str, object]:
    """One step of ZeRO at `stage` in 2 replicas of 2: the bytes this rank sent across
    the replicas, by collective, and the elements of its gradient shards."""
    from dtrain import Mesh, ZeRO, comm

    mesh = Mesh(dp_replicate=2, dp_shard=2)
    torch.manual_seed(0)
    model = _Blocks()
    zero = ZeRO(model, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=stage,
                group=mesh.group("dp_shard"), replicate_group=mesh.group("dp_replicate"),
                bucket_mb=0.0001)
    comm.traffic(mesh.group("dp_replicate"), reset=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(mesh.world.rank))
    zero(x).square().mean().backward()
    zero.step()
    return {"sent": comm.traffic(mesh.group("dp_replicate")),
            "shard": sum(u.master.numel() for u in zero.units), "units": len(zero.units),
            "element": zero.units[0].master.element_size()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 3])
def test_only_an_all_reduce_of_each_shard_crosses_the_replicas(stage: int) -> None:
    """The traffic across replicas per step is one all-reduce of this rank's gradient
    shards: 2(R-1)/R x the shard's bytes (R = 2: the shard once), in as many all-reduces
    as units; the gathers and reduce-scatters stay inside the replica."""
    for r in run_ranks(_crossing_bytes, 4, stage, timeout=50):
        assert r["sent"] == {"all_reduce": 2 * (2 - 1) / 2 * r["shard"] * r["element"]}
        assert r["units"] > 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides, message", [
    (["parallel.dp_replicate=3", "parallel.zero=1"],
     "parallel.dp_replicate = 3 does not divide the data-parallel ranks (dp = 2)"),
    (["parallel.dp_replicate=2"], "parallel.dp_replicate = 2 shards the model state inside "
     "each replica: set parallel.zero = 1, 2 or 3"),
    (["parallel.dp_replicate=2", "parallel.exchange='ps'"],
     "parallel.dp_replicate = 2 shards the model state inside each replica"),
], ids=["not-dividing", "without-zero", "with-ps"])
def test_hsdp_mistakes_are_one_line(tmp_path: Path, overrides: list[str], message: str) -> None:
    assert_refused(tmp_path, CONFIG, overrides, message)
