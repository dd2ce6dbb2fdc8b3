"""`dtrain plan --hardware` against published large-scale runs: predicted against published.

    .venv/bin/python -m benchmarks.cluster_validation         # prints the markdown tables

The rows that must hold are tests (tests/planner/test_plan_cluster.py: Megatron-LM's Table 1,
Korthikanti et al.'s 530B runs and Llama 3 405B's Table 4); this script prints them for
RESULTS.md with the published runs the cost model does not match, and why.
"""

from __future__ import annotations

from dtrain.planner.analytic.hardware import Cluster, hardware
from dtrain.planner.analytic.published import (
    FITTED_ON,
    KORTHIKANTI_530B,
    LLAMA_3_TABLE_4,
    MEGATRON_2021,
    MEGATRON_TABLE_1,
    llama_row,
    megatron_row,
    published_layout,
)
from dtrain.planner.analytic.search import best_layout, rank
from dtrain.planner.shape import ModelShape

# Megatron-Turing NLG 530B (Smith et al., 2022, "Using DeepSpeed and Megatron to Train
# Megatron-Turing NLG 530B", section 2.4): Megatron-DeepSpeed, A100 80GB, tp 8, pp 35,
# global batch 1920, sequence 2048; nodes -> TFLOP/s per GPU (recomputation counted)
MT_NLG = [(280, 126), (350, 121), (420, 113)]


def megatron() -> None:
    print("| params (B) | counted (B) | published layout | TFLOP/s published | predicted "
          "| ratio | recommended layout | its step / published layout's |")
    print("|---|---|---|---|---|---|---|---|")
    for i, row in enumerate(MEGATRON_TABLE_1):
        shape, cluster, params, tp, pp, gpus, batch, tflops = megatron_row(row)
        ours = published_layout(shape, cluster, batch, tp, pp)
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
        ours = published_layout(shape, cluster, 2240, 8, 35, recompute, sp)
        what = "sequence parallel + selective" if sp else "full recomputation"
        print(f"| {what} | {ours.label} | {mfu:.1%} | {ours.mfu:.1%} | "
              f"{ours.mfu / mfu:.3f} |")


def llama() -> None:
    print("| Llama 3 405B | published layout, as planned | recompute | memory | TFLOP/s "
          "(MFU) published | predicted (Meta's count) | ratio | PaLM's count |")
    print("|---|---|---|---|---|---|---|---|")
    for row in LLAMA_3_TABLE_4:
        gpus, seq, tflops, mfu = row[0], row[5], row[7], row[8]
        ours, meta = llama_row(row)
        palm = ours.mfu * hardware("h100-80gb").peak_tflops
        print(f"| {gpus:,} H100s, seq {seq:,} | {ours.label} | {ours.planned.recompute} | "
              f"{ours.memory['total'] / 2**30:.1f} GiB | {tflops} ({mfu:.0%}) | "
              f"{meta:.1f} ({meta / 989:.1%}) | {meta / tflops:.3f} | {palm:.1f} |")


def outside() -> None:
    print("| run | layout | published | predicted | ratio |")
    print("|---|---|---|---|---|")
    shape = ModelShape(105, 20480, 128, 2048, 50272)
    for nodes, tflops in MT_NLG:
        cluster = Cluster(hardware("a100-80gb"), nodes, 8)
        ours = best_layout(shape, cluster, 1920, 8, 35, nodes * 8 // 280, (1, 2), (1, 2, 3, 4, 6),
                           (1,), ("full",), (False,), MEGATRON_2021,
                           schedules=("1f1b",))  # DeepSpeed's pipeline engine: 1F1B
        print(f"| MT-NLG 530B, {nodes * 8} A100s | {ours.label} | {tflops} TFLOP/s | "
              f"{ours.tflops_per_gpu:.1f} | {ours.tflops_per_gpu / tflops:.3f} |")


if __name__ == "__main__":
    megatron()
    print()
    korthikanti()
    print()
    llama()
    print()
    outside()
