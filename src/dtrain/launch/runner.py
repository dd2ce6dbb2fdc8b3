"""Start a job's ranks on torch's elastic agent (the engine behind torchrun).

The agent starts `nproc` processes on this machine, gives each its RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, watches them, and when one fails stops the others. dtrain
adds what a user sees: output lines prefixed with the rank, a single line naming the rank
that failed and its exit code, a free port for single-machine runs, sane thread counts,
and errors for a missing script or an unreachable master instead of tracebacks.

Several machines: run the same command on each with `--nnodes M --node-rank R --master
HOST:PORT`; node 0 hosts the rendezvous store at HOST:PORT (a static rendezvous, so node
ranks are the ones given). Each launcher beats on a counter in that store, so that when
ranks fail because a machine died or was cut off, the error line names it
(heartbeat.Heartbeat).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass, field

from dtrain.comm import segment
from dtrain.errors import ConfigError, LaunchError
from dtrain.launch import bootstrap, exits, heartbeat, rendezvous, waker

PREFIX = "[rank${rank}] "


@dataclass
class LaunchSpec:
    """What to start and where.

    Attributes:
        command: the program and arguments each rank runs (argv[0] is the executable); a
            Python program runs through dtrain.launch.bootstrap (it dies with the agent and
            notes its exit time).
        nproc: ranks on this machine.
        nnodes: machines in the job.
        node_rank: this machine's index; node 0 hosts the rendezvous.
        master: HOST:PORT of node 0's store; a free local port when None (one machine).
        max_restarts: times the agent restarts all ranks after a failure.
        raw_local_rank0: local rank 0 writes straight to this terminal, unprefixed, so it
            can draw a progress bar; the other ranks are still prefixed.
        join_timeout: seconds to wait for all machines to join.
        env: extra environment variables for every rank.
        timeline: record a timeline of every rank (dtrain.timeline) and merge it into this
            file once they end; with nnodes > 1 each machine writes its ranks' into
            `<timeline>.node-<node_rank>.json`. Empty: none.
    """

    command: list[str]
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master: str | None = None
    max_restarts: int = 0
    raw_local_rank0: bool = False
    join_timeout: int = 120
    env: dict[str, str] = field(default_factory=dict)
    timeline: str = ""


def parse_master(master: str) -> tuple[str, int]:
    """Split HOST:PORT, with a clear error when it is malformed."""
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--master {master!r} is not HOST:PORT (for example 10.0.0.1:29500)")
    return host.strip("[]"), int(port)


def validate(spec: LaunchSpec) -> None:
    """Check the numbers a user typed before anything starts."""
    if spec.nproc < 1:
        raise ConfigError(f"-n {spec.nproc}: the number of processes must be at least 1")
    if spec.nnodes < 1:
        raise ConfigError(f"--nnodes {spec.nnodes} must be at least 1")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise ConfigError(
            f"--node-rank {spec.node_rank} must be in [0, {spec.nnodes}) for --nnodes {spec.nnodes}"
        )
    if spec.nnodes > 1 and spec.master is None:
        raise ConfigError("--nnodes > 1 needs --master HOST:PORT (the address of node 0)")
    if spec.max_restarts < 0:
        raise ConfigError(f"--max-restarts {spec.max_restarts} must be 0 or more")


def _rank_env(spec: LaunchSpec, run_id: str, exit_dir: str) -> dict[str, str]:
    env = {"DTRAIN_RUN_ID": run_id, "PYTHONUNBUFFERED": "1", exits.ENV: exit_dir}
    env["TORCH_CPP_LOG_LEVEL"] = os.environ.get("DTRAIN_USER_CPP_LOG_LEVEL", "WARNING")
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks share the cores; more threads than cores makes every rank slower.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.nproc))
    return env


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(spec: LaunchSpec) -> None:
    """Run the job to completion.

    Raises:
        ConfigError: the spec is malformed.
        LaunchError: a rank failed (its exit code is the error's), the master is
            unreachable, or its port is in use.
    """
    # Imported here: the agent pulls in much of torch, which `dtrain --help` need not pay.
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    validate(spec)
    timeline = _start_timeline(spec) if spec.timeline else ""
    listen_fd: dict[str, int] = {}  # node 0 hosts the store, on the master's address only
    if spec.master is None:
        host = "127.0.0.1"
        listen_fd["listen_fd"], port = rendezvous.listen(host, 0)
    else:
        host, port = parse_master(spec.master)
        if spec.node_rank == 0:
            listen_fd["listen_fd"], _ = rendezvous.listen(host, port)
    rendezvous.register()
    # Every machine of a job must agree on the run id; the master address is what they share.
    run_id = os.environ.get("DTRAIN_RUN_ID") or (
        uuid.uuid4().hex[:12] if spec.master is None else f"dtrain-{host}-{port}"
    )
    tee: Std | dict[int, Std] = Std.ALL
    if spec.raw_local_rank0:
        tee = {i: Std.NONE if i == 0 else Std.ALL for i in range(spec.nproc)}
    # The agent logs each failure and signal itself; dtrain reports it once, in one line.
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="dtrain-logs-") as log_dir:
        config = LaunchConfig(
            min_nodes=spec.nnodes,
            max_nodes=spec.nnodes,
            nproc_per_node=spec.nproc,
            run_id=run_id,
            role="worker",
            rdzv_backend=rendezvous.BACKEND,
            rdzv_endpoint=f"{host}:{port}",
            rdzv_configs={"rank": spec.node_rank, "timeout": spec.join_timeout, **listen_fd},
            max_restarts=spec.max_restarts,
            monitor_interval=0.1,
            start_method="spawn",
            log_line_prefix_template=PREFIX,
            logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=tee),
        )
        saved = dict(os.environ)
        exit_dir = os.path.join(log_dir, "exits")
        os.makedirs(exit_dir)
        os.environ.update({**_rank_env(spec, run_id, exit_dir), **spec.env})
        if timeline:
            os.environ["DTRAIN_TIMELINE"] = timeline  # read by dtrain.init in every rank
        beat = None
        if spec.nnodes > 1:  # names a machine that is lost, should ranks here fail
            beat = heartbeat.Heartbeat(host, port, run_id, spec.node_rank, spec.nnodes,
                                       spec.nproc)
        waking = waker.Waker()  # a stopped rank gets the signal that stops the job at once
        try:
            command = bootstrap.command(spec.command)
            elastic_launch(config, command[0])(*command[1:])
        except ChildFailedError as exc:
            codes = {r: f.exitcode for r, f in exc.failures.items()}
            rank = exits.first_failed(codes, exit_dir)
            failure = exc.failures[rank]
            others = len(exc.failures) - 1
            more = f" ({others} other rank{'s' if others > 1 else ''} failed too)" if others else ""
            lost = beat.lost() if beat else ""
            raise LaunchError(
                f"{lost}{'; then ' if lost else ''}"
                f"rank {rank} {_describe(failure.exitcode)}{more}; its output is above",
                exit_code=_exit_code(failure.exitcode) or 1,
            ) from None
        except SignalException as exc:
            name = signal.Signals(exc.sigval).name
            raise LaunchError(f"stopped by {name}: all ranks were shut down",
                              exit_code=128 + exc.sigval) from None
        except (RuntimeError, TimeoutError, ValueError) as exc:
            raise _rendezvous_error(exc, host, port, spec) from None
        finally:
            waking.stop()
            if beat:
                beat.stop()
            os.environ.clear()
            os.environ.update(saved)
            segment.sweep(segment.sanitize(run_id))  # shm segments a killed rank left named
            if timeline:
                _merge_timeline(spec, timeline)
            sys.stdout.flush()


def _local_ranks(spec: LaunchSpec) -> range:
    """The ranks started on this machine (node_rank * nproc on)."""
    return range(spec.node_rank * spec.nproc, (spec.node_rank + 1) * spec.nproc)


def _start_timeline(spec: LaunchSpec) -> str:
    """The absolute path the ranks record the timeline for; stale parts removed."""
    from dtrain.timeline import part_path, prepare

    timeline = prepare(spec.timeline)
    for rank in _local_ranks(spec):
        part_path(timeline, rank).unlink(missing_ok=True)
    return timeline


def _merge_timeline(spec: LaunchSpec, timeline: str) -> None:
    """Merge the parts the ranks wrote (all of them, or those a failure left) into one file."""
    from dtrain.timeline import merge_ranks

    out = timeline
    if spec.nnodes > 1:
        out = f"{timeline.removesuffix('.json')}.node-{spec.node_rank}.json"
    try:
        merged = merge_ranks(timeline, _local_ranks(spec), out)
    except (OSError, ValueError) as exc:
        print(f"dtrain: could not merge the timeline into {out}: {exc}", file=sys.stderr)
        return
    if not merged:
        print("dtrain: no timeline: no rank wrote one (a rank writes it when it exits after "
              "dtrain.init(); one killed by a signal does not)", file=sys.stderr)
        return
    print(f"dtrain: timeline of {merged} rank(s) written to {out} "
          "(open it in https://ui.perfetto.dev)")


def _rendezvous_error(exc: Exception, host: str, port: int, spec: LaunchSpec) -> LaunchError:
    text = str(exc)
    lowered = text.lower()
    if "address already in use" in lowered or "eaddrinuse" in lowered:
        return LaunchError(f"port {port} on {host} is in use: pass --master {host}:<free port>")
    if "timed out" in lowered or "timeout" in lowered or "connect" in lowered:
        return LaunchError(
            f"node {spec.node_rank} could not reach the master at {host}:{port} within "
            f"{spec.join_timeout}s: check that node 0 runs with the same --master and the "
            "address is reachable"
        )
    return LaunchError(f"could not start the job: {text.splitlines()[0] if text else exc!r}")
