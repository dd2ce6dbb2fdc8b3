"""`dtrain bench scaling`: one training job on 1, 2, ... N workers, strong and weak.

    dtrain bench scaling                                  # built-in GPT, 1,2(,4..) workers
    dtrain bench scaling my.toml --workers 1,2,4,8 --steps 50 --json s.json --plot s.png
    dtrain bench scaling --modes strong --batch 64 --repeats 3

Each point is a real `dtrain train` run (a subprocess, data parallel over the workers, tp
and pp as the config says) for `--steps` steps, with per-step metrics and a timeline
trace. Strong scaling keeps the global batch at B (each worker gets B/n); weak scaling
keeps B per worker (the global batch is B x n), so a run with identical settings (the
1-worker point) is measured once and serves both. From the steps after `--warmup`:

- step time: the median over the timed steps of every repeat (rank 0's clock; data
  parallelism keeps the ranks in step);
- throughput: global batch / step time, in samples/s (x block_size for tokens/s);
- speed-up: throughput(n) / throughput(n0), n0 the smallest worker count (normally 1);
- efficiency: speed-up / (n / n0), in both modes: 1 is perfect scaling;
- comm share: the time some collective is in progress on a rank (the union of its
  "comm" spans) over its step time, inside the timed steps, averaged over ranks.

Each worker gets max(1, cores // n) torch threads (OMP_NUM_THREADS), cores being those
this process may run on; with more workers than cores they time-slice, which the table
and the plot point out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.errors import ConfigError
from dtrain.tools import check_output, parse_list
from dtrain.tools.scaling_report import MODES, Row, plot, print_table

if TYPE_CHECKING:  # the config (and torch under it) is imported where a command needs it
    from dtrain.config import Config

STDERR_TAIL = 15  # lines of a failed run's stderr shown above the error


@dataclass(frozen=True)
class Options:
    """A checked `dtrain bench scaling` command line."""

    config: str | None
    overrides: tuple[str, ...]
    workers: tuple[int, ...]
    modes: tuple[str, ...]
    steps: int
    warmup: int
    batch: int | None
    repeats: int
    out: Path
    plot: Path
    json: Path | None
    run_timeout: float


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_worker(workers: int, cores: int) -> int:
    """Torch threads for each of `workers` processes so that together they fill the cores."""
    return max(1, cores // workers)


def default_workers(cores: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the cores available (at least 1 and 2)."""
    counts = [1]
    while counts[-1] * 2 <= max(2, cores):
        counts.append(counts[-1] * 2)
    return tuple(counts)


def parse_workers(text: str) -> tuple[int, ...]:
    """The worker counts in `text` (comma-separated), ascending, without repeats.

    Raises:
        ConfigError: an entry is not a positive integer, or there is none.
    """
    counts = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        if not item.isdigit() or int(item) < 1:
            raise ConfigError(f"--workers: {item!r} is not a positive number of workers "
                              "(use e.g. --workers 1,2,4)")
        counts.add(int(item))
    if not counts:
        raise ConfigError("--workers is empty: use e.g. --workers 1,2,4")
    return tuple(sorted(counts))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define `dtrain bench scaling`'s options on `parser`."""
    from dtrain.config import add_config_arguments

    add_config_arguments(parser, "TOML config of the job (default: built-in GPT)")
    parser.add_argument("--workers", metavar="LIST",
                        help="worker counts, e.g. 1,2,4 (default: 1, 2, 4, ... up to the "
                             "cores available, at least 1,2)")
    parser.add_argument("--modes", default=",".join(MODES), metavar="LIST",
                        help="strong (fixed global batch), weak (fixed batch per worker), or "
                             "both (default)")
    parser.add_argument("--steps", type=int, default=30,
                        help="training steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, metavar="K",
                        help="first steps of each run left out of the timing (default 5)")
    parser.add_argument("--batch", type=int, metavar="B",
                        help="global batch for strong scaling, batch per worker for weak "
                             "scaling (default: the config's train.batch_size)")
    parser.add_argument("--repeats", type=int, default=1, metavar="R",
                        help="runs of each point, taking turns; medians over all (default 1)")
    parser.add_argument("--out", default="runs/scaling", metavar="DIR",
                        help="folder of the runs (default runs/scaling)")
    parser.add_argument("--plot", metavar="PATH",
                        help="PNG of speed-up, efficiency and comm share (default "
                             "OUT/scaling.png)")
    parser.add_argument("--json", metavar="PATH",
                        help="write the rows, the machine and the commands as JSON")
    parser.add_argument("--run-timeout", type=float, default=1800, metavar="SECONDS",
                        help="stop a run that takes longer than this (default 1800)")


