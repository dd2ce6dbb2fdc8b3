"""Published large-scale training runs: what the cluster planner is checked against (its
tests, and benchmarks/cluster_validation.py).

The figures are data: Megatron-LM's Table 1 (Narayanan et al., 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), the 530B runs of
Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models")
and Llama 3 405B's Table 4 (Dubey et al., 2024, "The Llama 3 Herd of Models"); each helper
plans a published layout as its authors ran it. The Zero Bubble paper's bubble rates and
the times they were computed from check the pipeline schedules' bubbles
(dtrain.planner.costs; tests/planner/test_plan_zero_bubble.py,
benchmarks/plan_zero_bubble.py).

Runs of other frameworks and mixture-of-experts runs are `PublishedRun`s, each with its
source, layout and what its software did (`OTHER_FRAMEWORKS`: 2022's Megatron-DeepSpeed
runs, dense, on A100s; `MOE_RUNS`: DeepSeek-V3 as DeepSeek trained it and as
Megatron-Core runs it, Qwen3-235B-A22B with and without Megatron-Core's all-to-all
overlap). Two constants come from them, each fitted on one run and checked on the others:
the Megatron-DeepSpeed framework's share of Megatron-LM's kernel rate
(dtrain.planner.analytic.software.FRAMEWORKS) and `MEGATRON_1F1B_OVERLAP`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtrain.errors import DtrainError
from dtrain.planner.analytic.cluster import CHUNKS, ClusterEstimate, Software
from dtrain.planner.analytic.hardware import Cluster, hardware
from dtrain.planner.analytic.search import best_layout
from dtrain.planner.costs import bubble, fill_share
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


MEGATRON_SCHEDULES = ("1f1b", "interleaved")
"""The schedules those runs used: Megatron-LM's 1F1B, interleaved over virtual stages."""


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
                       zeros=(0,), recompute=(recompute,), sequence_parallel=(sp,), soft=soft,
                       schedules=MEGATRON_SCHEDULES)
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
                       sequence_parallel=(True,), cp=cp, cp_methods=("allgather",),
                       schedules=MEGATRON_SCHEDULES)
    if best is None or not best.fits:
        raise DtrainError("the published layout is predicted not to fit")
    return best, best.tokens_per_s * shape.model_flops_per_token(causal=True) / gpus / 1e12


@dataclass(frozen=True)
class PublishedRun:
    """A published training run, planned with its published layout and what its software
    did (the options the authors did not publish left to the planner's fastest).

    `published` is per GPU, in `unit`: "TFLOP/s" (the hardware's FLOPs, recomputation
    counted, as Megatron-LM and its forks report them) or "tokens/s" (where the run's
    FLOP count differs from the planner's, or only time is published).
    """

    name: str
    source: str
    shape: ModelShape
    cluster: Cluster
    batch: int
    tp: int
    pp: int
    dp: int
    published: float
    unit: str
    soft: Software
    ep: int = 1
    schedule: str = "1f1b"
    chunks: tuple[int, ...] = (1,)
    micro_batches: tuple[int, ...] = (1,)
    zeros: tuple[int, ...] = (1,)
    recompute: tuple[str, ...] = ("full",)
    sequence_parallel: bool = False
    forced_balance: bool = False
    note: str = ""

    @property
    def gpus(self) -> int:
        return self.cluster.gpus

    def plan(self) -> ClusterEstimate:
        """The published layout planned as run.

        Raises:
            DtrainError: no micro-batch size or stage count the run allows splits its batch.
        """
        best = best_layout(self.shape, self.cluster, self.batch, self.tp, self.pp, self.dp,
                           self.micro_batches, self.chunks, self.zeros, self.recompute,
                           (self.sequence_parallel,), self.soft, self.ep,
                           schedules=(self.schedule,))
        if best is None:
            raise DtrainError(f"{self.name}: the published layout does not split the batch")
        return best

    def predicted(self, estimate: ClusterEstimate | None = None) -> float:
        """The planner's figure in the run's `unit`, per GPU."""
        estimate = estimate or self.plan()
        if self.unit == "tokens/s":
            return estimate.tokens_per_s / self.gpus
        return estimate.tflops_per_gpu

    def error(self, estimate: ClusterEstimate | None = None) -> float:
        """predicted / published - 1."""
        return self.predicted(estimate) / self.published - 1


def _a100(nodes: int, **figures: str) -> Cluster:
    return Cluster(hardware("a100-80gb", figures), nodes, 8)


