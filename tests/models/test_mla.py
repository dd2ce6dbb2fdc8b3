"""Multi-head latent attention: the module against a plain per-head reference written here
(forward and backward, fp64; DeepSeek's own complex-number rotation of interleaved pairs),
inside packed documents, and generation through its compressed cache: the same logits and
greedy tokens as without a cache, and the bytes per token it keeps beside grouped-query
attention of the same width."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F

from dtrain.errors import ConfigError
from dtrain.models import ModelConfig, build, resolve
from dtrain.models.generate import attach, detach
from dtrain.models.kv_cache import LatentCache
from dtrain.models.mla import LatentAttention, MLAConfig

DIM, HEADS, THETA = 32, 4, 10000.0
WIDTHS = {"kv_lora_rank": 12, "qk_rope_head_dim": 8, "qk_nope_head_dim": 6, "v_head_dim": 10}


def attention(q_lora_rank: int) -> LatentAttention:
    torch.manual_seed(0)
    attn = LatentAttention(DIM, HEADS, MLAConfig(**WIDTHS, q_lora_rank=q_lora_rank), THETA)
    with torch.no_grad():
        for p in attn.parameters():  # norms away from 1 too
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    return attn.double()


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotate_pairs(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotation: each interleaved pair (x[2j], x[2j+1]) a complex number turned
    by position x theta^(-2j/d), as their apply_rotary_emb (view_as_complex) does, the
    angles computed in float32 as theirs (and transformers') are."""
    d = x.shape[-1]
    freqs = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = (positions.float()[:, None] * freqs).double()
    turn = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * turn).flatten(-2)


