"""Sampling text from any of dtrain's models, a token at a time through a KV cache.

    ids = generate(model, prompt, new_tokens=200, block_size=model.block_size,
                   generator=torch.Generator().manual_seed(0))

Each step feeds the model only the tokens it has not seen (dtrain.models.kv_cache: the
prompt once, then the last token), takes the last position's logits and draws the next
token from softmax(logits / temperature) with the generator given. A model that cannot
keep a cache (a user's own module) is fed its whole window each step instead. Either way a
sequence longer than `block_size` is read through its last `block_size` tokens, from
position 0, the positions it was trained on.

The same steps run a model split over ranks (dtrain.train.generation): `pick_token` is
the one draw every path makes, so the same seed gives the same text in any layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.kv_cache import KVCache, LatentCache, LayerCache
from dtrain.models.mla import LatentAttention
from dtrain.models.stages import AttentionCore, StagedLM


def _holders(model: nn.Module) -> list[AttentionCore | LatentAttention]:
    """The modules that keep a layer's cache, in module order: each latent attention (its
    cache is compressed: its core is fed the decompressed keys) and every other attention
    core."""
    holders: list[AttentionCore | LatentAttention] = []
    inside: set[int] = set()
    for m in model.modules():  # a latent attention comes before its core
        if isinstance(m, LatentAttention):
            holders.append(m)
            inside.add(id(m.core))
        elif isinstance(m, AttentionCore) and id(m) not in inside:
            holders.append(m)
    return holders


def attach(model: nn.Module, staged: bool = False) -> KVCache | None:
    """Give `model` (dtrain's GPT or Llama, or a Hugging Face causal LM) an empty KV
    cache, its layer caches on its attention cores (on its latent attentions, a
    `LatentCache` of their compressed latents); None for a model that cannot keep one
    (a user's own module; a Hugging Face model run in pipeline stages, `staged`, whose
    blocks dtrain calls one by one), which is then fed its whole window each step.

    Raises:
        ConfigError: the model runs under context or sequence parallelism (each rank holds
            part of every sequence; generation feeds one token at a time).
    """
    if getattr(model, "context", None) is not None:
        raise ConfigError("generation runs with parallel.cp = 1: context parallelism splits "
                          "every sequence, and generation feeds one token at a time")
    if getattr(model, "sequence_parts", 1) > 1:
        raise ConfigError("generation runs without parallel.sequence_parallel: it splits "
                          "every sequence, and generation feeds one token at a time")
    hf = getattr(model, "hf", None) is not None and hasattr(model, "kv_cache")
    if not isinstance(model, StagedLM) and not (hf and not staged):
        return None
    layers: list[LayerCache | LatentCache] = []
    for holder in _holders(model):
        if isinstance(holder, LatentAttention):
            holder.cache = LatentCache()
            layers.append(holder.cache)
        else:
            holder.cache = LayerCache()
            layers.append(holder.cache)
    cache = KVCache(layers)
    # an attribute of the model's class (StagedLM, HFCausalLM), not a submodule
    model.kv_cache = cache  # type: ignore[assignment]
    return cache


def detach(model: nn.Module) -> None:
    """Take `attach`'s cache off `model` again: its forward is the full one again."""
    for holder in _holders(model):
        holder.cache = None
    if getattr(model, "kv_cache", None) is not None:
        model.kv_cache = None  # type: ignore[assignment]  # as in attach


def window(ids: torch.Tensor, block_size: int, cache: KVCache | None) -> torch.Tensor:
    """The tokens of `ids` (batch, time) the next forward reads: the unseen ones with a
    cache (`KVCache.window`), else the last `block_size`."""
    return ids[:, -block_size:] if cache is None else cache.window(ids, block_size)


def pick_token(logits: torch.Tensor, generator: torch.Generator | None,
               temperature: float) -> torch.Tensor:
    """One token per row of `logits` (batch, vocabulary; the whole vocabulary), drawn from
    softmax(logits / temperature) with `generator`: (batch, 1) token ids."""
    probs = F.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, new_tokens: int, block_size: int,
             temperature: float = 0.8, generator: torch.Generator | None = None) -> torch.Tensor:
    """Append `new_tokens` sampled tokens to each row of `idx`, the model seeing at most
    the last `block_size` tokens (its forward(idx) gives logits, or an output with
    `.logits`), through a KV cache where the model keeps one.

    Raises:
        ConfigError: the model runs under context or sequence parallelism.
    """
    was_training = model.training
    model.eval()
    cache = attach(model)
    try:
        for _ in range(new_tokens):
            fed = window(idx, block_size, cache)
            out = model(fed)
            if cache is not None:
                cache.advance(fed.shape[1])
            logits = getattr(out, "logits", out)[:, -1, :]
            idx = torch.cat([idx, pick_token(logits, generator, temperature)], dim=1)
    finally:
        detach(model)
        model.train(was_training)
    return idx
