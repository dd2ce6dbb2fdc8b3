"""`dtrain plan --hardware` against published large-scale runs: predicted against published.

    .venv/bin/python -m benchmarks.cluster_validation         # prints the markdown tables

The rows that must hold are tests (tests/planner/test_plan_cluster.py: Megatron-LM's Table 1,
Korthikanti et al.'s 530B runs and Llama 3 405B's Table 4; test_plan_moe_at_scale.py: the
runs of other frameworks and the mixture-of-experts runs at scale); this script prints them
for RESULTS.md.
"""

from __future__ import annotations

import dataclasses

from dtrain.planner.analytic.hardware import Cluster, hardware
from dtrain.planner.analytic.published import (
    FITTED_ON,
    KORTHIKANTI_530B,
    LLAMA_3_TABLE_4,
    MEGATRON_2021,
    MEGATRON_TABLE_1,
    MOE_NOT_MATCHED,
    MOE_RUNS,
    OTHER_FRAMEWORKS,
    PublishedRun,
    llama_row,
    megatron_row,
    published_layout,
)
from dtrain.planner.analytic.search import rank
from dtrain.planner.shape import ModelShape


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


def _as_megatron(run: PublishedRun) -> float:
    """The run's error planned as Megatron-LM would run it (the framework's share 1)."""
    return dataclasses.replace(run, soft=dataclasses.replace(
        run.soft, framework="megatron-lm")).error()


def other_frameworks() -> None:
    print("| run | source | layout, as planned | published TFLOP/s | as Megatron-LM | "
          "as Megatron-DeepSpeed | error |")
    print("|---|---|---|---|---|---|---|")
    for run in OTHER_FRAMEWORKS:
        ours = run.plan()
        note = f" ({run.note})" if run.note else ""
        print(f"| {run.name}{note} | {run.source} | {ours.label} | {run.published:.0f} | "
              f"{_as_megatron(run):+.1%} | {run.predicted(ours):.1f} | {run.error(ours):+.1%} |")


def moe(runs: list[PublishedRun] = MOE_RUNS) -> None:
    print("| run | source | layout, as planned | software | recompute | memory | published "
          "tokens/s per GPU | predicted | a2a exposed | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        ours = run.plan()
        soft = run.soft
        how = ("FP8, " if soft.float8 else "BF16, ") + \
            f"{soft.dispatch}, {soft.a2a_overlap:.0%} of the all-to-all hidden" + \
            (", forced balance" if run.forced_balance else "")
        fits = "" if ours.fits else " (does not fit)"
        print(f"| {run.name} | {run.source} | {ours.label} | {how} | "
              f"{ours.planned.recompute} | {ours.memory['total'] / 2**30:.1f} GiB{fits} | "
              f"{run.published:,.0f} | {run.predicted(ours):,.0f} | "
              f"{ours.parts['ep'] / ours.step_s:.0%} of the step | {run.error(ours):+.1%} |")


if __name__ == "__main__":
    megatron()
    print()
    korthikanti()
    print()
    llama()
    print()
    other_frameworks()
    print()
    moe()
    print()
    moe(MOE_NOT_MATCHED)
