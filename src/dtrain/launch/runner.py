"""Start a job's ranks on torch's elastic agent (the engine behind torchrun).

The agent starts `nproc` processes on this machine, gives each its RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, watches them, and when one fails stops the others. dtrain
adds what a user sees: output lines prefixed with the rank, a single line naming the rank
that failed and its exit code, a free port for single-machine runs, sane thread counts,
and errors for a missing script or an unreachable master instead of tracebacks.

Several machines: run the same command on each with `--nnodes N` (or `MIN:MAX`, elastic)
and `--master HOST:PORT`; node 0 (`--node-rank 0`, or the first launcher able to listen
there) hosts the job's store at HOST:PORT, where the launchers meet in rounds of torch's
dynamic rendezvous (dtrain.launch.rendezvous). Each launcher beats on a counter in that
store (nodes.NodeWatch): a machine that goes silent is noticed within seconds, named in
the error line, and, in an elastic job, left behind in a new round. With `--rdzv-backend
etcd` the store is an etcd cluster (dtrain.store.etcd) and no machine hosts it; with live
replicas too, the job goes on without any machine it loses, node 0's included.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass, field

from dtrain import env as contract
from dtrain.comm.shm import segment
from dtrain.errors import ConfigError, LaunchError
from dtrain.launch import bootstrap, exits, nodes, rendezvous, waker
from dtrain.store import StoreAddress, check_backend

PREFIX = "[rank${rank}] "
LIVE_EXIT_WAIT_S = 10  # a live job's launchers wait this long for each other at the end


@dataclass
class LaunchSpec:
    """What to start and where.

    Attributes:
        command: the program and arguments each rank runs (argv[0] is the executable); a
            Python program runs through dtrain.launch.bootstrap (it dies with the agent and
            notes its exit time).
        nproc: ranks on this machine.
        nnodes: machines in the job (the most, when `min_nodes` is less).
        min_nodes: an elastic job (`--nnodes MIN:MAX`) starts, and goes on, with at least
            this many machines; None: `nnodes` exactly.
        node_rank: 0 hosts the rendezvous store at `master`; None: the first launcher able
            to listen there does. Node ranks in the job are the rendezvous's, by address.
        last_call: once `min_nodes` have joined, seconds a round waits for more.
        master: HOST:PORT of node 0's store; a free local port when None (one machine).
        max_restarts: times the agent restarts all ranks after a failure.
        raw_local_rank0: local rank 0 writes straight to this terminal, unprefixed, so it
            can draw a progress bar; the other ranks are still prefixed.
        join_timeout: seconds to wait for all machines to join.
        env: extra environment variables for every rank.
        timeline: record a timeline of every rank (dtrain.timeline) and merge it into this
            file once they end; with nnodes > 1 each machine writes its ranks' into
            `<timeline>.node-<node_rank>.json`. Empty: none.
        rdzv_backend: where the job's store lives: "c10d" (node 0's launcher, at `master`)
            or "etcd" (the cluster at `rdzv_endpoints`, HOST:PORT,...).
        rdzv_endpoints: the etcd cluster's members.
        run_id: the job's id, the same on every machine (needed with etcd, whose keys
            outlive the job); empty: made from `master`, or random on one machine.
        live: the ranks are live replicas' (dtrain.launch.supervisor): a lost machine is not
            a failure, and a launcher that arrives late takes a lost one's place.
    """

    command: list[str]
    nproc: int
    nnodes: int = 1
    min_nodes: int | None = None
    node_rank: int | None = None
    master: str | None = None
    max_restarts: int = 0
    raw_local_rank0: bool = False
    join_timeout: int = 120
    last_call: float = 5.0
    env: dict[str, str] = field(default_factory=dict)
    timeline: str = ""
    rdzv_backend: str = "c10d"
    rdzv_endpoints: str = ""
    run_id: str = ""
    live: bool = False


def parse_master(master: str) -> tuple[str, int]:
    """Split HOST:PORT, with a clear error when it is malformed."""
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--master {master!r} is not HOST:PORT (for example 10.0.0.1:29500)")
    return host.strip("[]"), int(port)


def parse_nnodes(text: str | int) -> tuple[int, int]:
    """`--nnodes N` or `MIN:MAX` as (min, max).

    Raises:
        ConfigError: not numbers, MIN below 1, or MIN above MAX.
    """
    low, sep, high = str(text).partition(":")
    if not low.strip().isdigit() or (sep and not high.strip().isdigit()):
        raise ConfigError(f"--nnodes {text!r} is not N or MIN:MAX (for example 2, or 1:4)")
    first, last = int(low), int(high if sep else low)
    if first < 1:
        raise ConfigError(f"--nnodes {text}: at least 1 machine is needed")
    if first > last:
        raise ConfigError(f"--nnodes {text}: MIN {first} is more than MAX {last}")
    return first, last


def validate(spec: LaunchSpec) -> None:
    """Check the numbers a user typed before anything starts."""
    if spec.nproc < 1:
        raise ConfigError(f"-n {spec.nproc}: the number of processes must be at least 1")
    if spec.nnodes < 1:
        raise ConfigError(f"--nnodes {spec.nnodes} must be at least 1")
    if spec.min_nodes is not None and not 1 <= spec.min_nodes <= spec.nnodes:
        raise ConfigError(f"--nnodes {spec.min_nodes}:{spec.nnodes}: MIN must be 1 to MAX")
    if spec.node_rank is not None and not 0 <= spec.node_rank < spec.nnodes:
        raise ConfigError(
            f"--node-rank {spec.node_rank} must be in [0, {spec.nnodes}) for --nnodes {spec.nnodes}"
        )
    if spec.join_timeout < 1:
        raise ConfigError(f"--join-timeout {spec.join_timeout} must be at least 1 (seconds)")
    check_backend(spec.rdzv_backend, spec.rdzv_endpoints,
                  spec.run_id or contract.RUN_ID.get())
    if spec.nnodes > 1 and spec.master is None and spec.rdzv_backend == "c10d":
        raise ConfigError("--nnodes > 1 needs --master HOST:PORT (the address of node 0), or "
                          "--rdzv-backend etcd")
    if spec.max_restarts < 0:
        raise ConfigError(f"--max-restarts {spec.max_restarts} must be 0 or more")


def _rank_env(spec: LaunchSpec, run_id: str, exit_dir: str,
              address: StoreAddress) -> dict[str, str]:
    env = {**contract.RUN_ID.pair(run_id), "PYTHONUNBUFFERED": "1",
           **contract.EXIT_DIR.pair(exit_dir), **address.env()}
    env["TORCH_CPP_LOG_LEVEL"] = contract.USER_CPP_LOG_LEVEL.get()
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
    from torch.distributed.elastic.multiprocessing.api import SignalException

    validate(spec)
    timeline = _start_timeline(spec) if spec.timeline else ""
    address, listen_fd = _store_address(spec)
    host, port = address.host, address.port
    # Every machine of a job must agree on the run id; the master address is what they share.
    run_id = spec.run_id or contract.RUN_ID.get() or (
        uuid.uuid4().hex[:12] if spec.master is None else f"dtrain-{host}-{port}"
    )
    address = StoreAddress(address.backend, host, port, address.endpoints, run_id)
    # The agent logs each failure and signal itself; dtrain reports it once, in one line.
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="dtrain-logs-") as log_dir:
        saved = dict(os.environ)
        exit_dir = os.path.join(log_dir, "exits")
        os.makedirs(exit_dir)
        os.environ.update({**_rank_env(spec, run_id, exit_dir, address), **spec.env})
        if timeline:
            contract.TIMELINE.set(timeline)  # read by dtrain.init in every rank
        waking = waker.Waker()  # continues stopped ranks once the job ends; fails stalled ones
        beat = rdzv = None
        try:
            store = rendezvous.open_store(address, listen_fd, spec.join_timeout)
            me = rendezvous.node_id(*address.first())
            if spec.nnodes > 1:  # notices, and names, a machine that is lost
                beat = nodes.NodeWatch(address, run_id, me)
            rdzv = rendezvous.Rendezvous(
                store, address, run_id, me, spec.min_nodes or spec.nnodes, spec.nnodes,
                spec.join_timeout, spec.last_call, spec.nproc,
                order=0 if listen_fd is not None else spec.node_rank, beat=beat,
                live=spec.live)
            result = run_agent(spec, rdzv, beat, log_dir)
            if result.is_failed():
                raise _failure(result, exit_dir, beat, waking)
        except SignalException as exc:
            name = signal.Signals(exc.sigval).name
            raise LaunchError(f"stopped by {name}: all ranks were shut down",
                              exit_code=128 + exc.sigval) from None
        except (RuntimeError, TimeoutError, ValueError) as exc:
            raise _rendezvous_error(exc, address, spec) from None
        finally:
            waking.stop()
            if beat:
                beat.stop()
            if rdzv is not None:
                rdzv.shutdown()
            os.environ.clear()
            os.environ.update(saved)
            segment.sweep(segment.sanitize(run_id))  # shm segments a killed rank left named
            if timeline:
                _merge_timeline(spec, timeline, rdzv)
            sys.stdout.flush()


def _store_address(spec: LaunchSpec) -> tuple[StoreAddress, int | None]:
    """Where the job's store is, and its socket if this launcher hosts it: the etcd cluster;
    a free port of 127.0.0.1 for one machine; `--master` for several, hosted by
    `--node-rank 0` or, without a node rank, by the first launcher able to listen there."""
    if spec.rdzv_backend == "etcd":
        from dtrain.store.etcd import parse_endpoints

        endpoints = tuple(parse_endpoints(spec.rdzv_endpoints))
        if len(endpoints) == 1:
            print("dtrain: warning: one etcd endpoint: the job's store is no longer fault "
                  "tolerant (give the cluster's three or more members)", file=sys.stderr)
        return StoreAddress("etcd", endpoints=endpoints), None
    if spec.master is None:
        fd, port = rendezvous.listen("127.0.0.1", 0)
        return StoreAddress("c10d", "127.0.0.1", port), fd
    host, port = parse_master(spec.master)
    listen_fd = None
    if spec.node_rank == 0:
        listen_fd = rendezvous.listen(host, port)[0]
    elif spec.node_rank is None:
        listen_fd = rendezvous.try_listen(host, port)
    return StoreAddress("c10d", host, port), listen_fd


def run_agent(spec: LaunchSpec, rdzv: rendezvous.Rendezvous, beat: nodes.NodeWatch | None,
               log_dir: str):
    """Start the ranks on torch's agent (as torchrun does) and watch them to the end."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    tee: Std | dict[int, Std] = Std.ALL
    if spec.raw_local_rank0:
        tee = {i: Std.NONE if i == 0 else Std.ALL for i in range(spec.nproc)}
    command = bootstrap.command(spec.command)
    worker = WorkerSpec(role="worker", local_world_size=spec.nproc, entrypoint=command[0],
                        # torch's RendezvousHandler by delegation, not a subclass of it
                        args=tuple(command[1:]), rdzv_handler=rdzv,  # type: ignore[arg-type]
                        max_restarts=spec.max_restarts, monitor_interval=0.1)
    # torch's agents wait for each other at the end, up to 5 minutes: a live job's lost
    # machines never come
    agent = _agent_class()(worker, DefaultLogsSpecs(log_dir=log_dir, tee=tee),
                           start_method="spawn", log_line_prefix_template=PREFIX,
                           exit_barrier_timeout=LIVE_EXIT_WAIT_S if spec.live else 300)
    agent.membership = _Membership(rdzv, beat, elastic=(spec.min_nodes or spec.nnodes)
                                   < spec.nnodes, live=spec.live)
    return agent.run()


