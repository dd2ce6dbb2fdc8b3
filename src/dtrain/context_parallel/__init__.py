"""Context parallelism: every sequence split between the ranks of a group, everywhere.

Sequence parallelism (dtrain.tensor_parallel) splits the sequence only between
tensor-parallel layers; attention still sees it whole. Context parallelism gives each rank
of a cp group two of the sequence's 2 x cp chunks (`chunks`, balanced for causal
attention) for the whole model: embeddings, blocks, head and loss run on those tokens,
and only attention meets the others (`attention`: a ring of key/value blocks, one
all-gather of keys and values, or Ulysses' all-to-all). Positions are the global ones.
Parameters are replicated over cp, so their gradients average over dp x cp.

    cp = ContextParallel(mesh.group("cp"), method="ring")
    dtrain.models.context.apply(model, cp)      # dtrain's GPT or Llama
    x, y = chunks.shard(x, cp.rank, cp.size), chunks.shard(y, cp.rank, cp.size)
    loss = model(x, y)[1]                       # this rank's tokens' mean loss

Modules: chunks (who holds which tokens), exchange (the differentiable all-gather and
all-to-all), attention (`ContextParallel` and its three methods). A model's attention
and positions are set by dtrain.models.context.
"""

from dtrain.context_parallel import chunks
from dtrain.context_parallel.attention import METHODS, ContextParallel, positions_of

__all__ = ["METHODS", "ContextParallel", "chunks", "positions_of"]
