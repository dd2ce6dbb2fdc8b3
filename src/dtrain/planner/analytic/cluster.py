"""The cost of a layout on a GPU cluster: memory per GPU, step time, tokens/s, MFU.

    cluster = Cluster(hardware("a100-80gb"), nodes=192, gpus_per_node=8)
    shape = parse_shape("layers=80,hidden=12288,heads=96,seq=2048,vocab=51200")
    best = search.rank(shape, cluster, batch=2304)[0]  # every layout, fastest first
    one = evaluate(shape, cluster, 2304, planned_layout(2304, tp=8, pp=8, dp=24))
    long = planned_layout(128, tp=8, pp=16, dp=8, cp=16, cp_method="allgather")

Unlike the traced planner (dtrain.planner.traced, this machine's ranks), everything here
is arithmetic on the shape (dtrain.planner.shape) and the hardware's figures
(dtrain.planner.analytic.hardware), as a mixed-precision job on GPUs runs it (Megatron-LM,
FSDP): bf16 weights and activations, fp32 gradients, an fp32 master copy and Adam's two
moments.

Memory of the busiest GPU (of the pipeline GPUs that differ: the first, the last with
the logits, under zbv and dualpipev the first with both, and the first of the others
holding each split of layers):

    weights 2Ψ, gradients 4Ψ, optimizer 12Ψ (Ψ the stage's parameters / tp); ZeRO 1
    divides the optimizer by dp x cp (the model is replicated over cp; under hybrid
    sharding by a replica's dp_shard x cp), ZeRO 2 the gradients too, ZeRO 3 the weights
    (plus two layers gathered); activations per layer
    and micro-batch as Korthikanti et al. (2022) count them (34·s·b·h + 5·a·s²·b bytes
    for GPT, divided by tp where tensor parallelism splits them, and where sequence
    parallelism does; generalized to grouped-query attention and SwiGLU; no s² terms
    with flash attention, whose kernels' norms keep one tensor (`Software.lean_norms`:
    30·s·b·h); 2·s·b·h with full recomputation, plus one layer's working set; s / cp
    tokens of each sequence with context parallelism), times the layers and
    micro-batches the stage's own schedule keeps in flight (`layers_in_flight`: 1F1B,
    interleaved, zb1p, zbv, dualpipev, over dtrain.pipeline.schedules, the lists dtrain's
    runtime executes, or closed forms tested against them; the layers cut as dtrain's
    `stage_layers = "auto"` cuts them, the embedding and the head weighing their
    parameters, and placed as the schedule places them: `stage_layers`); fp32 logits and
    their gradient on the stage with the head; and the hardware's `reserved` bytes.

Time of one micro-batch through a stage: each matrix multiply (m x k by k x n, bf16)
takes the longer of its FLOPs at `gemm_efficiency` of the peak rate and its operands'
bytes at the memory bandwidth (a roofline: a tensor-parallel shard's thin multiplies and,
without flash attention, attention's per-head products with their small head size fall
below the peak; flash attention's core runs at that rate, the causally masked half of its
products skipped); backward
twice forward (flash attention's core 2.5 times: it computes the scores again);
element-wise work (norms, softmax, dropout, activations) as twice the activation bytes
moved at the memory bandwidth; recomputation one more forward of what it recomputes;
tp's two all-reduces per layer each way (two more when recomputing whole layers;
sequence parallelism's all-gathers and reduce-scatters move the same bytes) on NVLink
inside a node, exposed; cp's exchanges of keys and values per layer (`context_seconds`:
a ring's steps behind the attention of the block in hand, an all-gather and a
reduce-scatter exposed, or Ulysses' all-to-alls exposed; a micro-batch's work is a
cp-th of the sequence's); pp's sends of one micro-batch's activations (split over the
tp GPUs, each on its own network port) at each of the busiest GPU's stage boundaries
with another GPU (dtrain.planner.costs.sends: the V-shaped schedules twice 1F1B's).

Mixture-of-experts blocks (a shape with `experts`): each MoE layer's routed experts are
folded over `ep` consecutive GPUs of a replica's dp x cp x tp, each expert whole on its
GPU (Megatron-Core's parallel folding with expert tensor parallelism 1, as dtrain's mesh
lays them out: dtrain.planner.analytic.dispatch), so weights, gradients and optimizer
state of the experts are divided by ep, and ZeRO divides them by the edp = dp x cp x tp /
ep GPUs holding the same experts; the dense parts are as above. Each GPU routes its own
b·s / (cp·tp) tokens (each tp rank its 1/tp): in balance it runs their k expert products
(grouped: E / ep experts of routed x k x ep / E rows each), the router and the shared
experts (split over tp as a dense MLP), and keeps their tensors (k x the expert's, the
dispatched tokens in and out, the router's probabilities); under sequence parallelism a
MoE layer's MLP has no tp collective (its tokens stay sharded). Per MoE layer and
micro-batch the tokens go to their experts' GPUs and back: two exchanges forward
(dispatch and combine), two in backward, two more in a recomputed forward, each of
`dispatch.exchange_seconds` (a plain all-to-all, or DeepEP-class kernels sending a token
once per node: `Software.dispatch`), exposed but for the share `Software.a2a_overlap`
hides under the stage's compute (`dispatch.exposed_seconds`). The experts' gradients are
reduced over their edp GPUs, ep apart.

Latent attention (MLA) and multi-token prediction (dtrain.planner.shape): each of
attention's projections is a matrix multiply of its own, split over tp by heads or whole
on every tp GPU (MLA's down-projections); attention's core has query/key heads of
head_dim and value heads of v_head_dim; a layer keeps MLA's latents (whole on every tp GPU)
beside its q, k, v and output; cp exchanges the decompressed keys and values. The stage
with the head also runs each multi-token prediction depth: a block of the last block's
kind, its 2h -> h projection and the head's logits again, and holds their parameters and
one micro-batch of their activations and fp32 logits.

The step is `m · slowest stage + fill · the other stages / v` for m micro-batches and v
virtual stages, `fill` the schedule's fill and drain as a share of 1F1B's, from the
slowest stage's forward, input-gradient and weight-gradient times
(dtrain.planner.costs.pipeline_seconds and fill_share: 1 for 1F1B and interleaved, whose
bubble is (p-1)/(v·m) of the ideal for equal stages; a third of it for zb1p at equal
times, a sixth for zbv and dualpipev), plus what data parallelism (over dp x cp GPUs)
does not hide: the
gradient all-reduce (ZeRO 1: the fp32 gradients reduce-scattered and the updated bf16
weights all-gathered), hierarchical (reduce-scatter on NVLink among a node's GPUs of the
group, across nodes on the network, back on NVLink), overlapped with the last
micro-batch's backward; ZeRO 2 reduce-scatters each micro-batch's gradients behind its
backward; ZeRO 3 gathers the weights for each micro-batch behind its compute; and the
optimizer step at memory bandwidth (30 bytes per parameter held).

Hybrid sharding (HSDP, `dp_replicate` R > 1; dtrain.planner.costs): ZeRO's collectives
above run over a replica's S = dp / R GPUs (x cp), and once a step each GPU's fp32
gradient shard, Ψ/(S·cp) parameters (the experts' over S·cp / ep), is all-reduced over
the R GPUs holding the same shard, S·cp·tp apart (`replica_seconds`): hierarchical as
above, so with replicas of whole nodes all of it crosses the network,
2(R-1)/R x 4Ψ/(S·cp) bytes per GPU (`replica_traffic`). It is one more of the last
micro-batch's collectives, hidden as they are: ZeRO 1 and 2 behind its backward with
the reduce-scatter (and ZeRO 1's gather), ZeRO 3 behind its compute with its gathers and
reduce-scatter. The phases of one collective and the collectives of one window add up
here (a replica of whole nodes reduce-scatters on the network too); HSDP gains where it
sends fewer bytes: ZeRO 3 (and 2) over every GPU cross the network for every
micro-batch, the replicas once a step.

FP8 (`Software.float8`, `dtrain plan --precision fp8`; torchao's float8 training, dtrain's
`[train] float8`): the blocks' linear layers (attention's projections, the MLP, a MoE
layer's shared experts) and the routed experts' grouped products (torchao's FP8 grouped
products for MoE, which issue 51 brings to `[train] float8`; DeepSeek-V3 trained them in
FP8) multiply at the hardware's dense FP8 rate (`fp8_tflops`) at the same
`gemm_efficiency`, their operands one byte each on the roofline, and each operand is
scaled from bf16 first: read twice (its absolute maximum, then the cast) and written in
one byte, 5 bytes per element at memory bandwidth (`linear_seconds`; backward, as
everywhere here, twice forward). Attention's core (the scores and their weighted sum),
the router, the output head, element-wise work and communication stay as in bf16.
Memory does not change: torchao keeps bf16 weights (and fp32 masters, gradients and
Adam state) and saves each linear's input for backward in its high precision, casting
it again in backward (`matmul_with_hp_or_float8_args` saves `input_hp, weight_hp_t`).

Frameworks (`Software.framework`; dtrain.planner.analytic.software): all of the above is
Megatron-LM's runtime; a run of another framework is timed with every kernel at its
framework's share of that rate (the hardware's `gemm_efficiency` and `memory_efficiency`
times the share) and its gradients reduced after the last backward where its runtime does
so.

Reported: `tflops_per_gpu` counts the FLOPs the GPUs execute, recomputation included
(Megatron-LM's "achieved TFLOP/s"); `mfu` counts the model's alone (6N + 12·l·h·s per
token, N the weights that multiply a token: a MoE block's active ones; PaLM's model FLOPs
utilization, attention's whole s x s products counted, twice what a causal kernel
computes: at 128K tokens that is 1.4 times the work), against the bf16 peak with FP8 too
(as torchtitan and Megatron-LM report FP8 runs: the same model FLOPs in less time, so an
FP8 run's MFU may pass what bf16 could reach).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from dtrain.errors import ConfigError
from dtrain.mesh import Dims
from dtrain.mesh.dims import V_SHAPED
from dtrain.pipeline.schedules import SPLIT, build
from dtrain.planner.analytic.dispatch import (
    DISPATCHES,
    all_to_all_seconds,
    exchange_seconds,
    exposed_seconds,
    tokens_routed,
)
from dtrain.planner.analytic.hardware import Cluster, Hardware
from dtrain.planner.analytic.software import Software, check_precision
from dtrain.planner.costs import (
    chunk_sizes,
    fill_share,
    holds_ends,
    live_micro_batches,
    pipeline_seconds,
    schedule_of,
    sends,
)
from dtrain.planner.planned import PlannedLayout
from dtrain.planner.shape import ModelShape

WEIGHT, GRAD, STATE = 2, 4, 12  # bytes per parameter: bf16 weights, fp32 grads, Adam
OPTIMIZER_BYTES = 30  # read master, m, v, grad; write master, m, v, bf16 weights
MICRO_SIZES = (1, 2, 4, 8, 16)
CHUNKS = (1, 2, 3, 4, 6, 8)
ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_CP_METHOD = "allgather"  # Llama 3's, where a plan does not choose one
SCHEDULES = ("1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
"""The pipeline schedules a plan weighs (gpipe holds more than 1f1b for the same time)."""


def planned_layout(batch: int, tp: int, pp: int, dp: int, zero: int = 0, micro_batch: int = 1,
                   virtual: int = 1, recompute: str = "full",
                   sequence_parallel: bool = False, ep: int = 1, cp: int = 1,
                   cp_method: str = DEFAULT_CP_METHOD,
                   schedule: str | None = None, replicas: int = 1) -> PlannedLayout:
    """tp x cp x pp x dp GPUs with a ZeRO stage, `micro_batch` sequences per micro-batch
    of a global batch of `batch`, `virtual` stages per pipeline GPU, the pipeline's
    `schedule` (default: 1f1b, or interleaved over several virtual stages; zbv and
    dualpipev run two), recomputation, sequence parallelism, the experts split over `ep`
    consecutive GPUs of a replica's dp x cp x tp (folded: dtrain.planner.analytic.dispatch),
    each sequence over `cp` GPUs meeting by `cp_method`, and the dp GPUs in `replicas`
    hybrid-sharding replicas (dp_replicate; ZeRO inside each): one layout as this planner
    plans it. A pipeline's micro-batches are those the batch leaves (without one, they are
    gradient accumulation, as in dtrain's config). `check_layout` says whether it can run.

    Raises:
        ConfigError: `replicas` does not divide dp (and what Dims refuses: an ep not
            dividing the GPUs it is folded over).
    """
    if replicas < 1 or dp % replicas:
        raise ConfigError(f"dp_replicate={replicas} does not divide dp={dp}: the replicas "
                          "of hybrid sharding hold dp / dp_replicate GPUs each")
    m = max(1, batch // max(1, dp * micro_batch)) if pp > 1 else 1
    named = schedule_of(schedule or "1f1b", virtual)
    dims = Dims(dp // replicas, tp, pp, zero, m,
                named,  # type: ignore[arg-type]  # Dims checks it
                virtual, ep=ep, cp=cp, sequence_parallel=sequence_parallel,
                cp_method=cp_method,  # type: ignore[arg-type]  # Dims checks it: CP_METHODS
                dp_replicate=replicas)
    return PlannedLayout(dims, recompute, micro_batch)


def cluster_label(planned: PlannedLayout) -> str:
    """A layout as this planner's tables show it, in Megatron-LM's order (tp innermost,
    first): `tp8 x cp16 x pp16 x dp8 x v8 mb1 zero1 sp allgather` (cp: the GPUs a
    sequence is split over, and after the options how they attend; ep: the GPUs of a
    MoE layer's experts, folded over dp x cp x tp, as in `tp2 x pp8 x dp16 ep32`; v:
    virtual stages of the
    interleaved schedule; the other schedules but 1F1B by name, `tp8 x pp8 x dp24 zbv mb1`;
    mb: sequences per micro-batch; hybrid sharding's replicas as the Dims show them,
    `tp1 x pp1 x dp4x8 mb2 zero3`: 4 replicas of 8 GPUs)."""
    layout = planned.dims
    experts = f" ep{layout.ep}" if layout.ep > 1 else ""
    dp = f"{layout.dp_replicate}x{layout.dp_shard}" if layout.dp_replicate > 1 else \
        f"{layout.dp}"
    parts = [f"tp{layout.tp}", f"pp{layout.pp}", f"dp{dp}{experts}"]
    if layout.cp > 1:
        parts.insert(1, f"cp{layout.cp}")
    if layout.virtual_stages > 1 and layout.schedule == "interleaved":
        parts.append(f"v{layout.virtual_stages}")
    named = f" {layout.schedule}" if layout.pp > 1 and \
        layout.schedule not in ("1f1b", "interleaved") else ""
    text = " x ".join(parts) + f"{named} mb{planned.micro_batch}"
    return text + (f" zero{layout.zero}" if layout.zero else "") + \
        (" sp" if planned.sequence_parallel else "") + \
        (f" {planned.cp_method}" if layout.cp > 1 else "")


@dataclass
class ClusterEstimate:
    planned: PlannedLayout
    memory: dict[str, float]
    fits: bool
    step_s: float
    parts: dict[str, float]  # seconds: compute, tp, cp, ep, pp, bubble, dp, optimizer
    bubble: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float

    @property
    def label(self) -> str:
        """The layout as the tables show it (`cluster_label`)."""
        return cluster_label(self.planned)

    def to_dict(self) -> dict:
        c, layout = self.planned, self.planned.dims
        return {"layout": self.label, "tp": layout.tp, "cp": layout.cp, "pp": layout.pp,
                "dp": layout.dp, "dp_replicate": layout.dp_replicate, "ep": layout.ep,
                "cp_method": c.cp_method,
                "zero": layout.zero, "microbatch": c.micro_batch,
                "schedule": layout.schedule if layout.pp > 1 else None,
                "virtual": layout.virtual_stages, "recompute": c.recompute,
                "sequence_parallel": c.sequence_parallel,
                "memory_per_gpu_bytes": int(self.memory["total"]),
                "memory_bytes": {k: int(v) for k, v in self.memory.items()},
                "fits": self.fits, "step_time_s": self.step_s, "time_s": self.parts,
                "bubble": self.bubble, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                "config": c.overrides()}


def gemm_seconds(m: float, n: float, k: float, hw: Hardware, count: float = 1) -> float:
    """`count` matrix multiplies of (m x k) by (k x n) in bf16: the longer of their
    arithmetic at the achievable rate and their operands' traffic at memory bandwidth."""
    flops = 2 * m * n * k * count
    traffic = 2 * (m * k + k * n + m * n) * count
    return max(flops / (hw.peak_flops * hw.gemm_efficiency), traffic / _bandwidth(hw))