MT_NLG = ModelShape(105, 20480, 128, 2048, 50272)
"""Megatron-Turing NLG 530B (the same shape as Megatron-LM's Table 1 row of 529.6B)."""
BLOOM = ModelShape(70, 14336, 112, 2048, 250880)
"""BLOOM 176B: GPT-like, its 250,680-token vocabulary padded to 250,880 (ALiBi for
positions: the shape's learned positions, 0.02% of the parameters, stand in)."""
GLM_130B = ModelShape(70, 12288, 96, 2048, 150528, "llama", ffn=32768, dropout=True)
"""GLM-130B: GeGLU MLPs of 32,768 (3 matrices, as a llama shape's SwiGLU), 150,528 tokens,
dropout 0.1; 130.5B parameters counted."""
DEEPSPEED_2022 = dataclasses.replace(MEGATRON_2021, framework="megatron-deepspeed")
"""2022's Megatron-DeepSpeed: Megatron-LM's kernels of that year (no flash attention),
DeepSpeed's pipeline engine (1F1B, the gradients reduced after the last micro-batch)."""

OTHER_FRAMEWORKS = [
    *(PublishedRun(
        f"MT-NLG 530B, {nodes * 8:,} A100 80GB", "Smith et al. 2022, arXiv 2201.11990, "
        "section 2.4", MT_NLG, _a100(nodes), 1920, 8, 35, nodes * 8 // 280, tflops,
        "TFLOP/s", DEEPSPEED_2022, micro_batches=(1, 2),
        note="fitted: the framework's kernel share" if nodes == 280 else "")
      for nodes, tflops in ((280, 126.0), (350, 121.0), (420, 113.0))),
    PublishedRun(
        "BLOOM 176B, 384 A100 80GB", "BigScience, bigscience-workshop/bigscience "
        "train/tr11-176B-ml (README, slurm script; 'about 150 TFLOPs')", BLOOM,
        _a100(48, inter_gbps="6.25"), 2048, 4, 12, 8, 150.0, "TFLOP/s", DEEPSPEED_2022,
        micro_batches=(2,),
        note="4 x 100 Gbit/s Omni-Path per node of 8: 6.25 GB/s per GPU"),
    PublishedRun(
        "GLM-130B, 768 A100 40GB", "Zeng et al. 2022, arXiv 2210.02414, section 2.3 "
        "(HFU 43.3% of 312)", GLM_130B, Cluster(hardware("a100-40gb"), 96, 8), 4224, 4, 8,
        24, 0.433 * 312, "TFLOP/s", DEEPSPEED_2022, micro_batches=(1, 2), zeros=(0, 1),
        note="DeepSpeed's PipeDream-Flush; FP16"),
]
"""Dense runs of 2022 trained with Megatron-DeepSpeed (Megatron-LM's layers in DeepSpeed's
pipeline engine), each recomputing whole layers as it ran: planned with that framework's
share of Megatron-LM's kernel rate, fitted on the first (software.FRAMEWORKS)."""

DEEPSEEK_V3 = ModelShape(61, 7168, 128, 4096, 129280, "llama", ffn=18432, experts=256,
                         top_k=8, moe_ffn=2048, shared_experts=1, moe_layers=58, n_group=8,
                         topk_group=4, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         mtp_depth=1)
"""DeepSeek-V3 (arXiv 2412.19437; its config.json): 671B parameters, 37.6B active, one
multi-token prediction module, pretrained at 4,096 tokens."""
QWEN3_235B = ModelShape(94, 4096, 64, 4096, 151936, "llama", kv_heads=4, head_dim=128,
                        qk_norm=True, ffn=12288, experts=128, top_k=8, moe_ffn=1536)
"""Qwen3-235B-A22B at 4,096 tokens."""
MEGATRON_1F1B_OVERLAP = 0.38
"""The share of the all-to-all Megatron-Core's 1F1B all-to-all overlap
(--overlap-moe-expert-parallel-comm) hides, as this planner counts it: fitted on the
Qwen3-235B pair of Megatron-Core's MoE model zoo (245 -> 276 TFLOP/s per H100 with it,
`MOE_RUNS`), checked on DeepSeek-V3 on 1,024 H100s (Megatron-Bridge)."""
DEEPSEEK_V3_RUN = Software(float8=True, dispatch="deepep", a2a_overlap=1.0)
"""DeepSeek's own: FP8 linear layers (experts included), DeepEP's kernels, DualPipe
hiding the all-to-all under compute (its report: 'near-zero all-to-all communication
overhead')."""
_H800 = Cluster(hardware("h800"), 256, 8)
_H100_DEEPSEEK = Cluster(hardware("h100-80gb"), 128, 8)
_H100_QWEN = Cluster(hardware("h100-80gb"), 32, 8)
_MODEL_ZOO = ("Megatron-Core MoE model zoo, yanring/Megatron-MoE-ModelZoo "
              "best_practice/qwen3/readme.md (its H100 table, BF16)")

