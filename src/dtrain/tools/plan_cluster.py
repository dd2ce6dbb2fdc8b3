"""`dtrain plan --hardware NAME`: layouts for a GPU cluster this machine is not.

    dtrain plan --hardware a100-80gb --nodes 192 --gpus-per-node 8 \\
        --model-shape layers=80,hidden=12288,heads=96,seq=2048,vocab=51200 --batch 2304
    dtrain plan --hardware h100-80gb --nodes 64 --set model.preset=llama-3-70b --batch 512
    dtrain plan --hardware h100-80gb --nodes 8 --set model.arch=llama \\
        --set model.preset=mixtral-8x7b --set model.block_size=4096 --batch 256 \\
        --layout tp=1,pp=4,dp=16,ep=8      # a mixture of experts, its experts over 8 GPUs
    dtrain plan --hardware h100-80gb --nodes 2048 --batch 128 --model-shape \
        arch=llama,layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,seq=131072,vocab=128256 \
        --layout tp=8,cp=16,pp=16,dp=8 --cp-method allgather   # each sequence over 16 GPUs
    dtrain plan --hardware a100-80gb --nodes 64 --model-shape ... --batch 1536 \\
        --layout tp=8,pp=8,dp=8 --microbatch 1 --recompute full --virtual-stages 2
    dtrain plan --hardware cluster.toml --nodes 16 --set hardware.inter_gbps=12.5 ...
    dtrain plan ... --tokens 300e9          # days and GPU-hours to train on 300B tokens
    dtrain plan --hardware h100-80gb --nodes 1 --set model.preset=llama-3-8b \
        --set model.block_size=8192 --batch 8 --precision fp8   # the linears in FP8
    dtrain plan --hardware h800 --nodes 256 --set model.arch=llama \
        --set model.preset=deepseek-v3 --batch 15360 --layout tp=1,pp=16,dp=128,ep=64 \
        --schedules dualpipev --microbatch 1 --zero 1 --precision fp8 --dispatch deepep \
        --a2a-overlap 1      # DeepSeek-V3 as DeepSeek trained it

Everything is arithmetic on the model's shape and the hardware's figures
(dtrain.planner.analytic), so it runs in seconds for any size. docs/choosing-a-layout.md
explains the model, its constants and its limits, and RESULTS.md compares it with
published runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from dtrain.errors import ConfigError
from dtrain.mesh.dims import SCHEDULES as NAMES
from dtrain.planner.analytic.cluster import (
    CHUNKS,
    MICRO_SIZES,
    SCHEDULES,
    ZERO_STAGES,
    ClusterEstimate,
    Software,
    check_precision,
    planned_layout,
)
from dtrain.planner.analytic.dispatch import DISPATCHES
from dtrain.planner.analytic.hardware import Cluster, hardware
from dtrain.planner.analytic.search import (
    best_layout,
    check_layout,
    context_methods,
    rank,
    recommend,
    training_time,
)
from dtrain.planner.analytic.software import FRAMEWORKS
from dtrain.planner.planned import CP_METHODS, RECOMPUTE
from dtrain.planner.shape import ModelShape, parse_shape
from dtrain.tools import check_output, write_json

LAYOUT_KEYS = ("tp", "cp", "pp", "dp", "ep", "dp_replicate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dtrain plan`'s options for GPU clusters."""
    group = parser.add_argument_group("GPU clusters (arithmetic, no tracing)")
    group.add_argument("--hardware", metavar="NAME|FILE", help="plan for a GPU cluster: "
                       "a100-40gb, a100-80gb, h100-80gb, h200, h800, or a TOML cluster file; "
                       "--set hardware.KEY=VALUE overrides its figures")
    group.add_argument("--nodes", type=int, help="machines (default 1)")
    group.add_argument("--gpus-per-node", type=int, help="GPUs per machine (default: the "
                       "hardware's, 8)")
    group.add_argument("--model-shape", metavar="KEY=V,..", help="the model by its shape: "
                       "layers, hidden, heads, seq, vocab, and optionally arch (gpt|llama), "
                       "kv_heads, ffn, tied, dropout, head_dim, qk_norm; a mixture of "
                       "experts (arch=llama): experts, top_k, and optionally moe_ffn, "
                       "shared_experts, moe_layers, n_group, topk_group; latent attention: "
                       "attention=mla, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
                       "v_head_dim, and optionally q_lora_rank; mtp_depth (default: the "
                       "config's model)")
    group.add_argument("--layout", metavar="tp=T,pp=P,dp=D[,cp=C][,ep=E][,dp_replicate=R]",
                       help="evaluate this layout only (its best micro-batch, virtual stages, "
                       "ZeRO stage, recomputation and cp method unless given); cp splits "
                       "every sequence over C GPUs (context parallelism, default 1); ep "
                       "splits a MoE model's experts over E consecutive GPUs of dp x cp x "
                       "tp (folded, each expert whole; default 1); "
                       "dp_replicate: hybrid sharding, ZeRO inside R replicas of dp / R "
                       "GPUs (default 1)")
    group.add_argument("--cp-method", choices=CP_METHODS, help="how the cp GPUs attend over "
                       "the whole sequence: ring (key/value blocks passed around, behind "
                       "the attention), allgather (keys and values gathered: Llama 3's) or "
                       "alltoall (Ulysses: heads split over cp); default: the fastest")
    group.add_argument("--microbatch", type=int, help="sequences per micro-batch (with "
                       "--layout)")
    group.add_argument("--virtual-stages", type=int, help="pipeline chunks per GPU: the "
                       "interleaved schedule's (with --layout; zbv and dualpipev run 2), or "
                       "--schedule-table's")
    group.add_argument("--zero", type=int, help="ZeRO stage 0-3 (with --layout)")
    group.add_argument("--attention", choices=("flash", "plain"), default="flash",
                       help="kernels: flash (no s x s scores kept, norms keep one tensor; "
                       "default) or plain (scores and each norm's input kept, as "
                       "Megatron-LM in 2021)")
    group.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                       help="the blocks' linear layers: bf16 (default) or fp8 (at the "
                       "hardware's FP8 rate, scaled from bf16 as torchao's float8 training "
                       "does: dtrain's [train] float8; attention's core, the head and the "
                       "rest stay bf16; MFU stays against the bf16 peak)")
    group.add_argument("--dispatch", choices=tuple(DISPATCHES), default="nccl",
                       help="how a MoE layer's tokens reach their experts: nccl (a plain "
                       "all-to-all, default) or deepep (DeepEP-class kernels: a token crosses "
                       "the network once per node, at DeepEP's published rate)")
    group.add_argument("--a2a-overlap", type=float, default=0.0, metavar="F",
                       help="the share of the MoE all-to-all hidden under compute, 0-1 "
                       "(default 0: none; DeepSeek-V3's DualPipe 1; Megatron-Core's 1F1B "
                       "overlap about 0.38, fitted on its Qwen3-235B runs)")
    group.add_argument("--framework", choices=tuple(FRAMEWORKS), default="megatron-lm",
                       help="the framework the run would use: megatron-lm (default) or "
                       "megatron-deepspeed (2022's: its kernels at 0.81 of Megatron-LM's "
                       "rate, gradients reduced after the last backward)")
    group.add_argument("--tokens", type=float, help="training tokens: adds days and "
                       "GPU-hours to train")
    group.add_argument("--top", type=int, default=15, help="rows of the table (default 15; "
                       "--json has every layout)")


