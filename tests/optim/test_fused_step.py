"""The optimizer step runs over all parameters at once in every layout: torch's multi-tensor
kernels (`foreach=True`) on a CPU, its fused ones (`fused=True`) on CUDA, for AdamW, Adam,
SGD, Muon's AdamW half and ZeRO's shard optimizers (offloaded ones included); on a CPU in
fp32 the multi-tensor step equals the per-parameter one bit for bit, and on CUDA the
fused one equals it within float32 rounding."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import dtrain
from dtrain.optim import Muon, OptimizerConfig, build_optimizer
from dtrain.optim.build import device_of, step_kernel, with_step_kernel
from dtrain.testing import run_threads

CONFIGS = {"adamw": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
           "adam": {"name": "adam", "lr": 1e-2, "weight_decay": 0.1},
           "sgd": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.1},
           "muon": {"name": "muon", "lr": 1e-2, "weight_decay": 0.1,
                    "muon_ns_dtype": "float32"}}
STEPS = 5


class Net(nn.Module):
    """Matrices in repeated blocks (Muon's), an embedding and a head, biases and a norm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 12)
        self.blocks = nn.ModuleList([nn.Linear(12, 12) for _ in range(2)])
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(self.norm(h))


def batch(step: int, rows: slice = slice(None)) -> torch.Tensor:
    return torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))[rows]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())


def kernels(optimizer: torch.optim.Optimizer) -> set[tuple[object, object]]:
    return {(g.get("foreach"), g.get("fused")) for g in optimizer.param_groups}


