"""ZeRO stages 1-3 equal one process (and DataParallel) on the same global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dtrain
from dtrain.errors import DtrainError
from dtrain.testing import run_threads
from tests.distributed import run_ranks

STEPS, PER_RANK, CLIP = 4, 4, 0.5
ALGORITHM = "native"  # "auto" would first calibrate itself on each group


class Net(nn.Module):
    """Blocks in a ModuleList (stage 3's default units) around a root with its own
    parameters; 234 elements, which no world size here divides."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(7, 7), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def base_model() -> Net:
    torch.manual_seed(0)
    return Net()


def adamw(params) -> torch.optim.Optimizer:
    """Two parameter groups with different lr and weight decay."""
    params = list(params)
    return torch.optim.AdamW([{"params": params[:3], "weight_decay": 0.1},
                              {"params": params[3:], "lr": 0.02, "weight_decay": 0.0}], lr=0.01)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def serial(world: int, accum: int, factory) -> tuple[list[float], dict, dict]:
    model = base_model()
    opt = factory(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step, world * PER_RANK * accum)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), opt.state_dict()


def train(rank: int, world: int, model: nn.Module, stage: int, accum: int, factory,
          mixed: str | None = None) -> dict:
    z = dtrain.ZeRO(model, factory, stage=stage, mixed_precision=mixed, bucket_mb=0.0005,
                    algorithm=ALGORITHM)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, world * PER_RANK * accum)
        mine = slice(rank * PER_RANK * accum, (rank + 1) * PER_RANK * accum)
        total = 0.0
        for micro, (xm, ym) in enumerate(zip(x[mine].chunk(accum), y[mine].chunk(accum),
                                             strict=True)):
            loss = nn.functional.cross_entropy(z(xm).float(), ym) / accum
            if micro < accum - 1:
                with z.no_sync():
                    z.backward(loss)
            else:
                z.backward(loss)
            total += loss.item()
        z.clip_grad_norm_(CLIP)
        z.step()
        z.zero_grad()
        losses.append(total)
    return {"losses": losses, "model": z.state_dict(), "optimizer": z.optimizer_state_dict(),
            "shards": z.sharded_state_dict(), "bytes": z.state_bytes(),
            "units": [(u.flat.numel, u.flat.padded, u.flat.shard_size) for u in z.units],
            "owned": sum(hi - lo for u in z.units for _, lo, hi in u.flat.pieces(rank))}


