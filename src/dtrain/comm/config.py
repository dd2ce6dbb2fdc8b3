"""The `[comm]` section: how the ranks exchange gradients.

    [comm]  backend = "auto", bucket_mb = 25, grad_dtype = "fp32", compression = "none"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.schema import positive


@dataclass
class CommConfig:
    """How the ranks exchange gradients: the transport, DataParallel's buckets, and what
    is sent."""

    backend: Literal["auto", "gloo", "nccl", "shm"] = "auto"
    """Collective backend: auto (NCCL with CUDA, else gloo), gloo, nccl, or shm (shared
    memory between the ranks of a host, hierarchical across hosts)."""
    bucket_mb: float = positive(25.0)
    """Gradient bucket size for data parallelism, in MB."""
    grad_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Dtype DataParallel communicates gradients in: fp32, bf16 or fp16 (ZeRO takes
    parallel.mixed_precision)."""
    compression: Literal["none", "powersgd", "int8"] = "none"
    """Gradients DataParallel sends: none (fp32 or grad_dtype), powersgd (rank
    compression_rank approximations with error feedback) or int8 (per-chunk scales, error
    feedback): fewer bytes per step over slow links (dtrain.sync.compression)."""
    compression_rank: int = positive(4)
    """With compression = "powersgd": the rank of each gradient matrix's approximation."""
    gather_dtype: Literal["auto", "bf16", "fp8", "int8"] = "auto"
    """With parallel.zero > 0: the dtype ZeRO's weight all-gathers travel in (ZeRO++'s
    qwZ): auto (the compute dtype), bf16, int8 (blockwise absmax scales, every device) or
    fp8 (e4m3 with blockwise scales; CUDA devices of compute capability 8.9 and up). Each
    rank dequantizes what it gathers; its own master weights stay exact."""
    reduce_dtype: Literal["auto", "fp32", "bf16", "int8"] = "auto"
    """With parallel.zero > 0: the dtype ZeRO's gradient reduce-scatters travel in (ZeRO++'s
    qgZ): auto (the compute dtype), fp32, bf16 or int8 (blockwise scales, exchanged by
    all-to-all and summed in fp32). Lossy ones keep what they dropped and add it to the
    next step's gradient (error feedback)."""
    quant_block: int = positive(256)
    """Elements per scale of an int8 or fp8 gather or reduction."""
