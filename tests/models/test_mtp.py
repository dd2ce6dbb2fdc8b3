"""Multi-token prediction: the loss against a reference written here (each depth on the rows
cut short by its offset, fp64, forward and backward), the main model's logits untouched,
evaluation without it, and the targets of packed rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtrain.data.sequences import IGNORE
from dtrain.models import ModelConfig, build, resolve
from dtrain.models.llama import Llama
from dtrain.models.llama_parts import rotary
from dtrain.models.mtp import shifted_targets

SHAPE = ModelConfig(arch="llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2, ffn_hidden=48,
                    block_size=16, tie_embeddings=False, mtp_depth=2, mtp_loss_weight=0.3)
DEEPSEEK = ModelConfig(arch="llama", preset="deepseek-tiny", n_layer=2, n_embd=32,
                       ffn_hidden=48, block_size=16, q_lora_rank=16, kv_lora_rank=12,
                       qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mtp_depth=2)


def model_of(cfg: ModelConfig, dtype: torch.dtype = torch.float64) -> Llama:
    torch.manual_seed(0)
    model = build(resolve(cfg, 64)).to(dtype)
    assert isinstance(model, Llama)
    return model


def reference_mtp(model: Llama, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP loss, depth by depth on rows cut short: depth k sees positions
    0..T-k-1, the previous depth's hidden states there and the embeddings of the tokens k
    ahead, runs its block at those positions and predicts the targets k ahead."""
    t = idx.shape[1]
    h = model.embed(idx)
    cos, sin = rotary(t, model.cfg.rope_dim, model.cfg.rope_theta, idx.device, h.dtype)
    for block in model.blocks:
        h = block(h, (cos, sin))
    assert model.mtp is not None
    losses = []
    for k, depth in enumerate(model.mtp.depths, start=1):
        short = t - k
        emb = model.embed(idx[:, k:])
        h = depth.eh_proj(torch.cat((depth.enorm(emb), depth.hnorm(h[:, :short])), dim=-1))
        h = depth.block(h, (cos[:short], sin[:short]))
        logits = model.head(depth.norm(h))
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      targets[:, k:].reshape(-1)))
    return model.cfg.mtp_loss_weight * sum(losses) / len(losses)


@pytest.mark.parametrize("cfg", [SHAPE, DEEPSEEK], ids=["gqa-dense", "deepseek-tiny"])
def test_the_mtp_loss_equals_the_reference_forward_and_backward(cfg: ModelConfig) -> None:
    """The model's training loss is its next-token loss plus the MTP loss (the dense
    model: no balance loss to add), in value and in every parameter's gradient."""
    model = model_of(cfg).train()
    idx = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(idx, -1, 1)
    logits, total = model(idx, targets)
    main = F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
    want = reference_mtp(model, idx, targets)
    torch.testing.assert_close(total - main, want)
    params = [p for p in model.parameters() if p.requires_grad]
    for name, got, ref in zip([n for n, p in model.named_parameters() if p.requires_grad],
                              torch.autograd.grad(total, params, retain_graph=True,
                                                  allow_unused=True),
                              torch.autograd.grad(main + want, params, allow_unused=True),
                              strict=True):
        if ref is None:  # experts no token reached in both
            assert got is None or not got.any(), name
            continue
        torch.testing.assert_close(got, ref, msg=name)


def test_the_main_logits_and_evaluation_leave_mtp_out() -> None:
    """The same weights without the modules give the same logits; in evaluation the loss
    is the next-token loss alone."""
    model = model_of(SHAPE, torch.float32)
    plain = build(resolve(ModelConfig(**{**SHAPE.__dict__, "mtp_depth": 0}), 64))
    plain.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("mtp.")})
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    targets = torch.roll(idx, -1, 1)
    logits, train_loss = model.train()(idx, targets)
    torch.testing.assert_close(logits, plain(idx))
    _, eval_loss = model.eval()(idx, targets)
    torch.testing.assert_close(eval_loss, plain.eval()(idx, targets)[1])
    assert train_loss > eval_loss


def test_shifted_targets_stop_at_the_row_and_document_ends() -> None:
    targets = torch.tensor([[10, 11, 12, 13, 14, 15]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two documents of three tokens
    assert shifted_targets(targets, 1, None).tolist() == [[11, 12, 13, 14, 15, IGNORE]]
    assert shifted_targets(targets, 1, positions).tolist() == \
        [[11, 12, IGNORE, 14, 15, IGNORE]]
    assert shifted_targets(targets, 2, positions).tolist() == \
        [[12, IGNORE, IGNORE, 15, IGNORE, IGNORE]]
