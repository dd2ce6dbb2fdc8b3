"""FP8 training (`[train] float8`, dtrain.models.float8) where no GPU has it: refused in one
line before anything is written, and the conversion itself checked on the CPU, where
torchao's Float8Linear runs (emulated, slowly) so the layer choice and the layouts' wiring
can be tested. Training on FP8 tensor cores is tests/gpu/test_gpu.py's."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtrain import models
from dtrain.errors import ConfigError
from dtrain.models import float8, init
from dtrain.models.config import ModelConfig
from dtrain.testing import run_ranks

try:
    from torchao.float8.float8_linear import Float8Linear
except ImportError:  # the refusals are tested all the same
    Float8Linear = None
TORCHAO = pytest.mark.skipif(Float8Linear is None, reason="needs torchao (the test extra)")

LLAMA = {"arch": "llama", "preset": "llama-tiny", "n_layer": 2, "block_size": 32}
STEPS = 5


def llama(**shape: object) -> nn.Module:
    torch.manual_seed(0)
    return models.build(models.resolve(ModelConfig(**{**LLAMA, **shape}), 256))


def test_refused_on_a_cpu_in_one_line() -> None:
    with pytest.raises(ConfigError) as caught:
        float8.check_float8(torch.device("cpu"))
    message = str(caught.value)
    assert "\n" not in message
    assert "compute capability >= 8.9" in message and "H100" in message
    assert "CPU" in message and 'train.float8 = "none"' in message


def test_without_torchao_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_torchao(name: str, *args: object, **kwargs: object) -> object:
        if name == "torchao" or name.startswith("torchao."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(ConfigError, match=r"pip install 'dtrain\[float8\]'") as caught:
        float8.convert_to_float8(llama(), "tensorwise")
    assert "\n" not in str(caught.value)


def test_the_blocks_linears_are_chosen_and_misaligned_ones_skipped() -> None:
    model = llama()
    chosen, skipped = float8.float8_layers(model)
    per_block = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate",
                 "mlp.up", "mlp.down"]
    assert chosen == [f"blocks.{i}.{name}" for i in range(2) for name in per_block]
    assert skipped == []
    # 352 = 22 x 16; 360 is not a multiple of 16: the MLP's three layers are left
    chosen, skipped = float8.float8_layers(llama(ffn_hidden=360))
    assert skipped == [f"blocks.{i}.mlp.{n}" for i in range(2) for n in ("gate", "up", "down")]
    assert all("attn" in name for name in chosen)


@TORCHAO
def test_conversion_swaps_the_layers_and_keeps_the_parameters() -> None:
    model = llama(ffn_hidden=360)
    before = dict(model.named_parameters())
    converted = float8.convert_to_float8(model, "rowwise")
    assert converted == float8.float8_layers(llama(ffn_hidden=360))[0]
    for name, module in model.named_modules():
        assert isinstance(module, Float8Linear) == (name in converted), name
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is before[n] for n in before)  # optimizers and hooks see the same
    assert type(model.head) is nn.Linear and type(model.blocks[0].mlp.up) is nn.Linear
    assert float8.convert_to_float8(model, "rowwise") == []  # again: nothing more to swap
    assert "blocks.0.mlp.gate" in float8.describe(converted, float8.float8_layers(model)[1],
                                                  "rowwise")


@TORCHAO
def test_conversion_of_a_model_in_split_form() -> None:
    """On the meta device, as every rank builds dtrain's models: allocated afterwards."""
    model = init.skeleton(lambda: models.build(models.resolve(ModelConfig(**LLAMA), 256)))
    assert len(float8.convert_to_float8(model, "tensorwise")) == 14
    init.allocate(model, torch.device("cpu"))
    layer = model.blocks[1].attn.q_proj
    assert isinstance(layer, Float8Linear) and layer.weight.device.type == "cpu"