def split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the config's --set items, the hardware.KEY ones as key -> value)."""
    config, hw = [], {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith("hardware."):
            hw[key.removeprefix("hardware.")] = value
        else:
            config.append(item)
    return config, hw


def schedules_of(text: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """`--schedules`: "auto" (`default`) or comma-separated names of the schedules
    (dtrain.mesh.dims.SCHEDULES).

    Raises:
        ConfigError: no name, or one that is no schedule.
    """
    if text.strip() == "auto":
        return default
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise ConfigError(f"--schedules is empty: give auto or some of {', '.join(NAMES)} "
                          "(several: 1f1b,zb1p)")
    for name in names:
        if name not in NAMES:
            raise ConfigError(f"--schedules: schedule={name!r} is not one: use auto or some of "
                              f"{', '.join(NAMES)}")
    return names


def _layout(args: argparse.Namespace) -> dict[str, int] | None:
    if args.layout is None:
        for flag in ("microbatch", "virtual_stages", "zero", "cp_method"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} goes with --layout "
                                  "tp=..,pp=..,dp=..")
        return None
    degrees = {}
    for item in args.layout.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in LAYOUT_KEYS or not value.strip().isdigit():
            raise ConfigError(f"--layout {args.layout!r}: give tp=T,pp=P,dp=D and "
                              "optionally cp=C, ep=E and dp_replicate=R (whole numbers)")
        degrees[key.strip()] = int(value)
    return {k: degrees.get(k, 1) for k in LAYOUT_KEYS}


CLUSTER_ONLY = ("nodes", "gpus_per_node", "model_shape", "layout", "microbatch",
                "virtual_stages", "zero", "cp_method", "tokens")


def check_cluster_flags(args: argparse.Namespace, hw_overrides: dict[str, str]) -> None:
    """Without --hardware, the cluster's flags are a mistake: say so."""
    given = [f"--{flag.replace('_', '-')}" for flag in CLUSTER_ONLY
             if getattr(args, flag) is not None]
    given += [f"--set hardware.{key}" for key in hw_overrides]
    if args.attention != "flash":
        given.append("--attention")
    if args.precision != "bf16":
        given.append("--precision")
    given += [flag for flag, value, default in (
        ("--dispatch", args.dispatch, "nccl"), ("--a2a-overlap", args.a2a_overlap, 0.0),
        ("--framework", args.framework, "megatron-lm")) if value != default]
    if given:
        raise ConfigError(f"{', '.join(given)} plan a GPU cluster: add --hardware NAME "
                          "(a100-40gb, a100-80gb, h100-80gb, h200, h800 or a TOML file)")


def cluster_plan(args: argparse.Namespace, config, hw_overrides: dict[str, str]) -> None:
    """Run `dtrain plan --hardware ...` (after the config is loaded)."""
    for flag in ("devices", "bandwidth", "latency", "model"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag} is for this machine's ranks; with --hardware give "
                              "--nodes and --gpus-per-node, the cluster's figures with --set "
                              "hardware.KEY=VALUE, the model with --model-shape")
    overrides = dict(hw_overrides)
    if args.memory:
        overrides["memory"] = args.memory
    if args.tflops is not None:
        overrides["peak_tflops"] = str(args.tflops)
    hw = hardware(args.hardware, overrides)
    cluster = Cluster(hw, 1 if args.nodes is None else args.nodes,
                      hw.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node)
    shape = parse_shape(args.model_shape) if args.model_shape else ModelShape.of(
        _resolved_model(config))
    batch = args.batch if args.batch is not None else config.train.batch_size
    if batch < 1 or args.top < 1:
        raise ConfigError("--batch and --top must be positive")
    if args.tokens is not None and not 0 < args.tokens < math.inf:
        raise ConfigError(f"--tokens {args.tokens:g} must be a positive number")
    check_output("--json", args.json)
    flash = args.attention == "flash"
    soft = Software(flash_attention=flash, lean_norms=flash, float8=args.precision == "fp8",
                    dispatch=args.dispatch, a2a_overlap=args.a2a_overlap,
                    framework=args.framework)
    check_precision(hw, soft)
    modes = RECOMPUTE if args.recompute == "auto" else (args.recompute,)
    seq = (False, True) if args.sequence_parallel == "auto" else \
        (args.sequence_parallel == "on",)
    schedules = schedules_of(args.schedules, SCHEDULES)
    layout = _layout(args)
    if layout is not None:
        estimates = [_given(shape, cluster, batch, layout, args, modes, seq, soft, schedules)]
    else:
        estimates = rank(shape, cluster, batch, modes, seq, soft, schedules)
        if not estimates:
            raise ConfigError(f"no layout of {cluster.gpus} GPUs splits a batch of {batch} "
                              "with this model: make --batch a multiple of the data-parallel "
                              "degrees, or change --nodes")
    best, why = recommend(estimates)
    info = {"model": shape.describe(), "parameters": shape.parameters(),
            "active_parameters": shape.active_parameters(),
            "model_flops_per_token": shape.model_flops_per_token(),
            "hardware": dataclasses.asdict(hw), "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node, "gpus": cluster.gpus,
            "global_batch": batch, "seq_len": shape.seq, "attention": args.attention,
            "precision": args.precision, "dispatch": args.dispatch,
            "a2a_overlap": args.a2a_overlap, "framework": args.framework,
            "kv_cache_bytes_per_token": shape.kv_cache_bytes(),
            "recommended": best.to_dict() if best else None, "why": why,
            "layouts": [e.to_dict() for e in estimates]}
    if args.tokens is not None and best is not None:
        info["training"] = training_time(best, args.tokens, batch, shape.seq, cluster.gpus)
    if args.json and write_json("--json", args.json, info):
        return
    _print(info, estimates[:args.top], len(estimates), hw)