def per_parameter(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` turned to torch's loop over parameters, one at a time."""
    for group in optimizer.param_groups:
        group.update(foreach=False, fused=None)
    return optimizer


def unchosen(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` as built over a module not yet allocated (split form, on the meta
    device): no kernel chosen, torch's default."""
    for options in [optimizer.defaults, *optimizer.param_groups]:
        options.update(foreach=None, fused=None)
    return optimizer


def trained(optimizer_of: Any, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = Net()
    optimizer = optimizer_of(model)
    for step in range(steps):
        loss_of(model, batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_optimizer_steps_all_at_once_on_a_cpu(name: str) -> None:
    optimizer = build_optimizer(Net(), OptimizerConfig(**CONFIGS[name]))
    assert kernels(optimizer) == {(True, None)}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_multi_tensor_step_is_the_per_parameter_step_bit_for_bit(name: str) -> None:
    config = OptimizerConfig(**CONFIGS[name])
    fast = trained(lambda m: build_optimizer(m, config))
    slow = trained(lambda m: per_parameter(build_optimizer(m, config)))
    for key, value in fast.items():
        assert torch.equal(value, slow[key]), key


def test_the_kernel_follows_the_device_and_keeps_a_callers_choice() -> None:
    cuda, cpu, meta = (torch.device(d) for d in ("cuda", "cpu", "meta"))
    assert step_kernel(cuda) == {"fused": True} and step_kernel(cpu) == {"foreach": True}
    assert device_of([torch.empty(1, device=meta)]) is None and step_kernel(None) == {}
    # a template built for CUDA, its pieces offloaded to the host
    on_host = with_step_kernel({"lr": 1.0, "foreach": None, "fused": True},
                               torch.optim.AdamW, cpu)
    assert on_host == {"lr": 1.0, "foreach": True, "fused": None}
    assert with_step_kernel({"foreach": False, "fused": None}, torch.optim.AdamW, cuda) == \
        {"foreach": False, "fused": None}
    assert with_step_kernel({"foreach": None}, Muon, cuda) == {"foreach": None, "fused": True}


def _zero_ranks(rank: int, base: Net, stage: int, name: str, offload: bool
                ) -> dict[str, Any]:
    """ZeRO over 2 thread ranks, each a half of every batch; the shard optimizer's kernels
    and the whole model's weights after STEPS steps. (The model is built before the
    threads start: they would draw its initial values from one generator at once.)"""
    model = copy.deepcopy(base)
    config = OptimizerConfig(**CONFIGS[name])
    zero = dtrain.ZeRO(model, lambda _: unchosen(build_optimizer(model, config)), stage=stage,
                       algorithm="native", bucket_mb=0.001,
                       offload_device="cpu" if offload else None)
    for step in range(STEPS):
        loss_of(zero, batch(step, slice(2 * rank, 2 * rank + 2))).backward()
        zero.step()
        zero.zero_grad()
    return {"kernels": kernels(zero.optimizer), "state": zero.state_dict()}


def test_a_resume_keeps_its_own_step_kernel_and_takes_the_checkpoints_options() -> None:
    """A checkpoint written where the step was fused (a GPU's), with another learning rate
    and weight decay, restored into this CPU run's AdamW (foreach): the learning rate and
    weight decay are the checkpoint's, the step kernel stays this machine's."""
    from types import SimpleNamespace

    from dtrain.checkpoint.training import restore

    optimizer = build_optimizer([nn.Parameter(torch.zeros(3))],
                                OptimizerConfig(name="adamw", lr=1e-3))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    saved = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    saved.update(lr=5e-4, weight_decay=0.25, foreach=None, fused=True, betas=[0.8, 0.9])
    ckpt = SimpleNamespace(meta={"param_groups": [saved], "scheduler": scheduler.state_dict(),
                                 "layout": {"tp": 1, "pp": 1}},
                           index={"world_size": 2})  # another layout's: no RNG restored
    held = SimpleNamespace(optimizers=[optimizer], loss_scale=1.0)
    restore(ckpt, held, [scheduler], SimpleNamespace(world_size=1, sync=1, tp=1, pp=1),  # type: ignore[arg-type]
            tensors=False)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (5e-4, 0.25, (0.8, 0.9))
    assert (group["foreach"], group["fused"]) == (True, None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage, name, offload", [
    (1, "adamw", False), (3, "adamw", False), (2, "adamw", True), (3, "sgd", True),
    (2, "muon", False)], ids=["zero1", "zero3", "zero2-offload", "zero3-offload-sgd",
                              "zero2-muon"])
def test_zero_shard_optimizers_step_all_at_once_equal_to_the_per_parameter_path(
        stage: int, name: str, offload: bool) -> None:
    """The shard pieces step by foreach (on the host, offloaded) whatever the factory's
    optimizer chose, and the weights equal one process's per-parameter optimizer within
    float32 rounding (the gradient averaged over two ranks rounds as a sum in another
    order)."""
    config = OptimizerConfig(**CONFIGS[name])
    one = trained(lambda m: per_parameter(build_optimizer(m, config)))
    for result in run_threads(_zero_ranks, 2, Net(), stage, name, offload):
        assert result["kernels"] == {(True, None)}
        torch.testing.assert_close(result["state"], one, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_fused_cuda_step_equals_the_per_parameter_step(name: str) -> None:
    """On CUDA: fused kernels (Muon's AdamW half too), a step count restored on the host
    midway (dtrain.layouts.parts restores a checkpoint's so; `steps_follow_params` moves it
    to the parameter's device), within float32 rounding of torch's per-parameter loop."""
    config = OptimizerConfig(**CONFIGS[name])

    def on_cuda(model: nn.Module, slow: bool) -> dict[str, torch.Tensor]:
        model = model.cuda()
        optimizer = build_optimizer(model, config)
        assert slow or kernels(optimizer) == {(None, True)}
        if slow:
            per_parameter(optimizer)
        for step in range(STEPS):
            loss_of(model, batch(step).cuda()).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:  # as dtrain.layouts.parts restores a checkpoint's count
                for state in optimizer.state.values():
                    if "step" in state:
                        state["step"] = torch.tensor(float(state["step"]))
        return {k: v.cpu() for k, v in model.state_dict().items()}

    torch.testing.assert_close(on_cuda(Net(), slow=False), on_cuda(Net(), slow=True),
                               rtol=1e-5, atol=1e-6)