@TORCHAO
def test_nothing_to_convert_and_unknown_recipes_are_one_line() -> None:
    gpt = models.build(models.resolve(ModelConfig(arch="gpt", n_embd=24, n_head=2,
                                                  n_layer=1, block_size=16), 256))
    with pytest.raises(ConfigError, match="multiples of 16"):
        float8.convert_to_float8(gpt, "tensorwise")
    with pytest.raises(ConfigError, match="must be one of none, tensorwise, rowwise"):
        float8.convert_to_float8(llama(), "blockwise")


ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.0}
SGD = {"name": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 0.0}
"""FP8 against fp32 trains with AdamW (the loss falls fast); FP8 against FP8 with SGD
without a clip, whose update shows a gradient of the wrong scale."""


def _layouts_run(parallel: dict, recipe: str, optimizer: dict = ADAMW,
                 save: str = "") -> tuple[list[float], str, int]:
    """STEPS steps of dtrain's Llama on one batch through dtrain.layouts.build on this CPU
    rank of 2, FP8 emulated (the hardware check lifted): (the global batch's losses, the
    banner, the linear layers in FP8 on this rank); the final weights saved at `save`."""
    import dtrain
    from dtrain import comm, layouts
    from dtrain.checkpoint import universal
    from dtrain.config import config_from_dict, dims_of
    from dtrain.mesh import Mesh

    float8.check_float8 = lambda device: None  # this forked rank only: the CPU emulates FP8
    world = dtrain.world.current().world_size
    config = config_from_dict({
        "model": LLAMA, "train": {"batch_size": 4, "seed": 3, "float8": recipe},
        "optimizer": optimizer, "parallel": {"nproc": world, **parallel}})
    mesh = Mesh(dims_of(config, world))
    layout = mesh.dims
    model = init.skeleton(lambda: models.build(models.resolve(ModelConfig(**LLAMA), 256)))
    held = layouts.build(model, mesh, config)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    rows = slice(mesh.coords["dp"] * 4 // layout.dp, (mesh.coords["dp"] + 1) * 4 // layout.dp)
    losses = []
    for _ in range(STEPS):  # one batch again and again: the loss falls fast
        loss = held.forward_backward([(x[rows], x.roll(-1, 1)[rows])]).reshape(1)
        if held.loss_group is not None:
            loss = comm.all_reduce(loss, op="avg", group=held.loss_group)
        losses.append(float(loss))
        held.step()
        held.zero_grad()
    fp8 = sum(isinstance(m, Float8Linear) or getattr(m, "matmul", F.linear) is not F.linear
              for m in held.module.modules())
    if save:
        pieces, extra = held.saved.state()
        universal.save(save, STEPS, pieces, extra, {}, keep_last=1,
                       group=held.saved.checkpoint_group)
    return losses, held.describe(), fp8


def _layouts(cases: list[tuple[dict, str]], folder: str) -> tuple[list[tuple], list[list]]:
    """Each case's run without FP8 and with it, then FP8 (tensorwise) under DataParallel
    and under ZeRO-3 with SGD, their weights saved in folder/dp and folder/zero3: in one
    process a rank, so torchao imports once."""
    against_fp32 = [(_layouts_run(parallel, "none"), _layouts_run(parallel, recipe))
                    for parallel, recipe in cases]
    fp8_pair = [_layouts_run(parallel, "tensorwise", SGD, f"{folder}/{name}")[0]
                for name, parallel in (("dp", {}), ("zero3", {"zero": 3}))]
    return against_fp32, fp8_pair


@TORCHAO
def test_layouts_convert_and_track_full_precision(tmp_path: Path) -> None:
    """On 2 ranks: DataParallel with tensorwise scaling, ZeRO-3 with rowwise (gathering
    fp32 shards, cast to FP8 in each linear) and tp = 2 with tensorwise (each rank's block
    of every split layer multiplied in FP8): the 14 linears of the blocks in FP8, and
    every step's loss within 3% of fp32's while it falls by a third (FP8 measured 1.2%
    apart at most, on the CPU's emulation). FP8 against FP8: DataParallel and ZeRO-3 with
    tensorwise scaling cast the same whole weights with the same scales (ZeRO-3 gathers
    them first), so with SGD their losses and final weights agree to float rounding."""
    from dtrain.checkpoint import universal

    cases = [({}, "tensorwise"), ({"zero": 3}, "rowwise"), ({"tp": 2}, "tensorwise")]
    ranks = run_ranks(_layouts, 2, cases, str(tmp_path), timeout=240)
    for runs, _ in ranks:
        for (_, recipe), ((want, _, none), (got, banner, fp8)) in zip(cases, runs,
                                                                      strict=True):
            assert none == 0 and fp8 == 14
            assert f"float8 {recipe} in 14 linear layers" in banner
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=3e-2,
                                       atol=0)
            assert got[-1] < 0.8 * got[0]
    dp, zero3 = ranks[0][1]
    assert dp[-1] < 0.97 * dp[0]  # SGD trained: the comparison is not of two idle runs
    torch.testing.assert_close(torch.tensor(zero3), torch.tensor(dp), rtol=1e-5, atol=0)
    want = universal.Checkpoint(tmp_path / "dp").model_state()
    got = universal.Checkpoint(tmp_path / "zero3").model_state()
    assert want and got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _sequence_parallel_step(sequence: bool) -> tuple[float, dict[str, torch.Tensor], int, int]:
    """One forward and backward of dtrain's Llama at tp = 2 on this CPU rank of 2, FP8
    (tensorwise) emulated, with or without sequence parallelism: (the loss, the gradients
    of this rank's blocks of the weights, the gathered inputs still alive when forward
    has returned, and the layers that took one again in backward)."""
    import weakref

    from dtrain import layouts
    from dtrain.config import config_from_dict, dims_of
    from dtrain.mesh import Mesh
    from dtrain.tensor_parallel import functions

    float8.check_float8 = lambda device: None  # this forked rank only: the CPU emulates FP8
    gathered: list[weakref.ref] = []
    gather, take = functions.gather_sequence, functions.Regather.take
    retaken = [0]

    def recording_gather(x: torch.Tensor, group: object, algorithm: str = "auto") -> torch.Tensor:
        whole = gather(x, group, algorithm)  # type: ignore[arg-type]
        gathered.append(weakref.ref(whole))
        return whole

    def counting_take(self: functions.Regather, part: torch.Tensor) -> torch.Tensor:
        retaken[0] += 1
        return take(self, part)

    functions.gather_sequence = recording_gather  # type: ignore[assignment]
    functions.Regather.take = counting_take  # type: ignore[method-assign]
    config = config_from_dict({
        "model": LLAMA, "train": {"batch_size": 4, "seed": 3, "float8": "tensorwise"},
        "optimizer": SGD, "parallel": {"nproc": 2, "tp": 2, "sequence_parallel": sequence}})
    model = init.skeleton(lambda: models.build(models.resolve(ModelConfig(**LLAMA), 256)))
    held = layouts.build(model, Mesh(dims_of(config, 2)), config)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    loss = held.loss_of((x, x.roll(-1, 1)))
    alive = sum(ref() is not None for ref in gathered)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in held.module.named_parameters()
             if p.grad is not None and ".blocks." in f".{name}"}
    return float(loss), grads, alive, retaken[0]


def _sequence_parallel_steps() -> list[tuple[float, dict[str, torch.Tensor], int, int]]:
    return [_sequence_parallel_step(sequence) for sequence in (False, True)]


@TORCHAO
@pytest.mark.timeout(240)
def test_fp8_under_sequence_parallelism_keeps_only_its_part_of_the_input() -> None:
    """tp = 2 with sequence parallelism and FP8: each column-parallel layer's FP8 product
    keeps this rank's part of the sequence for backward, not the gathered whole (which
    torchao's Float8Linear would save in full precision): once forward has returned no
    gathered input is alive, backward takes each again where a layer reads it (q, k, v,
    gate and up in each block, and the output head, which stays out of FP8: before, only
    the head did), and the loss and every gradient equal those of tp = 2 without
    sequence parallelism (the same whole inputs, scaled alike)."""
    ranks = run_ranks(_sequence_parallel_steps, 2, timeout=200)
    for (plain_loss, plain, _, _), (loss, grads, alive, retaken) in ranks:
        assert alive == 0
        assert retaken == 5 * LLAMA["n_layer"] + 1  # type: ignore[operator]
        assert loss == pytest.approx(plain_loss, rel=1e-6)
        assert grads.keys() == plain.keys() and len(grads) > 0
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
