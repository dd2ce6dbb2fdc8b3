"""`dtrain bench comm`: dtrain.comm's collectives timed per algorithm and message size.

    dtrain bench comm                                     # 2 local ranks, 4 B .. 256 MiB
    dtrain bench comm -n 4 --ops all_reduce --algorithms native,ring --max-bytes 64M
    dtrain bench comm --json comm.json --calibrate        # also save auto's cost models
    dtrain run -n 8 -m dtrain.cli bench comm              # under a launcher: one rank each

For each operation and message size, every rank makes warm-up calls of each algorithm,
then times runs of calls on a float32 tensor (sum, root 0), each run after a barrier, the
algorithms taking turns in rounds so that a busy moment of the machine hurts them alike;
the figure is the slowest rank's median round (dtrain.comm.timing). Big messages get fewer
calls (about SECONDS_PER_POINT for each row), so the default range takes a few minutes on
2 cores.

As in nccl-tests, `bytes` is the whole buffer (for all_gather the gathered result, for
reduce_scatter the input before scattering), algbw = bytes / time, and busbw = algbw times
the share of the data each rank must move: 2(n-1)/n for all_reduce, (n-1)/n for
all_gather and reduce_scatter, 1 for broadcast and reduce. Busbw is comparable across rank
counts and with the bandwidth of the links.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.errors import ConfigError, exit_code_of
from dtrain.sizes import parse_size
from dtrain.tools import check_output, parse_list

if TYPE_CHECKING:  # torch is imported on use, so `dtrain --help` starts without it
    import torch

    from dtrain.comm.group import Group

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
ALGORITHMS = ("native", "ring", "tree", "halving_doubling", "auto")  # no torch import for --help
BACKENDS = ("gloo", "nccl", "shm")
SECONDS_PER_POINT = 0.5  # timed calls per row: about this long, at most --iters
WARMUP_SECONDS = 0.1  # warm-up calls after the first: about this long, at most --warmup - 1
ROUNDS = 20  # the timed calls of the algorithms at one size take turns in this many rounds
ELEMENT_BYTES = 4  # float32


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min_bytes, min_bytes * factor, ... up to max_bytes."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def element_count(op: str, nbytes: int, ranks: int) -> int:
    """float32 elements of the whole buffer for `nbytes`; a multiple of `ranks` where the
    operation splits the buffer into one piece per rank."""
    count = max(1, nbytes // ELEMENT_BYTES)
    if op in ("all_gather", "reduce_scatter"):
        count = -(-count // ranks) * ranks
    return count


@dataclass(frozen=True)
class Options:
    """A checked `dtrain bench comm` command line."""

    nproc: int
    ops: tuple[str, ...]
    algorithms: tuple[str, ...]
    backends: tuple[str, ...]
    min_bytes: int
    max_bytes: int
    factor: int
    iters: int
    warmup: int
    json: str | None = None
    calibrate: bool = False
    segment_bytes: int | None = None

    def argv(self) -> list[str]:
        """These options as arguments, for the ranks this process starts."""
        args = [
            "--ops", ",".join(self.ops), "--algorithms", ",".join(self.algorithms),
            "--backend", ",".join(self.backends), "--min-bytes", str(self.min_bytes),
            "--max-bytes", str(self.max_bytes), "--factor", str(self.factor),
            "--iters", str(self.iters), "--warmup", str(self.warmup),
        ]
        if self.json:
            args += ["--json", self.json]
        if self.calibrate:
            args.append("--calibrate")
        if self.segment_bytes is not None:
            args += ["--segment-bytes", str(self.segment_bytes)]
        return args


@dataclass(frozen=True)
class Record:
    """One measurement: a row of the table, and an entry of the --json list."""

    op: str
    backend: str
    algorithm: str
    world_size: int
    bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    chosen: str = ""  # for algorithm "auto": the algorithm it ran


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define `dtrain bench comm`'s options on `parser`."""
    parser.add_argument("-n", "--nproc", type=int, default=2,
                        help="ranks to start on this machine (default 2); under a launcher "
                             "(dtrain run, torchrun, srun) its ranks are used instead")
    parser.add_argument("--ops", default=",".join(DEFAULT_OPS), metavar="LIST",
                        help=f"operations, comma-separated, from {', '.join(OPS)} "
                             "(default: all but reduce)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), metavar="LIST",
                        help="algorithms to compare (default: all); an operation skips those "
                             "it lacks, auto applies to every one")
    parser.add_argument("--backend", default="gloo", metavar="LIST",
                        help="torch.distributed backends, comma-separated: gloo, or nccl "
                             "where CUDA is available (default gloo)")
    parser.add_argument("--min-bytes", default="4", metavar="SIZE",
                        help="smallest message, e.g. 4, 4K, 16M (K = 1024; default 4)")
    parser.add_argument("--max-bytes", default="256M", metavar="SIZE",
                        help="largest message (default 256M)")
    parser.add_argument("--factor", type=int, default=4,
                        help="ratio between consecutive sizes (default 4)")
    parser.add_argument("--iters", type=int, default=1000, metavar="K",
                        help="timed calls per row, at most (default 1000); big messages get "
                             f"fewer, about {SECONDS_PER_POINT:g} s a row")
    parser.add_argument("--warmup", type=int, default=5, metavar="W",
                        help="untimed calls first, at most (default 5; the first one sizes "
                             "the timed run)")
    parser.add_argument("--json", metavar="PATH",
                        help="write every measurement as a JSON list (rank 0)")
    parser.add_argument("--calibrate", action="store_true",
                        help="first measure auto's cost models of --ops and --algorithms and "
                             "save them (DTRAIN_CALIBRATION, default ~/.cache/dtrain/"
                             "calibration.json); the table then uses them")
    parser.add_argument("--segment-bytes", help=argparse.SUPPRESS)  # ring experiments


