"""dtrain.tensor_parallel: Megatron-style tensor parallelism on dtrain.comm.

Split each big layer's weights across the ranks of a tensor-parallel group, so a model too
big for one device trains at all, and every rank computes a slice of every layer:

    mesh = dtrain.Mesh(tp=2)                      # or Mesh(dp=2, tp=2): tp inside, dp outside
    model = GPT(cfg)                              # the whole model, same seed on every rank
    tensor_parallel.parallelize(model, tensor_parallel.gpt_plan(cfg), mesh.group("tp"))
    model = dtrain.DataParallel(model, group=mesh.group("dp"))   # optional, over dp
    ...
    loss.backward()
    tensor_parallel.clip_grad_norm_(model, 1.0)   # the norm of the whole gradient
    state = tensor_parallel.full_state_dict(model)   # loads into the plain GPT

Layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, and the
vocab-parallel cross-entropy; their communication is in `functions` (Megatron's f and g).
`apply_sequence_parallel` (or `split_model(..., sequence_parallel=True)`) then keeps the
activations between the split layers as 1/tp of the sequence on each rank (`sequence`).
"""

from dtrain.split import Split
from dtrain.tensor_parallel.functions import (
    SequenceGather,
    copy_to_group,
    gather_last,
    gather_sequence,
    reduce_from_group,
    reduce_scatter_sequence,
    scatter_last,
    scatter_sequence,
)
from dtrain.tensor_parallel.hf_plans import hf_plan
from dtrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from dtrain.tensor_parallel.loss import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from dtrain.tensor_parallel.parallelize import Colwise, Rowwise, Vocab, VocabLoss, parallelize
from dtrain.tensor_parallel.plan_of import plan_of, split_model
from dtrain.tensor_parallel.plans import (
    bert_plan,
    gpt_plan,
    latent_attention_plan,
    llama_plan,
)
from dtrain.tensor_parallel.sequence import apply_sequence_parallel
from dtrain.tensor_parallel.whole import (
    clip_grad_norm_,
    full_grads,
    full_optimizer_state,
    full_state_dict,
    load_full_state_dict,
    parameter_bytes,
    placements,
)

__all__ = [
    "Colwise", "ColumnParallelLinear", "RowParallelLinear", "Rowwise", "SequenceGather",
    "Split", "Vocab", "VocabLoss", "VocabParallelCrossEntropy", "VocabParallelEmbedding",
    "apply_sequence_parallel", "bert_plan", "clip_grad_norm_", "copy_to_group", "full_grads",
    "full_optimizer_state", "full_state_dict", "gather_last", "gather_sequence", "gpt_plan",
    "hf_plan", "latent_attention_plan", "llama_plan", "load_full_state_dict", "parallelize",
    "parameter_bytes", "placements", "plan_of", "reduce_from_group", "reduce_scatter_sequence",
    "scatter_last", "scatter_sequence", "split_model", "vocab_parallel_cross_entropy",
]