@dataclass
class _Membership:
    """What the agent consults when its ranks fail or hang: whether a node has left."""

    rdzv: rendezvous.Rendezvous
    beat: nodes.NodeWatch | None
    elastic: bool
    live: bool = False
    lost: str = ""  # the last node lost, as the head of an error line
    said: set[str] = field(default_factory=set)  # live: the losses already reported

    def left(self, failed: bool) -> bool:
        """Whether a member of the round has left (asked on failure: waiting for its
        heartbeat's verdict; else: silent for the heartbeat's grace already). A live job
        goes on: its replicas there are dropped, and a launcher started anew takes the
        place."""
        if self.beat is None:
            return False
        self.lost = self.beat.lost() if failed else self.beat.silent()
        if self.live and self.lost and not self.beat.store_lost:
            which = self.lost.partition(":")[0]  # "lost node 0 (ranks 0-1)", without the time
            try:  # a launcher may have taken a lost place since: watch it instead
                self.rdzv.refresh_members()
            except Exception:  # noqa: BLE001 - the store is slow now: look again next time
                pass
            if which not in self.said:
                self.said.add(which)
                print(f"dtrain: {self.lost}; the live replicas there are dropped and the others "
                      "go on (the same command on a new machine takes its place)",
                      file=sys.stderr, flush=True)
            return False
        return bool(self.lost)