def options(args: argparse.Namespace) -> Options:
    """Check a parsed command line.

    Raises:
        ConfigError: an unknown operation, algorithm or backend, a malformed size or
            count, an unwritable --json path, or nothing to measure.
    """
    ops = parse_list(args.ops, OPS, "--ops")
    algorithms = parse_list(args.algorithms, ALGORITHMS, "--algorithms")
    backends = parse_backends(args.backend)
    min_bytes = parse_size(args.min_bytes, "--min-bytes")
    max_bytes = parse_size(args.max_bytes, "--max-bytes")
    if min_bytes < ELEMENT_BYTES:
        raise ConfigError(f"--min-bytes {min_bytes} is less than one float32 (4 bytes)")
    if max_bytes < min_bytes:
        raise ConfigError(f"--max-bytes {args.max_bytes} is below --min-bytes {args.min_bytes}")
    for flag, value, least in (("-n", args.nproc, 1), ("--factor", args.factor, 2),
                               ("--iters", args.iters, 1), ("--warmup", args.warmup, 1)):
        if value < least:
            raise ConfigError(f"{flag} {value} must be at least {least}")
    check_output("--json", args.json)
    segment = None
    if args.segment_bytes is not None:
        segment = parse_size(args.segment_bytes, "--segment-bytes")
    if not any(algs for _, algs in plan(ops, algorithms)):
        from dtrain.comm import AVAILABLE

        have = "; ".join(f"{op}: {', '.join(AVAILABLE[op])}, auto" for op in ops)
        raise ConfigError(f"nothing to measure: --algorithms {','.join(algorithms)} fits none "
                          f"of --ops {','.join(ops)} ({have})")
    json_path = str(Path(args.json).absolute()) if args.json else None
    return Options(args.nproc, ops, algorithms, backends, min_bytes, max_bytes, args.factor,
                   args.iters, args.warmup, json_path, args.calibrate, segment)


def parse_backends(text: str) -> tuple[str, ...]:
    """The backends in `text` (comma-separated).

    Raises:
        ConfigError: a backend that is unknown, or nccl on a machine without CUDA.
    """
    backends = tuple(dict.fromkeys(b.strip() for b in text.split(",") if b.strip()))
    for backend in backends:
        if backend not in BACKENDS:
            raise ConfigError(f"--backend {backend!r} is not available: use gloo, shm, or "
                              "nccl where CUDA is available")
    if "nccl" in backends:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--backend nccl needs CUDA, which this machine lacks: use gloo")
    if not backends:
        raise ConfigError("--backend is empty: use gloo, shm, or nccl where CUDA is available")
    return backends


