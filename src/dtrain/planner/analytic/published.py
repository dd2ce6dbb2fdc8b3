"""Published large-scale training runs: what the cluster planner is checked against (its
tests, and benchmarks/cluster_validation.py).

The figures are data: Megatron-LM's Table 1 (Narayanan et al., 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), the 530B runs of
Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models")
and Llama 3 405B's Table 4 (Dubey et al., 2024, "The Llama 3 Herd of Models"); each helper
plans a published layout as its authors ran it.
"""

from __future__ import annotations

from dtrain.errors import DtrainError
from dtrain.planner.analytic.cluster import CHUNKS, ClusterEstimate, Software
from dtrain.planner.analytic.hardware import Cluster, hardware
from dtrain.planner.analytic.search import best_layout
from dtrain.planner.shape import ModelShape

# params (B), heads, hidden, layers, tp, pp, GPUs, global batch, achieved TFLOP/s per GPU;
# sequence 2048, vocabulary 51,200, A100 80GB nodes of 8, full activation recomputation
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
FITTED_ON = (0, 9)  # the rows hardware.gemm_efficiency was fitted on (the first and last)
# Korthikanti et al. 2022: the 530B GPT on 2240 A100s (tp 8, pp 35, dp 8), a global batch
# of 2240 sequences (280 per data-parallel copy of the model), model FLOPs utilization
# with full recomputation and with sequence parallelism + selective recomputation (no
# flash attention then).
KORTHIKANTI_530B = [("full", False, 0.421), ("selective", True, 0.542)]
MEGATRON_2021 = Software(flash_attention=False, lean_norms=False)
# Llama 3 405B, Table 4 (H100 80GB, 8 per node, bf16; global batch 16M tokens): GPUs, tp,
# cp, pp, dp, sequence, global batch in sequences, TFLOP/s per GPU and MFU as Meta counts
# them (model FLOPs, recomputation not counted; attention's causal half, our reading)
LLAMA_3_TABLE_4 = [
    (8192, 8, 1, 16, 64, 8192, 2048, 430, 0.43),
    (16384, 8, 1, 16, 128, 8192, 2048, 400, 0.41),
    (16384, 8, 16, 16, 8, 131072, 128, 380, 0.38),
]


def megatron_row(row: tuple) -> tuple[ModelShape, Cluster, float, int, int, int, int, float]:
    """A row of MEGATRON_TABLE_1 as (shape, cluster, parameters in billions, tp, pp, GPUs,
    global batch, published TFLOP/s per GPU)."""
    params, heads, hidden, layers, tp, pp, gpus, batch, tflops = row
    shape = ModelShape(layers, hidden, heads, 2048, 51200)
    return shape, Cluster(hardware("a100-80gb"), gpus // 8, 8), params, tp, pp, gpus, \
        batch, tflops


def published_layout(shape: ModelShape, cluster: Cluster, batch: int, tp: int, pp: int,
                     recompute: str = "full", sp: bool = False,
                     soft: Software = MEGATRON_2021) -> ClusterEstimate:
    """The published degrees with their best micro-batch size and virtual stages.

    Raises:
        DtrainError: the planner predicts the published layout does not fit.
    """
    best = best_layout(shape, cluster, batch, tp, pp, cluster.gpus // (tp * pp),
                       zeros=(0,), recompute=(recompute,), sequence_parallel=(sp,), soft=soft)
    if best is None or not best.fits:
        raise DtrainError("the published layout is predicted not to fit")
    return best


def llama_3_405b(seq: int) -> ModelShape:
    """Llama 3 405B's shape at sequence length `seq`."""
    return ModelShape(126, 16384, 128, seq, 128256, "llama", kv_heads=8, ffn=53248)


def llama_row(row: tuple) -> tuple[ClusterEstimate, float]:
    """(the published layout planned as Meta ran it, its TFLOP/s per GPU as Meta counts
    them): ZeRO 1 (FSDP keeping the weights gathered, fp32 gradients accumulated whole),
    sequence parallelism, keys and values all-gathered over cp, the fastest micro-batch,
    virtual stages and recomputation that fit.

    Raises:
        DtrainError: the planner predicts the published layout does not fit.
    """
    gpus, tp, cp, pp, dp, seq, batch = row[:7]
    shape = llama_3_405b(seq)
    cluster = Cluster(hardware("h100-80gb"), gpus // 8, 8)
    best = best_layout(shape, cluster, batch, tp, pp, dp, (1, 2), CHUNKS, (1,),
                       sequence_parallel=(True,), cp=cp, cp_methods=("allgather",))
    if best is None or not best.fits:
        raise DtrainError("the published layout is predicted not to fit")
    return best, best.tokens_per_s * shape.model_flops_per_token(causal=True) / gpus / 1e12