FP8_CAST_BYTES = 5
"""Bytes moved per element to scale a bf16 operand to FP8 dynamically: read for its
absolute maximum, read again and written in one byte."""


def linear_seconds(m: float, n: float, k: float, hw: Hardware, count: float = 1,
                   float8: bool = False) -> float:
    """`count` linear layers' forward multiply of (m x k) inputs by (k x n) weights: in
    bf16 `gemm_seconds`; in FP8 the multiply at the FP8 rate on its roofline (one-byte
    operands, a bf16 result) plus the scaling of both operands (FP8_CAST_BYTES per
    element at memory bandwidth)."""
    if not float8:
        return gemm_seconds(m, n, k, hw, count)
    flops = 2 * m * n * k * count
    traffic = (m * k + k * n + 2 * m * n) * count
    cast = FP8_CAST_BYTES * (m * k + k * n) * count
    return max(flops / (hw.fp8_flops * hw.gemm_efficiency), traffic / _bandwidth(hw)) + \
        cast / _bandwidth(hw)


def _bandwidth(hw: Hardware) -> float:
    return hw.memory_gbps * 1e9 * hw.memory_efficiency


def layer_activations(shape: ModelShape, b: int, tp: int, sp: bool, recompute: str,
                      flash: bool, moe: bool = False, cp: int = 1,
                      lean_norms: bool = False) -> float:
    """Bytes one layer (a MoE layer with `moe`) keeps for backward per micro-batch of `b`
    sequences on a tp GPU of a cp group (its seq / cp tokens of each sequence).

    Korthikanti et al. count each norm's input and output (the next matrix multiply's
    input); with `lean_norms` a norm keeps only its output, from which its backward
    recovers the normalized input ((y - β) / γ): Apex's memory-efficient LayerNorm and
    RMSNorm (Megatron-LM's --memory-efficient-layer-norm), and Meta's Llama 3 stack, which
    frees each pipeline stage's input (a layer's first norm's input, a layer per chunk).
    """
    s, h = shape.seq // cp, shape.hidden
    shared = 1 / tp if sp else 1.0  # tensors between the row- and the column-parallel layers
    if recompute == "full":
        return 2 * s * b * h * shared  # the layer's input
    drop = 1 if shape.dropout else 0
    # two norms' outputs feeding the column layers (and their inputs), dropout masks
    replicated = s * b * h * (2 + 2 + (0 if lean_norms else 2 + 2) + 2 * drop)
    # MLA's normed latents feeding its up-projections (and their norms' inputs), whole
    # on every tp rank, and the shared rotary key
    latents = 2 * s * b * shape.latent_width * (1 if lean_norms else 2)
    # q, k, v, the attention output, the MLP's intermediate tensors
    split = 2 * s * b * (shape.qkv_width + shape.value_width) + \
        _mlp_activations(shape, s * b, moe)
    scores = 0.0
    if not flash and recompute == "none":  # softmax output (+ its dropout mask and output)
        scores = shape.heads * s * shape.seq * b * (2 + 3 * drop)  # its queries, every key
    return replicated * shared + latents + (split + scores) / tp