MOE_RUNS = [
    PublishedRun(
        "DeepSeek-V3, 2,048 H800, as run", "DeepSeek-AI, arXiv 2412.19437, sections 3.1-3.3 "
        "and 4 (180K H800 GPU hours per trillion tokens)", DEEPSEEK_V3, _H800, 15360, 1, 16,
        128, 1e12 / (180e3 * 3600), "tokens/s", DEEPSEEK_V3_RUN, ep=64,
        schedule="dualpipev", chunks=(2,), recompute=("none",),
        note="DualPipe planned as dualpipev; recomputing only norms and MLA's "
        "up-projections (counted as none); micro-batch of 1 (not published)"),
    PublishedRun(
        "DeepSeek-V3, 2,048 H800, recomputing whole layers", "the same", DEEPSEEK_V3, _H800,
        15360, 1, 16, 128, 1e12 / (180e3 * 3600), "tokens/s", DEEPSEEK_V3_RUN, ep=64,
        schedule="dualpipev", chunks=(2,), recompute=("full",),
        note="the fastest the planner finds to fit 80 GB"),
    PublishedRun(
        "DeepSeek-V3, 1,024 H100", "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md "
        "(25.09 container, DGX-H100), scripts/performance/configs/deepseek", DEEPSEEK_V3,
        _H100_DEEPSEEK, 8192, 2, 8, 64, 1297.0, "tokens/s",
        Software(float8=True, dispatch="deepep", a2a_overlap=MEGATRON_1F1B_OVERLAP,
                 overlap_dp=False), ep=64, schedule="interleaved", chunks=(4,),
        recompute=("none",), sequence_parallel=True, forced_balance=True,
        note="FP8 current scaling; MTP 1; 1F1B all-to-all overlap; gradient reduction not "
        "overlapped (its recipe)"),
    PublishedRun(
        "Qwen3-235B-A22B, 256 H100", _MODEL_ZOO, QWEN3_235B, _H100_QWEN, 2048, 2, 8, 16,
        2048 * 4096 / 19.7 / 256, "tokens/s", Software(dispatch="deepep"), ep=32,
        schedule="interleaved", chunks=(4,), recompute=("none",), sequence_parallel=True,
        note="245 TFLOP/s, 19.7 s a step; recomputing norms and activations (counted as "
        "none)"),
    PublishedRun(
        "Qwen3-235B-A22B, 256 H100, 1F1B all-to-all overlap", _MODEL_ZOO, QWEN3_235B,
        _H100_QWEN, 2048, 2, 8, 16, 2048 * 4096 / 17.6 / 256, "tokens/s",
        Software(dispatch="deepep", a2a_overlap=MEGATRON_1F1B_OVERLAP), ep=32,
        schedule="interleaved", chunks=(4,), recompute=("none",), sequence_parallel=True,
        note="276 TFLOP/s, 17.6 s a step; fitted: MEGATRON_1F1B_OVERLAP"),
]
"""Mixture-of-experts runs with expert parallelism folded over dp x tp (Megatron-Core's
expert tensor parallelism 1), each in tokens/s per GPU (the published step time or GPU
hours; their FLOP counts differ from the planner's)."""

MOE_NOT_MATCHED = [
    PublishedRun(
        "Qwen3-235B-A22B, 256 H100, ep8 in a node, FSDP", _MODEL_ZOO, QWEN3_235B,
        _H100_QWEN, 2048, 2, 1, 128, 2048 * 4096 / 17.6 / 256, "tokens/s",
        Software(dispatch="deepep"), ep=8, micro_batches=(4,), zeros=(3,),
        sequence_parallel=True, note="276 TFLOP/s; Megatron-FSDP, full recomputation"),
    PublishedRun(
        "Qwen3-235B-A22B, 256 H100, ep8 in a node, plain all-to-all", _MODEL_ZOO, QWEN3_235B,
        _H100_QWEN, 2048, 2, 32, 4, 2048 * 4096 / 24.2 / 256, "tokens/s", Software(), ep=8,
        schedule="interleaved", chunks=(3,), recompute=("none",), sequence_parallel=True,
        note="200 TFLOP/s; Megatron-Core's alltoall dispatcher"),
    PublishedRun(
        "Qwen3-235B-A22B, 256 H100, tp4, ep8 in a node", _MODEL_ZOO, QWEN3_235B, _H100_QWEN,
        2048, 4, 8, 8, 2048 * 4096 / 29.0 / 256, "tokens/s", Software(dispatch="deepep"),
        ep=8, schedule="interleaved", chunks=(4,), recompute=("none",),
        sequence_parallel=True, note="167 TFLOP/s; no recomputation"),
]
"""The model zoo's other Qwen3-235B layouts, which the planner does not match (not in the
tests; benchmarks/RESULTS.md shows them): it ranks the layouts keeping ep inside a node
above the published best, and the runs were slower than it."""


