"""`dtrain plan`: every layout of a model on N devices, with its memory, traffic and time.

    dtrain plan                                   # the built-in GPT on its 2 ranks
    dtrain plan --set model.arch=llama --set model.preset=llama-3-8b -n 64 --memory 80GB
    dtrain plan -n 8 --memory 80GB --layers 24 --embd 1024 --heads 16 --block 1024 \\
        --vocab 50304 --batch 64 --tflops 300 --bandwidth 100
    dtrain plan my.toml -n 4 --json plan.json     # a training config's model and batch
    dtrain plan --model mypkg.models:build -n 4   # a model of your own (dp and ZeRO only)
    dtrain plan -n 4 --memory 2GB --recompute full --sequence-parallel on
    dtrain plan --set model.arch=llama --set model.preset=moe-tiny -n 4   # with ep layouts
    dtrain plan --set model.arch=llama --set model.block_size=4096 --set \
        parallel.cp_method=allgather -n 8          # cp layouts attending by all-gather
    dtrain plan --hardware a100-80gb --nodes 192 --model-shape layers=80,hidden=12288,\
        heads=96,seq=2048,vocab=51200 --batch 2304   # a GPU cluster (dtrain.tools.plan_cluster)
    dtrain plan --schedule-table --pp 4 --microbatches 8 --schedule zbv   # each rank's actions

Figures are per rank, for the busiest rank of each layout (dtrain.planner). The compute
rate defaults to a matrix multiply timed on this machine; link costs to the calibration
`dtrain bench comm --calibrate` saved (else assumed, and said so).

Activation recomputation and sequence parallelism start from the config's (`[memory]
recompute`, `[parallel] sequence_parallel`); by default (`auto`) a layout
that does not fit so takes sequence parallelism, then recomputes more (selective, then
full), whichever fits at the least time. `--recompute MODE` and `--sequence-parallel
on|off` fix them instead. Context-parallel layouts (`cp2`: dtrain's GPT and Llama without
dropout) attend by the config's `[parallel] cp_method`.

Pipelines are planned with each schedule of `--schedules` that can run them (default: 1f1b,
zb1p, zbv and dualpipev; the cluster planner adds interleaved), cut into stages as
`[parallel] stage_layers` says. `--schedule-table` prints one pipeline's schedule instead:
each rank's actions, the step's bubble and each rank's peak of live micro-batches,
simulated (dtrain.planner.costs).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from typing import TYPE_CHECKING

from dtrain.errors import ConfigError
from dtrain.mesh.dims import SCHEDULES
from dtrain.sizes import parse_size
from dtrain.tools import check_output, plan_cluster, write_json

if TYPE_CHECKING:
    from dtrain.config import Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define `dtrain plan`'s options on `parser`."""
    from dtrain.config import add_config_arguments

    add_config_arguments(parser, "a dtrain train TOML config (its model, batch, optimizer "
                         "and nproc); default: the built-in one", "model.n_layer=12")
    parser.add_argument("-n", "--devices", type=int, help="devices (ranks) to plan for "
                        "(default: the config's parallel.nproc)")
    parser.add_argument("--memory", metavar="SIZE", help="memory per device, e.g. 80GB or "
                        "24GiB (default: the GPU's, else this machine's RAM / devices)")
    parser.add_argument("--batch", type=int, help="global batch in sequences (default: "
                        "train.batch_size)")
    for flag, key, what in (("--layers", "n_layer", "blocks"), ("--heads", "n_head", "heads"),
                            ("--embd", "n_embd", "width"), ("--vocab", "vocab_size", "vocab"),
                            ("--block", "block_size", "sequence length")):
        parser.add_argument(flag, type=int, dest=key, help=f"model {what} (model.{key})")
    parser.add_argument("--model", metavar="MODULE:FACTORY", help="plan a model of your own: "
                        "FACTORY() returns (model, inputs for one sample); dp and ZeRO only")
    parser.add_argument("--tflops", type=float, help="compute rate per device in TFLOP/s "
                        "(default: timed here)")
    parser.add_argument("--bandwidth", type=float, metavar="GB/S", help="link bandwidth per "
                        "rank, GB/s (default: measured by dtrain bench comm --calibrate)")
    parser.add_argument("--latency", type=float, default=None, metavar="US",
                        help="seconds per collective call, in microseconds (with --bandwidth)")
    parser.add_argument("--ranks-per-machine", type=int, metavar="N",
                        help="the devices are machines of N ranks joined by --network: a "
                        "collective spanning machines costs the network's figures (how "
                        "hybrid sharding, dp_replicate, is weighed)")
    parser.add_argument("--network", type=float, metavar="GB/S",
                        help="bandwidth per rank between machines, GB/s (with "
                        "--ranks-per-machine)")
    parser.add_argument("--network-latency", type=float, default=None, metavar="US",
                        help="microseconds per collective call between machines (with "
                        "--network; default: --latency's)")
    parser.add_argument("--schedules", default="auto", metavar="LIST",
                        help="pipeline schedules to consider, comma-separated: "
                             f"{', '.join(SCHEDULES)} (default auto: 1f1b, zb1p, zbv and "
                             "dualpipev; with --hardware interleaved too)")
    parser.add_argument("--recompute", default="auto",
                        choices=("auto", "none", "selective", "full"),
                        help="activation recomputation to plan with (default auto: the "
                        "config's memory.recompute, or more where a layout "
                        "does not fit without)")
    parser.add_argument("--sequence-parallel", default="auto", choices=("auto", "on", "off"),
                        help="sequence parallelism for tp layouts (default auto: the config's "
                        "parallel.sequence_parallel, or on where a layout does not fit "
                        "without)")
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON ('-': "
                        "standard output, instead of the table)")
    table = parser.add_argument_group("one pipeline's schedule (--schedule-table)")
    table.add_argument("--schedule-table", action="store_true",
                       help="print each pipeline rank's actions (F3: forward of micro-batch "
                       "3, B1.1: backward of micro-batch 1 on chunk 1, W0: weights' "
                       "gradients, F3&: a forward paired with the backward after it), the "
                       "simulated bubble and each rank's peak of live micro-batches")
    table.add_argument("--pp", type=int, help="pipeline ranks (default: parallel.pp)")
    table.add_argument("--microbatches", type=int,
                       help="micro-batches per step (default: parallel.microbatches)")
    table.add_argument("--schedule", choices=SCHEDULES,
                       help="the schedule (default: parallel.schedule)")
    table.add_argument("--times", metavar="F,B,W", default="1,1,1",
                       help="relative time of a stage's forward, input gradient and "
                       "weights' gradients of one micro-batch (default 1,1,1)")
    table.add_argument("--comm", type=float, metavar="T", default=0.0,
                       help="time of one message between two ranks, in --times' units "
                       "(default 0)")
    plan_cluster.add_arguments(parser)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _links(args: argparse.Namespace):
    from dtrain.planner.traced import machine
    from dtrain.planner.traced.links import DEFAULT_LATENCY_US, Links

    latency = args.latency if args.latency is not None else DEFAULT_LATENCY_US
    links = Links.given(args.bandwidth, latency) if args.bandwidth is not None else \
        machine.links()
    if (args.ranks_per_machine is None) != (args.network is None):
        raise ConfigError("--ranks-per-machine and --network go together: the machines' "
                          "size and the bandwidth between them")
    if args.ranks_per_machine is not None:
        across = args.network_latency if args.network_latency is not None else latency
        links = links.across_machines(args.ranks_per_machine, args.network, across)
    return links


