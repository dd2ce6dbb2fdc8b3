"""The CUDA lane: what has a GPU path (NCCL, CUDA tensors, bf16, split-form construction on
the GPU, recomputation with fused attention), held to one process on the GPU as the CPU
tests hold the CPU paths: losses of every step and the final weights. Marked `gpu`:
`make test-gpu` runs them on a machine with CUDA; elsewhere they are skipped (two-GPU tests
also skip on one GPU). `scripts/gpu-check.sh` runs them, with the GPU figures, on a lent
machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain import layouts, models
from dtrain.checkpoint import universal
from dtrain.config import config_from_dict, dims_of
from dtrain.mesh import Mesh
from dtrain.models import init, recompute
from dtrain.models.config import ModelConfig
from dtrain.testing import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
NCCL = {"DTRAIN_BACKEND": "nccl"}

LLAMA = {"arch": "llama", "preset": "llama-tiny", "n_layer": 2, "block_size": 64}
STEPS, LR, SEED = 3, 0.5, 11
"""Plain SGD (no momentum, no decay, no clip) at a rate that moves every weight visibly in
three steps, so a layout that drops, doubles or mis-scales a gradient is seen."""


def skeleton(shape: dict = LLAMA) -> nn.Module:
    return init.skeleton(lambda: models.build(models.resolve(ModelConfig(**shape), 256)))


def batches(device: str, sequences: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 256, (sequences, 64), generator=g)
        out.append((x.to(device), x.roll(-1, 1).to(device)))
    return out


def test_split_form_values_on_the_gpu_are_the_cpus() -> None:
    cpu = init.materialized(skeleton(), init.Initial(skeleton(), seed=1), "cpu")
    gpu = init.materialized(skeleton(), init.Initial(skeleton(), seed=1), "cuda")
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters(), strict=True):
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0, msg=name)


def test_recomputed_fused_attention_gives_the_same_gradients_in_bf16() -> None:
    """Selective and full recomputation on the GPU's fused SDPA kernels under bf16
    autocast: the same loss and gradients as without."""
    x, y = batches("cuda")[0]
    grads = {}
    for mode in ("none", "selective", "full"):
        model = init.materialized(skeleton(), init.Initial(skeleton(), seed=1), "cuda")
        recompute.recompute_mode(model, mode)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        grads[mode] = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    for mode in ("selective", "full"):
        torch.testing.assert_close(grads[mode], grads["none"], rtol=0, atol=0)


def _layout_run(parallel: dict, memory: dict, folder: str,
                train: dict | None = None, optimizer: dict | None = None) -> list[float]:
    """STEPS steps of a layout on the GPU(s) over NCCL: the mean loss of each step, and the
    final weights saved (layout-free) under `folder`; `train`, `optimizer`: more keys of
    those sections."""
    import dtrain
    from dtrain import comm

    world = dtrain.world.current()
    assert world.device.type == "cuda" and world.backend == "nccl"
    config = config_from_dict({
        "model": LLAMA, "train": {"batch_size": 4, "seed": SEED, **(train or {})},
        "optimizer": {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0,
                      **(optimizer or {})},
        "parallel": {"nproc": world.world_size, **parallel}, "memory": memory})
    mesh = Mesh(dims_of(config, world.world_size))
    layout = mesh.dims
    held = layouts.build(skeleton(), mesh, config)
    losses = []
    dp_rank = mesh.coords["dp"]
    for x, y in batches("cuda"):
        rows = slice(dp_rank * 4 // layout.dp, (dp_rank + 1) * 4 // layout.dp)
        loss = held.forward_backward([(x[rows], y[rows])]).float().reshape(1)
        held.step()
        held.zero_grad()
        if held.loss_group is not None:  # the global batch's loss, as the trainer reports
            loss = comm.all_reduce(loss, op="avg", group=held.loss_group)
        losses.append(loss.cpu())
    pieces, extra = held.saved.state()
    universal.save(Path(folder), STEPS, pieces, extra, {}, keep_last=1,
                   group=held.saved.checkpoint_group)
    return [float(loss) for loss in losses]


def _one_process(mixed: bool) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """The same steps in one process with plain torch: fp32, or bf16 compute over fp32
    master weights (what ZeRO's mixed_precision = "bf16" does); (losses, final weights,
    initial weights)."""
    model = init.materialized(skeleton(), init.Initial(skeleton(), seed=SEED), "cuda")
    start = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    masters = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    if mixed:
        model.to(torch.bfloat16)
    params = dict(model.named_parameters())
    losses = []
    for x, y in batches("cuda"):
        _, loss = model(x, y)
        loss.backward()
        with torch.no_grad():
            for name, p in params.items():
                masters[name] -= LR * p.grad.float()
                p.copy_(masters[name])
                p.grad = None
        losses.append(float(loss.detach().float()))
    return losses, {n: m.cpu() for n, m in masters.items()}, start


def _assert_equal_to_one_process(folder: Path, losses: list[list[float]], mixed: bool,
                                 tol: float) -> None:
    want_losses, want, start = _one_process(mixed)
    got = universal.Checkpoint(universal.latest(folder)).model_state()
    assert set(got) == set(want), set(got) ^ set(want)
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(want_losses),
                                   rtol=tol, atol=0)
    for name, value in want.items():
        moved = (value - start[name]).abs().max()
        assert moved > 1e-4, f"{name} did not move in the one-process run"
        # the layout's change of each weight against one process's, to `tol` of its size
        torch.testing.assert_close(got[name].float() - start[name], value - start[name],
                                   rtol=0, atol=tol * float(moved), msg=name)


@pytest.mark.parametrize("parallel, memory, mixed, tol", [
    ({}, {}, False, 1e-4),
    ({"zero": 3}, {"recompute": "full"}, False, 1e-4),
    ({"zero": 3, "mixed_precision": "bf16"}, {"recompute": "selective"}, True,
     3e-2),
], ids=["dp", "zero3-full", "zero3-bf16-selective"])
def test_layouts_on_one_gpu_with_nccl_equal_one_process(parallel: dict, memory: dict,
                                                        mixed: bool, tol: float,
                                                        tmp_path: Path) -> None:
    """Three steps of each layout on one GPU over NCCL against the same steps in plain torch:
    losses of every step and every weight's change. bf16's tolerance is bf16 rounding of
    the compute copy (both runs round the same values; atomics may order sums apart)."""
    losses = run_ranks(_layout_run, 1, parallel, memory, str(tmp_path), timeout=180, env=NCCL)
    _assert_equal_to_one_process(tmp_path, losses, mixed, tol)


@pytest.mark.parametrize("parallel, tol", [
    ({"zero": 1}, 1e-5), ({"zero": 2, "mixed_precision": "bf16"}, 1e-3), ({"zero": 3}, 1e-5),
    ({"zero": 3, "mixed_precision": "bf16"}, 1e-3)],
    ids=["zero1", "zero2-bf16", "zero3", "zero3-bf16"])
def test_optimizer_offload_on_one_gpu_equals_no_offload(parallel: dict, tol: float,
                                                         tmp_path: Path) -> None:
    """`[memory] offload = "optimizer"` on the GPU (pinned host buffers, a side CUDA stream,
    SGD's momentum and the masters on the host) against the same layout without it: the
    losses of every step and the final weights. The host's SGD and the GPU's round alike
    (elementwise multiply-adds, fused or not: an ulp apart at most), so fp32's tolerance is a
    few ulps; under bf16 such an ulp of a master may round its bf16 copy apart."""
    losses, weights = {}, {}
    for offload in ("none", "optimizer"):
        folder = tmp_path / offload
        losses[offload] = run_ranks(_layout_run, 1, parallel, {"offload": offload}, str(folder),
                                    None, {"momentum": 0.9}, timeout=180, env=NCCL)
        weights[offload] = universal.Checkpoint(universal.latest(folder)).model_state()
    torch.testing.assert_close(losses["optimizer"], losses["none"], rtol=tol, atol=0)
    torch.testing.assert_close(weights["optimizer"], weights["none"], rtol=tol, atol=tol / 10)


def test_offload_keeps_the_optimizer_on_pinned_host_memory() -> None:
    """In one process (a ZeRO group of one): with offload the master shards and AdamW's
    state are pinned host tensors, copies run on a side stream, the GPU holds less, and
    three steps give the weights of three steps without offload."""
    import dtrain

    def train(offload: str | None) -> tuple[dtrain.ZeRO, list[float], int]:
        """The wrapper, the losses, and the CUDA bytes it holds after its steps (a delta:
        a wrapper is not freed at once, its parameters' hooks pointing back at it)."""
        before = torch.cuda.memory_allocated()
        model = init.materialized(skeleton(), init.Initial(skeleton(), seed=SEED), "cuda")
        z = dtrain.ZeRO(model, lambda p: torch.optim.AdamW(p, lr=1e-3), stage=2,
                        mixed_precision="bf16", offload_device=offload)
        losses = []
        for x, y in batches("cuda"):
            _, loss = z(x, y)
            z.backward(loss)
            z.clip_grad_norm_(1.0)
            z.step()
            z.zero_grad()
            losses.append(float(loss.detach().float()))
        torch.cuda.synchronize()
        return z, losses, torch.cuda.memory_allocated() - before

    _, want, held = train(None)
    z, got, moved = train("cpu")
    assert z.offload is not None and z.offload.copies.stream is not None
    assert all(u.master.is_pinned() and u.master.dtype == torch.float32 for u in z.units)
    state = [t for s in z.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert state and all(t.device.type == "cpu" for t in state)
    assert z.state_bytes()["optimizer"] == 0 < z.state_bytes()["host_optimizer"]
    assert moved < held, (moved, held)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)  # bf16 weights: a flipped ulp


@pytest.mark.parametrize("parallel, tol", [({}, 1e-3), ({"zero": 3}, 1e-3)],
                         ids=["dp", "zero3"])
def test_compiled_blocks_on_one_gpu_equal_one_process(parallel: dict, tol: float,
                                                      tmp_path: Path) -> None:
    """`[train] compile = true` on CUDA (inductor's generated kernels, ZeRO-3's gathers in
    hooks outside the compiled blocks): the eager one-process run's losses and weight changes,
    to 1e-3 of them (fused kernels sum in another order than eager ones)."""
    train = {"compile": True, "out_dir": str(tmp_path / "run")}
    losses = run_ranks(_layout_run, 1, parallel, {}, str(tmp_path / "ckpt"), train,
                       timeout=300, env=NCCL)
    _assert_equal_to_one_process(tmp_path / "ckpt", losses, False, tol)


FP8 = pytest.mark.skipif(not torch.cuda.is_available()
                         or torch.cuda.get_device_capability() < (8, 9),
                         reason="needs FP8 tensor cores (compute capability 8.9)")
FP8_STEPS = 5
FP8_TOL = 5e-2
"""FP8 against the same run without it: every step's loss within 5% while AdamW on one
batch takes it down by a third (on the CPU's emulation the two were 1.2% apart at most:
tests/models/test_float8.py)."""


def _fp8_run(parallel: dict, train: dict, folder: str) -> tuple[list[float], int]:
    """FP8_STEPS AdamW steps of a layout on one batch, on one GPU over NCCL: (the loss of
    each step, the FP8 layers of the held model)."""
    import dtrain

    assert dtrain.world.current().backend == "nccl"
    config = config_from_dict({
        "model": LLAMA, "train": {"batch_size": 4, "seed": SEED, "out_dir": folder, **train},
        "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.0},
        "parallel": {"nproc": 1, **parallel}})
    held = layouts.build(skeleton(), Mesh(dims_of(config, 1)), config)
    x, y = batches("cuda")[0]
    losses = []
    for _ in range(FP8_STEPS):
        losses.append(float(held.forward_backward([(x, y)]).float()))
        held.step()
        held.zero_grad()
    return losses, sum(type(m).__name__ == "Float8Linear" for m in held.module.modules())


@FP8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("parallel, train", [
    ({}, {}),
    ({"zero": 3, "mixed_precision": "bf16"}, {}),
    ({"zero": 3, "mixed_precision": "bf16"}, {"compile": True}),
], ids=["dp-fp32", "zero3-bf16", "zero3-bf16-compiled"])
def test_float8_trains_like_full_precision(parallel: dict, train: dict, recipe: str,
                                           tmp_path: Path) -> None:
    """`[train] float8` on FP8 tensor cores: the blocks' 14 linear layers of dtrain's Llama
    in FP8, with DataParallel (fp32 compute) and ZeRO-3 (bf16 compute over fp32 masters,
    gathered in bf16 and cast in each linear), eager and compiled (converted first, then
    compiled): each step's loss within FP8_TOL of the same layout's without FP8."""
    (want, none), = run_ranks(_fp8_run, 1, parallel, train, str(tmp_path / "want"),
                              timeout=300, env=NCCL)
    (got, fp8), = run_ranks(_fp8_run, 1, parallel, {**train, "float8": recipe},
                            str(tmp_path / "got"), timeout=300, env=NCCL)
    assert none == 0 and fp8 == 14
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=FP8_TOL, atol=0)
    assert got[-1] < 0.8 * got[0], got


@TWO_GPUS
@pytest.mark.parametrize("parallel", [
    {"tp": 2, "sequence_parallel": True}, {"zero": 3}, {"pp": 2, "microbatches": 2}],
    ids=["tp2-sp", "zero3", "pp2"])
def test_two_gpus_over_nccl_equal_one_process(parallel: dict, tmp_path: Path) -> None:
    losses = run_ranks(_layout_run, 2, parallel, {"recompute": "full"},
                       str(tmp_path), timeout=240, env=NCCL)
    _assert_equal_to_one_process(tmp_path, losses, False, 1e-4)


def _collectives(algorithm: str) -> dict[str, torch.Tensor]:
    import dtrain
    from dtrain import comm

    rank = dtrain.world.current().rank
    x = torch.arange(8, dtype=torch.float32, device="cuda") + 10 * rank

    def form(op: str) -> str:  # an operation without this form runs its native one
        return algorithm if algorithm in comm.AVAILABLE[op] else "native"

    out = {"all_reduce": comm.all_reduce(x.clone(), algorithm=form("all_reduce")),
           "all_gather": comm.all_gather(x.view(1, -1), algorithm=form("all_gather")),
           "reduce_scatter": comm.reduce_scatter(x.clone(), algorithm=form("reduce_scatter")),
           "broadcast": comm.broadcast(x.clone(), src=1, algorithm=form("broadcast"))}
    assert all(t.is_cuda for t in out.values())
    return {k: v.cpu() for k, v in out.items()}


@TWO_GPUS
@pytest.mark.parametrize("algorithm", ["native", "ring", "tree"])
def test_collectives_of_cuda_tensors_over_nccl(algorithm: str) -> None:
    base = torch.arange(8, dtype=torch.float32)
    want = {"all_reduce": 2 * base + 10, "all_gather": torch.stack([base, base + 10]),
            "broadcast": base + 10}
    for rank, got in enumerate(run_ranks(_collectives, 2, algorithm, timeout=120, env=NCCL)):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, msg=f"{algorithm} {key}")
        torch.testing.assert_close(got["reduce_scatter"], (2 * base + 10)[4 * rank:4 * rank + 4])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).cuda()


