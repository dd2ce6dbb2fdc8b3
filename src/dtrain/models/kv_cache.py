"""Keys and values of the tokens a model has seen, so generation feeds each new token once.

Without a cache every generated token re-runs the whole prefix: t tokens cost t forwards
of up to `block_size` positions each. With one, each attention core keeps the keys and
values it computed, and a forward reads only the tokens not yet seen (the prompt once,
then one token per step): the same logits, to float rounding, for a fraction of the work.

    cache = attach(model)                 # dtrain.models.generate; None: it cannot cache
    logits = model(ids); cache.advance(ids.shape[1])
    logits = model(next_id); cache.advance(1)
    detach(model)

The cache lives beside the modules that read it: each `AttentionCore` gets a `LayerCache`
of its own (under tensor parallelism, of this rank's heads only), and the model its
`KVCache`, whose `length` offsets the positions of the next tokens (learned positions,
rotary angles). A Hugging Face model keeps transformers' own `DynamicCache` in it.
Putting the caches on a model and taking them off is dtrain.models.generate's.

Multi-head latent attention (dtrain.models.mla) keeps a `LatentCache` instead: per token
the compressed latent its keys and values are decompressed from (kv_lora_rank numbers) and
the rotary key every head shares (qk_rope_head_dim), not each head's keys and values; it
decompresses them on every read. That is MLA's point at inference: DeepSeek-V3 keeps 576
numbers per token and layer where multi-head attention of its 128 heads would keep 32768
(`nbytes` counts what a cache holds).
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention core's keys and values so far, (batch, kv heads, time, head size)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append the new tokens' `k` and `v`; returns every key and value kept, and how
        many tokens came before the new ones."""
        if self.k is None or self.v is None:
            self.k, self.v = k, v
            return k, v, 0
        before = self.k.shape[2]
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        return self.k, self.v, before

    def clear(self) -> None:
        self.k = self.v = None

    def nbytes(self) -> int:
        """Bytes the kept keys and values take."""
        return sum(t.nbytes for t in (self.k, self.v) if t is not None)


class LatentCache:
    """One latent attention's compressed keys and values so far: the normalized latent
    (batch, time, kv_lora_rank) and the rotated key part every head shares (batch, 1, time,
    qk_rope_head_dim), from which the attention decompresses each head's keys and values."""

    def __init__(self) -> None:
        self.latent: torch.Tensor | None = None
        self.rope: torch.Tensor | None = None

    def extend(self, latent: torch.Tensor, rope: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append the new tokens' `latent` and `rope` key; returns every latent and rope
        key kept, and how many tokens came before the new ones."""
        if self.latent is None or self.rope is None:
            self.latent, self.rope = latent, rope
            return latent, rope, 0
        before = self.latent.shape[1]
        self.latent = torch.cat([self.latent, latent], dim=1)
        self.rope = torch.cat([self.rope, rope], dim=2)
        return self.latent, self.rope, before

    def clear(self) -> None:
        self.latent = self.rope = None

    def nbytes(self) -> int:
        """Bytes the kept latents and rope keys take."""
        return sum(t.nbytes for t in (self.latent, self.rope) if t is not None)


class KVCache:
    """A model's layer caches and how many tokens they hold (`length`): the position of
    the next token fed."""

    def __init__(self, layers: list[LayerCache | LatentCache]) -> None:
        self.layers = layers
        self.length = 0
        self.hf: object | None = None
        """A Hugging Face model's DynamicCache (dtrain.models.hf), made on its first use."""

    def advance(self, tokens: int) -> None:
        """The forward just run fed `tokens` more tokens."""
        self.length += tokens

    def nbytes(self) -> int:
        """Bytes the layer caches hold (dtrain's own models; a Hugging Face model's cache is
        transformers' and not counted)."""
        return sum(layer.nbytes() for layer in self.layers)

    def reset(self) -> None:
        """Forget every token: the next forward starts at position 0."""
        for layer in self.layers:
            layer.clear()
        self.length, self.hf = 0, None

    def window(self, ids: torch.Tensor, block_size: int) -> torch.Tensor:
        """The tokens of `ids` (batch, time) the next forward reads: those not yet seen,
        or, once `ids` outgrows `block_size`, its last `block_size` tokens from position
        0 again (the cache emptied), as a model without a cache reads them."""
        if ids.shape[1] > block_size:
            self.reset()
            return ids[:, -block_size:]
        return ids[:, self.length:]