def _resolved_model(config):
    from dtrain.data import vocab_of
    from dtrain.models import resolve

    dc = config.data
    return resolve(config.model, vocab_of(dc.path, dc.format, dc.tokenizer))


def _given(shape, cluster: Cluster, batch: int, layout: dict[str, int],
           args: argparse.Namespace, modes, seq, soft: Software,
           schedules: tuple[str, ...] = SCHEDULES) -> ClusterEstimate:
    """The given layout with its best options (those not fixed by the flags), its
    pipeline with the fastest of `schedules` that runs it."""
    tp, pp, dp, ep, cp, replicas = (layout[k] for k in ("tp", "pp", "dp", "ep", "cp",
                                                        "dp_replicate"))
    micro = (args.microbatch,) if args.microbatch is not None else MICRO_SIZES
    chunks = (args.virtual_stages,) if args.virtual_stages is not None else CHUNKS
    zeros = (args.zero,) if args.zero is not None else \
        tuple(z for z in ZERO_STAGES if z or replicas == 1)  # hybrid sharding: ZeRO
    methods = (args.cp_method,) if args.cp_method else context_methods(shape, tp, cp)
    # the degrees, heads and layers; and, when the flags fix everything, the one choice
    # one schedule asked for: the layout is checked with it (the V-shaped: on two chunks)
    first = schedules[0] if len(schedules) == 1 and pp > 1 else None
    if first in ("zbv", "dualpipev") and args.virtual_stages is None:
        chunks = (2,)
    if first == "interleaved" and chunks[0] == 1:
        first = None
    check_layout(shape, cluster, batch, planned_layout(batch, tp, pp, dp, zeros[0], micro[0],
                                                       chunks[0], modes[0], ep=ep, cp=cp,
                                                       cp_method=methods[0], schedule=first,
                                                       replicas=replicas))
    best = best_layout(shape, cluster, batch, tp, pp, dp, micro, chunks, zeros, modes, seq,
                       soft, ep, cp, methods, schedules, replicas=(replicas,))
    if best is None:
        raise ConfigError(f"--layout {args.layout}: no micro-batch size splits a batch of "
                          f"{batch} over dp={dp}")
    return best