def _inputs() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).cuda()


def _data_parallel_grads(grad_dtype: str, peer: str) -> dict[str, torch.Tensor]:
    """One backward of the rank's half batch under dtrain's DataParallel or torch's DDP:
    the averaged gradients. Both ranks may share one GPU (gloo carries CUDA tensors)."""
    import dtrain

    world = dtrain.world.current()
    net = _net()
    if peer == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
    else:
        model = dtrain.DataParallel(net, grad_dtype=grad_dtype)
    model(_inputs()[world.rank::2]).pow(2).mean().backward()
    return {n: p.grad.cpu() for n, p in net.named_parameters()}


def _halves_grads() -> list[dict[str, torch.Tensor]]:
    """One process's gradients of each half of the batch (what each rank computes)."""
    halves = []
    for half in (0, 1):
        net = _net()
        net(_inputs()[half::2]).pow(2).mean().backward()
        halves.append({n: p.grad.cpu() for n, p in net.named_parameters()})
    return halves


def _two_halves_grads() -> dict[str, torch.Tensor]:
    net, x = _net(), _inputs()
    ((net(x[0::2]).pow(2).mean() + net(x[1::2]).pow(2).mean()) / 2).backward()
    return {n: p.grad.cpu() for n, p in net.named_parameters()}


