"""Local SGD and DiLoCo equal their definitions: replicas simulated by hand in one thread,
and, with H = 1, outer lr 1 and no momentum, synchronous data parallelism."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtrain import comm
from dtrain.errors import DtrainError
from dtrain.sync.diloco import DiLoCo
from dtrain.testing import run_ranks, run_threads
from tests.support.calibration import write_calibration

PER_RANK = 4


def _initial_model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


INITIAL = _initial_model()  # drawn once: threads seeding the shared generator would race


def make_model() -> nn.Module:
    return copy.deepcopy(INITIAL)


@pytest.fixture(autouse=True)
def _calibrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved cost curves, so that `auto` picks ring (else native) at once instead of
    measuring every algorithm on every new group (seconds each)."""
    monkeypatch.setenv("DTRAIN_CALIBRATION", str(tmp_path / "calibration.json"))
    write_calibration(tmp_path / "calibration.json", ("threads", "gloo"), (2, 3))


def make_replica(rank: int) -> nn.Module:
    """Rank 0's model is the reference; others start elsewhere, to be overwritten."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(PER_RANK, 6, generator=g), torch.randn(PER_RANK, 3, generator=g)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def values(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def simulate(world: int, steps: int, sync_every: int, inner: Callable, mode: str = "diloco",
             outer_lr: float = 0.7, momentum: float = 0.9, streaming: bool = False,
             flush: bool = False) -> list[list[torch.Tensor]]:
    """Each replica's parameters after `steps`, written from the definitions."""
    models = [make_model() for _ in range(world)]
    opts = [inner(m.parameters()) for m in models]
    anchor = values(models[0])
    buf = [torch.zeros_like(a) for a in anchor]

    def land(sent: list[list[torch.Tensor]]) -> None:
        mean = [torch.stack([s[k] for s in sent]).mean(0) for k in range(len(anchor))]
        if mode == "local_sgd":
            target = mean
        else:  # Nesterov SGD on the anchor with the pseudo-gradient
            for k, delta in enumerate(a - m for a, m in zip(anchor, mean, strict=True)):
                buf[k] = momentum * buf[k] + delta
                anchor[k] = anchor[k] - outer_lr * (delta + momentum * buf[k])
            target = anchor
        with torch.no_grad():  # plus the progress made since sending (streaming)
            for model, mine in zip(models, sent, strict=True):
                for p, t, s in zip(model.parameters(), target, mine, strict=True):
                    p.copy_(t + (p - s))

    pending = None
    for step in range(steps):
        for rank, (model, opt) in enumerate(zip(models, opts, strict=True)):
            inner_step(model, opt, *batch(step, rank))
        if pending is not None:
            land(pending)
            pending = None
        if (step + 1) % sync_every == 0:
            pending = [values(m) for m in models]
            if not streaming:
                land(pending)
                pending = None
    if flush and pending is not None:
        land(pending)
    return [values(m) for m in models]


def train(rank: int, steps: int, sync_every: int, inner: Callable, flush: bool = False,
          **options) -> tuple[list[torch.Tensor], list[bool]]:
    """One replica under DiLoCo: its parameters after `steps`, and which steps synced."""
    model = make_replica(rank)
    opt = inner(model.parameters())
    diloco = DiLoCo(model, sync_every=sync_every, **options)
    synced = []
    for step in range(steps):
        inner_step(model, opt, *batch(step, rank))
        synced.append(diloco.step())
    if flush:
        diloco.flush()
    return values(model), synced


def assert_replicas(got: list, expected: list[list[torch.Tensor]]) -> None:
    for (params, _), want in zip(got, expected, strict=True):
        torch.testing.assert_close(params, want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_one_step_rounds_equal_synchronous_data_parallel(world: int) -> None:
    steps = 5
    reference = make_model()
    opt = sgd(reference.parameters())
    for step in range(steps):
        xs, ys = zip(*(batch(step, r) for r in range(world)), strict=True)
        inner_step(reference, opt, torch.cat(xs), torch.cat(ys))
    got = run_threads(lambda rank: train(rank, steps, 1, sgd, outer_lr=1.0,
                                         outer_momentum=0.0), world)
    for params, synced in got:
        torch.testing.assert_close(params, values(reference))
        assert synced == [True] * steps


@pytest.mark.timeout(60)
def test_local_sgd_equals_its_simulation() -> None:
    got = run_threads(lambda rank: train(rank, 7, 3, adamw, mode="local_sgd"), 2)
    assert_replicas(got, simulate(2, 7, 3, adamw, mode="local_sgd"))
    assert got[0][1] == [False, False, True] * 2 + [False]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_diloco_equals_its_simulation(world: int) -> None:
    got = run_threads(lambda rank: train(rank, 7, 2, adamw, outer_lr=0.7,
                                         outer_momentum=0.9), world)
    assert_replicas(got, simulate(world, 7, 2, adamw, outer_lr=0.7, momentum=0.9))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, sync_every, streaming", [
    ("diloco", 2, True), ("diloco", 1, True), ("local_sgd", 3, True)])
