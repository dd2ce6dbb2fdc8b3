"""The cost of a layout on a GPU cluster: memory per GPU, step time, tokens/s, MFU.

    cluster = Cluster(hardware("a100-80gb"), nodes=192, gpus_per_node=8)
    shape = parse_shape("layers=80,hidden=12288,heads=96,seq=2048,vocab=51200")
    best = search.rank(shape, cluster, batch=2304)[0]  # every layout, fastest first
    one = evaluate(shape, cluster, 2304, planned_layout(2304, tp=8, pp=8, dp=24))

Unlike the traced planner (dtrain.planner.traced, this machine's ranks), everything here
is arithmetic on the shape (dtrain.planner.shape) and the hardware's figures
(dtrain.planner.analytic.hardware), as a mixed-precision job on GPUs runs it (Megatron-LM,
FSDP): bf16 weights and activations, fp32 gradients, an fp32 master copy and Adam's two
moments.

Memory of the busiest GPU (the first pipeline stage, or the last with the logits):

    weights 2Ψ, gradients 4Ψ, optimizer 12Ψ (Ψ the stage's parameters / tp); ZeRO 1
    divides the optimizer by dp, ZeRO 2 the gradients too, ZeRO 3 the weights (plus two
    layers gathered); activations per layer and micro-batch as Korthikanti et al. (2022)
    count them (34·s·b·h + 5·a·s²·b bytes for GPT, divided by tp where tensor parallelism
    splits them, and where sequence parallelism does; generalized to grouped-query
    attention and SwiGLU; no s² terms with flash attention; 2·s·b·h with full
    recomputation, plus one layer's working set), times the micro-batch chunks the
    pipeline schedule keeps in flight on the first stage (dtrain.pipeline.schedules,
    the lists dtrain's runtime executes); fp32 logits and their gradient on the last
    stage; and the hardware's `reserved` bytes.

Time of one micro-batch through a stage: each matrix multiply (m x k by k x n, bf16)
takes the longer of its FLOPs at `gemm_efficiency` of the peak rate and its operands'
bytes at the memory bandwidth (a roofline: a tensor-parallel shard's thin multiplies and,
without flash attention, attention's per-head products with their small head size fall
below the peak; flash attention's core runs at that rate, the causally masked half of its
products skipped); backward
twice forward; element-wise work (norms, softmax, dropout, activations) as twice the
activation bytes moved at the memory bandwidth; recomputation one more forward of what it
recomputes; tp's two all-reduces per layer each way (two more when recomputing whole
layers; sequence parallelism's all-gathers and reduce-scatters move the same bytes) on
NVLink inside a node, exposed; pp's sends of one micro-batch's activations (split over
the tp GPUs, each on its own network port) at each stage boundary.

Mixture-of-experts blocks (a shape with `experts`): each MoE layer's routed experts are
split over `ep` data-parallel GPUs (ep divides dp and the experts) and over tp (the
experts' own tensor parallelism, Megatron-Core's default; dtrain's own ep keeps a MoE
block whole on each tp rank for now), so weights, gradients and optimizer state of the
experts are divided by ep x tp, and ZeRO divides them by the dp / ep GPUs holding the same
experts; the dense parts are as above. In balance every GPU runs k expert products per
token (grouped: E / ep experts of tokens x k x ep / E rows each), the router and the
shared experts, and keeps their tensors (k x the expert's, the dispatched tokens in and
out, the router's probabilities). Per MoE layer and micro-batch the tokens go to their
experts' GPUs and back by all-to-all: 2 x tokens x k x hidden bf16 elements forward
(dispatch and combine), the same again in backward (and in the recomputed forward), the
tokens divided over tp (sequence parallelism, which Megatron-Core requires with ep and
tp); (ep - 1) / ep of it leaves the GPU, on NVLink to the ep group's GPUs in the node and
on the network to the others, both at once (the slower sets the time), exposed. An ep
group is ep consecutive dp ranks, tp x ep consecutive GPUs; the experts' gradients are
reduced over the dp / ep GPUs holding the same experts, tp x ep apart.

The step is `m · slowest stage + the other stages / v` for m micro-batches and v virtual
stages (dtrain.planner.costs.pipeline_seconds; the bubble: (p-1)/(v·m) of the ideal for
equal stages), plus what data
parallelism does not hide: the gradient all-reduce (ZeRO 1: reduce-scatter and
all-gather), hierarchical (reduce-scatter on NVLink among a node's GPUs of the dp group,
across nodes on the network, back on NVLink), overlapped with the last micro-batch's
backward; ZeRO 2 reduce-scatters each micro-batch's gradients behind its backward; ZeRO 3
gathers the weights for each micro-batch behind its compute; and the optimizer step at
memory bandwidth (30 bytes per parameter held).

Reported: `tflops_per_gpu` counts the FLOPs the GPUs execute, recomputation included
(Megatron-LM's "achieved TFLOP/s"); `mfu` counts the model's alone (6N + 12·l·h·s per
token, N the weights that multiply a token: a MoE block's active ones; PaLM's model FLOPs
utilization).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from dtrain.job_layout import Layout
from dtrain.pipeline.schedules import build
from dtrain.planner.analytic.hardware import Cluster, Hardware
from dtrain.planner.costs import pipeline_seconds
from dtrain.planner.planned import PlannedLayout
from dtrain.planner.shape import ModelShape

WEIGHT, GRAD, STATE = 2, 4, 12  # bytes per parameter: bf16 weights, fp32 grads, Adam
OPTIMIZER_BYTES = 30  # read master, m, v, grad; write master, m, v, bf16 weights
MICRO_SIZES = (1, 2, 4, 8, 16)
CHUNKS = (1, 2, 3, 4, 6, 8)
ZERO_STAGES = (0, 1, 2, 3)


def planned_layout(batch: int, tp: int, pp: int, dp: int, zero: int = 0, micro_batch: int = 1,
                   virtual: int = 1, recompute: str = "full",
                   sequence_parallel: bool = False, ep: int = 1) -> PlannedLayout:
    """tp x pp x dp GPUs with a ZeRO stage, `micro_batch` sequences per micro-batch of a
    global batch of `batch`, `virtual` stages per pipeline GPU (the interleaved schedule),
    recomputation, sequence parallelism and the experts split over `ep` of the dp GPUs:
    one layout as this planner plans it. A pipeline's micro-batches are those the batch
    leaves (without one, they are gradient accumulation, as in dtrain's config).
    `check_layout` says whether it can run."""
    m = max(1, batch // max(1, dp * micro_batch)) if pp > 1 else 1
    layout = Layout(dp, tp, pp, zero, m, "interleaved" if virtual > 1 else "1f1b", virtual,
                    ep=ep)
    return PlannedLayout(layout, recompute, sequence_parallel, micro_batch)


def cluster_label(planned: PlannedLayout) -> str:
    """A layout as this planner's tables show it, in Megatron-LM's order (tp innermost,
    first): `tp8 x pp8 x dp24 ep8 x v2 mb1 zero1 sp` (ep: the dp GPUs the experts are
    split over, v: virtual stages, mb: sequences per micro-batch)."""
    layout = planned.layout
    experts = f" ep{layout.ep}" if layout.ep > 1 else ""
    parts = [f"tp{layout.tp}", f"pp{layout.pp}", f"dp{layout.dp}{experts}"]
    if layout.virtual_stages > 1:
        parts.append(f"v{layout.virtual_stages}")
    text = " x ".join(parts) + f" mb{planned.micro_batch}"
    return text + (f" zero{layout.zero}" if layout.zero else "") + \
        (" sp" if planned.sequence_parallel else "")


@dataclass(frozen=True)
class Software:
    """What the training code does, beyond the layout."""

    flash_attention: bool = True
    overlap_dp: bool = True


@dataclass
class ClusterEstimate:
    planned: PlannedLayout
    memory: dict[str, float]
    fits: bool
    step_s: float
    parts: dict[str, float]  # seconds: compute, tp, ep, pp, bubble, dp, optimizer
    bubble: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float

    @property
    def label(self) -> str:
        """The layout as the tables show it (`cluster_label`)."""
        return cluster_label(self.planned)

    def to_dict(self) -> dict:
        c, layout = self.planned, self.planned.layout
        return {"layout": self.label, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                "ep": layout.ep, "zero": layout.zero, "microbatch": c.micro_batch,
                "virtual": layout.virtual_stages, "recompute": c.recompute,
                "sequence_parallel": c.sequence_parallel,
                "memory_per_gpu_bytes": int(self.memory["total"]),
                "memory_bytes": {k: int(v) for k, v in self.memory.items()},
                "fits": self.fits, "step_time_s": self.step_s, "time_s": self.parts,
                "bubble": self.bubble, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu}


def gemm_seconds(m: float, n: float, k: float, hw: Hardware, count: float = 1) -> float:
    """`count` matrix multiplies of (m x k) by (k x n) in bf16: the longer of their
    arithmetic at the achievable rate and their operands' traffic at memory bandwidth."""
    flops = 2 * m * n * k * count
    traffic = 2 * (m * k + k * n + m * n) * count
    return max(flops / (hw.peak_flops * hw.gemm_efficiency), traffic / _bandwidth(hw))


def _bandwidth(hw: Hardware) -> float:
    return hw.memory_gbps * 1e9 * hw.memory_efficiency


def layer_activations(shape: ModelShape, b: int, tp: int, sp: bool, recompute: str,
                      flash: bool, moe: bool = False) -> float:
    """Bytes one layer (a MoE layer with `moe`) keeps for backward per micro-batch of `b`
    sequences on a tp GPU."""
    s, h = shape.seq, shape.hidden
    shared = 1 / tp if sp else 1.0  # tensors between the row- and the column-parallel layers
    if recompute == "full":
        return 2 * s * b * h * shared  # the layer's input
    drop = 1 if shape.dropout else 0
    q, kv = shape.attention_width, shape.kv_heads * shape.head_dim
    # norms' inputs and outputs feeding the column layers, dropout masks
    replicated = s * b * h * (2 + 2 + 2 + 2 + 2 * drop)
    # q, k, v, the attention output, the MLP's intermediate tensors
    split = 2 * s * b * (q + 2 * kv) + 2 * s * b * q + _mlp_activations(shape, s * b, moe)
    scores = 0.0
    if not flash and recompute == "none":  # softmax output (+ its dropout mask and output)
        scores = shape.heads * s * s * b * (2 + 3 * drop)
    return replicated * shared + (split + scores) / tp


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


@functools.cache
def chunks_in_flight(pp: int, microbatches: int, virtual: int) -> int:
    """The most (micro-batch, chunk) forwards the first stage holds before their backward."""
    if pp == 1:
        return 1
    name = "interleaved" if virtual > 1 else "1f1b"
    live = most = 0
    for action in build(name, pp, 0, microbatches, virtual):
        live += 1 if action.kind == "F" else -1
        most = max(most, live)
    return most


def _collective(nbytes: float, n: int, share: float, link_gbps: float, latency_us: float,
                hw: Hardware, calls: int = 1) -> float:
    """Seconds for a collective over n GPUs moving `share` of `nbytes` per GPU."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return calls * latency_us * 1e-6 + nbytes * share / (link_gbps * 1e9 * hw.link_efficiency)


def _layer_forward(shape: ModelShape, c: PlannedLayout, moe: bool, hw: Hardware,
                   soft: Software) -> tuple[float, float]:
    """(all of one layer's forward, its attention core's) in seconds on a tp GPU for one
    micro-batch: a dense layer, or with `moe` a MoE layer."""
    s, h, t, b = shape.seq, shape.hidden, c.layout.tp, c.micro_batch
    tokens = b * s
    q, kv = shape.attention_width, shape.kv_heads * shape.head_dim
    linear_s = gemm_seconds(tokens, (q + 2 * kv) / t, h, hw) + gemm_seconds(tokens, h, q / t, hw)
    width = 2 if shape.gated else 1  # gate and up side by side
    if not moe:
        linear_s += (gemm_seconds(tokens, width * shape.ffn / t, h, hw)
                     + gemm_seconds(tokens, h, shape.ffn / t, hw))
    else:  # the router; E / ep local experts of tokens x k x ep / E rows; the shared ones
        local = shape.experts // c.layout.ep
        rows = tokens * shape.top_k / local
        f, shared = shape.moe_ffn, shape.shared_experts * shape.moe_ffn
        linear_s += gemm_seconds(tokens / t, shape.experts, h, hw)
        linear_s += (gemm_seconds(rows, width * f / t, h, hw, local)
                     + gemm_seconds(rows, h, f / t, hw, local))
        if shared:
            linear_s += (gemm_seconds(tokens, width * shared / t, h, hw)
                         + gemm_seconds(tokens, h, shared / t, hw))
    heads = b * shape.heads / t  # scores (s x d by d x s) and weighted sum (s x s by s x d)
    if soft.flash_attention:  # tiles in on-chip memory, the masked half skipped
        attention_s = 2 * 2 * s * s * shape.head_dim * heads / 2 / \
            (hw.peak_flops * hw.gemm_efficiency)
    else:
        attention_s = (gemm_seconds(s, s, shape.head_dim, hw, heads)
                       + gemm_seconds(s, shape.head_dim, s, hw, heads))
    elementwise = 2 * layer_activations(shape, b, t, c.sequence_parallel, "none",
                                        soft.flash_attention, moe)
    return linear_s + attention_s + elementwise / _bandwidth(hw), attention_s


def _stage_seconds(shape: ModelShape, c: PlannedLayout, layers: int, last: bool,
                   cluster: Cluster, soft: Software) -> tuple[float, float, float, float]:
    """(compute, tp communication, ep all-to-all, backward compute) of one micro-batch on
    one stage of `layers` layers, the MoE layers among them in the model's proportion."""
    hw = cluster.hardware
    h, t = shape.hidden, c.layout.tp
    tokens = c.micro_batch * shape.seq
    share = shape.moe_layers / shape.layers
    compute = backward = 0.0
    for moe, count in ((False, layers * (1 - share)), (True, layers * share)):
        if not count:
            continue
        forward, attention_s = _layer_forward(shape, c, moe, hw, soft)
        again = {"full": forward, "selective": attention_s, "none": 0.0}[c.recompute]
        compute += count * (3 * forward + again)
        backward += count * (2 * forward + again)
    if last:  # the output head: logits forward and backward, and the loss
        compute += 3 * gemm_seconds(tokens, shape.vocab / t, h, hw)
        compute += 12 * tokens * shape.vocab / t / _bandwidth(hw)
    inside = t <= cluster.gpus_per_node
    link = hw.intra_gbps if inside else hw.inter_gbps
    latency = hw.intra_latency_us if inside else hw.inter_latency_us
    reductions = 4 + (2 if c.recompute == "full" else 0)
    calls = 2 if c.sequence_parallel else 1
    tp_s = layers * reductions * _collective(2 * tokens * h, t, 2 * (t - 1) / t, link,
                                             latency, hw, calls)
    exchanges = 4 + (2 if c.recompute == "full" else 0)  # dispatch and combine each way
    ep_s = layers * share * exchanges * all_to_all_seconds(
        all_to_all_bytes(shape, c.micro_batch, t), c.layout.ep, t, cluster)
    return compute, tp_s, ep_s, backward


def all_to_all_bytes(shape: ModelShape, micro_batch: int, tp: int) -> float:
    """Bytes one GPU hands one all-to-all of a MoE layer (a dispatch or a combine) per
    micro-batch: its tokens' k assignments of `hidden` bf16 elements, the tokens divided
    over tp; a layer sends two (dispatch, combine) forward and two in backward."""
    return 2.0 * micro_batch * shape.seq * shape.top_k * shape.hidden / tp


def all_to_all_seconds(nbytes: float, ep: int, tp: int, cluster: Cluster) -> float:
    """One all-to-all of `nbytes` per GPU over an ep group (ep GPUs tp apart): (ep - 1) /
    ep of it leaves the GPU, on NVLink to the group's GPUs in the node and on the network
    to the others, at once."""
    if ep <= 1:
        return 0.0
    hw = cluster.hardware
    near = min(ep, max(1, cluster.gpus_per_node // tp))  # the group's GPUs in one node
    inside = _collective(nbytes, near, (near - 1) / ep, hw.intra_gbps, hw.intra_latency_us, hw)
    across = _collective(nbytes, ep, (ep - near) / ep, hw.inter_gbps, hw.inter_latency_us, hw)
    return max(inside, across)


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
    return params - experts, experts


def evaluate(shape: ModelShape, cluster: Cluster, batch: int, c: PlannedLayout,
             soft: Software | None = None) -> ClusterEstimate:
    """The figures of one layout for a global batch of `batch` sequences (the caller has
    checked it: `check_layout`)."""
    soft = soft or Software()
    hw = cluster.hardware
    layout = c.layout
    v = layout.virtual_stages
    m = batch // (layout.dp * c.micro_batch)
    layers = v * math.ceil(shape.layers / (layout.pp * v))  # the busiest rank's
    last_compute, last_tp, last_ep, backward = _stage_seconds(shape, c, layers, True, cluster,
                                                              soft)
    mid_compute, mid_tp, mid_ep = (last_compute, last_tp, last_ep) if layout.pp == 1 else \
        _stage_seconds(shape, c, layers, False, cluster, soft)[:3]
    # pipeline sends: activations forward, gradients back, split over the tp GPUs' ports
    tokens = c.micro_batch * shape.seq
    beyond = layout.tp * layout.dp >= cluster.gpus_per_node
    p2p = 0.0
    if layout.pp > 1:
        p2p = 2 * v * _collective(2 * tokens * shape.hidden / layout.tp, 2, 1.0,
                                  hw.inter_gbps if beyond else hw.intra_gbps,
                                  hw.inter_latency_us if beyond else hw.intra_latency_us, hw)
    mid = mid_compute + mid_tp + mid_ep + p2p
    last = last_compute + last_tp + last_ep + p2p
    stages = [(mid_compute, mid_tp, mid_ep)] * (layout.pp - 1) + \
        [(last_compute, last_tp, last_ep)]
    slow_compute, slow_tp, slow_ep = max(stages, key=sum)
    slowest = slow_compute + slow_tp + slow_ep + p2p
    pipeline = pipeline_seconds([mid] * (layout.pp - 1) + [last], m, v)
    first_held = _held(shape, layers, True, layout.pp == 1, layout)
    last_held = _held(shape, layers, layout.pp == 1, True, layout)
    dense, experts = max(first_held, last_held, key=sum)
    window = backward / v if soft.overlap_dp else 0.0  # one micro-batch's backward
    if layout.zero <= 1:  # one gradient all-reduce (ZeRO 1: reduce-scatter and all-gather)
        exposed = max(0.0, _grad_seconds(GRAD, dense, experts, 2, c, cluster) - window)
    elif layout.zero == 2:  # each micro-batch's gradients reduce-scattered, the weights gathered
        exposed = m * max(0.0, _grad_seconds(GRAD, dense, experts, 1, c, cluster) - window) + \
            _grad_seconds(WEIGHT, dense, experts, 1, c, cluster)
    else:  # ZeRO 3 gathers the weights for forward and backward of every micro-batch
        per_micro = _grad_seconds(GRAD + 2 * WEIGHT, dense, experts, 1, c, cluster)
        exposed = m * max(0.0, per_micro - slowest)
    held = dense / layout.dp + experts / _expert_dp(layout) if layout.zero else \
        dense + experts
    optimizer_s = OPTIMIZER_BYTES * held / _bandwidth(hw)
    step = pipeline + exposed + optimizer_s
    memory = _memory(shape, c, m, layers, first_held, last_held, hw, soft)
    tokens_step = batch * shape.seq
    gpus = layout.tp * layout.pp * layout.dp
    parts = {"compute": m * slow_compute, "tp": m * slow_tp, "ep": m * slow_ep, "pp": m * p2p,
             "bubble": pipeline - m * slowest, "dp": exposed, "optimizer": optimizer_s}
    return ClusterEstimate(
        c, memory, memory["total"] <= hw.memory, step, parts,
        bubble=parts["bubble"] / step,
        tokens_per_s=tokens_step / step,
        tflops_per_gpu=tokens_step * shape.flops_per_token(c.recompute) / step / gpus / 1e12,
        mfu=tokens_step * shape.model_flops_per_token() / step / gpus / hw.peak_flops)


def _held(shape: ModelShape, layers: int, first: bool, last: bool,
          layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters a GPU of a stage holds before ZeRO: the dense ones split
    over tp, the routed experts over ep x tp."""
    dense, experts = _stage_params(shape, layers, first, last, layout.pp)
    return dense / layout.tp, experts / (layout.tp * layout.ep)


def _expert_dp(layout: Layout) -> int:
    """GPUs holding the same experts: dp / ep."""
    return layout.dp // layout.ep


def _grad_seconds(per_param: float, dense: float, experts: float, passes: int,
                  c: PlannedLayout, cluster: Cluster) -> float:
    """A reduce-scatter (`passes` 1) or all-reduce (2) of `per_param` bytes of each
    parameter held: the dense ones over dp, the experts' over the dp / ep GPUs holding
    them (tp x ep apart)."""
    layout = c.layout
    return _dp_seconds(per_param * dense, passes, layout.dp, layout.tp, cluster) + \
        _dp_seconds(per_param * experts, passes, _expert_dp(layout), layout.tp * layout.ep,
                    cluster)


def _dp_seconds(nbytes: float, passes: int, n: int, apart: int, cluster: Cluster) -> float:
    """Reduce-scatter (`passes` 1) or all-reduce (2) of `nbytes` over n GPUs `apart` GPUs
    apart, hierarchical: a node holds several of them when the gap leaves room; they
    reduce-scatter on NVLink, the parts cross the network, and (all-reduce) come back the
    same way."""
    if n == 1:
        return 0.0
    hw = cluster.hardware
    per_node = max(1, min(n, cluster.gpus_per_node // apart))
    nodes = n // per_node
    inside = _collective(nbytes, per_node, passes * (per_node - 1) / per_node, hw.intra_gbps,
                         hw.intra_latency_us, hw, passes)
    across = _collective(nbytes / per_node, nodes, passes * (nodes - 1) / nodes,
                         hw.inter_gbps, hw.inter_latency_us, hw, passes)
    return inside + across


def _memory(shape: ModelShape, c: PlannedLayout, m: int, layers: int,
            first_held: tuple[float, float], last_held: tuple[float, float], hw: Hardware,
            soft: Software) -> dict[str, float]:
    sp, flash = c.sequence_parallel, soft.flash_attention
    layout = c.layout
    share = shape.moe_layers / shape.layers
    kinds = [(moe, weight) for moe, weight in ((False, 1 - share), (True, share)) if weight]
    per_layer = sum(weight * layer_activations(shape, c.micro_batch, layout.tp, sp,
                                               c.recompute, flash, moe)
                    for moe, weight in kinds)
    # one layer's working set in backward: all of its tensors when recomputed
    working = max(layer_activations(shape, c.micro_batch, layout.tp, sp,
                                    "none" if c.recompute == "full" else c.recompute, flash,
                                    moe) for moe, _ in kinds)
    v = layout.virtual_stages
    held = chunks_in_flight(layout.pp, m, v) * (layers / v) * per_layer
    tokens = c.micro_batch * shape.seq
    logits = 2 * 4 * tokens * shape.vocab / layout.tp  # fp32 logits and their gradient
    # the largest block a ZeRO 3 GPU gathers, twice (the one computing, the next)
    block = max(shape.block_params(moe) - (shape.experts * shape.expert_params() if moe else 0)
                for moe, _ in kinds) / layout.tp
    if _expert_dp(layout) > 1:  # experts not already whole on the GPU
        block += shape.experts * shape.expert_params() / (layout.tp * layout.ep)
    out = {}
    for name, (dense, experts), acts in (
            ("first", first_held, held + working),
            ("last", last_held, (layers * per_layer if layout.pp > 1 else held)
             + working + logits)):
        weights = WEIGHT * (dense + experts)
        grads = GRAD * (dense + experts)
        state = STATE * (dense + experts)
        sharded = dense / layout.dp + experts / _expert_dp(layout)
        if layout.zero >= 1:
            state = STATE * sharded
        if layout.zero >= 2:
            grads = GRAD * sharded
        if layout.zero == 3:
            weights = WEIGHT * sharded + 2 * WEIGHT * block
        figures = {"weights": weights, "grads": grads, "optimizer": state,
                   "activations": acts, "reserved": hw.reserved}
        figures["total"] = sum(figures.values())
        out[name] = figures
    return max(out.values(), key=lambda f: f["total"])
