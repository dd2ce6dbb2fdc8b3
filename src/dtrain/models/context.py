"""Context parallelism on a model: its attention over the whole sequence, its positions.

    cp = ContextParallel(mesh.group("cp"), method="ring")   # dtrain.context_parallel
    apply(model, cp)

After `apply`, dtrain's GPT or Llama (or a Hugging Face model of the Llama family, whose
attention layers then call dtrain's through transformers' attention interface) takes this
rank's two chunks of each sequence
(dtrain.context_parallel.chunks.shard) instead of whole sequences: its embeddings, norms,
MLPs, head and loss run on those tokens alone, its positions (GPT's learned embedding,
Llama's rotary angles) are the tokens' places in the whole sequence, and every attention
core meets the other ranks' keys and values through `cp`. The loss it returns is the mean
over this rank's tokens; every rank holds as many, so the mean over the cp group is the
whole sequence's, and averaging gradients over dp x cp gives one process's.
"""

from __future__ import annotations

import torch
from torch import nn

from dtrain.context_parallel import ContextParallel
from dtrain.errors import ConfigError, DtrainError
from dtrain.models.hf import HF_DOCUMENTS, Family, HFCausalLM
from dtrain.models.stages import AttentionCore, StagedLM

HF_ATTENTION = "dtrain_context_parallel"
"""The name dtrain's attention is registered under in transformers' AttentionInterface."""


def apply(model: nn.Module, cp: ContextParallel) -> nn.Module:
    """Run `model` on this rank's chunks of each sequence (see the module doc); returns
    it, changed in place.

    Raises:
        ConfigError: a model other than dtrain's GPT and Llama and a Hugging Face model of
            the Llama family (Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE).
    """
    if isinstance(model, HFCausalLM) and model.family is Family.ROTARY:
        return _apply_hf(model, cp)
    if not isinstance(model, StagedLM):
        raise ConfigError(f"context parallelism runs dtrain's GPT and Llama and Hugging Face "
                          f"models of the Llama family, not {type(model).__name__}: use cp = 1")
    model.context = cp
    for module in model.modules():
        if isinstance(module, AttentionCore):
            module.context = cp
    return model


def _apply_hf(model: HFCausalLM, cp: ContextParallel) -> HFCausalLM:
    """A Hugging Face model of the Llama family: its attention layers call dtrain's through
    transformers' attention interface, and it is given its tokens' global positions."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    model.hf.set_attn_implementation(HF_ATTENTION)
    model.context = cp
    for layer in model.hf.model.layers:
        layer.self_attn.context = cp
    return model


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: object
                  ) -> tuple[torch.Tensor, None]:
    """transformers' attention call (query (batch, heads, tokens, dim), key and value with
    their own heads) answered by the module's ContextParallel, causal over the whole
    sequence; the output as transformers expects it, (batch, tokens, heads, dim)."""
    if dropout:
        raise DtrainError("attention dropout under context parallelism: set the model's "
                          "attention_dropout to 0")
    cp: ContextParallel = module.context  # type: ignore[assignment]  # set by _apply_hf
    given = kwargs.get("position_ids") if kwargs.get(HF_DOCUMENTS) else None
    documents = given if isinstance(given, torch.Tensor) else None  # packed documents'
    return cp.attention(query, key, value, causal=True, scale=scaling,
                        documents=documents).transpose(1, 2), None