def _print(info: dict, shown: list[ClusterEstimate], count: int, hw) -> None:
    out = sys.stdout  # the stream at the call, not the one at import (a test may swap it)
    gib = 2**30
    active = info["active_parameters"]
    active_text = f" ({active / 1e9:.2f}B active)" if active != info["parameters"] else ""
    print(f"dtrain plan: {info['model']}, {info['parameters'] / 1e9:.2f}B parameters"
          f"{active_text}; "
          f"{info['gpus']} GPUs ({info['nodes']} nodes x {info['gpus_per_node']}); global "
          f"batch {info['global_batch']} x {info['seq_len']} tokens", file=out)
    fp8 = "; the blocks' linear layers and experts in fp8" if info["precision"] == "fp8" \
        else ""
    framework = f"; as {info['framework']} runs it" if info["framework"] != "megatron-lm" \
        else ""
    print(f"hardware: {hw.describe()}; {info['attention']} attention{fp8}{framework}",
          file=out)
    print("memory per GPU: bf16 weights, fp32 gradients and Adam state (ZeRO divides them), "
          "activations of the busiest stage; TFLOP/s counts recomputation, MFU does not",
          file=out)
    moe = active != info["parameters"]
    if moe:
        print(f"experts: whole, over ep consecutive GPUs of dp x cp x tp (ZeRO: over the "
              f"dp x cp x tp / ep holding the same ones); FLOPs from the active parameters; "
              f"a2a: the step's wait for the all-to-all ({info['dispatch']}, "
              f"{info['a2a_overlap']:.0%} of it hidden under compute)", file=out)
    a2a = f" {'a2a':>8}" if moe else ""
    width = max([34] + [len(e.label) for e in shown])
    header = (f"{'layout':{width}} {'recompute':>9} {'memory':>9} {'fits':>4} {'bubble':>6}{a2a} "
              f"{'step':>9} {'tokens/s':>10} {'TFLOP/s':>7} {'MFU':>6}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for e in shown:
        a2a = f" {e.parts['ep']:>7.2f}s" if moe else ""
        print(f"{e.label:{width}} {e.planned.recompute:>9} "
              f"{e.memory['total'] / gib:>5.1f} GiB {'yes' if e.fits else 'NO':>4} "
              f"{e.bubble:>6.1%}{a2a} {e.step_s:>8.2f}s {e.tokens_per_s:>10.0f} "
              f"{e.tflops_per_gpu:>7.1f} {e.mfu:>6.1%}", file=out)
    if count > len(shown):
        print(f"... {count - len(shown)} more layouts (--top N, or --json for all)", file=out)
    print(f"recommended: {info['why']}", file=out)
    if "training" in info:
        t = info["training"]
        print(f"training on {t['tokens']:.3g} tokens: {t['steps']} steps, {t['days']:.1f} "
              f"days, {t['gpu_hours']:,.0f} GPU-hours", file=out)