def test_streaming_equals_its_simulation(mode: str, sync_every: int, streaming: bool) -> None:
    got = run_threads(lambda rank: train(rank, 7, sync_every, adamw, mode=mode,
                                         streaming=streaming), 2)
    assert_replicas(got, simulate(2, 7, sync_every, adamw, mode=mode, streaming=streaming))
    flushed = run_threads(lambda rank: train(rank, 6, sync_every, adamw, flush=True,
                                             mode=mode, streaming=streaming), 2)
    expected = simulate(2, 6, sync_every, adamw, mode=mode, streaming=streaming, flush=True)
    assert_replicas(flushed, expected)
    torch.testing.assert_close(flushed[0][0], flushed[1][0])  # a round ended: identical


def _resume(rank: int, steps: int, stop: int, **options) -> list[torch.Tensor]:
    """Train `stop` steps, checkpoint, continue in fresh objects up to `steps`."""
    model = make_replica(rank)
    opt = adamw(model.parameters())
    diloco = DiLoCo(model, sync_every=3, **options)
    for step in range(stop):
        inner_step(model, opt, *batch(step, rank))
        diloco.step()
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "diloco": diloco.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved)
    model = make_replica(rank + 5)
    opt = adamw(model.parameters())
    diloco = DiLoCo(model, sync_every=3, **options)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    diloco.load_state_dict(state["diloco"])
    assert (diloco.inner_step, diloco.round_step) == (stop, stop % 3)
    for step in range(stop, steps):
        inner_step(model, opt, *batch(step, rank))
        diloco.step()
    return values(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop, options", [
    (4, {}), (5, {"mode": "local_sgd"}), (3, {"streaming": True}),
    (3, {"streaming": True, "mode": "local_sgd"}), (4, {"streaming": True})])
def test_resume_mid_round_equals_an_uninterrupted_run(stop: int, options: dict) -> None:
    whole = run_threads(lambda rank: train(rank, 8, 3, adamw, **options)[0], 2)
    resumed = run_threads(lambda rank: _resume(rank, 8, stop, **options), 2)
    for got, want in zip(resumed, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _bytes(rank: int, sync_every: int, bucket_mb: float) -> tuple[int, float, int, int]:
    """(DiLoCo's all-reduce bytes over one round, bytes_per_sync, per-step gradient
    all-reduce bytes over as many steps, buckets)."""
    model = make_replica(rank)
    opt = sgd(model.parameters())
    diloco = DiLoCo(model, sync_every=sync_every, bucket_mb=bucket_mb)
    comm.traffic(reset=True)
    for step in range(sync_every):
        inner_step(model, opt, *batch(step, rank))
        diloco.step()
    sent = comm.traffic(reset=True)["all_reduce"]
    for step in range(sync_every):
        inner_step(model, opt, *batch(step, rank))
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        comm.all_reduce(grads, op="avg")
    per_step = comm.traffic(reset=True)["all_reduce"]
    return sent, diloco.bytes_per_sync(comm.resolve(None).size), per_step, len(
        diloco.state_dict()["anchor"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bucket_mb, buckets", [(25.0, 1), (0.0002, 2)])
def test_bytes_per_sync_is_what_traffic_counts(bucket_mb: float, buckets: int) -> None:
    sync_every = 4
    for sent, predicted, per_step, made in run_threads(
            lambda rank: _bytes(rank, sync_every, bucket_mb), 3):
        assert (sent, made) == (predicted, buckets)
        if buckets == 1:  # the same buffer, sent once per round instead of every step
            assert per_step == sync_every * sent


@pytest.mark.timeout(30)
@pytest.mark.parametrize("options, name", [
    ({"sync_every": 0}, "sync_every"), ({"sync_every": 1.5}, "sync_every"),
    ({"mode": "adam"}, "mode"), ({"outer_lr": 0.0}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"), ({"outer_momentum": -0.1}, "outer_momentum"),
    ({"bucket_mb": 0}, "bucket_mb")])
def test_bad_input_is_one_clear_line(options: dict, name: str) -> None:
    with pytest.raises(DtrainError) as caught:
        DiLoCo(make_model(), **{"sync_every": 2, **options})
    message = str(caught.value)
    assert "\n" not in message and name in message


@pytest.mark.timeout(30)
def test_a_checkpoint_of_another_round_length_is_refused() -> None:
    def load(rank: int) -> None:
        saved = DiLoCo(make_model(), sync_every=2).state_dict()
        with pytest.raises(DtrainError, match="sync_every=2"):
            DiLoCo(make_model(), sync_every=3).load_state_dict(saved)

    run_threads(load, 2)


def train_on_gloo(steps: int, sync_every: int) -> list[torch.Tensor]:
    return train(dist.get_rank(), steps, sync_every, adamw, streaming=True, flush=True)[0]


@pytest.mark.timeout(120)
def test_diloco_on_gloo_processes() -> None:
    got = run_ranks(train_on_gloo, 2, 5, 2)
    want = simulate(2, 5, 2, adamw, streaming=True, flush=True)
    for params, expected in zip(got, want, strict=True):
        torch.testing.assert_close(params, expected)