def options(args: argparse.Namespace) -> Options:
    """Check a parsed command line.

    Raises:
        ConfigError: a malformed list or count, or an output folder that does not exist.
    """
    workers = parse_workers(args.workers) if args.workers else default_workers(available_cores())
    modes = parse_list(args.modes, MODES, "--modes")
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--repeats", args.repeats, 1), ("--run-timeout",
                                                                args.run_timeout, 1)):
        if value < least:
            raise ConfigError(f"{flag} {value} must be at least {least}")
    if args.warmup >= args.steps:
        raise ConfigError(f"--warmup {args.warmup} leaves none of --steps {args.steps} to time: "
                          "make --steps larger than --warmup")
    if args.batch is not None and args.batch < 1:
        raise ConfigError(f"--batch {args.batch} must be at least 1")
    out = Path(args.out).absolute()
    plot = Path(args.plot).absolute() if args.plot else out / "scaling.png"
    json_path = Path(args.json).absolute() if args.json else None
    check_output("--plot", args.plot)
    check_output("--json", args.json)
    return Options(args.config, tuple(args.overrides), workers, modes, args.steps, args.warmup,
                   args.batch, args.repeats, out, plot, json_path, args.run_timeout)


def run_overrides(opts: Options, workers: int, batch: int, run_dir: Path) -> list[str]:
    """`--set` values of one run: the user's, then the scaling point's (which win)."""
    return [*opts.overrides, f"parallel.nproc={workers}", "parallel.dp=0",
            f"train.steps={opts.steps}", f"train.batch_size={batch}", "train.eval_every=0",
            "train.eval_batches=1", "logging.sample_tokens=0", f"logging.log_every={opts.steps}",
            "checkpoint.every=0", 'checkpoint.resume=""',
            f"train.out_dir={json.dumps(str(run_dir))}"]


def check_point(opts: Options, mode: str, workers: int, batch: int) -> None:
    """Check one point's config as `dtrain train` would before starting ranks, so that a
    misfit costs no run.

    Raises:
        ConfigError: the config is invalid, or the workers do not fit its layout or batch.
    """
    from dtrain.config import dims_of, load_config

    config = load_config(opts.config, run_overrides(opts, workers, batch, opts.out))
    try:
        dims_of(config, workers)
    except ConfigError as exc:
        fix = "choose --workers it divides or another --batch" if mode == "strong" else \
            "choose other --workers or --batch"
        raise ConfigError(f"{mode} scaling on {workers} worker(s), global batch {batch}: "
                          f"{exc}; {fix}") from None


def train_command(opts: Options, workers: int, batch: int, run_dir: Path) -> list[str]:
    """The `dtrain train` command line of one run, writing metrics and a timeline there."""
    sets = [arg for item in run_overrides(opts, workers, batch, run_dir) for arg in ("--set", item)]
    return [sys.executable, "-m", "dtrain.cli", "train", *([opts.config] if opts.config else []),
            *sets, "--metrics", str(run_dir / "metrics.jsonl"),
            "--timeline", str(run_dir / "timeline.json")]


