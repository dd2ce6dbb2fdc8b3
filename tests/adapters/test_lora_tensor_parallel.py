"""LoRA adapters split with their tensor-parallel layers: on two ranks, with and without
sequence parallelism, the logits, the loss and every adapter's whole gradient equal the
unsplit adapted model's (dtrain's Llama: column and row-parallel layers; dtrain's GPT: a
fused QKV cut in three parts); the base stays frozen."""

from __future__ import annotations

import copy

import pytest
import torch

from dtrain import comm
from dtrain import tensor_parallel as tp
from dtrain.adapters import AdapterConfig, apply
from dtrain.adapters.config import check_adapter_layout
from dtrain.errors import ConfigError
from dtrain.models import ModelConfig, build, resolve
from dtrain.testing import run_ranks

SMALL = {"block_size": 16, "n_layer": 2, "n_embd": 32, "n_head": 4}
MODELS = {"llama": ModelConfig(arch="llama", **SMALL, n_kv_head=2, ffn_hidden=64),
          "gpt": ModelConfig(arch="gpt", **SMALL)}


def _adapted(cfg: ModelConfig) -> torch.nn.Module:
    """The model with adapters on every default layer, B drawn too (so they count)."""
    torch.manual_seed(0)
    model = build(resolve(cfg, 256))
    apply(model, AdapterConfig(kind="lora", rank=4, alpha=8), cfg.arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(0, 0.1)
    return model


def _split_rank(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                sequence_parallel: bool) -> tuple:
    """One tensor-parallel rank: the whole logits, the loss, whole gradients, and the
    names of the parameters that train."""
    tp.split_model(model, comm.resolve(None), sequence_parallel=sequence_parallel,
                   algorithm="native")
    logits, loss = model(x, y)
    loss.backward()
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    whole = tp.gather_last(logits, comm.resolve(None), "native")
    return whole.detach(), loss.detach(), tp.full_grads(model), trained


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_split_adapters_equal_the_unsplit_model(arch: str) -> None:
    model = _adapted(MODELS[arch])
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
    logits, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)
    for sequence_parallel in (False, True):
        for whole, part_loss, full, trained in run_ranks(
                _split_rank, 2, copy.deepcopy(model), x, y, sequence_parallel, timeout=100):
            assert trained == sorted(grads), sequence_parallel
            torch.testing.assert_close(whole, logits.detach())
            torch.testing.assert_close(part_loss, loss.detach())
            for name, grad in grads.items():
                torch.testing.assert_close(full[name], grad, msg=f"{name} sp={sequence_parallel}")
            assert all(full[n] is None for n in full if n not in grads)


def test_adapter_dropout_with_tensor_parallelism_is_refused() -> None:
    check_adapter_layout(AdapterConfig(kind="lora", dropout=0.1), 1)
    check_adapter_layout(AdapterConfig(kind="lora"), 2)
    with pytest.raises(ConfigError, match="adapter.dropout = 0.1 with parallel.tp = 2"):
        check_adapter_layout(AdapterConfig(kind="lora", dropout=0.1), 2)