def plan_choices(args: argparse.Namespace, config: Config
                 ) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """The recomputation modes and sequence-parallel settings each layout may take,
    preferred first: `--recompute` and `--sequence-parallel` when given, else the
    config's (`[memory]`, `[parallel]`) and those saving more memory after them."""
    from dtrain.planner import RECOMPUTE

    if args.recompute != "auto":
        modes: tuple[str, ...] = (args.recompute,)
    else:
        modes = RECOMPUTE[RECOMPUTE.index(config.memory.recompute):]
    if args.sequence_parallel != "auto":
        seq: tuple[bool, ...] = (args.sequence_parallel == "on",)
    else:
        seq = (True,) if config.parallel.sequence_parallel else (False, True)
    return modes, seq


def plan_command(args: argparse.Namespace) -> None:
    """Run `dtrain plan` as parsed by the CLI."""
    from dtrain.config import load_config
    from dtrain.data import vocab_of
    from dtrain.models import resolve
    from dtrain.planner import plan, profile_factory, profile_model, recommend
    from dtrain.planner.traced import machine
    from dtrain.planner.traced.construction import whole_model
    from dtrain.planner.traced.slow_links import recommend_sync, sync_options

    config_overrides, hw_overrides = plan_cluster.split_overrides(list(args.overrides))
    overrides = config_overrides + [
        f"model.{key}={getattr(args, key)}" for key in
        ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
        if getattr(args, key) is not None]
    config = load_config(args.config, overrides)
    if args.schedule_table:
        schedule_table_command(args, config)
        return
    _check_table_flags(args)
    if args.hardware is not None:
        plan_cluster.cluster_plan(args, config, hw_overrides)
        return
    plan_cluster.check_cluster_flags(args, hw_overrides)
    devices = args.devices if args.devices is not None else config.parallel.nproc
    batch = args.batch if args.batch is not None else config.train.batch_size
    if devices < 1 or batch < 1:
        raise ConfigError("--devices and --batch must be positive")
    for flag, value in (("--tflops", args.tflops), ("--bandwidth", args.bandwidth)):
        if value is not None and not 0 < value < math.inf:
            raise ConfigError(f"{flag} {value:g} must be a positive number")
    if args.latency is not None and not 0 <= args.latency < math.inf:
        raise ConfigError(f"--latency {args.latency:g} must be 0 or more")
    from dtrain.planner.traced import SCHEDULES as TRACED

    schedules = plan_cluster.schedules_of(args.schedules, TRACED)
    check_output("--json", args.json)
    memory, memory_from = ((parse_size(args.memory, "--memory"), "given") if args.memory
                           else machine.device_memory(devices))
    flops = args.tflops * 1e12 if args.tflops else machine.measured_flops()
    links = _links(args)
    modes, seq = plan_choices(args, config)
    # cached: plan() and the header below trace the same micro-batch sizes, in the
    # recomputation modes planned only
    if args.model:
        trace = functools.cache(lambda b: profile_factory(args.model, b, modes))
    else:
        dc = config.data
        shape = resolve(config.model, vocab_of(dc.path, dc.format, dc.tokenizer))
        trace = functools.cache(lambda b, cp=1, method="ring":
                                profile_model(shape, b, modes, cp=cp, cp_method=method,
                                              adapter=config.adapter,
                                              reference=config.objective.kind == "dpo"))
    if args.model and config.parallel.ep > 1:
        raise ConfigError(f"parallel.ep = {config.parallel.ep} with --model: a model of your "
                          "own is planned with dp and ZeRO only; leave parallel.ep = 1")
    if config.memory.recompute_modules:
        raise ConfigError("memory.recompute_modules is not planned: dtrain plan counts the "
                          "recompute modes (none, selective, full); leave "
                          "recompute_modules out, or plan with --recompute MODE")
    estimates = plan(trace, devices, memory, batch, flops, links, config.optimizer.name,
                     config.train.grad_accum, config.comm.bucket_mb, schedules, modes, seq,
                     config.parallel.cp_method, config.parallel.stage_layers)
    if not estimates:
        raise ConfigError(f"no layout of {devices} devices splits a batch of {batch}: make "
                          "--batch a multiple of the device count")
    best, why = recommend(estimates)
    profile = trace(max(1, batch // devices))
    replicated = next((e for e in estimates if e.fits and e.dims.dp > 1 and e.dims.ep == 1
                       and e.dims.cp == 1 and not e.dims.zero
                       and e.dims.exchange == "collective"), None)
    options = [] if replicated is None else \
        sync_options(trace(batch // (replicated.dims.dp * replicated.dims.microbatches)),
                     replicated, links)
    sync, sync_why = recommend_sync(options)
    info = {
        "model": profile.name, "parameters": profile.params.total, "devices": devices,
        "memory_per_device": memory, "memory_from": memory_from, "global_batch": batch,
        "seq_len": profile.seq_len, "optimizer": config.optimizer.name,
        "flops_per_device": flops, "flops_from": "given" if args.tflops else "timed here",
        "links": links.source, "whole_model_bytes": int(whole_model(profile.params)),
        "recompute_choices": list(modes), "sequence_parallel_choices": list(seq),
        "cp_method": config.parallel.cp_method,
        "recommended": best.to_dict() if best else None, "why": why,
        "layouts": [e.to_dict() for e in estimates],
        "sync": {"layout": replicated.label if replicated else None,
                 "options": [o.to_dict() for o in options],
                 "recommended": sync.to_dict() if sync else None, "why": sync_why},
    }
    if args.json and write_json("--json", args.json, info):
        return
    _print_table(info, estimates, why)
    if options:
        _print_sync(info["sync"], options)


TABLE_ONLY = ("pp", "microbatches", "schedule")


def _check_table_flags(args: argparse.Namespace) -> None:
    """`--pp`, `--microbatches`, `--schedule`, `--times` and `--comm` go with
    --schedule-table."""
    given = [f"--{flag}" for flag in TABLE_ONLY if getattr(args, flag) is not None]
    given += ["--times"] if args.times != "1,1,1" else []
    given += ["--comm"] if args.comm else []
    if given:
        raise ConfigError(f"{', '.join(given)}: for one pipeline's --schedule-table; add it, "
                          "or leave them out (a plan weighs every layout, with --schedules)")


def _times(text: str) -> tuple[float, float, float]:
    """`--times F,B,W` as three positive numbers.

    Raises:
        ConfigError: not three positive numbers.
    """
    try:
        times = tuple(float(part) for part in text.split(","))
    except ValueError:
        times = ()
    if len(times) != 3 or not all(0 < t < math.inf for t in times):
        raise ConfigError(f"--times {text!r}: give three positive numbers F,B,W (a stage's "
                          "forward, input gradient and weights' gradients), e.g. 1,1,0.5")
    return times[0], times[1], times[2]


def schedule_table(schedule: str, pp: int, microbatches: int, chunks: int,
                   times: tuple[float, float, float] = (1.0, 1.0, 1.0),
                   comm: float = 0.0) -> dict:
    """One pipeline's schedule as `--schedule-table` shows it: each rank's actions (the
    lists the runtime executes), its peak of live micro-batches (in chunk-sized units) and
    the stages it holds, and the bubble of the step simulated on `times` (a stage's F, B
    and W of one micro-batch) with `comm` per message between ranks
    (dtrain.planner.costs.bubble).

    Raises:
        ConfigError: the schedule cannot run so, or a negative `comm` (a one-line reason).
    """
    from dtrain.pipeline.schedules import check, peak_live
    from dtrain.planner.costs import action_lists, bubble, placed, schedule_of, step_length

    if pp < 2:
        raise ConfigError(f"--schedule-table needs a pipeline: pp = {pp}; give --pp 2 or more "
                          "(or parallel.pp)")
    if not 0 <= comm < math.inf:
        raise ConfigError(f"--comm {comm:g} must be 0 or more")
    check(schedule, pp, microbatches, chunks)
    named = schedule_of(schedule, chunks)
    lists = action_lists(named, pp, microbatches, chunks)
    place = placed(named, pp, chunks)
    return {"schedule": schedule, "pp": pp, "microbatches": microbatches, "chunks": chunks,
            "times": list(times), "comm": comm,
            "bubble": bubble(pp, microbatches, chunks, schedule, times, comm),
            "step": step_length(named, pp, microbatches, chunks, times, comm),
            "ranks": [{"rank": r, "stages": [place.stage(r, c) for c in range(chunks)],
                       "peak_live": peak_live(actions),
                       "actions": [repr(a) for a in actions]}
                      for r, actions in enumerate(lists)]}


def schedule_table_command(args: argparse.Namespace, config: Config) -> None:
    """Run `dtrain plan --schedule-table`: the flags, else the config's `[parallel]`."""
    from dtrain.mesh.dims import V_SHAPED

    if args.hardware is not None:
        raise ConfigError("--schedule-table prints one pipeline's actions: leave --hardware "
                          "out (a cluster plan weighs the schedules with --schedules)")
    p = config.parallel
    schedule = args.schedule or p.schedule
    chunks = args.virtual_stages
    if chunks is None:
        if schedule in V_SHAPED:
            chunks = 2
        elif schedule == "interleaved":
            chunks = max(2, p.virtual_stages)
        else:
            chunks = p.virtual_stages
    table = schedule_table(schedule, p.pp if args.pp is None else args.pp,
                           p.microbatches if args.microbatches is None else args.microbatches,
                           chunks, _times(args.times), args.comm)
    check_output("--json", args.json)
    if args.json and write_json("--json", args.json, table):
        return
    print_schedule_table(table)


def print_schedule_table(table: dict, out=sys.stdout) -> None:
    """`schedule_table`'s figures: a header, then a row per rank."""
    chunks = table["chunks"]
    held = "stage" if chunks == 1 else "stages"
    f, b, w = (f"{t:g}" for t in table["times"])
    print(f"dtrain plan --schedule-table: {table['schedule']}, pp={table['pp']}, "
          f"{table['microbatches']} micro-batches, {chunks} chunk{'s' if chunks > 1 else ''} "
          f"per rank; F, B, W of a stage = {f}, {b}, {w}; a message {table['comm']:g}",
          file=out)
    print(f"bubble {table['bubble']:.2%} of a step of {table['step']:g} (every rank busy "
          f"{table['step'] * (1 - table['bubble']):g}); live: the most micro-batches a rank "
          "holds (chunk-sized), from F to W (to B where backward is whole)", file=out)
    width = max(len(held), *(len(",".join(map(str, r["stages"]))) for r in table["ranks"]))
    print(f"{'rank':>4} {held:>{width}} {'live':>4}  actions", file=out)
    for row in table["ranks"]:
        stages = ",".join(map(str, row["stages"]))
        print(f"{row['rank']:>4} {stages:>{width}} {row['peak_live']:>4}  "
              f"{' '.join(row['actions'])}", file=out)


def _print_table(info: dict, estimates, why: str, out=sys.stdout) -> None:
    print(f"dtrain plan: {info['model']}, {info['parameters'] / 1e6:.2f}M parameters; "
          f"{info['devices']} devices of {_size(info['memory_per_device'])} "
          f"({info['memory_from']}); global batch {info['global_batch']}, "
          f"{info['optimizer']}", file=out)
    print(f"compute: {info['flops_per_device'] / 1e12:.3g} TFLOP/s per device "
          f"({info['flops_from']}); links: {info['links']}", file=out)
    print(f"recompute: {' or '.join(info['recompute_choices'])}; sequence parallel: "
          f"{' or '.join('on' if s else 'off' for s in info['sequence_parallel_choices'])} "
          f"(sp: on, for tp layouts); cp layouts attend by {info['cp_method']}", file=out)
    print("memory per rank (busiest rank); build: the peak while the layout builds it from a "
          f"skeleton (the whole model is {_size(info['whole_model_bytes'])}, what every rank "
          "held before split-form construction); comm: bytes handed to collectives per step",
          file=out)
    width = max([28, *(len(e.label) for e in estimates)])
    header = (f"{'layout':{width}} {'recompute':>9} {'params':>10} {'grads':>10} {'optim':>10} "
              f"{'activ.':>10} {'total':>10} {'fits':>4} {'build':>10} {'comm/step':>10} "
              f"{'bubble':>6} {'step':>9}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for e in estimates:
        print(f"{e.label:{width}} {e.recompute:>9} {_size(e.params):>10} {_size(e.grads):>10} "
              f"{_size(e.optimizer):>10} {_size(e.activations):>10} {_size(e.total):>10} "
              f"{'yes' if e.fits else 'NO':>4} {_size(e.construction):>10} "
              f"{_size(sum(e.traffic.values())):>10} {e.bubble:>6.0%} "
              f"{e.step_s * 1e3:>7.1f}ms", file=out)
    print(f"recommended: {why}", file=out)


def _print_sync(sync: dict, options, out=sys.stdout) -> None:
    """The ways the fastest data-parallel layout could synchronize
    (dtrain.planner.traced.slow_links)."""
    print(f"\nsynchronizing {sync['layout']} over these links (progress: steps to the loss one "
          "synchronous step reaches, measured on the default job):", file=out)
    header = f"{'option':18} {'sent/step':>10} {'step':>9} {'progress':>8} {'to same loss':>12}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for o in options:
        print(f"{o.name:18} {_size(o.bytes_per_step):>10} {o.step_s * 1e3:>7.1f}ms "
              f"{o.progress:>7.2f}x {o.time_to_loss_s * 1e3:>10.1f}ms", file=out)
    print(f"recommended sync: {sync['why']}", file=out)
