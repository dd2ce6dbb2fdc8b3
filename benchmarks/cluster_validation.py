"""`dtrain plan --hardware` against published large-scale runs: predicted against published.

    .venv/bin/python -m benchmarks.cluster_validation         # prints the markdown tables

The rows that must hold within 15% are tests (tests/test_plan_cluster.py: Megatron-LM's
Table 1 and Korthikanti et al.'s 530B runs); this script prints them for RESULTS.md with
two more published runs the cost model does not match, and why.
"""

from __future__ import annotations

from dtrain.planner.analytic.hardware import Cluster, hardware
from dtrain.planner.analytic.search import best_layout, rank
from dtrain.planner.shape import ModelShape
from tests.test_plan_cluster import (
    FITTED_ON,
    KORTHIKANTI_530B,
    MEGATRON_2021,
    MEGATRON_TABLE_1,
    _published_layout,
    _row,
)

# Megatron-Turing NLG 530B (Smith et al., 2022, "Using DeepSpeed and Megatron to Train
# Megatron-Turing NLG 530B", section 2.4): Megatron-DeepSpeed, A100 80GB, tp 8, pp 35,
# global batch 1920, sequence 2048; nodes -> TFLOP/s per GPU (recomputation counted)
MT_NLG = [(280, 126), (350, 121), (420, 113)]
# Llama 3 405B (Dubey et al., 2024, "The Llama 3 Herd of Models", Table 4): H100, tp 8,
# pp 16, sequence 8192, 16M tokens per batch; GPUs, dp -> model TFLOP/s per GPU
LLAMA_3_405B = [(8192, 64, 430), (16384, 128, 400)]


def megatron() -> None:
    print("| params (B) | counted (B) | published layout | TFLOP/s published | predicted "
          "| ratio | recommended layout | its step / published layout's |")
    print("|---|---|---|---|---|---|---|---|")
    for i, row in enumerate(MEGATRON_TABLE_1):
        shape, cluster, params, tp, pp, gpus, batch, tflops = _row(row)
        ours = _published_layout(shape, cluster, batch, tp, pp)
        best = rank(shape, cluster, batch, soft=MEGATRON_2021)[0]
        fitted = " (fitted)" if i in FITTED_ON else ""
        print(f"| {params}{fitted} | {shape.parameters() / 1e9:.2f} | {ours.label} | "
              f"{tflops} | {ours.tflops_per_gpu:.1f} | {ours.tflops_per_gpu / tflops:.3f} | "
              f"{best.label}, recompute {best.planned.recompute} | "
              f"{best.step_s / ours.step_s:.3f} |")


def korthikanti() -> None:
    shape = ModelShape(105, 20480, 128, 2048, 51200)
    cluster = Cluster(hardware("a100-80gb"), 280, 8)
    print("| 530B on 2240 A100s | layout | MFU published | predicted | ratio |")
    print("|---|---|---|---|---|")
    for recompute, sp, mfu in KORTHIKANTI_530B:
        ours = _published_layout(shape, cluster, 2240, 8, 35, recompute, sp)
        what = "sequence parallel + selective" if sp else "full recomputation"
        print(f"| {what} | {ours.label} | {mfu:.1%} | {ours.mfu:.1%} | "
              f"{ours.mfu / mfu:.3f} |")


def outside() -> None:
    print("| run | layout | published | predicted | ratio |")
    print("|---|---|---|---|---|")
    shape = ModelShape(105, 20480, 128, 2048, 50272)
    for nodes, tflops in MT_NLG:
        cluster = Cluster(hardware("a100-80gb"), nodes, 8)
        ours = best_layout(shape, cluster, 1920, 8, 35, nodes * 8 // 280, (1, 2), (1, 2, 3, 4, 6),
                           (1,), ("full",), (False,), MEGATRON_2021)
        print(f"| MT-NLG 530B, {nodes * 8} A100s | {ours.label} | {tflops} TFLOP/s | "
              f"{ours.tflops_per_gpu:.1f} | {ours.tflops_per_gpu / tflops:.3f} |")
    llama = ModelShape(126, 16384, 128, 8192, 128256, "llama", kv_heads=8, ffn=53248)
    for gpus, _, tflops in LLAMA_3_405B:
        cluster = Cluster(hardware("h100-80gb"), gpus // 8, 8)
        ours = best_layout(llama, cluster, 2048, 8, 16, gpus // 128, (1, 2), (1, 2, 3, 4, 6),
                           (1,), sequence_parallel=(True,))
        model_tflops = ours.mfu * cluster.hardware.peak_tflops
        print(f"| Llama 3 405B, {gpus} H100s | {ours.label}, recompute "
              f"{ours.planned.recompute} | {tflops} TFLOP/s (model) | {model_tflops:.1f} | "
              f"{model_tflops / tflops:.3f} |")


if __name__ == "__main__":
    megatron()
    print()
    korthikanti()
    print()
    outside()