def _mlp_activations(shape: ModelShape, tokens: int, moe: bool) -> float:
    """Bytes an MLP keeps for backward: a dense one's intermediate tensors; a MoE one's
    for the k routed experts and the shared ones, the dispatched tokens in and out, and
    the router's fp32 probabilities."""
    width = 3 if shape.gated else 2
    if not moe:
        return 2 * tokens * shape.ffn * width
    experts = shape.top_k + shape.shared_experts
    return 2 * tokens * shape.moe_ffn * width * experts + \
        2 * 2 * tokens * shape.top_k * shape.hidden + 4 * tokens * shape.experts


def end_weights(shape: ModelShape) -> tuple[float, float]:
    """The input part's parameters (the token and position embeddings) and the output
    part's (the final norm and the head, a tied one's copy too) in blocks' worth, an
    average block's: what dtrain's `stage_layers = "auto"` counts on the first and the
    last stage (dtrain.pipeline.pieces.cut)."""
    h = shape.hidden
    block = (shape.dense_layers * shape.block_params()
             + shape.moe_layers * shape.block_params(moe=True)) / shape.layers
    gpt = shape.arch == "gpt"
    inputs = shape.vocab * h + (shape.seq * h if gpt else 0)
    outputs = shape.vocab * h + (2 * h if gpt else h)
    return inputs / block, outputs / block