def run_training(command: list[str], threads: int, timeout: float, what: str) -> None:
    """Run one `dtrain train` to the end in its own process group, which is killed if it
    overruns `timeout` or this process is interrupted (so no rank outlives the benchmark).

    Raises:
        ConfigError: the run failed or overran; its last stderr lines are printed first.
    """
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ConfigError(f"{what} ran past --run-timeout {timeout:g} s: raise it or lower "
                          "--steps") from None
    except BaseException:
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        for line in stderr.splitlines()[-STDERR_TAIL:]:
            print(f"  | {line}", file=sys.stderr)
        raise ConfigError(f"{what} failed (exit code {proc.returncode}; its stderr is above): "
                          f"fix the job, then retry; command: {shlex.join(command)}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def timed_step_times(metrics_path: Path, warmup: int) -> list[float]:
    """Seconds of each step after the first `warmup`, from a `--metrics` file."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    return [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > warmup]


def comm_share(trace_path: Path, warmup: int) -> float:
    """Share of the step time after `warmup` steps with a collective in progress, from a
    `dtrain train --timeline` trace: per rank, its "comm" spans clipped to its timed "step"
    spans, over the length of those steps (`dtrain.timeline.summarize` counts overlapping
    collectives once); the mean over ranks."""
    from dtrain.timeline import summarize

    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    steps = [e for e in spans if e["cat"] == "step" and e["args"]["step"] > warmup]
    timed = list(steps)
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        for e in spans:
            if e["cat"] == "comm" and e["pid"] == step["pid"] and e["ts"] < end \
                    and e["ts"] + e["dur"] > start:
                clipped = max(e["ts"], start)
                timed.append({**e, "ts": clipped, "dur": min(e["ts"] + e["dur"], end) - clipped})
    seconds = summarize(timed)
    shares = [cats.get("comm", 0.0) / cats["step"] for cats in seconds.values() if cats["step"]]
    return statistics.fmean(shares)


@dataclass
class Measurement:
    """What the runs of one (workers, global batch) point gave."""

    step_times: list[float]
    shares: list[float]
    commands: list[str]


def measure_all(opts: Options, points: dict[tuple[int, int], str], cores: int
                ) -> dict[tuple[int, int], Measurement]:
    """Run every point `repeats` times, the points taking turns in each round so that a
    busy moment of the machine does not fall on one point alone."""
    results = {key: Measurement([], [], []) for key in points}
    total, done = len(points) * opts.repeats, 0
    for repeat in range(opts.repeats):
        for (workers, batch), label in points.items():
            run_dir = opts.out / f"n{workers}-b{batch}-r{repeat}"
            for stale in ("metrics.jsonl", "timeline.json"):
                (run_dir / stale).unlink(missing_ok=True)
            command = train_command(opts, workers, batch, run_dir)
            done += 1
            print(f"# run {done}/{total}: {label}, {workers} worker(s), global batch {batch}",
                  flush=True)
            run_training(command, threads_per_worker(workers, cores), opts.run_timeout,
                         f"the run on {workers} worker(s) ({label}, global batch {batch})")
            result = results[workers, batch]
            result.step_times += timed_step_times(run_dir / "metrics.jsonl", opts.warmup)
            result.shares.append(comm_share(run_dir / "timeline.json", opts.warmup))
            result.commands.append(shlex.join(command))
    return results


def make_rows(batches: dict[str, dict[int, int]], results: dict[tuple[int, int], Measurement],
              block_size: int, cores: int) -> list[Row]:
    """The table: throughput of each point, and its speed-up and efficiency against the
    smallest worker count of its mode."""
    rows = []
    for mode, batch_of in batches.items():
        base = min(batch_of)
        base_rate = batch_of[base] / statistics.median(results[base, batch_of[base]].step_times)
        for workers, batch in batch_of.items():
            result = results[workers, batch]
            step = statistics.median(result.step_times)
            speedup = batch / step / base_rate
            rows.append(Row(mode, workers, batch, threads_per_worker(workers, cores),
                            step * 1e3, batch / step, batch * block_size / step, speedup,
                            speedup / (workers / base), statistics.fmean(result.shares),
                            workers > cores, len(result.step_times), result.commands))
    return rows


def machine_info(config: Config, cores: int) -> dict[str, Any]:
    """What the figures depend on: cores, the load others put on them before the runs
    (1-minute load average), backend, device, versions."""
    import torch

    cuda = torch.cuda.is_available()
    backend = config.comm.backend
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    return {"cores": cores, "load_before": round(os.getloadavg()[0], 2), "backend": backend,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def scaling_command(args: argparse.Namespace) -> None:
    """Run `dtrain bench scaling` as parsed by the CLI.

    Raises:
        ConfigError: bad options, a point the config or batch cannot run, or a failed run.
    """
    from dtrain.config import load_config

    opts = options(args)
    cores = available_cores()
    config = load_config(opts.config, list(opts.overrides))
    batch = opts.batch or config.train.batch_size
    batches = {mode: {n: batch if mode == "strong" else batch * n for n in opts.workers}
               for mode in opts.modes}
    points: dict[tuple[int, int], str] = {}
    for mode, batch_of in batches.items():
        for workers, global_batch in batch_of.items():
            check_point(opts, mode, workers, global_batch)
            label = points.get((workers, global_batch))
            points[workers, global_batch] = f"{label} and {mode}" if label else mode
    try:
        opts.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {str(opts.out)!r}: cannot create it: {exc.strerror or exc}"
                          ) from None
    machine = machine_info(config, cores)
    results = measure_all(opts, points, cores)
    rows = make_rows(batches, results, config.model.block_size, cores)
    print_table(rows, machine)
    title = f"dtrain bench scaling ({Path(opts.config).name if opts.config else 'built-in GPT'})"
    plot(rows, machine, title, opts.plot)
    print(f"# plot: {opts.plot}")
    if opts.json:
        report = {"command": shlex.join(["dtrain", *sys.argv[1:]]), "machine": machine,
                  "steps": opts.steps, "warmup": opts.warmup, "repeats": opts.repeats,
                  "block_size": config.model.block_size, "rows": [asdict(r) for r in rows]}
        opts.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"# wrote {len(rows)} rows to {opts.json}")