# Qi et al., "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241, ICLR 2024), GPT-3-like
# models on A100 80GB (Megatron-LM), sequence 1024. Table 3: layers, pipeline stages and
# micro-batch size; Table 9 (appendix D): the profiled T_F, T_B, T_W and T_comm (ms) of one
# stage and one micro-batch, from which Table 5 computes its bubble rates, (cost -
# m(T_F + T_B + T_W)) / cost, cost the longest stage's time (section 5.3). 1F1B-I runs a
# layer per chunk; ZB-1p is the schedule searched within 1F1B's memory, ZB-H1 the
# handcrafted one (dtrain's zb1p); ZB-2p and ZB-H2 hold twice as much (dtrain has neither).
ZERO_BUBBLE_LAYERS = {"1.5B": 22, "6.2B": 30, "14.6B": 46, "28.3B": 62}
# model, p, m, T_F, T_B, T_W, T_comm
ZERO_BUBBLE_TABLE_9 = [
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601),
    ("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626),
    ("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762),
    ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527),
    ("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577),
    ("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377),
    ("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379),
    ("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378),
    ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408),
    ("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408),
    ("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460),
]
# model, p, m, bubble rate of 1F1B, 1F1B-I, ZB-H1, ZB-H2, ZB-1p, ZB-2p
ZERO_BUBBLE_TABLE_5 = [
    ("1.5B", 8, 24, 0.2431, 0.1055, 0.1585, 0.1083, 0.1585, 0.0433),
    ("1.5B", 8, 32, 0.1985, 0.0818, 0.1242, 0.0837, 0.1242, 0.0039),
    ("1.5B", 8, 64, 0.1240, 0.0443, 0.0674, 0.0444, 0.0674, 0.0026),
    ("6.2B", 8, 24, 0.2347, 0.0808, 0.1323, 0.0698, 0.1323, 0.0029),
    ("6.2B", 8, 32, 0.1898, 0.0628, 0.1045, 0.0559, 0.1045, 0.0022),
    ("6.2B", 8, 64, 0.1091, 0.0320, 0.0554, 0.0294, 0.0554, 0.0010),
    ("14.6B", 16, 48, 0.2552, 0.1104, 0.1397, 0.0672, 0.1397, 0.0066),
    ("14.6B", 16, 64, 0.2082, 0.0852, 0.1088, 0.0516, 0.1088, 0.0054),
    ("14.6B", 16, 128, 0.1251, 0.0445, 0.0576, 0.0266, 0.0576, 0.0028),
    ("28.3B", 32, 96, 0.2646, 0.1493, 0.1421, 0.0641, 0.1421, 0.0038),
    ("28.3B", 32, 128, 0.2168, 0.1164, 0.1106, 0.0490, 0.1106, 0.0029),
    ("28.3B", 32, 256, 0.1352, 0.0624, 0.0594, 0.0257, 0.0594, 0.0018),
]
# Table 8: the ZB-V runs (section 6: 2p chunks, micro-batches of 6, 2, 2 sequences); its
# times are not published (Table 9 holds section 5's). model, p, m, bubble rate of 1F1B,
# 1F1B-I, ZB-H1, ZB-H2, ZB-V
ZERO_BUBBLE_TABLE_8 = [
    ("6.2B", 16, 48, 0.2668, 0.1499, 0.1536, 0.0823, 0.0697),
    ("6.2B", 16, 64, 0.2206, 0.1169, 0.1198, 0.0630, 0.0533),
    ("6.2B", 16, 128, 0.1390, 0.0621, 0.0637, 0.0325, 0.0274),
    ("14.6B", 24, 72, 0.2699, 0.1519, 0.1439, 0.0628, 0.0638),
    ("14.6B", 24, 96, 0.2229, 0.1184, 0.1121, 0.0480, 0.0483),
    ("14.6B", 24, 192, 0.1403, 0.0630, 0.0595, 0.0247, 0.0250),
    ("28.3B", 32, 96, 0.2676, 0.1509, 0.1429, 0.0629, 0.0593),
    ("28.3B", 32, 128, 0.2204, 0.1177, 0.1111, 0.0478, 0.0451),
    ("28.3B", 32, 256, 0.1362, 0.0626, 0.0593, 0.0251, 0.0236),
]


def zero_bubble_times(model: str, p: int, m: int) -> tuple[tuple[float, float, float], float]:
    """((T_F, T_B, T_W), T_comm) of Table 9's run of `model` at p stages and m
    micro-batches, or (for Table 8's runs) of its run of `model` at the same m's rank among
    its three, the nearest setting published.

    Raises:
        KeyError: a model the paper did not run.
    """
    rows = [r for r in ZERO_BUBBLE_TABLE_9 if r[0] == model]
    if not rows:
        raise KeyError(f"the Zero Bubble paper ran no {model} model")
    exact = [r for r in rows if r[1:3] == (p, m)]
    if exact:
        row = exact[0]
    else:
        ms = sorted(r[2] for r in ZERO_BUBBLE_TABLE_8 if r[0] == model)
        row = rows[ms.index(m)]
    return (row[3], row[4], row[5]), row[6]


def interleaved_chunks(model: str, p: int) -> int:
    """1F1B-I's chunks per stage: a layer each, as many as a middle stage's layers."""
    return -(-ZERO_BUBBLE_LAYERS[model] // p)


@dataclass(frozen=True)
class BubbleCheck:
    """dtrain's bubble of a schedule against the Zero Bubble paper's, on the paper's times.

    `ours` is `dtrain.planner.costs.bubble` (dtrain's own action lists simulated with the
    paper's T_F, T_B, T_W and T_comm, what `command` prints) or, where `closed_form`, the
    cluster planner's `fill_share` (messages free)."""

    model: str
    p: int
    m: int
    schedule: str  # dtrain's
    published: str  # the paper's column
    paper: float
    ours: float
    times: tuple[float, float, float]
    comm: float
    chunks: int = 1
    closed_form: bool = False

    @property
    def relative(self) -> float:
        """ours / paper - 1."""
        return self.ours / self.paper - 1

    @property
    def command(self) -> str:
        """The command that prints `ours` (the closed form: the benchmark's)."""
        if self.closed_form:
            return "python -m benchmarks.plan_zero_bubble"
        chunks = f" --virtual-stages {self.chunks}" if self.schedule == "interleaved" else ""
        times = ",".join(f"{t:g}" for t in self.times)
        return (f"dtrain plan --schedule-table --pp {self.p} --microbatches {self.m} "
                f"--schedule {self.schedule}{chunks} --times {times} --comm {self.comm:g}")


def _check(model: str, p: int, m: int, schedule: str, published: str, paper: float,
           chunks: int = 1, closed_form: bool = False) -> BubbleCheck:
    times, comm = zero_bubble_times(model, p, m)
    if closed_form:
        total = sum(times)
        idle = fill_share(schedule, times) * (p - 1) * total / chunks
        ours = idle / (m * total + idle)
    else:
        ours = bubble(p, m, chunks, schedule, times, comm)
    return BubbleCheck(model, p, m, schedule, published, paper, ours, times, comm, chunks,
                       closed_form)


def zero_bubble_checks() -> list[BubbleCheck]:
    """Table 5's rows: 1F1B, 1F1B-I (dtrain's interleaved at a layer a chunk) and ZB-H1
    (= ZB-1p there; dtrain's zb1p) against dtrain's lists on Table 9's times."""
    checks = []
    for model, p, m, one, inter, h1, _, _, _ in ZERO_BUBBLE_TABLE_5:
        checks += [_check(model, p, m, "1f1b", "1F1B", one),
                   _check(model, p, m, "interleaved", "1F1B-I", inter,
                          interleaved_chunks(model, p)),
                   _check(model, p, m, "zb1p", "ZB-H1 (= ZB-1p)", h1)]
    return checks


def zero_bubble_v_checks(models: tuple[str, ...] = ("6.2B", "14.6B", "28.3B"),
                         most: int | None = None) -> list[BubbleCheck]:
    """Table 8's rows of `models` (m up to `most`): ZB-V against dtrain's zbv lists and
    against the cluster planner's closed form, with 1F1B and ZB-H1 beside them, all on
    Table 9's times of the same model (Table 8's own are not published; the 28.3B runs
    have the same p and m in both tables)."""
    checks = []
    for model, p, m, one, _, h1, _, zbv in ZERO_BUBBLE_TABLE_8:
        if model not in models or (most is not None and m > most):
            continue
        checks += [_check(model, p, m, "1f1b", "1F1B", one),
                   _check(model, p, m, "zb1p", "ZB-H1", h1),
                   _check(model, p, m, "zbv", "ZB-V", zbv, 2),
                   _check(model, p, m, "zbv", "ZB-V", zbv, 2, closed_form=True)]
    return checks