def end_weighted_sizes(layers: int, stages: int, first: float = 0.0, last: float = 0.0,
                       least_end: int = 0) -> list[int]:
    """Layers of each of `stages` consecutive stages, the heaviest as light as can be when
    the first also weighs `first` layers and the last `last` (dtrain's "auto" cut,
    dtrain.pipeline.partition.balanced_sizes, for blocks of equal size): every stage at
    least one layer, the two ends at least `least_end` (0: a stage may hold the embedding
    or the head alone, as Megatron-LM can run it). Where several cuts are as good the
    shorter stages are at the model's ends, the first and the last, then the second and
    the second-to-last, ...: Llama 3 405B's 126 layers over 16 stages are 7, 8 (x 14), 7,
    as Meta ran them (Dubey et al. 2024, section 3.3.2; Megatron-LM's
    --decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers).

    Raises:
        ConfigError: fewer layers than the stages need.
    """
    if stages == 1:
        return [layers]
    extra = [first] + [0.0] * (stages - 2) + [last]
    least = [least_end] + [1] * (stages - 2) + [least_end]
    if sum(least) > layers:
        raise ConfigError(f"{layers} layers do not fill {stages} pipeline stages: use at "
                          f"most {layers + 2 - 2 * least_end} stages (pp x virtual stages)")

    def caps(most: float) -> list[int]:
        return [max(lo, math.floor(most - e + 1e-9)) for lo, e in zip(least, extra,
                                                                        strict=True)]

    # the lightest heaviest stage is a whole number of layers plus one of the extras
    for most in sorted({k + e for k in range(layers + 1) for e in (0.0, first, last)}):
        if all(lo + e <= most + 1e-9 for lo, e in zip(least, extra, strict=True)) and \
                sum(caps(most)) >= layers:
            break
    sizes = caps(most)
    ends = list(dict.fromkeys(k for pair in zip(range(stages), reversed(range(stages)),
                                                strict=True) for k in pair))
    excess = sum(sizes) - layers
    while excess:
        for k in ends:
            if excess and sizes[k] > least[k]:
                sizes[k] -= 1
                excess -= 1
    return sizes


@functools.cache
def stage_layers(shape: ModelShape, pp: int, virtual: int = 1, schedule: str = "1f1b"
                 ) -> tuple[tuple[int, ...], ...]:
    """The layers of each pipeline GPU's chunks, in chunk order: the model's layers cut
    into pp·v stages by `end_weighted_sizes`, the first stage carrying the embedding's
    parameters and the last the head's as blocks' worth (`end_weights`, dtrain's
    `stage_layers = "auto"`), and placed as `schedule` places them (GPU i's chunk j is
    stage j·pp + i as dtrain's interleaved schedule and Megatron-LM number them; under
    zbv and dualpipev GPU i holds stages i and 2pp-1-i, the embedding and the head both
    on GPU 0). The ends may hold no layer (the embedding or the head alone) except under
    the schedules that split backward, whose every stage needs a layer's products."""
    stages = pp * virtual
    first, last = end_weights(shape) if stages > 1 else (0.0, 0.0)
    sizes = end_weighted_sizes(shape.layers, stages, first, last,
                               1 if schedule in SPLIT else 0)
    return tuple(tuple(chunks) for chunks in chunk_sizes(sizes, schedule, pp, virtual))


@functools.cache
def _stage_counts(shape: ModelShape, pp: int, virtual: int, schedule: str
                  ) -> tuple[tuple[int, bool, bool, int], ...]:
    """The pipeline GPUs' (layers, first, last) and how many GPUs have each
    (`stage_layers`; first and last: holding the embedding's stage, the head's)."""
    counts: dict[tuple[int, bool, bool], int] = {}
    for rank, chunks in enumerate(stage_layers(shape, pp, virtual, schedule)):
        key = (sum(chunks), *holds_ends(schedule, pp, virtual, rank))
        counts[key] = counts.get(key, 0) + 1
    return tuple((*key, count) for key, count in counts.items())


@functools.cache
def _stage_kinds(shape: ModelShape, pp: int, virtual: int, schedule: str
                 ) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The pipeline GPUs that differ (`stage_layers`), each as (its chunks' layers, its
    rank): the first (the embedding's), the last (the head's), and the first of the others
    holding each split of layers (with the same layers, a later GPU keeps fewer
    activations in flight under 1F1B; under the zero-bubble schedules as many or fewer)."""
    ranks: dict[tuple, int] = {}
    for rank, chunks in enumerate(stage_layers(shape, pp, virtual, schedule)):
        ranks.setdefault((chunks, *holds_ends(schedule, pp, virtual, rank)), rank)
    return tuple((chunks, rank) for (chunks, _, _), rank in ranks.items())


@functools.cache
def layers_in_flight(pp: int, rank: int, microbatches: int, chunks: tuple[int, ...],
                     schedule: str = "1f1b") -> int:
    """The most activations, in layers x micro-batches, pipeline GPU `rank` of `pp` keeps
    between forwards and their backwards (their W, under the schedules that split
    backward), its chunks holding `chunks` layers (dtrain.pipeline.schedules): 1F1B
    p - rank micro-batches; interleaved counted on its lists (a chunk without a layer
    keeps nothing); zb1p p on every GPU; the V-shaped schedules by their micro-batch
    counts at their peak (dtrain.planner.costs.live_micro_batches): zbv 2p of either
    chunk, as many of each; dualpipev 2p - rank of the first chunk and rank + 1 of the
    second."""
    named = schedule_of(schedule, len(chunks))
    if pp == 1:  # one micro-batch at a time (gradient accumulation)
        return sum(chunks)
    if named == "interleaved":
        # the warm-up forwards, then a forward and a backward at a time, whose chunks
        # repeat every pp x v of them: 3 x pp micro-batches reach the most there is
        live = most = 0
        for action in build("interleaved", pp, rank, min(microbatches, 3 * pp), len(chunks)):
            live += chunks[action.chunk] if action.kind == "F" else -chunks[action.chunk]
            most = max(most, live)
        return most
    if named == "dualpipev":
        return (2 * pp - rank) * chunks[0] + (rank + 1) * chunks[1]
    count = live_micro_batches(named, pp, rank, microbatches)
    if named in V_SHAPED:
        return count * sum(chunks) // 2
    return count * chunks[0]


def _collective(nbytes: float, n: int, share: float, link_gbps: float, latency_us: float,
                hw: Hardware, calls: int = 1) -> float:
    """Seconds for a collective over n GPUs moving `share` of `nbytes` per GPU."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return calls * latency_us * 1e-6 + nbytes * share / (link_gbps * 1e9 * hw.link_efficiency)


def _link(inside: bool, hw: Hardware) -> tuple[float, float]:
    """(GB/s, latency in µs) of NVLink inside a node, or of the network."""
    return (hw.intra_gbps, hw.intra_latency_us) if inside else \
        (hw.inter_gbps, hw.inter_latency_us)


