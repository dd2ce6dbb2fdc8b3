"""The CUDA lane: what has a GPU path (NCCL, CUDA tensors, bf16, split-form construction on
the GPU, recomputation with fused attention), checked against the CPU's answers. Marked
`gpu`: `make test-gpu` runs them on a machine with CUDA; elsewhere they are skipped
(two-GPU tests also skip on one GPU)."""

from __future__ import annotations

import pytest
import torch

from dtrain import layouts, models
from dtrain.config import config_from_dict, layout_of
from dtrain.mesh import Mesh
from dtrain.models import init, recompute
from dtrain.models.config import ModelConfig
from tests.distributed import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

LLAMA = {"arch": "llama", "preset": "llama-tiny", "n_layer": 2, "block_size": 64}


def skeleton(shape: dict = LLAMA) -> torch.nn.Module:
    return init.skeleton(lambda: models.build(models.resolve(ModelConfig(**shape), 256)))


def batch(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 64), generator=g)
    return x.to(device), x.roll(-1, 1).to(device)


def test_split_form_values_on_the_gpu_are_the_cpus() -> None:
    cpu = init.materialized(skeleton(), init.Initial(skeleton(), seed=1), "cpu")
    gpu = init.materialized(skeleton(), init.Initial(skeleton(), seed=1), "cuda")
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters(), strict=True):
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0, msg=name)


def test_recomputed_fused_attention_gives_the_same_gradients_in_bf16() -> None:
    """Selective and full recomputation on the GPU's fused SDPA kernels under bf16
    autocast: the same loss and gradients as without."""
    x, y = batch("cuda")
    grads = {}
    for mode in ("none", "selective", "full"):
        model = init.materialized(skeleton(), init.Initial(skeleton(), seed=1), "cuda")
        recompute.activation_checkpointing(model, mode)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        grads[mode] = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    for mode in ("selective", "full"):
        torch.testing.assert_close(grads[mode], grads["none"], rtol=0, atol=0)


def _layout_loss(parallel: dict, memory: dict) -> float:
    import dtrain

    world = dtrain.world.current()
    assert world.device.type == "cuda" and world.backend == "nccl"
    config = config_from_dict({"model": LLAMA, "train": {"batch_size": 4 * world.world_size},
                               "parallel": {"nproc": world.world_size, **parallel},
                               "memory": memory})
    layout = layout_of(config, world.world_size)
    mesh = Mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp)
    held = layouts.build(skeleton(), mesh, layout, config)
    x, y = batch("cuda")
    return float(held.forward_backward([(x, y)]))


def _one_process_loss(mixed: bool = False) -> float:
    model = init.materialized(skeleton(), init.Initial(skeleton(), seed=1337), "cuda")
    x, y = batch("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mixed):
        _, loss = model(x, y)
    return float(loss)


@pytest.mark.parametrize("parallel, memory, mixed", [
    ({}, {}, False),
    ({"zero": 3}, {"activation_checkpointing": "full"}, False),
    ({"zero": 3, "mixed_precision": "bf16"}, {"activation_checkpointing": "selective"}, True),
], ids=["dp", "zero3-full", "zero3-bf16-selective"])
def test_layouts_on_one_gpu_with_nccl_equal_one_process(parallel: dict, memory: dict,
                                                        mixed: bool) -> None:
    loss, = run_ranks(_layout_loss, 1, parallel, memory, timeout=180)
    want = _one_process_loss(mixed)
    assert abs(loss - want) <= (2e-2 if mixed else 1e-5) * abs(want)


@TWO_GPUS
@pytest.mark.parametrize("parallel", [
    {"tp": 2, "sequence_parallel": True}, {"zero": 3}, {"pp": 2, "microbatches": 2}],
    ids=["tp2-sp", "zero3", "pp2"])
def test_two_gpus_over_nccl_equal_one_process(parallel: dict) -> None:
    results = run_ranks(_layout_loss, 2, parallel, {"activation_checkpointing": "full"},
                        timeout=240)
    want = _one_process_loss()
    assert max(abs(loss - want) for loss in results) <= 1e-4 * abs(want)


def _collectives(algorithm: str) -> dict[str, torch.Tensor]:
    import dtrain
    from dtrain import comm

    rank = dtrain.world.current().rank
    x = torch.arange(8, dtype=torch.float32, device="cuda") + 10 * rank
    out = {"all_reduce": comm.all_reduce(x.clone(), algorithm=algorithm),
           "all_gather": comm.all_gather(x.view(1, -1), algorithm=algorithm),
           "reduce_scatter": comm.reduce_scatter(x.clone(), algorithm=algorithm),
           "broadcast": comm.broadcast(x.clone(), src=1, algorithm=algorithm)}
    assert all(t.is_cuda for t in out.values())
    return {k: v.cpu() for k, v in out.items()}


@TWO_GPUS
@pytest.mark.parametrize("algorithm", ["native", "ring", "tree"])
def test_collectives_of_cuda_tensors_over_nccl(algorithm: str) -> None:
    base = torch.arange(8, dtype=torch.float32)
    want = {"all_reduce": 2 * base + 10, "all_gather": torch.stack([base, base + 10]),
            "broadcast": base + 10}
    for rank, got in enumerate(run_ranks(_collectives, 2, algorithm, timeout=120)):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, msg=f"{algorithm} {key}")
        torch.testing.assert_close(got["reduce_scatter"], (2 * base + 10)[4 * rank:4 * rank + 4])


def _data_parallel_grads(grad_dtype: str) -> dict[str, torch.Tensor]:
    import dtrain

    rank = dtrain.world.current().rank
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                              torch.nn.Linear(32, 4)).cuda()
    model = dtrain.DataParallel(net, grad_dtype=grad_dtype)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).cuda()
    model(x[rank::2]).pow(2).mean().backward()
    return {n: p.grad.cpu() for n, p in net.named_parameters()}


@TWO_GPUS
@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
def test_data_parallel_of_cuda_tensors_averages_gradients(grad_dtype: str) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                              torch.nn.Linear(32, 4)).cuda()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).cuda()
    ((net(x[0::2]).pow(2).mean() + net(x[1::2]).pow(2).mean()) / 2).backward()
    want = {n: p.grad.cpu() for n, p in net.named_parameters()}
    tol = {"rtol": 1e-2, "atol": 1e-3} if grad_dtype == "bf16" else {}
    for got in run_ranks(_data_parallel_grads, 2, grad_dtype, timeout=120):
        torch.testing.assert_close(got, want, **tol)