def plan(ops: tuple[str, ...], algorithms: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """Each operation with the chosen algorithms it has (auto: all of them)."""
    from dtrain.comm import AVAILABLE

    return [(op, [a for a in algorithms if a == "auto" or a in AVAILABLE[op]]) for op in ops]


def bench_command(args: argparse.Namespace) -> None:
    """Run `dtrain bench comm` as parsed by the CLI.

    Under a launcher this process is one rank and measures; started by hand it starts
    `--nproc` ranks of `python -m dtrain.tools.comm_bench` that do.
    """
    opts = options(args)
    from dtrain.world import detect

    if detect(os.environ).source != "single":
        bench(opts)
        return
    from dtrain.launch.runner import LaunchSpec, launch

    launch(LaunchSpec(
        command=[sys.executable, "-u", "-m", "dtrain.tools.comm_bench", *opts.argv()],
        nproc=opts.nproc, raw_local_rank0=True,
    ))


def bench(opts: Options) -> list[Record]:
    """Measure as one rank of a job (every rank calls this); returns every measurement.

    Rank 0 prints the tables and writes --json and the calibration file.
    """
    import torch.distributed as dist

    from dtrain import comm
    from dtrain import world as world_mod
    from dtrain.comm.algorithms import ring
    from dtrain.comm.group import timeout_of

    if opts.segment_bytes is not None:
        ring.SEGMENT_BYTES = opts.segment_bytes
    world = world_mod.init(backend=opts.backends[0])
    show = _printer(world.rank == 0)
    records: list[Record] = []
    for backend in opts.backends:
        pg = dist.group.WORLD if backend == world.backend else dist.new_group(
            backend="gloo" if backend == "shm" else backend, timeout=timeout_of(dist.group.WORLD))
        assert pg is not None  # the world, started above
        group = comm.wrap(pg, backend)
        device = _device(backend, world.local_rank)
        show(f"# dtrain bench comm: {group.size} ranks, {backend}, float32 (op sum, root 0), "
             f"ring segments of {ring.SEGMENT_BYTES} B")
        show(f"# time: up to {opts.iters} calls after up to {opts.warmup} warm-up calls (fewer "
             f"for big messages), algorithms taking turns in {ROUNDS} rounds; the slowest "
             f"rank's median round")
        if opts.calibrate:
            show(f"# calibration saved to {calibrate(group, device, opts.ops, opts.algorithms)}")
        for op, algorithms in plan(opts.ops, opts.algorithms):
            if algorithms:
                records += _bench_op(op, algorithms, group, backend, device, opts, show)
    if opts.json and world.rank == 0:
        Path(opts.json).write_text(json.dumps([asdict(r) for r in records], indent=1) + "\n")
        show(f"# wrote {len(records)} measurements to {opts.json}")
    return records


def calibrate(group: Group, device: torch.device, ops: tuple[str, ...],
              algorithms: tuple[str, ...]) -> Path | None:
    """Measure the cost models of each of `ops` that has a choice of algorithm, over those
    of its algorithms in `algorithms`, and use them in this run where all of them were
    measured; rank 0 saves them and returns where (the other ranks return None)."""
    from dtrain.comm import AVAILABLE, select

    models = {}
    for op in ops:
        candidates = tuple(a for a in AVAILABLE[op] if a in algorithms)
        if len(AVAILABLE[op]) > 1 and candidates:
            lines = select.measure(group, op, candidates, device)  # rank 0's, on every rank
            if candidates == AVAILABLE[op]:
                group.cost_models[op] = lines  # so auto needs no file, which rank 0 is writing
            models[select.cache_key(group, op)] = lines
    return select.save_models(models) if group.rank == 0 else None


def _bench_op(op: str, algorithms: list[str], group: Group, backend: str,
              device: torch.device, opts: Options, show: Callable[[str], None]) -> list[Record]:
    import torch

    from dtrain import comm
    from dtrain.comm.ops import bus_factor

    n = group.size
    factor = bus_factor(op, n)
    show(f"#\n# {op}: busbw = algbw x {factor:.2f}"
         f" ({'2(n-1)/n' if op == 'all_reduce' else '(n-1)/n' if factor < 1 else '1'})")
    show(f"# {'size(B)':>12} {'count':>11}  {'algorithm':<24} {'time(us)':>11} "
         f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
    records: list[Record] = []
    worst: tuple[float, int, str, str] | None = None
    seen: set[int] = set()
    for nbytes in message_sizes(opts.min_bytes, opts.max_bytes, opts.factor):
        count = element_count(op, nbytes, n)
        if count in seen:
            continue
        seen.add(count)
        size = count * ELEMENT_BYTES
        tensor = torch.zeros(count // n if op == "all_gather" else count, device=device)
        labels = dict(zip(algorithms, algorithms, strict=True))
        choice = ""
        if "auto" in labels:  # may measure the cost models: before any clock starts
            nbytes_in = tensor.numel() * ELEMENT_BYTES
            choice = comm.explain(op, nbytes_in, group, device).algorithm
            labels["auto"] = f"auto ({choice})"
        calls = {a: _call(op, tensor, group, a) for a in algorithms}
        times = time_calls(calls, group, device, opts.iters, opts.warmup)
        for algorithm, seconds in times.items():
            algbw = size / seconds / 1e9
            records.append(Record(op, backend, algorithm, n, size, seconds * 1e6, algbw,
                                  algbw * factor, choice if algorithm == "auto" else ""))
            show(f"  {size:>12} {count:>11}  {labels[algorithm]:<24} {seconds * 1e6:>11.1f} "
                 f"{algbw:>12.3f} {algbw * factor:>12.3f}")
        others = {a: t for a, t in times.items() if a != "auto"}
        if "auto" in times and others:
            best = min(others, key=others.__getitem__)
            ratio = times["auto"] / others[best]
            if worst is None or ratio > worst[0]:
                worst = (ratio, size, best, labels["auto"])
    if worst is not None:
        ratio, size, best, label = worst
        show(f"# auto's time / the fastest algorithm's: at most {ratio:.2f} "
             f"(at {size} B: {label}, fastest {best})")
    return records


def _call(op: str, tensor: torch.Tensor, group: Group, algorithm: str) -> Callable[[], Any]:
    from dtrain import comm

    fn = getattr(comm, op)
    if op in ("broadcast", "reduce"):
        return lambda: fn(tensor, 0, group=group, algorithm=algorithm)
    return lambda: fn(tensor, group=group, algorithm=algorithm)


def time_calls(calls: dict[str, Callable[[], Any]], group: Group, device: torch.device,
               iters: int, warmup: int) -> dict[str, float]:
    """Seconds per call of each collective, timed as dtrain.comm.timing describes.

    The first warm-up call of each estimates its time, and every rank adopts the slowest
    rank's estimates so that all make the same calls: up to `warmup - 1` more warm-up
    calls in about WARMUP_SECONDS, then up to `iters` timed calls in about
    SECONDS_PER_POINT, in up to ROUNDS rounds.
    """
    from dtrain.comm import timing

    sync = timing.synchronizer(device)
    first = []
    for call in calls.values():
        start = time.perf_counter()
        call()
        sync()
        first.append(time.perf_counter() - start)
    counts = {}
    for (name, call), estimate in zip(calls.items(), timing.slowest(first, group, device),
                                      strict=True):
        estimate = max(estimate, 1e-9)
        for _ in range(min(warmup - 1, int(WARMUP_SECONDS / estimate))):
            call()
        counts[name] = max(1, min(iters, int(SECONDS_PER_POINT / estimate)))
    return timing.time_turns(calls, counts, min(ROUNDS, *counts.values()), group, device)


def _device(backend: str, local_rank: int) -> torch.device:
    import torch

    if backend == "nccl":
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def _printer(enabled: bool) -> Callable[[str], None]:
    def show(line: str) -> None:
        if enabled:
            print(line, flush=True)

    return show


def main(argv: list[str] | None = None) -> int:
    """One rank that `dtrain bench comm` started: `python -m dtrain.tools.comm_bench ARGS`."""
    parser = argparse.ArgumentParser(prog="dtrain bench comm")
    add_arguments(parser)
    return exit_code_of(lambda: bench(options(parser.parse_args(argv))))


if __name__ == "__main__":
    sys.exit(main())
