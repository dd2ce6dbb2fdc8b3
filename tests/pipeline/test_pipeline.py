"""Pipeline parallelism equals one process, for every schedule; its memory bound holds."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import dtrain
from dtrain import pipeline
from dtrain.checkpoint import universal
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.pipeline import Action
from dtrain.testing import run_ranks, run_threads
from tests.models.test_models_train import assert_same_run, run
from tests.support.cli import TINY_MODEL

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=8, n_head=4, n_embd=32)
STEPS, BATCH = 3, 8


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def tokens(step: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randint(0, CFG.vocab_size, (n, CFG.block_size), generator=g),
            torch.randint(0, CFG.vocab_size, (n, CFG.block_size), generator=g))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)


def float32(losses: list[float]) -> torch.Tensor:
    """float32 losses kept as Python floats, as float32 again: assert_close then allows
    float32's rounding, where on Python floats it would allow float64's."""
    return torch.tensor(losses, dtype=torch.float32)


def serial(optimizer=adamw) -> tuple[list[float], dict]:
    model = gpt()
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = model(*tokens(step))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_pipeline(base: GPT, pp: int, schedule: str, chunks: int, microbatches: int,
                   wrap=None, group=None, batch: slice = slice(None), optimizer=adamw) -> dict:
    model = copy.deepcopy(base)
    mine = pipeline.pieces_for(pipeline.cut(model, pp * chunks), group, schedule)
    modules = [wrap(piece) for piece in mine] if wrap else mine
    pipe = pipeline.Pipeline(modules, group, microbatches=microbatches, schedule=schedule,
                             loss_fn=pipeline.lm_loss,
                             tied=pipeline.tied_weights(model, mine, group))
    opt = optimizer(nn.ModuleList(mine).parameters())
    losses = []
    for step in range(STEPS):
        x, y = tokens(step)
        losses.append(pipe.step(x[batch], y[batch]).item())
        opt.step()
        opt.zero_grad()
    state = {k: v for piece in mine for k, v in piece.state_dict().items()}
    return {"losses": losses, "state": state, "peak": pipe.peak_live}


def threads_equal_serial(pp: int, schedule: str, chunks: int, microbatches: int,
                        optimizer=adamw) -> list[dict]:
    """`train_pipeline` in pp threads: every loss and every final weight equal one
    process's (asserted); each rank's results."""
    losses, state = serial(optimizer)
    base = gpt()  # built once: the threads share torch's generator
    results = run_threads(lambda rank: train_pipeline(base, pp, schedule, chunks, microbatches,
                                                      optimizer=optimizer), pp, timeout=100)
    for r in results:
        torch.testing.assert_close(float32(r["losses"]), float32(losses))
        for name, value in r["state"].items():
            torch.testing.assert_close(value, state[name], msg=name)
    assert set().union(*(r["state"] for r in results)) == set(state)
    return results


@pytest.mark.timeout(60)
def test_balanced_sizes_minimize_the_costliest_stage() -> None:
    assert pipeline.balanced_sizes([1, 1, 1, 1], 2) == [2, 2]
    assert pipeline.balanced_sizes([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert pipeline.balanced_sizes([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 17 13
    seq = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 64), nn.Linear(64, 4), nn.Linear(4, 4))
    pieces = pipeline.split(seq, 2)  # by parameters: 320 | 4160 + 260 + 20
    assert [list(p.state_dict()) for p in pieces] == [
        ["0.weight", "0.bias"], ["1.weight", "1.bias", "2.weight", "2.bias", "3.weight",
                                 "3.bias"]]
    timed = pipeline.stage_sizes(list(seq), 2, "time", sample=torch.randn(2, 4))
    assert sum(timed) == 4 and min(timed) >= 1


@pytest.mark.timeout(60)
def test_schedules_run_each_micro_batch_once_in_their_order() -> None:
    assert pipeline.build("1f1b", 4, 0, 6)[:6] == [Action("F", 0), Action("F", 1),
                                                   Action("F", 2), Action("F", 3),
                                                   Action("B", 0), Action("F", 4)]
    assert pipeline.build("1f1b", 4, 3, 6)[:3] == [Action("F", 0), Action("B", 0),
                                                   Action("F", 1)]
    assert pipeline.build("gpipe", 2, 1, 3) == [Action("F", i) for i in range(3)] + [
        Action("B", i) for i in range(3)]
    for name, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 3)):
        for rank in range(4):
            actions = pipeline.build(name, 4, rank, 8, chunks)
            for kind in "FB":
                done = sorted((a.micro, a.chunk) for a in actions if a.kind == kind)
                assert done == [(m, c) for m in range(8) for c in range(chunks)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp, schedule, chunks", [
    (2, "gpipe", 1), (2, "1f1b", 1), (4, "gpipe", 1), (4, "1f1b", 1),
    (2, "interleaved", 2), (4, "interleaved", 2),
])
def test_equals_one_process(pp: int, schedule: str, chunks: int) -> None:
    """Loss and every parameter after several steps, with the tied embedding and head on
    the first and last ranks."""
    threads_equal_serial(pp, schedule, chunks, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp", [2, 4])
def test_live_micro_batches_at_most_pp_for_1f1b_and_m_for_gpipe(pp: int) -> None:
    base, m = gpt(), 8
    for schedule, bound in (("1f1b", pp), ("gpipe", m)):
        peaks = [r["peak"] for r in run_threads(
            lambda rank, s=schedule: train_pipeline(base, pp, s, 1, m), pp)]
        assert max(peaks) == bound and all(p <= bound for p in peaks)
        if schedule == "1f1b":
            assert peaks == [pp - r for r in range(pp)]  # the warm-up shrinks down the pipe


@pytest.mark.timeout(60)
def test_timeline_records_every_action_in_schedule_order() -> None:
    base = gpt()

    def body(rank: int) -> tuple[list, list]:
        model = copy.deepcopy(base)
        mine = pipeline.pieces_for(pipeline.cut(model, 2))
        pipe = pipeline.Pipeline(mine, microbatches=4, schedule="1f1b",
                                 loss_fn=pipeline.lm_loss, timeline=True)
        pipe.step(*tokens(0))
        return pipe.events, pipe.actions

    for events, actions in run_threads(body, 2):
        assert [Action(kind, micro, chunk) for kind, micro, chunk, _, _ in events] == actions
        assert all(0 <= start <= end for *_, start, end in events)
        assert all(a[4] <= b[3] for a, b in zip(events, events[1:], strict=False))  # one at a time


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pp, schedule, chunks, microbatches, message", [
    (4, "1f1b", 3, 4, "cannot cut 8 layers into 12 pipeline stages"),
    (2, "interleaved", 2, 3, "make microbatches (3) a multiple of 2"),
    (2, "1f1b", 1, 3, "a batch of 8 does not split into 3 micro-batches"),
    (2, "zigzag", 1, 4, "schedule='zigzag': use one of gpipe, 1f1b, interleaved"),
    (2, "1f1b", 2, 4, "use 'interleaved' for virtual stages"),
])
def test_bad_input_is_one_clear_error(pp: int, schedule: str, chunks: int,
                                      microbatches: int, message: str) -> None:
    base = gpt()
    with pytest.raises(RuntimeError) as info:
        run_threads(lambda rank: train_pipeline(base, pp, schedule, chunks, microbatches), pp,
                    timeout=20)
    assert isinstance(info.value.__cause__, ConfigError)
    assert message in str(info.value.__cause__)


def dp_pp_rank(base: GPT, schedule: str = "1f1b", microbatches: int = 2,
               optimizer=adamw) -> dict:
    """dp=2 x pp=2: each stage's piece in DataParallel over dp, each dp rank on its half of
    the batch."""
    mesh = dtrain.Mesh(dp=2, pp=2)
    half = BATCH // 2
    batch = slice(mesh.coords["dp"] * half, (mesh.coords["dp"] + 1) * half)
    result = train_pipeline(
        base, 2, schedule, 1, microbatches, group=mesh.group("pp"), batch=batch,
        wrap=lambda piece: dtrain.DataParallel(piece, group=mesh.group("dp"),
                                               algorithm="native"), optimizer=optimizer)
    return {**result, "coords": mesh.coords}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_dp2_pp2_on_four_processes_equals_one_process() -> None:
    losses, state = serial()
    results = run_ranks(dp_pp_rank, 4, gpt(), timeout=120)
    assert [r["coords"]["pp"] for r in results] == [0, 0, 1, 1]
    for first, second in ((results[0], results[1]), (results[2], results[3])):
        halves = [(a + b) / 2 for a, b in zip(first["losses"], second["losses"], strict=True)]
        torch.testing.assert_close(float32(halves), float32(losses))  # each replica's half's
    for r in results:
        for name, value in r["state"].items():
            torch.testing.assert_close(value, state[name], msg=name)
    assert set().union(*(r["state"] for r in results)) == set(state)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def zero_pp_rank(stage: int, schedule: str) -> dict:
    """dp=2 x pp=2 with each stage's piece sharded by ZeRO over the dp axis."""
    mesh = dtrain.Mesh(dp=2, pp=2)
    piece = pipeline.pieces_for(pipeline.split(mlp(), 2, balance=[4, 3]), mesh.group("pp"))[0]
    z = dtrain.ZeRO(piece, adamw, stage=stage, group=mesh.group("dp"), algorithm="native")
    pipe = pipeline.Pipeline([z], mesh.group("pp"), microbatches=2, schedule=schedule,
                             loss_fn=nn.functional.cross_entropy)
    half = slice(mesh.coords["dp"] * 4, mesh.coords["dp"] * 4 + 4)
    for step in range(STEPS):
        x, y = mlp_batch(step)
        pipe.step(x[half], y[half])
        z.step()
        z.zero_grad()
    return z.state_dict()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage, schedule", [
    pytest.param(1, "gpipe", marks=pytest.mark.slow), (3, "1f1b")])
