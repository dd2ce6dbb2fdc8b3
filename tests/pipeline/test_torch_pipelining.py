"""dtrain's V-shaped zero-bubble schedules side by side with torch.distributed.pipelining's
own, ScheduleZBVZeroBubble and ScheduleDualPipeV: the same four pieces of one Llama,
placed in the same V on pp = 2 ranks, 4 micro-batches, plain SGD; every step's loss and
every final weight equal.

The Llama's head is not tied to its embedding: torch's schedules have no way to sum the
gradient of a weight two stages hold. Both sides average over micro-batches alike: dtrain
backpropagates each micro-batch's mean loss divided by their number, torch backpropagates
the mean loss itself and divides the accumulated gradients by their number after the last
backward (`scale_grads=True`, its default).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV, ScheduleZBVZeroBubble

from dtrain import pipeline
from dtrain.models import ModelConfig, build, resolve
from dtrain.testing import run_ranks
from tests.pipeline.test_pipeline import float32

PP, MICROBATCHES, STEPS, BATCH = 2, 4, 3, 8
CFG = resolve(ModelConfig(arch="llama", block_size=16, n_layer=4, n_embd=32, n_head=4,
                          n_kv_head=2, ffn_hidden=64, tie_embeddings=False), 256)
TORCH = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}


def llama() -> nn.Module:
    torch.manual_seed(0)
    return build(CFG)


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(400 + step)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def train_dtrain(schedule: str) -> dict:
    """Losses per step and this rank's final weights under dtrain's `schedule`."""
    mine = pipeline.pieces_for(pipeline.cut(llama(), 2 * PP), schedule=schedule)
    pipe = pipeline.Pipeline(mine, microbatches=MICROBATCHES, schedule=schedule,
                             loss_fn=pipeline.lm_loss)
    opt = sgd(nn.ModuleList(mine).parameters())
    losses = []
    for step in range(STEPS):
        losses.append(pipe.step(*tokens(step)).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses,
            "state": {k: v for piece in mine for k, v in piece.state_dict().items()}}


def train_torch(schedule: str) -> dict:
    """The same under torch's schedule, each dtrain piece a PipelineStage at its stage of
    the V (rank r: r and 2pp-1-r); the losses on the rank of the last stage, rank 0."""
    rank = dist.get_rank()
    held = (rank, 2 * PP - 1 - rank)
    pieces = pipeline.cut(llama(), 2 * PP)
    mine = [pieces[s] for s in held]
    stages = [PipelineStage(pieces[s], s, 2 * PP, torch.device("cpu")) for s in held]
    sched = TORCH[schedule](stages, n_microbatches=MICROBATCHES, loss_fn=pipeline.lm_loss)
    opt = sgd(nn.ModuleList(mine).parameters())
    losses = []
    for step in range(STEPS):
        x, y = tokens(step)
        if rank == 0:  # the first stage and the last
            micro: list[torch.Tensor] = []
            sched.step(x, target=y, losses=micro)
            losses.append(torch.stack(micro).mean().item())
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
    return {"losses": losses,
            "state": {k: v for piece in mine for k, v in piece.state_dict().items()}}


def side_by_side(schedule: str) -> dict:
    """This rank's run under dtrain's `schedule`, then under torch's, on one process group."""
    return {"dtrain": train_dtrain(schedule), "torch": train_torch(schedule)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_shaped_schedules_equal_torch_pipelinings(schedule: str) -> None:
    """Both ranks' final weights, and the losses where torch has them (rank 0)."""
    results = run_ranks(side_by_side, PP, schedule, timeout=80)
    torch.testing.assert_close(float32(results[0]["dtrain"]["losses"]),
                               float32(results[0]["torch"]["losses"]))
    for r in results:
        ours, theirs = r["dtrain"]["state"], r["torch"]["state"]
        assert ours.keys() == theirs.keys()
        for name, value in ours.items():
            torch.testing.assert_close(value, theirs[name], msg=name)
    names = set().union(*(r["dtrain"]["state"] for r in results))
    assert names == set(llama().state_dict())