def run(world: int, stage: int, accum: int = 1, factory=adamw, mixed: str | None = None):
    base = base_model()
    return run_threads(lambda rank: train(rank, world, copy.deepcopy(base), stage, accum,
                                          factory, mixed), world, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_equal_one_process(stage: int, world: int) -> None:
    losses, model, optim = serial(world, 1, adamw)
    results = run(world, stage)
    mean = [sum(r["losses"][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(mean, losses)
    for r in results:
        torch.testing.assert_close(r["model"], model)
        torch.testing.assert_close(r["optimizer"]["state"], optim["state"])
        assert [g["lr"] for g in r["optimizer"]["param_groups"]] == [0.01, 0.02]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_and_sgd_momentum(stage: int) -> None:
    """Two micro-batches under no_sync equal one batch twice as large."""
    _, model, _ = serial(2, 2, sgd)
    for r in run(2, stage, accum=2, factory=sgd):
        torch.testing.assert_close(r["model"], model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_is_one_nth(stage: int) -> None:
    """Optimizer state is 1/N of the unsharded optimizer's, counted from tensor sizes; in
    stage 3 the parameters resident between steps are 1/N; stages 2-3 keep no full gradient."""
    world = 4
    results = run(world, stage)
    model = base_model()
    unsharded = adamw(model.parameters())
    nn.functional.cross_entropy(model(batch(0, 4)[0]), batch(0, 4)[1]).backward()
    unsharded.step()
    full_bytes = sum(t.numel() * t.element_size() for s in unsharded.state.values()
                     for t in s.values() if t.dim() > 0)
    assert sum(r["bytes"]["optimizer"] for r in results) == full_bytes
    for r in results:
        assert r["bytes"]["optimizer"] == full_bytes * r["owned"] // sum(u[0] for u in r["units"])
        assert r["owned"] <= sum(shard for _, _, shard in r["units"])  # 1/N, up to padding
        shard_bytes = 4 * sum(shard for _, _, shard in r["units"])
        full = 4 * sum(padded for _, padded, _ in r["units"])
        if stage == 3:
            assert r["bytes"]["params"] == 0 and r["bytes"]["master"] == shard_bytes
        else:
            assert r["bytes"]["params"] == full
        # zero_grad released the gradient shards; stage 1 keeps its full gradient buffer
        assert r["bytes"]["grads"] == (full if stage == 1 else 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 3])
def test_sharded_state_loads_on_another_world_size(stage: int) -> None:
    saved = run(4, stage)
    shards = [r["shards"] for r in saved]
    base = base_model()

    def load(rank: int) -> tuple[dict, dict]:
        z = dtrain.ZeRO(copy.deepcopy(base), adamw, stage=stage, algorithm=ALGORITHM)
        z.load_sharded_state_dict(shards)
        return z.state_dict(), z.optimizer_state_dict()

    for world in (1, 2, 3):
        for model, optim in run_threads(load, world, timeout=60):
            torch.testing.assert_close(model, saved[0]["model"])
            torch.testing.assert_close(optim["state"], saved[0]["optimizer"]["state"])


@pytest.mark.timeout(120)
def test_full_state_loads_back_on_another_world_size() -> None:
    saved = run(2, 2)[0]
    base = base_model()

    def load(rank: int) -> tuple[dict, dict]:
        z = dtrain.ZeRO(copy.deepcopy(base), adamw, stage=3, algorithm=ALGORITHM)
        z.load_state_dict(saved["model"])
        z.load_optimizer_state_dict(saved["optimizer"])
        return z.state_dict(), z.optimizer_state_dict()

    for model, optim in run_threads(load, 3, timeout=60):
        torch.testing.assert_close(model, saved["model"])
        torch.testing.assert_close(optim["state"], saved["optimizer"]["state"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mixed", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 3])
def test_mixed_precision_keeps_fp32_masters(stage: int, mixed: str) -> None:
    losses, model, _ = serial(2, 1, adamw)
    for r in run(2, stage, mixed=mixed):
        assert all(v.dtype == torch.float32 for v in r["model"].values())
        torch.testing.assert_close(r["model"], model, atol=0.02, rtol=0.05)
        torch.testing.assert_close(r["losses"], losses, atol=0.02, rtol=0.02)


def test_fp16_overflow_skips_the_step_and_halves_the_scale() -> None:
    def body(rank: int) -> tuple[bool, float, bool]:
        z = dtrain.ZeRO(base_model(), adamw, stage=2, mixed_precision="fp16",
                        algorithm=ALGORITHM)
        before = z.state_dict()
        scale = z.loss_scale
        loss = z(torch.randn(4, 5)).float().sum() * (1e6 if rank == 1 else 1.0)
        z.backward(loss)
        took = z.step()
        after = z.state_dict()
        same = all(torch.equal(before[k], after[k]) for k in before)
        return took, z.loss_scale / scale, same

    for took, ratio, same in run_threads(body, 2, timeout=60):
        assert (took, ratio, same) == (False, 0.5, True)


def test_bad_options_are_one_line_errors() -> None:
    with pytest.raises(DtrainError, match="stage=4"):
        dtrain.ZeRO(base_model(), adamw, stage=4)
    model = base_model()
    with pytest.raises(DtrainError, match="left out trainable parameters"):
        dtrain.ZeRO(model, lambda params: torch.optim.SGD(model.out.parameters(), lr=0.1))


def _processes(stages: list[int]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, model, _ = serial(world, 1, adamw)
    data_parallel = dtrain.DataParallel(base_model())
    opt = adamw(data_parallel.parameters())
    for step in range(STEPS):
        x, y = batch(step, world * PER_RANK)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad()
        nn.functional.cross_entropy(data_parallel(x[mine]), y[mine]).backward()
        torch.nn.utils.clip_grad_norm_(data_parallel.parameters(), CLIP)
        opt.step()
    out = {"serial": model, "dp": data_parallel.state_dict()}
    for stage in stages:
        out[stage] = train(rank, world, base_model(), stage, 1, adamw)["model"]
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: threads
def test_processes_on_gloo_equal_data_parallel_and_one_process(world: int) -> None:
    for result in run_ranks(_processes, world, [1, 2, 3], timeout=150):
        torch.testing.assert_close(result["dp"], result["serial"])
        for stage in (1, 2, 3):
            torch.testing.assert_close(result[stage], result["serial"])