@TWO_GPUS
@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
def test_data_parallel_of_cuda_tensors_over_nccl_averages_gradients(grad_dtype: str) -> None:
    want, (first, second) = _two_halves_grads(), _halves_grads()
    for got in run_ranks(_data_parallel_grads, 2, grad_dtype, "dtrain", timeout=120,
                         env=NCCL):
        assert set(got) == set(want)
        for name, value in want.items():
            if grad_dtype == "fp32":
                torch.testing.assert_close(got[name], value, msg=name)
                continue
            # bf16 buckets: each half rounded to bf16, summed, rounded, halved: at most three
            # roundings of 2^-9 each, relative to the halves' sizes (not their sum's)
            bound = 2 ** -7 * (first[name].abs() + second[name].abs()) / 2 + 1e-12
            assert ((got[name] - value).abs() <= bound).all(), name


@pytest.mark.parametrize("peer", ["dtrain", "ddp"])
def test_two_processes_sharing_one_gpu_over_gloo_average_like_ddp(peer: str) -> None:
    """Two processes on one GPU, gloo carrying CUDA tensors: DataParallel's averaged
    gradients equal one process's on the two halves, as torch's DDP's do the same way."""
    want = _two_halves_grads()
    for got in run_ranks(_data_parallel_grads, 2, "fp32", peer, timeout=120,
                         env={"DTRAIN_BACKEND": "gloo"}):
        torch.testing.assert_close(got, want)