def test_zero_pieces_over_dp_equal_one_process(stage: int, schedule: str) -> None:
    """Stage 3 gathers a piece again for each micro-batch's backward, whatever ran since."""
    model = mlp()
    opt = adamw(model.parameters())
    for step in range(STEPS):
        nn.functional.cross_entropy(model(mlp_batch(step)[0]), mlp_batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    states = run_ranks(zero_pp_rank, 4, stage, schedule, timeout=120)
    for state in states:
        for name, value in state.items():
            torch.testing.assert_close(value, model.state_dict()[name], msg=name)
    assert set().union(*states) == set(model.state_dict())


INTERLEAVED = ["--set", "parallel.pp=2", "--set", "parallel.schedule='interleaved'",
               "--set", "parallel.virtual_stages=2", "--set", "parallel.microbatches=4"]
FOUR_BLOCKS_SGD = ["--set", "model.n_layer=4", "--set", "optimizer.name='sgd'"]
"""SGD with momentum and clipping. AdamW's eps of 1e-8 would turn the rounding noise of an
almost-zero gradient into a step: 7e-5 on one weight of 4096 after 4 steps, 1f1b alike."""


@pytest.mark.slow  # two `dtrain train` runs: 30-50 s on 2 cores
@pytest.mark.timeout(300)
def test_interleaved_train_run_equals_one_process(tmp_path: Path) -> None:
    """`dtrain train` with pp = 2 and 2 virtual stages a rank (4 blocks in 4 chunks: rank 0
    holds blocks 0 and 2 with the embedding, rank 1 blocks 1 and 3 with the tied head):
    losses per step and final weights equal one process's."""
    one = run(tmp_path, "one", TINY_MODEL, ["-n", "1", *FOUR_BLOCKS_SGD])
    got = run(tmp_path, "interleaved", TINY_MODEL, ["-n", "2", *INTERLEAVED, *FOUR_BLOCKS_SGD])
    assert "pipeline of 2 stages (interleaved, 4 micro-batches) x data parallel over 1" \
        in got[3]
    assert universal.Checkpoint(got[2]).meta["layout"]["virtual_stages"] == 2
    assert_same_run(got, one)
