"""What the training code does, beyond the layout: its kernels, precision, the MoE layers'
all-to-all and how much of it hides, and the framework a published run was trained with.

    soft = Software()                                   # Megatron-LM as it runs today
    soft = Software(float8=True, dispatch="deepep", a2a_overlap=1.0)   # DeepSeek-V3's run
    soft = Software(flash_attention=False, lean_norms=False,
                    framework="megatron-deepspeed")     # BLOOM's, MT-NLG's (2022)

The cluster planner (dtrain.planner.analytic.cluster) costs a layout as a well-tuned
Megatron-LM runs it. Other frameworks of the published runs it is checked against ran the
same arithmetic slower, for reasons their papers do not break down (their pipeline
engine's scheduling, kernels not fused as Megatron-LM's, launches serialized): each is one
`Framework`, a share of Megatron-LM's compute rate (every kernel's time divided by it) and
what its runtime does differently that the planner can count (the gradients reduced after
the last micro-batch instead of behind its backward). The shares are fitted, each on the
runs its reason names, and checked on the others (benchmarks/RESULTS.md, "Planning GPU
clusters"); `FRAMEWORKS` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.errors import ConfigError
from dtrain.planner.analytic.dispatch import DISPATCHES
from dtrain.planner.analytic.hardware import Hardware


@dataclass(frozen=True)
class Framework:
    """A training framework as the planner counts it.

    kernel_efficiency: the share of Megatron-LM's compute rate its kernels reach (every
        compute time is divided by it; 1 for Megatron-LM).
    overlap_dp: whether it reduces the gradients behind the last micro-batch's backward
        (Megatron-LM, FSDP) or after it (DeepSpeed's pipeline engine: its `ReduceGrads`
        runs once every micro-batch is done).
    why: where the share comes from.
    """

    kernel_efficiency: float
    overlap_dp: bool
    why: str


FRAMEWORKS: dict[str, Framework] = {
    "megatron-lm": Framework(
        1.0, True, "the reference: gemm_efficiency is fitted on Megatron-LM's Table 1"),
    "megatron-deepspeed": Framework(
        0.81, False,
        "2022's Megatron-DeepSpeed (MT-NLG, BLOOM): Megatron-LM's layers run by DeepSpeed's "
        "pipeline engine; fitted on MT-NLG 530B at 2,240 GPUs, the same shape Megatron-LM "
        "ran at 163 TFLOP/s (Table 1) against MT-NLG's 126; checked on its other two runs "
        "and on BLOOM 176B"),
}
"""The frameworks a plan may assume (`Software.framework`, `dtrain plan --framework`)."""


@dataclass(frozen=True)
class Software:
    """What the training code does, beyond the layout.

    flash_attention: attention's core in on-chip tiles (no s x s scores kept), its masked
        half skipped; without it, scores on the roofline and kept (Megatron-LM in 2021).
    overlap_dp: the gradient reduction behind the last micro-batch's backward (the
        framework's own choice still applies: a framework that cannot overlaps nothing).
    lean_norms: each LayerNorm/RMSNorm keeps one tensor for backward, its output (which
        the next matrix multiply keeps anyway; the normalized input is (y - β) / γ), not
        also its input (`layer_activations`).
    float8: the blocks' linear layers and the routed experts' grouped products multiply
        in FP8 (`linear_seconds`; the hardware needs an FP8 rate: `check_precision`).
    dispatch: how a MoE layer's tokens reach their experts: "nccl" (a plain all-to-all)
        or "deepep" (DeepEP-class kernels: once per machine over the network, fanned out
        on NVLink; dtrain.planner.analytic.dispatch).
    a2a_overlap: the share of the all-to-all hidden under compute (0: none, as dtrain's
        own MoE layer runs it; 1: all of it that compute can cover, as DeepSeek-V3's
        DualPipe and Megatron-Core's 1F1B all-to-all overlap aim for).
    framework: the framework that runs it (FRAMEWORKS).
    """

    flash_attention: bool = True
    overlap_dp: bool = True
    lean_norms: bool = True
    float8: bool = False
    dispatch: str = "nccl"
    a2a_overlap: float = 0.0
    framework: str = "megatron-lm"

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCHES:
            raise ConfigError(f"--dispatch {self.dispatch}: use {' or '.join(DISPATCHES)}")
        if not 0.0 <= self.a2a_overlap <= 1.0:
            raise ConfigError(f"--a2a-overlap {self.a2a_overlap:g} is a share of the "
                              "all-to-all: give a number from 0 to 1")
        if self.framework not in FRAMEWORKS:
            raise ConfigError(f"--framework {self.framework}: use one of "
                              f"{', '.join(FRAMEWORKS)}")

    @property
    def runs(self) -> Framework:
        """The framework's figures (FRAMEWORKS)."""
        return FRAMEWORKS[self.framework]

    @property
    def overlaps_dp(self) -> bool:
        """Whether the gradients' reduction hides behind the last backward: asked for, and
        the framework can."""
        return self.overlap_dp and self.runs.overlap_dp


def check_precision(hw: Hardware, soft: Software) -> None:
    """Refuse to plan FP8 on hardware without an FP8 rate.

    Raises:
        ConfigError: `soft.float8` and `hw.fp8_tflops` is 0 (an A100).
    """
    if soft.float8 and not hw.fp8_tflops:
        raise ConfigError(f"--precision fp8: {hw.name} has no FP8 tensor cores (they came "
                          "with compute capability 8.9: H100, H200, L4): use --precision "
                          "bf16, or give its rate with --set hardware.fp8_tflops=N")
