"""ZeRO-3 of a LoRA model shards its frozen base too: each rank keeps 1/N of the base
(gathered per block for forward and backward, freed after, no gradient buffer, no
optimizer state), and training equals one process: the same losses, the same adapters,
the base unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

import dtrain
from dtrain.adapters import AdapterConfig, apply
from dtrain.models import ModelConfig, build, resolve
from dtrain.testing import run_ranks

CFG = ModelConfig(arch="llama", block_size=16, n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                  ffn_hidden=64)
STEPS = 3


def _adapted() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build(resolve(CFG, 256))
    apply(model, AdapterConfig(kind="lora", rank=4, alpha=8), "llama")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(0, 0.1)
    return model


def _batch(step: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = (torch.randint(0, 256, (4, 16), generator=g) for _ in range(2))
    return x[rows], y[rows]


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _sharded(model: torch.nn.Module) -> tuple[list[float], dict, dict[str, int], int]:
    """ZeRO-3 over the world, the frozen base sharded: losses, the whole state after the
    steps, this rank's bytes, and how many parameters the optimizer steps."""
    world = dtrain.world.current()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    zero = dtrain.ZeRO(model, _sgd, stage=3, frozen=frozen)
    losses = []
    rows = slice(world.rank * 2, world.rank * 2 + 2)
    for step in range(STEPS):
        _, loss = zero(*_batch(step, rows))
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        losses.append(float(dtrain.comm.all_reduce(loss.detach(), op="avg")))
    stepped = sum(p.numel() for g in zero.optimizer.param_groups for p in g["params"])
    return losses, zero.state_dict(), zero.state_bytes(), stepped


@pytest.mark.timeout(120)
def test_zero3_shards_the_frozen_base_and_equals_one_process() -> None:
    model = _adapted()
    start = copy.deepcopy(model.state_dict())
    frozen_bytes = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    adapter_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    alone = copy.deepcopy(model)
    optimizer = _sgd([p for p in alone.parameters() if p.requires_grad])
    want = []
    for step in range(STEPS):
        _, loss = alone(*_batch(step, slice(None)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    for losses, state, held, stepped in run_ranks(_sharded, 2, model, timeout=100):
        torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
        for key, value in alone.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
            if ".lora_" not in key:
                assert torch.equal(state[key], start[key]), key
        # half the base (plus padding) on each of 2 ranks, nothing gathered between steps;
        # no gradient kept for it, and the optimizer steps the adapters alone
        assert frozen_bytes // 2 <= held["frozen"] <= frozen_bytes // 2 + 64, (held, frozen_bytes)
        assert stepped <= adapter_numel // 2 + 2