def test_packed_documents_under_flex_attention_equal_the_dense_mask() -> None:
    """On CUDA dtrain's Llama attends over packed documents with flex attention's block
    mask: the loss and every gradient equal those under the dense boolean mask (fp32)."""
    from dtrain.masks import document_block_mask, document_mask
    from dtrain.models.rows import PackedDocuments

    torch.manual_seed(0)
    model = models.build(models.resolve(ModelConfig(**{**LLAMA, "block_size": 256}), 256))
    model = model.cuda()
    lengths = [37, 120, 3, 96]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    x = torch.randint(0, 256, (1, 256), device="cuda")
    y = torch.randint(0, 256, (1, 256), device="cuda")
    results = []
    for mask in (document_block_mask(positions), document_mask(positions)):
        model.zero_grad()
        model.documents = PackedDocuments(positions, mask)  # the stages read it, as forward sets
        model.documents_given += 1
        h = model.stage_in(x)
        for block in model.blocks:
            h = model.stage_block(block, h)
        loss = nn.functional.cross_entropy(model.stage_out(h)[0], y[0])
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (flex_loss, flex_grads), (dense_loss, dense_grads) = results
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(flex_grads, dense_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_fused_rms_norm_equals_the_written_out_norm_in_bf16() -> None:
    """dtrain's RMSNorm runs torch's F.rms_norm (one kernel on CUDA): in bf16 on the GPU,
    its values and gradients equal Hugging Face's written-out norm within bf16's rounding
    (bit for bit on a CPU: tests/models/test_llama.py)."""
    from dtrain.models.llama_parts import RMSNorm
    from tests.models.test_llama import _written_out_rms_norm

    torch.manual_seed(0)
    norm = RMSNorm(2048, 1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    weight = norm.weight.detach().clone().requires_grad_()
    grad = torch.randn_like(x)
    got, want = norm(x), _written_out_rms_norm(x_ref, weight, 1e-5)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(norm.weight.grad, weight.grad, rtol=1.6e-2, atol=1e-1)
