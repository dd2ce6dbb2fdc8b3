"""Context parallelism on a model: its attention over the whole sequence, its positions.

    cp = ContextParallel(mesh.group("cp"), method="ring")   # dtrain.context_parallel
    apply(model, cp)

After `apply`, dtrain's GPT or Llama takes this rank's two chunks of each sequence
(dtrain.context_parallel.chunks.shard) instead of whole sequences: its embeddings, norms,
MLPs, head and loss run on those tokens alone, its positions (GPT's learned embedding,
Llama's rotary angles) are the tokens' places in the whole sequence, and every attention
core meets the other ranks' keys and values through `cp`. The loss it returns is the mean
over this rank's tokens; every rank holds as many, so the mean over the cp group is the
whole sequence's, and averaging gradients over dp x cp gives one process's.
"""

from __future__ import annotations

from torch import nn

from dtrain.context_parallel import ContextParallel
from dtrain.errors import ConfigError
from dtrain.models.stages import AttentionCore, StagedLM


def apply(model: nn.Module, cp: ContextParallel) -> nn.Module:
    """Run `model` on this rank's chunks of each sequence (see the module doc); returns
    it, changed in place.

    Raises:
        ConfigError: a model other than dtrain's GPT and Llama.
    """
    if not isinstance(model, StagedLM):
        raise ConfigError(f"context parallelism runs dtrain's GPT and Llama (model.arch = "
                          f"\"gpt\" or \"llama\"), not {type(model).__name__}: use cp = 1")
    model.context = cp
    for module in model.modules():
        if isinstance(module, AttentionCore):
            module.context = cp
    return model
