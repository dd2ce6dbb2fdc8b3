"""A mixture-of-experts layer's all-to-all on a GPU cluster: which GPUs hold the experts,
the bytes each GPU sends to them and back, over which links, how fast, and how much of it
hides under compute.

    exchange_seconds(shape, 1, tp=2, cp=1, ep=32, cluster=c, dispatch=DISPATCHES["deepep"])
    exposed_seconds(exchanges, compute, overlap=1.0)   # what a step still waits for

The layout: expert parallelism folded (Megatron-Core's "parallel folding", Liu et al.
2025, arXiv 2504.14960). A MoE layer has its own layout over the GPUs of a pipeline stage,
ep x edp = dp x cp x tp, each expert whole on its GPU (expert tensor parallelism 1): the
ep GPUs are consecutive (tp innermost, then cp, then dp), so an ep group fills a node
before it crosses to another whatever the attention's tp and cp, and each GPU holds E / ep
of each MoE layer's experts; the edp GPUs holding the same experts are ep apart. Each GPU
routes its own tokens, b·s / (cp·tp) of a micro-batch of b sequences: under tp each tp rank
takes its own 1/tp of them (its shard under sequence parallelism, which Megatron-Core
requires with experts and tp).

One exchange (a dispatch; a combine moves the same bytes back) on one GPU: its tokens' k
copies of `hidden` bf16 elements, each to the GPU holding its expert (in balance, E / ep
of the experts on each of the ep GPUs), by one of the `DISPATCHES`:

- "nccl", a plain all-to-all (Megatron-Core's alltoall dispatcher, dtrain's own MoE
  layer): (near - 1) / ep of the copies to the group's other GPUs in the node on NVLink,
  (ep - near) / ep to other nodes over the network, at once (the slower sets the time),
  each at the hardware's `link_efficiency` (NCCL's all-to-all reaches one network port's
  rate per GPU, its maintainers say: NVIDIA/nccl-tests issues 130 and 267).
- "deepep", DeepEP's normal kernels (DeepSeek-V3, arXiv 2412.19437, section 3.2.2;
  deepseek-ai/DeepEP): a token crosses the network once for each other node its experts
  are on, to the GPU of the same index there, which forwards it on NVLink to the GPUs of
  its experts (`nodes_reached`: with group-limited routing whose groups are whole nodes,
  DeepSeek-V3's 8 groups on 8 nodes with 4 picked, a token reaches at most 4 nodes where
  its 8 copies would cross to 7 of every 8); the network at DeepEP's published rate,
  `DEEPEP_NETWORK_EFFICIENCY` of the port (43-51 GB/s of "bottleneck bandwidth" at ep
  16-64 on H800s' 50 GB/s ports), NVLink as NCCL's (153-158 GB/s on the H800's 160 GB/s
  of NVLink, which the H800 preset's 200 GB/s at `link_efficiency` is).

A step sends, per MoE layer and micro-batch, two exchanges forward and two in backward
(their gradients), two more recomputing whole layers.

Overlap (`Software.a2a_overlap` = f, dtrain plan --a2a-overlap): f of the exchanges' time
hides under the stage's compute of its micro-batches (DeepSeek-V3's DualPipe pairs one
micro-batch's forward with another's backward and runs one's all-to-all beside the other's
compute; Megatron-Core's 1F1B all-to-all overlap does the same; chunking a micro-batch
hides one chunk's exchange behind another's experts), at most as long as that compute.
What hides still costs: the exchange's kernels take SMs the compute would have used
(DeepSeek-V3 gives its dispatch and combine 20 of an H800's 132: `COMMUNICATION_SMS`; the
planner assumes as many for NCCL's kernels), so the compute beside them runs slower by
that share, for as long as they run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtrain.planner.analytic.hardware import Cluster, Hardware
from dtrain.planner.shape import ModelShape

DEEPEP_NETWORK_EFFICIENCY = 0.9
"""DeepEP V1's internode dispatch and combine: 43-51 GB/s RDMA "bottleneck bandwidth" at
16 and 64 GPUs (58 at 32) on CX7 400 Gbit/s ports of about 50 GB/s (its README's
performance table, H800, DeepSeek-V3's pretraining setting)."""
COMMUNICATION_SMS = 20 / 132
"""The share of an H800/H100's 132 SMs the dispatch and combine kernels take while they run
beside compute: DeepSeek-V3's 20 (arXiv 2412.19437, section 3.2.2)."""


@dataclass(frozen=True)
class Dispatch:
    """How a MoE layer's tokens reach their experts' GPUs.

    network_efficiency: the share of a network port's rate it reaches (None: the
        hardware's link_efficiency).
    per_node: a token crosses the network once per node it goes to, fanned out there on
        NVLink (DeepEP); else once per copy (a plain all-to-all).
    """

    name: str
    network_efficiency: float | None
    per_node: bool


DISPATCHES: dict[str, Dispatch] = {
    "nccl": Dispatch("nccl", None, False),
    "deepep": Dispatch("deepep", DEEPEP_NETWORK_EFFICIENCY, True),
}


def tokens_routed(shape: ModelShape, micro_batch: int, tp: int, cp: int = 1) -> float:
    """Tokens one GPU routes per micro-batch: b·s / (cp·tp) (the module doc)."""
    return micro_batch * shape.seq / (tp * cp)


def all_to_all_bytes(shape: ModelShape, micro_batch: int, tp: int, cp: int = 1) -> float:
    """Bytes one GPU hands one exchange of a MoE layer (a dispatch or a combine) per
    micro-batch: its tokens' k copies of `hidden` bf16 elements, the tokens divided over tp
    and cp; a layer sends two (dispatch, combine) forward and two in backward."""
    return 2.0 * tokens_routed(shape, micro_batch, tp, cp) * shape.top_k * shape.hidden


def _seconds(nbytes: float, gbps: float, latency_us: float, efficiency: float) -> float:
    return latency_us * 1e-6 + nbytes / (gbps * 1e9 * efficiency) if nbytes > 0 else 0.0


def all_to_all_seconds(nbytes: float, n: int, apart: int, cluster: Cluster,
                       network_efficiency: float | None = None) -> float:
    """One all-to-all of `nbytes` per GPU over n GPUs `apart` GPUs apart: (near - 1) / n
    of it on NVLink to the group's other GPUs in the node, (n - near) / n on the network
    to the others, at once (each at link_efficiency, the network at `network_efficiency`
    if given)."""
    if n <= 1:
        return 0.0
    hw = cluster.hardware
    near = min(n, max(1, cluster.gpus_per_node // apart))  # the group's GPUs in one node
    inside = _seconds(nbytes * (near - 1) / n, hw.intra_gbps, hw.intra_latency_us,
                      hw.link_efficiency)
    across = _seconds(nbytes * (n - near) / n, hw.inter_gbps, hw.inter_latency_us,
                      network_efficiency or hw.link_efficiency)
    return max(inside, across)


def nodes_reached(shape: ModelShape, nodes: int) -> float:
    """The nodes a token's k experts lie on, on average, its experts spread evenly over
    `nodes` nodes (in balance: each expert as likely). Without group-limited routing, k
    draws among the nodes: nodes·(1 - (1 - 1/nodes)^k). With it (n_group groups of
    consecutive experts, topk_group picked): where each node holds whole groups, the nodes
    holding one of the topk_group groups drawn from n_group (DeepSeek-V3: 4 of 8 groups
    on 8 nodes, 4 nodes); where each group spans several nodes, k draws among the nodes of
    the topk_group groups."""
    k = shape.top_k
    if nodes <= 1:
        return 1.0
    groups, picked = shape.n_group, shape.topk_group
    if groups and groups % nodes == 0:
        per = groups // nodes
        missed = math.comb(groups - per, picked) / math.comb(groups, picked)
        return nodes * (1 - missed)
    if groups and nodes % groups == 0:
        nodes = picked * nodes // groups
    return nodes * (1 - (1 - 1 / nodes) ** k)


def exchange_seconds(shape: ModelShape, micro_batch: int, tp: int, cp: int, ep: int,
                     cluster: Cluster, dispatch: Dispatch) -> float:
    """One exchange (dispatch or combine) of one GPU's tokens over its ep group of
    consecutive GPUs, per micro-batch (the module doc)."""
    if ep <= 1:
        return 0.0
    copies = all_to_all_bytes(shape, micro_batch, tp, cp)
    nodes = math.ceil(ep / cluster.gpus_per_node)
    if not dispatch.per_node or nodes == 1:
        return all_to_all_seconds(copies, ep, 1, cluster, dispatch.network_efficiency)
    hw: Hardware = cluster.hardware
    near = cluster.gpus_per_node
    network = copies / shape.top_k * nodes_reached(shape, nodes) * (nodes - 1) / nodes
    inside = _seconds(copies * (near - 1) / near, hw.intra_gbps, hw.intra_latency_us,
                      hw.link_efficiency)
    across = _seconds(network, hw.inter_gbps, hw.inter_latency_us,
                      dispatch.network_efficiency or hw.link_efficiency)
    return max(inside, across)


def exposed_seconds(exchanges: float, compute: float, overlap: float) -> float:
    """Of `exchanges` seconds of all-to-all, what a step waits for when `overlap` of it
    hides under `compute` seconds of work (no more than that): the rest, and the hidden
    part's share of SMs (COMMUNICATION_SMS) the compute beside it loses."""
    hidden = min(overlap * exchanges, compute)
    return exchanges - hidden + COMMUNICATION_SMS * hidden