def _layer_forward(shape: ModelShape, c: PlannedLayout, moe: bool, hw: Hardware,
                   soft: Software) -> tuple[float, float, float]:
    """(all of one layer's forward, its attention core's, its weights' products') in
    seconds on a tp GPU of a cp group for one micro-batch: a dense layer, or with `moe` a
    MoE layer."""
    s, h, t, b, cp = shape.seq, shape.hidden, c.dims.tp, c.micro_batch, c.dims.cp
    tokens = b * s // cp
    fp8 = soft.float8  # the blocks' nn.Linear layers and the routed experts, not the router
    linear_s = sum(linear_seconds(tokens, p.outputs / (t if p.split == "column" else 1),
                                  p.inputs / (t if p.split == "row" else 1), hw, float8=fp8)
                   for p in shape.attention_projections())
    width = 2 if shape.gated else 1  # gate and up side by side
    if not moe:
        linear_s += (linear_seconds(tokens, width * shape.ffn / t, h, hw, float8=fp8)
                     + linear_seconds(tokens, h, shape.ffn / t, hw, float8=fp8))
    else:  # the router; E / ep whole experts of routed x k x ep / E rows; the shared ones
        local = shape.experts // c.dims.ep
        rows = tokens_routed(shape, b, t, cp) * shape.top_k / local
        f, shared = shape.moe_ffn, shape.shared_experts * shape.moe_ffn
        linear_s += gemm_seconds(tokens / t, shape.experts, h, hw)
        linear_s += (linear_seconds(rows, width * f, h, hw, local, fp8)
                     + linear_seconds(rows, h, f, hw, local, fp8))
        if shared:
            linear_s += (linear_seconds(tokens, width * shared / t, h, hw, float8=fp8)
                         + linear_seconds(tokens, h, shared / t, hw, float8=fp8))
    attention_s = attention_seconds(shape, c, hw, soft)
    elementwise = 2 * layer_activations(shape, b, t, c.sequence_parallel, "none",
                                        soft.flash_attention, moe, cp)
    return linear_s + attention_s + elementwise / _bandwidth(hw), attention_s, linear_s


def _per_micro_batch(c: PlannedLayout) -> PlannedLayout:
    """What a micro-batch's time and a layer's activations depend on: `c` without its
    data and pipeline degrees, ZeRO stage and schedule (the key of the caches below)."""
    layout = c.dims
    return _micro_key(layout.tp, layout.ep, layout.cp, c.recompute, c.sequence_parallel,
                      c.micro_batch, c.cp_method)


@functools.cache
def _micro_key(tp: int, ep: int, cp: int, recompute: str, sp: bool, micro_batch: int,
               cp_method: str) -> PlannedLayout:
    # dp_shard = ep: the least data parallelism the experts fit in (no figure here reads it)
    dims = Dims(ep, tp, ep=ep, cp=cp, sequence_parallel=sp,
                cp_method=cp_method)  # type: ignore[arg-type]  # Dims checks it: CP_METHODS
    return PlannedLayout(dims, recompute, micro_batch)


