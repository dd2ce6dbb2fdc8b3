"""`dtrain generate CKPT --prompt TEXT`: text from a checkpoint's model, in split form.

Opens the checkpoint and its config here (a missing checkpoint or a layout that does not
fit costs no process start-up), then runs `-n` ranks of `python -m
dtrain.train.generation` (in place for `-n 1`, or under a launcher: torchrun, srun,
`dtrain run`), each holding its part of the
model in the layout `--set parallel.*` asks for; rank 0 prints the text.

    dtrain generate out/checkpoints --prompt "def " --tokens 200
    dtrain generate out/checkpoints --prompt "def " -n 2 --set parallel.tp=2
    dtrain generate out/checkpoints --chat --prompt "What is two plus two?"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from dtrain.checkpoint.universal import Checkpoint
from dtrain.config import parse_override
from dtrain.errors import ConfigError, DtrainError


def generate_command(args: argparse.Namespace) -> None:
    """Run `dtrain generate` as parsed by the CLI.

    Raises:
        ConfigError: no checkpoint there (or a damaged one), a bad flag, a layout that
            does not fit the ranks.
    """
    if args.tokens < 0:
        raise ConfigError(f"--tokens {args.tokens} must be 0 or more")
    if args.temperature <= 0:
        raise ConfigError(f"--temperature {args.temperature} must be above 0")
    if args.nproc < 1:
        raise ConfigError(f"-n {args.nproc} must be at least 1")
    try:
        ckpt = Checkpoint(args.checkpoint)
    except DtrainError as exc:
        raise ConfigError(str(exc)) from None
    from dtrain.train.generation import generate_text, generation_config, model_of

    config = generation_config(ckpt, [parse_override(o) for o in args.overrides], args.nproc)
    model_of(ckpt)  # one that records its model
    if args.backend is not None:
        config.comm.backend = args.backend
    from dtrain.world import detect

    if args.nproc == 1 or detect(os.environ).source != "single":  # this process is a rank
        from dtrain.world import current

        text = generate_text(config, str(ckpt.path), args.prompt, args.tokens, args.seed,
                             args.temperature, args.chat)
        if current().is_main:
            print(text, flush=True)
        return
    from dtrain.launch.runner import LaunchSpec, launch

    with tempfile.TemporaryDirectory(prefix="dtrain-generate-") as folder:
        job = Path(folder) / "generate.json"
        job.write_text(json.dumps({"config": config.to_dict(), "checkpoint": str(ckpt.path),
                                   "prompt": args.prompt, "tokens": args.tokens,
                                   "seed": args.seed, "temperature": args.temperature,
                                   "chat": args.chat}))
        launch(LaunchSpec(command=[sys.executable, "-u", "-m", "dtrain.train.generation",
                                   str(job)],
                          nproc=args.nproc, nnodes=1, min_nodes=1, node_rank=None,
                          master=None, max_restarts=0, join_timeout=120, raw_local_rank0=True))
