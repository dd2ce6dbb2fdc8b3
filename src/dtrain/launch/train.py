"""`dtrain train`: read the config, then train here or start the ranks that will.

Under a launcher (dtrain run, torchrun, srun, mpirun) this process is already one rank and
trains directly. Started by hand, it validates the config first (so a typo costs no
process start-up), writes it to `out_dir/config.json`, and launches `parallel.nproc` ranks
of `python -m dtrain.train.worker` on the elastic agent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from dtrain import env as contract
from dtrain.config import Config, dims_of, load_config
from dtrain.errors import ConfigError


def train_command(args: argparse.Namespace) -> None:
    """Run `dtrain train` as parsed by the CLI."""
    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"parallel.nproc={args.nproc}")
    if args.backend is not None:
        overrides.append(f"comm.backend={args.backend}")
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={json.dumps(args.resume)}")
    config = load_config(args.config, overrides)
    if config.train.float8 != "none":  # a machine without FP8 costs no start-up either
        from dtrain.models.float8 import check_float8

        check_float8(_rank_device(config))
    if config.comm.gather_dtype == "fp8":  # as float8: refused before any rank starts
        from dtrain.comm import check_wire_dtype

        check_wire_dtype("fp8", _rank_device(config), key="comm.gather_dtype")
    if args.metrics:
        config.logging.metrics = args.metrics
    if args.timeline:
        config.logging.timeline = args.timeline
    if config.logging.timeline:  # absolute: ranks may start elsewhere; a bad folder fails now
        from dtrain.timeline import prepare

        config.logging.timeline = prepare(config.logging.timeline)

    # a bad checkpoint costs no start-up (one host's folder holds only part of a replicated one)
    if config.checkpoint.resume not in ("", "auto") and not config.checkpoint.copies:
        from dtrain.train.trainer import open_checkpoint

        open_checkpoint(config.checkpoint.resume, config)

    from dtrain.world import detect

    pc = config.parallel
    launched = detect(os.environ).source != "single"
    if config.checkpoint.copies and not launched:  # ranks under a launcher check it
        from dtrain.checkpoint.copies import check_copies

        check_copies(config.checkpoint.copies, args.nnodes)
    alone = pc.nproc == 1 and args.nnodes == 1 and pc.exchange != "ps"
    if launched or alone:
        from dtrain.train.trainer import train

        train(config)
        return

    from dtrain.launch.runner import LaunchSpec, launch

    world_size = config.parallel.nproc * args.nnodes
    live = config.fault_tolerance.mode == "live"
    ranks = pc.copy_ranks  # of a live replica
    if live and args.min_nodes < args.nnodes:
        raise ConfigError("fault_tolerance.mode = \"live\" keeps a fixed set of live replica "
                          f"slots: give --nnodes {args.nnodes} (live replicas that die are "
                          "dropped and brought back live), or fault_tolerance.mode = "
                          "\"restart\" for an elastic job")
    if live and world_size % ranks:
        raise ConfigError(f"{world_size} ranks do not make live replicas of dp x tp x pp = "
                          f"{ranks} ranks each: run a multiple of {ranks} ranks")
    if live:  # each live replica's, as its ranks check again, the batch over all of them
        dims_of(config, ranks).per_rank_batch(config.train.batch_size,
                                              config.train.grad_accum, world_size // ranks)
    elif args.min_nodes == args.nnodes:  # (an elastic job's rounds re-derive the layout)
        dims_of(config, world_size)  # the check every rank makes again
    from dtrain.train.check import check_job

    check_job(config)  # a bad corpus or model costs no start-up either
    from dtrain.checkpoint import atomic

    out_dir = Path(config.train.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        text = config.to_json().encode()  # atomic: another machine's ranks may be reading it
        atomic.write_atomic(out_dir / "config.json", lambda f: f.write(text))
    except OSError as exc:
        raise ConfigError(f"train.out_dir {str(out_dir)!r} is not writable: {exc}") from None
    command = [sys.executable, "-u", "-m", "dtrain.train.worker", str(out_dir / "config.json")]
    nproc = pc.nproc
    env: dict[str, str] = {}
    if pc.exchange == "ps":  # servers beside the workers; they snapshot into the run folder
        from dtrain.launch.roles import plan

        command, nproc, env = plan(command, pc.nproc, config.ps.servers, args.nnodes,
                                   snapshot_dir=str(out_dir / "ps-snapshots"),
                                   snapshot_every=config.ps.snapshot_every)
    if args.min_nodes < args.nnodes:  # elastic: each round re-derives the layout
        contract.ELASTIC_MAX_RANKS.set(world_size, env)
    restarts = args.max_restarts
    if live:  # each live replica restarted in place, not the whole job
        from dtrain.launch import supervisor

        command, restarts = supervisor.command(
            args.max_restarts, command, config.fault_tolerance.standby), 0
        contract.LIVE_RANKS.set(ranks, env)
    ft = config.fault_tolerance
    launch(LaunchSpec(
        command=command, nproc=nproc, nnodes=args.nnodes, min_nodes=args.min_nodes,
        node_rank=args.node_rank, master=args.master, max_restarts=restarts,
        join_timeout=args.join_timeout, raw_local_rank0=True, env=env,
        timeline=config.logging.timeline,
        rdzv_backend=args.rdzv_backend or ft.rdzv_backend,
        rdzv_endpoints=args.rdzv_endpoints or ft.rdzv_endpoints,
        run_id=args.rdzv_id or ft.rdzv_id, live=live,
    ))


def _rank_device(config: Config) -> torch.device:
    """The device this machine's ranks will compute on, as dtrain.world.init chooses it: a
    GPU when their backend is NCCL (`comm.backend`, or env DTRAIN_BACKEND, or NCCL
    wherever CUDA is available), else the CPU."""
    backend = config.comm.backend if config.comm.backend != "auto" else contract.BACKEND.get()
    if backend == "nccl" or (not backend and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")
