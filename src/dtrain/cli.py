"""The `dtrain` command: `dtrain run` starts ranks, `dtrain train` trains a model,
`dtrain plan` predicts memory and time of every layout before a run, `dtrain export`
writes a checkpoint as one plain state_dict or a Hugging Face folder, `dtrain generate`
samples text from a checkpoint's model split over ranks, `dtrain data
prepare` tokenizes a corpus into shards, `dtrain bench comm` measures the collectives
and `dtrain bench scaling` the speed-up of a training job from 1 to N workers.

Errors a user can fix print as one line (`dtrain: error: ...`) with a non-zero exit code;
tracebacks are for dtrain's own bugs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from dtrain import env
from dtrain.errors import ConfigError, exit_code_of


class _Parser(argparse.ArgumentParser):
    """argparse's mistakes in dtrain's form: the usage, then one `dtrain: error:` line
    (its subcommands' too, which argparse would head `dtrain train: error:`)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"dtrain: error: {message}\n")


def _add_launch_flags(p: argparse.ArgumentParser, default_nproc: int | None) -> None:
    p.add_argument("-n", "--nproc", type=int, default=default_nproc,
                   help="processes (ranks) on this machine")
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="machines in the job (default 1); MIN:MAX: elastic, starts with the "
                        "machines that arrive and goes on when some leave or join")
    p.add_argument("--node-rank", type=int, default=None,
                   help="0: this machine hosts the rendezvous at --master (default: the first "
                        "launcher able to listen there does)")
    p.add_argument("--master", metavar="HOST:PORT",
                   help="address of node 0's rendezvous store (needed with --nnodes > 1)")
    p.add_argument("--rdzv-backend", choices=("c10d", "etcd"), default=None,
                   help="where the job's store lives: c10d (default), node 0's launcher at "
                        "--master; etcd, a cluster that survives losing any one member")
    p.add_argument("--rdzv-endpoints", metavar="HOST:PORT,...", default=None,
                   help="the etcd cluster's members, with --rdzv-backend etcd")
    p.add_argument("--rdzv-id", metavar="NAME", default=None,
                   help="the job's id, the same on every machine and new for each job "
                        "(needed with etcd, whose keys outlive the job)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart all ranks up to K times after a failure (default 0)")
    p.add_argument("--join-timeout", type=int, default=120, metavar="SECONDS",
                   help="how long machines wait for each other to join (default 120)")
    p.add_argument("--backend", choices=("gloo", "nccl", "shm"),
                   help="collective backend for dtrain.init() in every rank (DTRAIN_BACKEND); "
                        "shm: shared memory between the ranks of a host")
    p.add_argument("--debug", action="store_true",
                   help="check every collective's arguments across ranks (DTRAIN_DEBUG=1)")
    p.add_argument("--timeline", metavar="PATH",
                   help="record every rank's collectives (and dtrain train's forward, "
                        "backward, optimizer and data spans) into one Chrome-trace JSON file "
                        "for https://ui.perfetto.dev")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dtrain", description="Train PyTorch models across processes, machines and GPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run", help="start N ranks of a script", description=(
            "Start N ranks of a Python script on this machine (and others with --nnodes). "
            "Each rank finds its place with dtrain.init(); output lines carry the rank."
        ),
    )
    _add_launch_flags(run, default_nproc=1)
    run.add_argument("--servers", type=int, default=0, metavar="S",
                     help="also start S parameter servers per machine (dtrain.ps); -n counts "
                          "the workers")
    run.add_argument("--server-host", default="127.0.0.1", metavar="HOST",
                     help="address the servers bind and publish (default 127.0.0.1; another "
                          "machine's workers need a reachable one)")
    run.add_argument("--snapshot-dir", metavar="DIR",
                     help="servers save their shards here and resume from them on restart")
    run.add_argument("--snapshot-every", type=int, default=0, metavar="K",
                     help="servers snapshot every K updates (default 0: never)")
    run.add_argument("-m", dest="module", action="store_true",
                     help="run SCRIPT as a module, like python -m")
    run.add_argument("script", help="the Python script (or module with -m) each rank runs")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    train = sub.add_parser(
        "train", help="train a model from a TOML config (the built-in GPT by default)",
        description=(
            "Train from a TOML config; with none, a small byte-level GPT on Python's own "
            "standard library sources, on 2 local ranks with data parallelism."
        ),
    )
    from dtrain.config import add_config_arguments

    add_config_arguments(train, "TOML config file (default: built-in)")
    train.add_argument("--metrics", metavar="PATH", help="write per-step metrics as JSON lines")
    train.add_argument("--resume", nargs="?", const="auto", metavar="CKPT",
                       help="resume from the newest checkpoint of this run, or from CKPT (a "
                            "checkpoints folder or one checkpoint; any layout)")
    _add_launch_flags(train, default_nproc=None)

    export = sub.add_parser(
        "export", help="write a checkpoint's model as a state_dict file, a Hugging Face folder "
                       "or a PEFT adapter folder",
        description=(
            "Write the model of a dtrain checkpoint (any layout) as one state_dict file that "
            "loads into the unparallelized model with load_state_dict (of an adapter "
            "checkpoint: the adapters alone), or with --format hf as a Hugging Face folder "
            "(config.json, model.safetensors, tokenizer.json) that transformers' "
            "AutoModelForCausalLM.from_pretrained loads (--merge: LoRA adapters folded "
            "into their weights), or with --format peft as a PEFT folder of the LoRA "
            "adapters (adapter_config.json, adapter_model.safetensors) that "
            "peft.PeftModel.from_pretrained loads; no dtrain needed."
        ),
    )
    export.add_argument("checkpoint", nargs="+",
                        help="a checkpoints folder (its newest) or one checkpoint; saved with "
                             "checkpoint.copies, each host's folder that is left (the "
                             "first one's newest step is exported)")
    export.add_argument("out", help="output: a .safetensors or .pt file, or a folder with "
                                    "--format hf or peft")
    export.add_argument("--format", choices=("state_dict", "hf", "peft"), default="state_dict",
                        help="state_dict (default), hf (a Hugging Face model folder) or peft "
                             "(a PEFT folder of the LoRA adapters)")
    export.add_argument("--merge", action="store_true",
                        help="with --format hf: fold the LoRA adapters into the weights they "
                             "adapt (an adapter checkpoint needs it)")

    generate = sub.add_parser(
        "generate", help="generate text from a checkpoint's model, split over ranks",
        description=(
            "Generate text from the model of a dtrain checkpoint (any layout), built in "
            "split form over -n ranks in the layout --set parallel.* asks for (tp, pp, "
            "ZeRO-3: no rank holds the whole model); rank 0 prints only the text. The same "
            "seed gives the same text in any layout."
        ),
    )
    generate.add_argument("checkpoint", help="a checkpoints folder (its newest) or one "
                                             "checkpoint")
    generate.add_argument("--prompt", default="", help="the text to continue (default: none, "
                                                       "the tokenizer's separator)")
    generate.add_argument("--tokens", type=int, default=200, metavar="T",
                          help="tokens to generate (default 200)")
    generate.add_argument("--chat", action="store_true",
                          help="the prompt is a user's message, rendered by the run's chat "
                               "template; stop at its end of turn and print the answer")
    generate.add_argument("--seed", type=int, default=0, metavar="S",
                          help="seed of the sampling generator (default 0)")
    generate.add_argument("--temperature", type=float, default=0.8, metavar="X",
                          help="softmax temperature of the draws (default 0.8)")
    generate.add_argument("-n", "--nproc", type=int, default=1,
                          help="ranks on this machine (default 1)")
    generate.add_argument("--set", dest="overrides", action="append", default=[],
                          metavar="KEY=VALUE",
                          help="override a key of the run's config, e.g. parallel.tp=2")
    generate.add_argument("--backend", choices=("gloo", "nccl", "shm"),
                          help="collective backend of the ranks")

    data = sub.add_parser("data", help="prepare training data",
                          description="Prepare training data: `dtrain data prepare`.")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prepare = data_sub.add_parser(
        "prepare", help="tokenize text or JSONL files into token shards",
        description=(
            "Tokenize text files, folders or JSONL files (a \"text\" field per line) into "
            "memory-mapped token shards for [data] format = \"tokens\": in parallel over "
            "processes, in constant memory, with a progress bar."
        ),
    )
    from dtrain.data.prepare import add_arguments

    add_arguments(prepare)

    plan = sub.add_parser(
        "plan", help="predict memory, communication and step time of every layout",
        description=(
            "For a model, a number of devices and the memory of each, list every layout "
            "(dp, ZeRO 0-3, tp, pp, micro-batches) with its bytes per rank, bytes "
            "communicated per step, pipeline bubble and estimated step time; mark those "
            "that do not fit and recommend one."
        ),
    )
    from dtrain.tools.plan import add_arguments as add_plan_arguments

    add_plan_arguments(plan)

    bench = sub.add_parser(
        "bench", help="measure dtrain's parts (comm: the collectives; scaling: a training "
                      "job on 1..N workers)",
        description="Benchmarks of dtrain's building blocks; each prints a table from rank 0.",
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    comm = benchmarks.add_parser(
        "comm", help="time each collective per algorithm and message size, like nccl-tests",
        description=(
            "Time dtrain.comm's collectives for each algorithm and message size on N local "
            "ranks (or as one rank under dtrain run / torchrun / srun). Rank 0 prints, per "
            "operation, time, algorithm bandwidth (bytes / time) and bus bandwidth (algbw "
            "scaled by the share of data each rank moves, as in nccl-tests)."
        ),
    )
    from dtrain.tools.comm_bench import add_arguments

    add_arguments(comm)
    scaling = benchmarks.add_parser(
        "scaling", help="throughput, speed-up and efficiency of a training job on 1..N workers",
        description=(
            "Run the same dtrain train job on 1, 2, ... N workers for a fixed number of steps, "
            "with a fixed global batch (strong scaling) and a fixed batch per worker (weak "
            "scaling); report throughput, speed-up, efficiency and the share of step time "
            "spent communicating, as a table, JSON and a PNG plot."
        ),
    )
    from dtrain.tools.scaling import add_arguments as add_scaling_arguments

    add_scaling_arguments(scaling)
    return parser


def _check_launch_flags(args: argparse.Namespace) -> None:
    """The launch flags dtrain run and dtrain train need before anything is computed
    from them (the launcher checks the others)."""
    from dtrain.launch.runner import parse_nnodes

    args.min_nodes, args.nnodes = parse_nnodes(args.nnodes)
    if args.join_timeout < 1:
        raise ConfigError(f"--join-timeout {args.join_timeout} must be at least 1 (seconds)")


def _run(args: argparse.Namespace) -> None:
    from dtrain.launch.runner import LaunchSpec, launch

    _check_launch_flags(args)
    if args.snapshot_every < 0:
        raise ConfigError(f"--snapshot-every {args.snapshot_every} must be 0 (never) or more")
    if args.module:
        command = [sys.executable, "-u", "-m", args.script, *args.args]
    else:
        if not os.path.isfile(args.script):
            raise ConfigError(
                f"script {args.script!r} not found (run from its folder or give a path)"
            )
        command = [sys.executable, "-u", args.script, *args.args]
    nproc = args.nproc
    env: dict[str, str] = {}
    if args.servers or args.snapshot_dir or args.snapshot_every:
        from dtrain.launch.roles import plan

        command, nproc, env = plan(command, args.nproc, args.servers, args.nnodes,
                                   args.server_host, args.snapshot_dir, args.snapshot_every)
    launch(LaunchSpec(
        command=command, nproc=nproc, nnodes=args.nnodes, min_nodes=args.min_nodes,
        node_rank=args.node_rank, master=args.master, max_restarts=args.max_restarts,
        join_timeout=args.join_timeout, env=env, timeline=args.timeline or "",
        rdzv_backend=args.rdzv_backend or "c10d", rdzv_endpoints=args.rdzv_endpoints or "",
        run_id=args.rdzv_id or "",
    ))


def _export(args: argparse.Namespace) -> None:
    if args.merge and args.format != "hf":
        raise ConfigError("dtrain export: --merge writes a Hugging Face folder: add --format hf")
    if args.format == "hf":
        from dtrain.tools.export_hf import export_hf

        print(f"dtrain: wrote "
              f"{export_hf(args.checkpoint[0], args.out, args.checkpoint[1:], args.merge)}")
        return
    if args.format == "peft":
        from dtrain.tools.export_peft import export_peft

        print(f"dtrain: wrote {export_peft(args.checkpoint[0], args.out, args.checkpoint[1:])}")
        return
    from dtrain.checkpoint.universal import export

    print(f"dtrain: wrote {export(args.checkpoint[0], args.out, args.checkpoint[1:])}")


def _generate(args: argparse.Namespace) -> None:
    from dtrain.launch.generate import generate_command

    generate_command(args)


def _data(args: argparse.Namespace) -> None:
    from dtrain.data.prepare import run

    run(args)


def _train(args: argparse.Namespace) -> None:
    from dtrain.launch.train import train_command

    _check_launch_flags(args)
    train_command(args)


def _bench(args: argparse.Namespace) -> None:
    if args.benchmark == "scaling":
        from dtrain.tools.scaling import scaling_command

        scaling_command(args)
        return
    from dtrain.tools.comm_bench import bench_command

    bench_command(args)


def _plan(args: argparse.Namespace) -> None:
    from dtrain.tools.plan import plan_command

    plan_command(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dtrain` console script; returns the process exit code."""
    args = _parser().parse_args(argv)
    # The launcher's own C++ warnings (socket polls while machines join) would bury the
    # one-line errors; ranks get the user's level back (see launch.runner).
    env.USER_CPP_LOG_LEVEL.set(os.environ.get("TORCH_CPP_LOG_LEVEL", "WARNING"))
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        if getattr(args, "debug", False):
            env.DEBUG.set(1)  # read by dtrain.comm in every rank started here
        if args.command == "run" and args.backend:
            env.BACKEND.set(args.backend)  # read by dtrain.init in every rank
        command = {"run": _run, "train": _train, "bench": _bench, "export": _export,
                   "plan": _plan, "data": _data, "generate": _generate}[args.command]
        return exit_code_of(lambda: command(args))
    except KeyboardInterrupt:
        print("dtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