def reference(attn: LatentAttention, x: torch.Tensor, positions: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The attention one head at a time, in plain torch: each head's query, its key from
    the latent and the shared rotary key, its value, causal softmax (inside each document
    when `positions` are given), then the output projection."""
    cfg = attn.cfg
    b, t, _ = x.shape
    at = torch.arange(t) if positions is None else positions
    if cfg.q_lora_rank:
        q = rms(x @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight) @ attn.q_b_proj.weight.T
    else:
        q = x @ attn.q_proj.weight.T
    q = q.view(b, t, HEADS, cfg.qk_head_dim)
    compressed = x @ attn.kv_a_proj_with_mqa.weight.T
    latent = rms(compressed[..., :cfg.kv_lora_rank], attn.kv_a_layernorm.weight)
    k_rope = compressed[..., cfg.kv_lora_rank:]
    kv = (latent @ attn.kv_b_proj.weight.T).view(b, t, HEADS, -1)
    heads = []
    for i in range(b):
        where = at if at.dim() == 1 else at[i]
        shared = rotate_pairs(k_rope[i], where)  # (t, rope)
        for h in range(HEADS):
            q_nope, q_rope = q[i, :, h, :cfg.qk_nope_head_dim], q[i, :, h, cfg.qk_nope_head_dim:]
            k_nope = kv[i, :, h, :cfg.qk_nope_head_dim]
            v = kv[i, :, h, cfg.qk_nope_head_dim:]
            scores = (q_nope @ k_nope.T + rotate_pairs(q_rope, where) @ shared.T)
            scores = scores / math.sqrt(cfg.qk_head_dim)
            seen = torch.ones(t, t, dtype=torch.bool).tril()
            if positions is not None:  # the same document: j within i's own start
                seen &= (torch.arange(t)[None, :] >= torch.arange(t)[:, None] - where[:, None])
            heads.append(torch.softmax(scores.masked_fill(~seen, -math.inf), -1) @ v)
    out = torch.stack(heads).view(b, HEADS, t, cfg.v_head_dim).transpose(1, 2)
    return out.reshape(b, t, -1) @ attn.o_proj.weight.T


DRAWING = threading.Lock()


def reference_case(q_lora_rank: int, t: int
                   ) -> tuple[LatentAttention, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the attention, an input x of `t` tokens with its gradient, the output's gradient,
    the reference's output) after the reference's backward: what the parallel tests
    split, alike on every rank (float64; one thread at a time: `attention` draws from
    torch's global generator)."""
    with DRAWING:
        attn = attention(q_lora_rank)
    gen = torch.Generator().manual_seed(1)  # threads: each its own, all alike
    x = torch.randn(2, t, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    dout = torch.randn(2, t, DIM, dtype=torch.float64, generator=gen)
    want = reference(attn, x)
    want.backward(dout)
    return attn, x, dout, want.detach()


@pytest.mark.parametrize("q_lora_rank", [0, 16], ids=["plain-queries", "query-bottleneck"])
def test_forward_and_backward_equal_the_plain_reference(q_lora_rank: int) -> None:
    attn = attention(q_lora_rank)
    x = torch.randn(2, 7, DIM, dtype=torch.float64, requires_grad=True)
    got, want = attn(x), reference(attn, x)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    params = [x, *attn.parameters()]
    for g, w in zip(torch.autograd.grad(got, params, grad),
                    torch.autograd.grad(want, params, grad), strict=True):
        torch.testing.assert_close(g, w)


def test_packed_documents_attend_inside_each() -> None:
    """Rows of two documents (positions restart at each): the reference's per-document
    mask and positions, through dtrain's PackedDocuments as the model passes them."""
    from dtrain.models.llama_parts import rotary
    from dtrain.models.rows import PackedDocuments

    attn = attention(16)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    cos, sin = rotary(7, 8, THETA, x.device, x.dtype, positions.reshape(-1))
    rope = (cos.view(2, 1, 7, 8), sin.view(2, 1, 7, 8))
    got = attn(x, rope, PackedDocuments.of(positions, context_parallel=False))
    torch.testing.assert_close(got, reference(attn, x, positions))


def test_the_latent_widths_are_checked_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"model\.qk_rope_head_dim = 7 is odd"):
        MLAConfig(**{**WIDTHS, "qk_rope_head_dim": 7})
    with pytest.raises(ConfigError, match=r"needs model\.kv_lora_rank above 0"):
        MLAConfig(**{**WIDTHS, "kv_lora_rank": 0})


MLA_LLAMA = ModelConfig(arch="llama", n_layer=2, n_embd=32, n_head=4, ffn_hidden=48,
                        block_size=24, attention="mla", q_lora_rank=16, **WIDTHS)


def model_of(cfg: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return build(resolve(cfg, 64)).eval()


def greedy(model: torch.nn.Module, prompt: torch.Tensor, steps: int, cached: bool
           ) -> torch.Tensor:
    """`steps` most likely tokens after `prompt`: through the KV cache, or each step's
    whole sequence again."""
    ids = prompt
    cache = attach(model) if cached else None
    with torch.no_grad():
        for _ in range(steps):
            fed = ids if cache is None else ids[:, cache.length:]
            logits = model(fed)[:, -1]
            if cache is not None:
                cache.advance(fed.shape[1])
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    detach(model)
    return ids


def test_the_cache_keeps_the_latent_and_gives_the_same_tokens() -> None:
    """A Llama with latent attention: logits fed through the cache a few tokens at a time
    equal the full forward's; greedy generation gives the same tokens with and without
    it; each layer keeps kv_lora_rank + qk_rope_head_dim numbers per token."""
    model = model_of(MLA_LLAMA)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = attach(model)
        parts = []
        for lo, hi in ((0, 5), (5, 6), (6, 9), (9, 12)):
            parts.append(model(ids[:, lo:hi]))
            cache.advance(hi - lo)
        assert all(isinstance(layer, LatentCache) for layer in cache.layers)
        assert cache.nbytes() == 2 * 2 * 12 * (12 + 8) * 4  # layers x rows x tokens x floats
        detach(model)
    torch.testing.assert_close(torch.cat(parts, dim=1), full)
    prompt = ids[:, :4]
    assert greedy(model, prompt, 12, cached=True).tolist() == \
        greedy(model, prompt, 12, cached=False).tolist()


def test_latent_cache_bytes_beside_grouped_query_attention() -> None:
    """At the same width and heads, per token and layer: multi-head attention keeps 2 x
    heads x head size numbers, grouped-query 2 x kv heads x head size, latent attention its
    latent and rope key (benchmarks/mla_cache.py prints the table at a larger width)."""
    prompt = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    per_token = {}
    for name, cfg in {"mha": ModelConfig(arch="llama", n_layer=2, n_embd=32, n_head=4,
                                         ffn_hidden=48, block_size=24),
                      "gqa": ModelConfig(arch="llama", n_layer=2, n_embd=32, n_head=4,
                                         n_kv_head=2, ffn_hidden=48, block_size=24),
                      "mla": MLA_LLAMA}.items():
        model = model_of(cfg)
        cache = attach(model)
        with torch.no_grad():
            model(prompt)
        cache.advance(10)
        per_token[name] = cache.nbytes() // (10 * 2)  # per token and layer
        detach(model)
    assert per_token == {"mha": 2 * 4 * 8 * 4, "gqa": 2 * 2 * 8 * 4, "mla": (12 + 8) * 4}


def test_an_mla_llama_trains_its_latent_projections() -> None:
    """Every parameter of the latent attention takes a gradient through the model's loss."""
    model = model_of(MLA_LLAMA).train()
    x = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    model(x, torch.roll(x, -1, 1))[1].backward()
    attn = model.blocks[0].attn
    assert isinstance(attn, LatentAttention)
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert F.cross_entropy(model.eval()(x).reshape(-1, 64), torch.roll(x, -1, 1).reshape(-1))


def test_pipeline_pieces_of_an_mla_llama_equal_the_whole_model() -> None:
    """Cut into two pipeline stages by its blocks, the stages in sequence give the whole
    model's logits (each stage computes its own rotary angles of the latent part)."""
    from dtrain import pipeline

    model = model_of(MLA_LLAMA)
    x = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(4))
    h = x
    with torch.no_grad():
        for piece in pipeline.cut(model, 2):
            h = piece(h)
        torch.testing.assert_close(h, model(x))
