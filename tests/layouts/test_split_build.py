"""Models built in split form (dtrain.models.init): on the meta device, each rank making
only what it holds, from initial values that depend on the seed and the parameter's name
alone, so every layout starts from one process's weights; and a model bigger than a rank's
memory cap builds and trains under it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtrain import layouts, models
from dtrain.checkpoint import universal
from dtrain.checkpoint.universal import MODEL
from dtrain.config import config_from_dict, dims_of
from dtrain.data_parallel import DataParallel
from dtrain.data_parallel.zero import ZeRO
from dtrain.errors import ConfigError
from dtrain.mesh import Mesh
from dtrain.models import init, weights
from dtrain.models.config import ModelConfig
from dtrain.planner import LiveBytes
from dtrain.split import Split
from dtrain.testing import run_ranks, run_threads
from tests.support.cli import dtrain
from tests.support.paths import ROOT

GPT = {"arch": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16}
LLAMA = {"arch": "llama", "preset": "llama-tiny", "n_layer": 2, "n_embd": 64,
         "ffn_hidden": 96, "block_size": 16}


def skeleton_of(model: dict) -> nn.Module:
    return init.skeleton(lambda: models.build(models.resolve(ModelConfig(**model), 256)))


def test_the_skeleton_holds_no_parameter_memory_and_keeps_ties() -> None:
    model = skeleton_of(GPT)
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.wte.weight
    init.allocate(model, "cpu")
    assert not init.is_skeleton(model) and model.head.weight is model.wte.weight


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=["gpt", "llama"])
def test_every_slice_of_the_initial_values_is_a_slice_of_the_whole(
        shape: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init, "CHUNK", 100)  # many generator groups per tensor
    monkeypatch.setattr(weights, "ROWS_AT_ONCE", 50)  # and copies of a few rows
    initial = init.Initial(skeleton_of(shape), seed=3)
    for name in initial.names():
        whole = initial.tensor(name)
        assert tuple(whole.shape) == initial.shape(name)
        flat = whole.reshape(-1)
        for lo, hi in [(0, 7), (5, flat.numel()), (flat.numel() // 3, flat.numel() // 2)]:
            torch.testing.assert_close(initial.rows(name, lo, hi), flat[lo:hi], rtol=0, atol=0)
        splits = [Split(0), Split(0, chunks=2)] + ([Split(1)] if whole.dim() == 2 else [])
        for split in splits:
            for part in range(2):
                want = split.shard(whole, part, 2)
                torch.testing.assert_close(initial.block(name, split, part, 2), want,
                                           rtol=0, atol=0)
                written = torch.empty_like(want)  # a few rows at a time
                initial.copy_into(written, name, split, part, 2)
                torch.testing.assert_close(written, want, rtol=0, atol=0)


def test_initial_values_follow_the_model_and_the_seed() -> None:
    model = skeleton_of(GPT)
    first = init.Initial(model, seed=1)
    again = init.Initial(skeleton_of(GPT), seed=1)
    other = init.Initial(model, seed=2)
    fc = MODEL + "blocks.0.mlp.fc.weight"
    torch.testing.assert_close(first.tensor(fc), again.tensor(fc), rtol=0, atol=0)
    assert not torch.equal(first.tensor(fc), other.tensor(fc))
    assert abs(first.tensor(fc).std().item() - 0.02) < 0.002
    assert torch.equal(first.tensor(MODEL + "blocks.0.ln1.weight"), torch.ones(32))
    assert torch.equal(first.tensor(MODEL + "blocks.0.mlp.fc.bias"), torch.zeros(128))


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, padding_idx=0)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.gru = nn.GRUCell(8, 8)  # initialized by its own reset_parameters
        self.bare = nn.Parameter(torch.ones(3))  # nothing says how: one line


def test_a_custom_module_is_drawn_by_its_layers_rules_or_asks_for_them() -> None:
    model = init.skeleton(Custom)
    with pytest.raises(ConfigError, match="Custom.bare has no known initialization"):
        init.Initial(model, seed=0)
    model.init_rules = lambda: {"bare": init.constant(2.0)}
    initial = init.Initial(model, seed=0)
    assert torch.equal(initial.tensor(MODEL + "bare"), torch.full((3,), 2.0))
    assert torch.equal(initial.tensor(MODEL + "emb.weight")[0], torch.zeros(8))  # padding
    assert initial.tensor(MODEL + "lin.weight").abs().max() <= 8 ** -0.5
    gru = initial.tensor(MODEL + "gru.weight_ih")
    assert gru.shape == (24, 8) and torch.equal(gru, initial.tensor(MODEL + "gru.weight_ih"))


# ---------------------------------------------------------------- layouts, in ranks
CONFIG = {"model": GPT, "train": {"batch_size": 4, "seed": 5},
          "optimizer": {"name": "sgd", "momentum": 0.0}}
LAYOUTS = {"tp": {"tp": 2}, "zero3": {"zero": 3}, "pp": {"pp": 2, "microbatches": 2},
           "dp": {}}


def _held_state(layouts_to_build: dict, folder: str) -> None:
    import dtrain

    world = dtrain.world.current()
    for name, parallel in layouts_to_build.items():
        config = config_from_dict({**CONFIG, "parallel": {"nproc": world.world_size,
                                                          **parallel}})
        mesh = Mesh(dims_of(config, world.world_size))
        model = skeleton_of(GPT)
        held = layouts.build(model, mesh, config)
        pieces, extra = held.saved.state()
        universal.save(Path(folder) / name, 0, pieces, extra, {}, keep_last=1,
                       group=held.saved.checkpoint_group)


def test_every_layout_builds_the_one_process_weights_in_split_form(tmp_path: Path) -> None:
    run_ranks(_held_state, 2, LAYOUTS, str(tmp_path), timeout=120)
    whole = init.materialized(skeleton_of(GPT), init.Initial(skeleton_of(GPT), seed=5))
    want = dict(whole.named_parameters())
    for name in LAYOUTS:
        got = universal.Checkpoint(tmp_path / name).model_state()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value.detach(), rtol=0, atol=0,
                                       msg=f"{name}: {key}")


# ---------------------------------------------------------------- under a memory cap
BIG = {"arch": "gpt", "n_layer": 32, "n_head": 4, "n_embd": 256, "block_size": 16}
"""25.3M parameters: 101 MB whole in fp32, in 32 blocks of 3 MB (ZeRO-3 gathers one or two
at a time)."""


def _one_step(shape: dict, whole: bool) -> float:
    import dtrain

    world = dtrain.world.current()
    config = config_from_dict({"model": shape, "train": {"batch_size": 4},
                               "optimizer": {"name": "sgd", "momentum": 0.0},
                               "parallel": {"nproc": world.world_size, "zero": 3}})
    mesh = Mesh(dims_of(config, world.world_size))
    if whole:  # as before split-form construction: every rank builds the whole model
        model = models.build(models.resolve(config.model, 256))
    else:
        model = skeleton_of(shape)
    held = layouts.build(model, mesh, config)
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = held.forward_backward([(x, x)])
    held.step()
    return float(loss)


def _train_under_cap(cap: int, whole: bool) -> tuple[float, int]:
    _one_step(GPT, whole)  # the collectives' one-time calibration (dtrain.comm.cost) first
    with LiveBytes(limit=cap) as live:
        loss = _one_step(BIG, whole)
    return loss, live.peak


@pytest.mark.slow
def test_a_model_bigger_than_the_cap_builds_and_trains_in_split_form() -> None:
    """A cap on each rank's live tensor bytes (the CPU's max_memory_allocated) below the
    whole model's size: ZeRO-3 over 4 ranks built in split form trains; built whole, as
    every rank used to, it cannot even start."""
    cap = 90 << 20  # the model is 101 MB whole; a rank holds a quarter plus its gradients
    results = run_ranks(_train_under_cap, 4, cap, False, timeout=150)
    assert len({loss for loss, _ in results}) == 1
    assert all(peak <= cap for _, peak in results)
    with pytest.raises(AssertionError, match="over the cap of 90.0 MiB"):
        run_ranks(_train_under_cap, 4, cap, True, timeout=150)


@pytest.mark.slow
def test_the_worked_example_trains_under_a_third_of_one_process() -> None:
    """examples/bigger_than_a_rank.py (docs/memory.md's worked example), on 4 ranks."""
    result = dtrain("run", "-n", "4", "examples/bigger_than_a_rank.py", cwd=str(ROOT),
                    timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "peaked at" in line]
    assert len(lines) == 4 and all("under a cap of" in line for line in lines)


class _Blocks(nn.Module):
    """Four ZeRO-3 units of 64 x 64 + 64 elements each, and a root unit of none."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


UNIT = 4 * (64 * 64 + 64)
"""Bytes of one whole unit of `_Blocks` in fp32."""


class _Largest(TorchDispatchMode):
    """The bytes of the largest storage any operation returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _build_peaks(rank: int) -> dict:
    """What a rank allocates while ZeRO-3 builds `_Blocks` from a skeleton, and while
    DataParallel wraps it whole; then one backward through each."""
    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    live, largest = LiveBytes(), _Largest()
    with live, largest:
        zero = ZeRO(init.skeleton(_Blocks), sgd, stage=3)
    out = {"zero peak": live.peak, "zero largest": largest.largest}
    zero(torch.ones(2, 64)).sum().backward()
    out["zero shapes"] = [tuple(p.shape) for p in zero.module.parameters()]
    largest, model = _Largest(), _Blocks()
    with largest:  # (LiveBytes would count the parameters too, which the wrap broadcasts)
        dp = DataParallel(model)
    out["dp largest"] = largest.largest
    out["dp allocated"] = [b.allocated for b in dp._buckets]
    dp(torch.ones(2, 64)).sum().backward()
    out["dp allocated after"] = [b.allocated for b in dp._buckets]
    return out


def test_zero3_and_data_parallel_allocate_no_whole_unit_or_bucket_when_built() -> None:
    """ZeRO-3 over 2 ranks builds a skeleton holding only each rank's shards (no tensor of
    a whole unit, which the first gather allocates); DataParallel allocates its gradient
    buckets at the first backward, not when it wraps."""
    for r in run_threads(_build_peaks, 2):
        assert r["zero largest"] < UNIT
        assert r["zero peak"] <= 4 * UNIT // 2 + 1024  # the 4 units' shards, a little more
        assert r["zero shapes"] == [(64, 64), (64,)] * 4
        assert r["dp largest"] < UNIT and not any(r["dp allocated"])  # one bucket: 4 units
        assert r["dp allocated after"] and all(r["dp allocated after"])