@functools.cache
def attention_seconds(shape: ModelShape, c: PlannedLayout, hw: Hardware,
                      soft: Software) -> float:
    """One layer's attention core forward on a tp GPU of a cp group for one micro-batch:
    the scores (s x d by d x s, d the query/key head's width) and the weighted sum (s x s
    by s x v, v the value head's) of its s / cp queries (the causal work balanced over cp:
    two mirrored chunks each)."""
    s, cp = shape.seq, c.dims.cp
    heads = c.micro_batch * shape.heads / c.dims.tp
    d, v = shape.head_dim, shape.value_width // shape.heads
    if soft.flash_attention:  # tiles in on-chip memory, the masked half skipped
        return 2 * s * s * (d + v) * heads / 2 / cp / (hw.peak_flops * hw.gemm_efficiency)
    return (gemm_seconds(s // cp, s, d, hw, heads) + gemm_seconds(s // cp, v, s, hw, heads))


@functools.cache
def _stage_seconds(shape: ModelShape, c: PlannedLayout, layers: int, last: bool,
                   cluster: Cluster, soft: Software
                   ) -> tuple[float, float, float, float, float, float, float]:
    """(compute, tp communication, cp exchanges, ep all-to-all, backward compute, forward
    compute, weight-gradient compute) of one micro-batch on one stage of `layers` layers,
    the MoE layers among them in the model's proportion, and with the head (`last`) the
    multi-token prediction modules (`c` as `_per_micro_batch` gives it: the key of its
    cache, which the searches hit for every data and pipeline degree, ZeRO stage and
    schedule). The weights' gradients (W, which the zero-bubble schedules run apart) are
    the products of forward's linear layers again; the input's gradient (B) is the rest of
    backward, recomputation included. The all-to-all is what a step waits for of it
    (dtrain.planner.analytic.dispatch: `Software.dispatch`, `Software.a2a_overlap`)."""
    hw = cluster.hardware
    h, t, cp = shape.hidden, c.dims.tp, c.dims.cp
    tokens = c.micro_batch * shape.seq // cp
    share = shape.moe_layers / shape.layers
    mtp = shape.mtp_depth if last else 0  # each a block of the last block's kind
    counts = {False: layers * (1 - share) + (0 if shape.mtp_moe else mtp),
              True: layers * share + (mtp if shape.mtp_moe else 0)}
    compute = backward = cp_s = forwards = weights = 0.0
    # a LoRA base computes no weight gradients (its adapters' products are negligible);
    # DPO's reference forward runs beside each forward, without backward
    frozen = 1.0 if shape.lora else 0.0
    reference = 1.0 if shape.dpo else 0.0
    for moe, count in counts.items():
        if not count:
            continue
        forward, attention_s, linear_s = _layer_forward(shape, c, moe, hw, soft)
        again = {"full": forward, "selective": attention_s, "none": 0.0}[c.recompute]
        # flash attention's backward computes the scores q k^T again (5 products against
        # forward's 2: 2.5x its forward, not 2x)
        again += attention_s / 2 if soft.flash_attention else 0.0
        back = 2 * forward - frozen * linear_s + again
        compute += count * (forward + back + reference * forward)
        backward += count * back
        forwards += count * (1 + reference) * forward
        weights += count * (1 - frozen) * linear_s
        cp_s += count * context_seconds(shape, c, attention_s, cluster)
    if last:  # the output head: logits forward and backward, and the loss; each
        # multi-token prediction depth's too, and its 2h -> h projection
        logits = (1 + mtp) * gemm_seconds(tokens, shape.vocab / t, h, hw) + \
            mtp * gemm_seconds(tokens, h, 2 * h, hw)
        loss = (1 + mtp) * 12 * tokens * shape.vocab / t / _bandwidth(hw)
        compute += (3 - frozen + reference) * logits + loss
        forwards += (1 + reference) * logits + loss
        weights += (1 - frozen) * logits
    link, latency = _link(t <= cluster.gpus_per_node, hw)
    again = 2 if c.recompute == "full" else 0
    calls = 2 if c.sequence_parallel else 1
    # two collectives each way per layer, one of them the MLP's; a MoE layer's experts
    # are folded over the tp GPUs, each routing its own tokens: under sequence
    # parallelism its MLP has no tp collective (its tokens stay sharded)
    reductions = (counts[False] + counts[True]) * (4 + again)
    if c.sequence_parallel:
        reductions -= counts[True] * (4 + again) / 2
    tp_s = reductions * _collective(2 * tokens * h, t, 2 * (t - 1) / t, link, latency, hw,
                                    calls)
    exchanges = 4 + again  # dispatch and combine each way
    dispatch = DISPATCHES[soft.dispatch]
    ep_s = counts[True] * exchanges * exchange_seconds(shape, c.micro_batch, t, cp,
                                                       c.dims.ep, cluster, dispatch)
    ep_s = exposed_seconds(ep_s, compute, soft.a2a_overlap)
    return compute, tp_s, cp_s, ep_s, backward, forwards, weights


def kv_block_bytes(shape: ModelShape, micro_batch: int, tp: int, cp: int) -> float:
    """One GPU's keys and values of one layer and micro-batch, bf16: its seq / cp tokens
    x their key/value width / tp (kv_heads x head_dim x 2, K and V; MLA's decompressed
    heads x (nope + rope + v), which is what attention's core reads) x 2 bytes: the block a
    ring step sends."""
    return 2 * micro_batch * shape.seq // cp * shape.key_value_width / tp


def context_bytes(shape: ModelShape, micro_batch: int, tp: int, cp: int,
                  method: str) -> float:
    """Bytes one GPU of a cp group sends per layer and micro-batch in forward: "ring" and
    "allgather" the other cp - 1 GPUs' worth of its key/value block (a step at a time, or
    at once); "alltoall" (cp - 1) / cp of its q, k, v and attention output. Backward sends
    twice as much (the blocks again and their gradients; the gradients of the four)."""
    if cp == 1:
        return 0.0
    block = kv_block_bytes(shape, micro_batch, tp, cp)
    if method != "alltoall":
        return (cp - 1) * block
    tokens = micro_batch * shape.seq // cp
    q_out = 2 * tokens * (shape.attention_width + shape.value_width) / tp
    return (cp - 1) / cp * (q_out + block)


def context_seconds(shape: ModelShape, c: PlannedLayout, attention_s: float,
                    cluster: Cluster) -> float:
    """Exposed seconds of one layer's cp exchanges for one micro-batch: forward, backward
    and a recomputed forward. The cp GPUs are tp apart (the mesh puts cp inside dp, tp
    innermost): NVLink when cp x tp GPUs fit in a node, the network otherwise.

    - "ring": each of cp - 1 steps sends a key/value block while the GPU computes its
      queries against the block in hand (`attention_s` / cp), so a step exposes what its
      send takes beyond that; backward passes the blocks and their gradients (twice the
      bytes against about twice the work); a fully recomputed forward runs the ring again.
    - "allgather": keys and values all-gathered before attention (they come out of the
      projection just before it needs them, so nothing hides it), again in backward (or
      in the recomputed forward), and their gradients reduce-scattered: three collectives,
      exposed, hierarchical where a node holds several of the group.
    - "alltoall": q, k, v turned from sequence shards into head shards and the output
      back (4 all-to-alls), their gradients in backward (4), 4 more recomputing; exposed.
    """
    layout = c.dims
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return 0.0
    hw = cluster.hardware
    again = 1 if c.recompute == "full" else 0
    block = kv_block_bytes(shape, c.micro_batch, tp, cp)
    if c.cp_method == "ring":
        link, latency = _link(cp * tp <= cluster.gpus_per_node, hw)
        step = _collective(block, 2, 1.0, link, latency, hw)
        return (1 + 2 + again) * (cp - 1) * max(0.0, step - attention_s / cp)
    if c.cp_method == "allgather":
        return 3 * _dp_seconds(cp * block, 1, cp, tp, cluster)
    tokens = c.micro_batch * shape.seq // cp
    q, out = (2 * tokens * width / tp for width in (shape.attention_width, shape.value_width))
    one = sum(all_to_all_seconds(nbytes, cp, tp, cluster) for nbytes in (q, out, block / 2,
                                                                         block / 2))
    return (2 + again) * one


@functools.cache
def _stage_params(shape: ModelShape, layers: int, first: bool, last: bool,
                  pp: int) -> tuple[float, float]:
    """(dense parameters, routed experts' parameters) of a stage of `layers` layers."""
    share = shape.moe_layers / shape.layers
    experts = layers * share * shape.experts * shape.expert_params()
    params = layers * ((1 - share) * shape.block_params() + share * shape.block_params(True))
    embedding = shape.vocab * shape.hidden
    if first:
        params += shape.embedding_params() - (0 if shape.tied else embedding)
    if last and (pp > 1 or not shape.tied):
        params += embedding  # the head (a copy of the tied embedding on the last stage)
    if last:  # the multi-token prediction modules, beside the head they share
        params += shape.mtp_parameters()
        experts += shape.mtp_depth * shape.experts * shape.expert_params() \
            if shape.mtp_moe else 0
    return params - experts, experts


def memory_of(shape: ModelShape, cluster: Cluster, batch: int, c: PlannedLayout,
              soft: Software | None = None) -> dict[str, float]:
    """The memory figures of one layout (`evaluate`'s, without its time): bytes of
    weights, grads, optimizer, activations, reserved and their total on the GPU needing
    the most."""
    soft = soft or Software()
    m = batch // (c.dims.dp * c.micro_batch)
    return _memory(shape, c, m, cluster.hardware, _activations(shape, _per_micro_batch(c), soft))


def evaluate(shape: ModelShape, cluster: Cluster, batch: int, c: PlannedLayout,
             soft: Software | None = None,
             memory: dict[str, float] | None = None) -> ClusterEstimate:
    """The figures of one layout for a global batch of `batch` sequences (the caller has
    checked it: `check_layout`; `memory`: its `memory_of`, if the caller has it)."""
    soft = soft or Software()
    check_precision(cluster.hardware, soft)
    cluster = as_run(cluster, soft)
    hw = cluster.hardware
    layout = c.dims
    pp, v = layout.pp, layout.virtual_stages
    m = batch // (layout.dp * c.micro_batch)
    kinds = _stage_counts(shape, pp, v, layout.schedule)
    micro = _per_micro_batch(c)
    stages = [_stage_seconds(shape, micro, layers, last, cluster, soft)
              for layers, _, last, _ in kinds]
    # pipeline sends: activations forward, gradients back, split over the tp GPUs' ports;
    # the busiest GPU's (the V-shaped schedules: twice 1F1B's, two chunks a GPU)
    tokens = c.micro_batch * shape.seq // layout.cp
    beyond = layout.tp * layout.cp * layout.dp >= cluster.gpus_per_node
    p2p = 0.0
    if pp > 1:
        p2p = _most_sends(layout.schedule, pp, v) * _collective(
            2 * tokens * shape.hidden / layout.tp, 2, 1.0, *_link(not beyond, hw), hw)
    totals = [sum(stage[:4]) + p2p for stage in stages]
    slowest = max(totals)
    slow_compute, slow_tp, slow_cp, slow_ep, backward, forward, weights_s = \
        stages[totals.index(slowest)]
    # every GPU's per micro-batch, the differing ones standing for those like them; the
    # others fill and drain as the schedule lets them (its bubble at the slowest stage's
    # forward, input-gradient and weight-gradient times)
    fill = fill_share(layout.schedule, (forward, slow_compute - forward - weights_s,
                                        weights_s)) if pp > 1 else 1.0
    pipeline = pipeline_seconds([total for total, (*_, count) in zip(totals, kinds, strict=True)
                                 for _ in range(count)], m, v, fill)
    dense, experts = max((_trained(shape, layers, first, last, layout)
                          for layers, first, last, _ in kinds), key=sum)
    weights = max((_held(shape, layers, first, last, layout)
                   for layers, first, last, _ in kinds), key=sum)
    window = backward / v if soft.overlaps_dp else 0.0  # one micro-batch's backward
    # hybrid sharding: the gradient shards' all-reduce across the replicas, once a step,
    # one more of the last micro-batch's collectives (the module doc); 0 without
    across = replica_seconds(GRAD, dense, experts, layout, cluster)
    if layout.zero == 0:  # one gradient all-reduce
        exposed = max(0.0, _grad_seconds(GRAD, dense, experts, 2, c, cluster) - window)
    elif layout.zero == 1:  # the gradients reduce-scattered, the updated bf16 weights gathered
        exposed = max(0.0, _grad_seconds(GRAD, dense, experts, 1, c, cluster) + across
                      + _grad_seconds(WEIGHT, dense, experts, 1, c, cluster) - window)
    elif layout.zero == 2:  # each micro-batch's gradients reduce-scattered, the weights gathered
        scatter = _grad_seconds(GRAD, dense, experts, 1, c, cluster)
        exposed = (m - 1) * max(0.0, scatter - window) + max(0.0, scatter + across - window) \
            + _grad_seconds(WEIGHT, dense, experts, 1, c, cluster)
    else:  # ZeRO 3 gathers the weights (a frozen base's too) for forward and backward
        per_micro = _grad_seconds(GRAD + 2 * WEIGHT, dense, experts, 1, c, cluster) \
            if not shape.lora else _grad_seconds(GRAD, dense, experts, 1, c, cluster) + \
            _grad_seconds(2 * WEIGHT, *weights, 1, c, cluster)
        exposed = (m - 1) * max(0.0, per_micro - slowest) + \
            max(0.0, per_micro + across - slowest)
    held = dense / _sharded_over(layout) + experts / _expert_dp(layout) if layout.zero else \
        dense + experts
    optimizer_s = OPTIMIZER_BYTES * held / _bandwidth(hw)
    step = pipeline + exposed + optimizer_s
    memory = memory or memory_of(shape, cluster, batch, c, soft)
    tokens_step = batch * shape.seq
    gpus = layout.world_size
    parts = {"compute": m * slow_compute, "tp": m * slow_tp, "cp": m * slow_cp,
             "ep": m * slow_ep, "pp": m * p2p, "bubble": pipeline - m * slowest,
             "dp": exposed, "optimizer": optimizer_s}
    return ClusterEstimate(
        c, memory, memory["total"] <= hw.memory, step, parts,
        bubble=parts["bubble"] / step,
        tokens_per_s=tokens_step / step,
        tflops_per_gpu=tokens_step * _flops(shape, c.recompute) / step / gpus / 1e12,
        mfu=tokens_step * _flops(shape) / step / gpus / hw.peak_flops)


def as_run(cluster: Cluster, soft: Software) -> Cluster:
    """`cluster` as `soft.framework` runs on it: its kernels at the framework's share of
    Megatron-LM's rate (the hardware's gemm and memory efficiencies times it)."""
    share = soft.runs.kernel_efficiency
    if share == 1.0:
        return cluster
    hw = cluster.hardware
    return dataclasses.replace(cluster, hardware=dataclasses.replace(
        hw, gemm_efficiency=hw.gemm_efficiency * share,
        memory_efficiency=hw.memory_efficiency * share))


@functools.cache
def _most_sends(schedule: str, pp: int, virtual: int) -> int:
    """Messages per micro-batch of the pipeline GPU sending the most
    (dtrain.planner.costs.sends)."""
    return max(sends(schedule, pp, virtual, rank) for rank in range(pp))


@functools.cache
def _flops(shape: ModelShape, recompute: str | None = None) -> float:
    """Training FLOPs per token: the hardware's with `recompute`, else the model's."""
    return shape.model_flops_per_token() if recompute is None else \
        shape.flops_per_token(recompute)


def _held(shape: ModelShape, layers: int, first: bool, last: bool,
          layout: Dims) -> tuple[float, float]:
    """(dense, expert) parameters a GPU of a stage holds before ZeRO: the dense ones split
    over tp, the routed experts (whole) over the ep GPUs they are folded over."""
    dense, experts = _stage_params(shape, layers, first, last, layout.pp)
    return dense / layout.tp, experts / layout.ep


def _trained(shape: ModelShape, layers: int, first: bool, last: bool,
             layout: Dims) -> tuple[float, float]:
    """(dense, expert) parameters of `_held` that train: all of them, or with LoRA the
    stage's adapters (split over tp with their layers; no expert is adapted)."""
    if not shape.lora:
        return _held(shape, layers, first, last, layout)
    share = shape.moe_layers / shape.layers
    adapters = layers * ((1 - share) * shape.adapter_params() +
                         share * shape.adapter_params(moe=True))
    return adapters / layout.tp, 0.0


def _sharded_over(layout: Dims) -> int:
    """GPUs ZeRO shares the dense parameters out over (DataParallel averages their
    gradients over them): dp_shard x cp, which is dp x cp without hybrid sharding (cp GPUs
    hold the whole model) and a replica's GPUs with it."""
    return layout.dp_shard * layout.cp


def _expert_dp(layout: Dims) -> int:
    """GPUs ZeRO shares the same experts out over (expert data parallelism, the Dims' edp):
    a replica's dp_shard x cp x tp GPUs / ep."""
    return layout.dp_shard * layout.cp * layout.tp // layout.ep


def replica_bytes(per_param: float, dense: float, experts: float, layout: Dims) -> float:
    """Bytes of the gradient shard a GPU all-reduces across hybrid sharding's replicas:
    `per_param` bytes of each parameter of its shard, `dense` / (dp_shard x cp) of the
    dense ones it holds and `experts` / edp of the experts' (`_expert_dp`); 0 without
    replicas."""
    if layout.dp_replicate == 1:
        return 0.0
    return per_param * (dense / _sharded_over(layout) + experts / _expert_dp(layout))


def replica_traffic(per_param: float, dense: float, experts: float, layout: Dims,
                    cluster: Cluster) -> tuple[float, float]:
    """(bytes on NVLink, bytes on the network) each GPU sends in the all-reduce of its
    gradient shard (`replica_bytes`) over the dp_replicate GPUs holding the same shard,
    dp_shard x cp x tp apart (`dp_traffic`): with replicas of whole nodes all of it on the
    network, 2(R-1)/R of the shard."""
    return dp_traffic(replica_bytes(per_param, dense, experts, layout), 2,
                      layout.dp_replicate, _replica_gap(layout), cluster)


def replica_seconds(per_param: float, dense: float, experts: float, layout: Dims,
                    cluster: Cluster) -> float:
    """Seconds of the all-reduce `replica_traffic` counts, hierarchical (`_dp_seconds`);
    0 without replicas."""
    return _dp_seconds(replica_bytes(per_param, dense, experts, layout), 2,
                       layout.dp_replicate, _replica_gap(layout), cluster)


def _replica_gap(layout: Dims) -> int:
    """GPUs between the same shard's holders in two replicas: a replica's dp_shard x cp x
    tp GPUs (the mesh puts dp_replicate outside them)."""
    return layout.dp_shard * layout.cp * layout.tp


def _grad_seconds(per_param: float, dense: float, experts: float, passes: int,
                  c: PlannedLayout, cluster: Cluster) -> float:
    """A reduce-scatter (`passes` 1) or all-reduce (2) of `per_param` bytes of each
    parameter held: the dense ones over dp x cp (tp apart), the experts' over the edp GPUs
    holding them (ep apart: the ep GPUs of a MoE layer are consecutive)."""
    layout = c.dims
    return _dp_seconds(per_param * dense, passes, _sharded_over(layout), layout.tp, cluster) + \
        _dp_seconds(per_param * experts, passes, _expert_dp(layout), layout.ep, cluster)


def _spread(n: int, apart: int, cluster: Cluster) -> tuple[int, int]:
    """(GPUs of a group of n, `apart` GPUs apart, in each node; the nodes it spans)."""
    per_node = max(1, min(n, cluster.gpus_per_node // apart))
    return per_node, n // per_node


def dp_traffic(nbytes: float, passes: int, n: int, apart: int,
               cluster: Cluster) -> tuple[float, float]:
    """(bytes on NVLink, bytes on the network) each GPU sends in `_dp_seconds`'
    collective: passes x (k-1)/k of `nbytes` among a node's k GPUs of the group, and
    passes x (nodes-1)/nodes of its 1/k part across the nodes."""
    per_node, nodes = _spread(n, apart, cluster)
    return (passes * nbytes * (per_node - 1) / per_node,
            passes * nbytes / per_node * (nodes - 1) / nodes)


def _dp_seconds(nbytes: float, passes: int, n: int, apart: int, cluster: Cluster) -> float:
    """Reduce-scatter (`passes` 1; an all-gather moves the same bytes) or all-reduce (2)
    of `nbytes` over n GPUs `apart` GPUs apart, hierarchical: a node holds several of
    them when the gap leaves room; they reduce-scatter on NVLink, the parts cross the
    network, and (all-reduce) come back the same way (`dp_traffic`)."""
    if n == 1:
        return 0.0
    hw = cluster.hardware
    per_node, nodes = _spread(n, apart, cluster)
    inside, across = dp_traffic(nbytes, passes, n, apart, cluster)
    return _collective(inside, per_node, 1.0, hw.intra_gbps, hw.intra_latency_us, hw,
                       passes) + \
        _collective(across, nodes, 1.0, hw.inter_gbps, hw.inter_latency_us, hw, passes)


@functools.cache
def _activations(shape: ModelShape, c: PlannedLayout, soft: Software) -> tuple[float, float,
                                                                               float, float]:
    """(bytes a layer keeps per micro-batch, on average over dense and MoE layers; one
    layer's working set in backward; the last stage's logits; the parameters of the
    largest block, which ZeRO 3 gathers) on a GPU (`c` as `_per_micro_batch` gives it)."""
    layout = c.dims
    sp, cp, flash, lean = c.sequence_parallel, layout.cp, soft.flash_attention, soft.lean_norms
    share = shape.moe_layers / shape.layers
    kinds = [(moe, weight) for moe, weight in ((False, 1 - share), (True, share)) if weight]
    per_layer = sum(weight * layer_activations(shape, c.micro_batch, layout.tp, sp,
                                               c.recompute, flash, moe, cp, lean)
                    for moe, weight in kinds)
    # one layer's working set in backward: all of its tensors when recomputed; with cp, the
    # keys and values attention meets (all of them gathered, or a ring's two blocks)
    working = max(layer_activations(shape, c.micro_batch, layout.tp, sp,
                                    "none" if c.recompute == "full" else c.recompute, flash,
                                    moe, cp, lean) for moe, _ in kinds)
    if cp > 1 and c.cp_method != "alltoall":
        working += (cp if c.cp_method == "allgather" else 2) * \
            kv_block_bytes(shape, c.micro_batch, layout.tp, cp)
    tokens = c.micro_batch * shape.seq // cp
    logits = 2 * 4 * tokens * shape.vocab / layout.tp  # fp32 logits and their gradient
    block = max(shape.block_params(moe) - (shape.experts * shape.expert_params() if moe else 0)
                for moe, _ in kinds) / layout.tp
    return per_layer, working, logits, block


def _memory(shape: ModelShape, c: PlannedLayout, m: int, hw: Hardware,
            activations: tuple[float, float, float, float]) -> dict[str, float]:
    """The figures of the pipeline GPU that needs the most memory: each stage's weights,
    gradients and optimizer state, and the activations its schedule keeps in flight for
    its own layers (`layers_in_flight`: the first GPU, the last with the logits, and the
    first of the others holding each split of layers, which keeps the most of them)."""
    layout = c.dims
    pp = layout.pp
    per_layer, working, logits, block = activations
    # the largest block a ZeRO 3 GPU gathers, twice (the one computing, the next)
    edp = _expert_dp(layout)
    if edp > 1:  # experts not already whole on the GPU
        block += shape.experts * shape.expert_params() / layout.ep
    out = []
    schedule = layout.schedule
    for chunks, rank in _stage_kinds(shape, pp, layout.virtual_stages, schedule):
        first, last = holds_ends(schedule, pp, layout.virtual_stages, rank)
        dense, experts = _held(shape, sum(chunks), first, last, layout)
        dense_t, experts_t = _trained(shape, sum(chunks), first, last, layout)
        # the stage with the head: its logits, and each multi-token prediction module's
        # block (one micro-batch of it: its backward follows its forward) and logits
        ends = (1 + shape.mtp_depth) * logits + shape.mtp_depth * per_layer if last else 0.0
        acts = layers_in_flight(pp, rank, m, chunks, schedule) * per_layer + working + ends
        weights = WEIGHT * (dense + experts)
        grads = GRAD * (dense_t + experts_t)  # what trains: gradients, optimizer state
        state = STATE * (dense_t + experts_t)
        sharded = dense / _sharded_over(layout) + experts / edp
        sharded_t = dense_t / _sharded_over(layout) + experts_t / edp
        if layout.zero >= 1:
            state = STATE * sharded_t
        if layout.zero >= 2:
            grads = GRAD * sharded_t
        if layout.zero == 3:
            weights = WEIGHT * sharded + 2 * WEIGHT * block
        figures = {"weights": weights, "grads": grads, "optimizer": state,
                   "activations": acts, "reserved": hw.reserved}
        figures["total"] = sum(figures.values())
        out.append(figures)
    return max(out, key=lambda f: f["total"])