def _agent_class():
    """torch's LocalElasticAgent, told about dtrain's membership (made on first use: the
    agent pulls in much of torch, which `dtrain --help` need not pay)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        """An elastic job (`--nnodes MIN:MAX`) whose node is lost goes on with the others in a
        new round, without spending a restart (torch does so only for nodes that join); a
        fixed-size one fails at once, naming the node, instead of when the ranks'
        collectives time out (then restarts if it may, to wait for the node's return). A
        lost store ends the job either way: the rendezvous lived there."""

        membership: _Membership

        def _monitor_workers(self, worker_group):  # the agent's hook for a subclass
            result = super()._monitor_workers(worker_group)
            failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            if result.state != WorkerState.HEALTHY and not failed:
                return result
            if not self.membership.left(failed):
                return result
            beat = self.membership.beat
            assert beat is not None  # left() is False without one
            if self.membership.elastic and not beat.store_lost:
                print(f"dtrain: {self.membership.lost}; going on without it in a new round",
                      file=sys.stderr, flush=True)
                self.membership.rdzv.membership_changed()
                return RunResult(state=WorkerState.HEALTHY)
            if failed:
                return result
            print(f"dtrain: {self.membership.lost}; stopping the ranks here", file=sys.stderr,
                  flush=True)
            return RunResult(state=WorkerState.FAILED)

    return Agent


def _failure(result, exit_dir: str, beat: nodes.NodeWatch | None,
             waking: waker.Waker) -> LaunchError:
    """The one error line for a job whose ranks failed: the node lost, the rank that failed
    first and how."""
    lost = (beat.lost() if beat else "")
    if not result.failures:  # stopped for a lost node before any rank failed
        return LaunchError(f"{lost or 'a node was lost'}; the ranks here were stopped",
                           exit_code=1)
    codes = {r: f.exitcode for r, f in result.failures.items()}
    rank = exits.first_failed(codes, exit_dir)
    failure = result.failures[rank]
    others = len(result.failures) - 1
    more = f" ({others} other rank{'s' if others > 1 else ''} failed too)" if others else ""
    how = _describe(failure.exitcode)
    if failure.pid in waking.stalled:
        how = (f"was stopped (SIGSTOP) for {waking.stalled[failure.pid]:.0f}s and killed "
               f"(set {contract.STALL_TIMEOUT.name} to allow longer)")
    return LaunchError(f"{lost}{'; then ' if lost else ''}rank {rank} {how}{more}; its output "
                       "is above", exit_code=_exit_code(failure.exitcode) or 1)


def _start_timeline(spec: LaunchSpec) -> str:
    """The absolute path the ranks record the timeline for; stale parts removed (those of
    this node's ranks; of every rank when the rendezvous will number the nodes)."""
    from dtrain.timeline import part_path, prepare

    timeline = prepare(spec.timeline)
    first, count = 0, spec.nnodes * spec.nproc
    if spec.node_rank is not None:
        first, count = spec.node_rank * spec.nproc, spec.nproc
    for rank in range(first, first + count):
        part_path(timeline, rank).unlink(missing_ok=True)
    return timeline


def _merge_timeline(spec: LaunchSpec, timeline: str,
                    rdzv: rendezvous.Rendezvous | None) -> None:
    """Merge the parts this node's ranks wrote (all of them, or those a failure left) in the
    last round into one file."""
    from dtrain.timeline import merge_ranks

    node, first = (rdzv.node_rank, rdzv.first_rank) if rdzv else (0, 0)
    out = timeline
    if spec.nnodes > 1:
        out = f"{timeline.removesuffix('.json')}.node-{node}.json"
    try:
        merged = merge_ranks(timeline, range(first, first + spec.nproc), out)
    except (OSError, ValueError) as exc:
        print(f"dtrain: could not merge the timeline into {out}: {exc}", file=sys.stderr)
        return
    if not merged:
        print("dtrain: no timeline: no rank wrote one (a rank writes it when it exits after "
              "dtrain.init(); one killed by a signal does not)", file=sys.stderr)
        return
    print(f"dtrain: timeline of {merged} rank(s) written to {out} "
          "(open it in https://ui.perfetto.dev)")


def _rendezvous_error(exc: Exception, address: StoreAddress, spec: LaunchSpec) -> LaunchError:
    text = str(exc)
    lowered = text.lower()
    host, port = address.host, address.port
    if address.backend == "etcd":
        return LaunchError(f"the rendezvous on {address.describe()} failed: "
                           f"{text.splitlines()[0] if text else exc!r}")
    if "address already in use" in lowered or "eaddrinuse" in lowered:
        return LaunchError(f"port {port} on {host} is in use: pass --master {host}:<free port>")
    if "timed out" in lowered or "timeout" in lowered or "connect" in lowered:
        return LaunchError(
            f"node {spec.node_rank} could not reach the master at {host}:{port} within "
            f"{spec.join_timeout}s: check that node 0 runs with the same --master and the "
            "address is reachable"
        )
    return LaunchError(f"could not start the job: {text.splitlines()[0] if text else exc!r}")
