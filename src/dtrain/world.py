"""The world: which process this is among how many, and the process group joining them.

`init()` reads the environment of whichever launcher started the process (dtrain's own,
torchrun, SLURM's srun, OpenMPI's or MPICH's mpirun), initializes `torch.distributed`
(gloo on CPU, NCCL when CUDA is used) with a timeout, and returns a `World`. Started by
none of them, a script is a one-process world and runs unchanged.

Terms (as in MPI): the *rank* numbers a process among all of them (0..world_size-1); the
*local rank* numbers it among the processes on its own machine (it picks the GPU); the
*node rank* numbers the machine.

mpirun and srun do not say where rank 0 listens. When every rank runs on one machine and
neither MASTER_ADDR nor MASTER_PORT is set, rank 0 listens on 127.0.0.1 at a port the
kernel picks and the ranks agree on it through a file (dtrain.agreed_port); across
machines MASTER_ADDR must be set (SLURM: the first host of the node list).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

# Before any group exists: its functions' `group=group.WORLD` defaults are then None.
# Imported after init (by torch._dynamo) they would hold the world's group past shutdown.
import torch.distributed.nn.functional  # noqa: F401

from dtrain import agreed_port
from dtrain import env as contract
from dtrain import timeline as timeline_mod
from dtrain.errors import ConfigError, DtrainError
from dtrain.store import StoreAddress, prefixed
from dtrain.timeline import Recorder

DEFAULT_TIMEOUT_S = 180.0
DEFAULT_MASTER_PORT = 29500
BACKENDS = ("gloo", "nccl", "shm")
LAUNCHERS = {"dtrain": "dtrain run", "torchrun": "torchrun", "slurm": "SLURM",
             "openmpi": "Open MPI", "mpich": "MPICH"}


@dataclass(frozen=True)
class World:
    """Where this process stands among all processes of the job.

    Attributes:
        rank: global index of this process, 0..world_size-1.
        world_size: number of processes in the job.
        local_rank: index of this process among those on its machine.
        local_world_size: number of processes on this machine.
        node_rank: index of this machine among the job's machines.
        role: "worker", or "server" for parameter-server processes.
        source: whose environment described the world: "dtrain", "torchrun", "slurm",
            "openmpi", "mpich" or "single".
        master_addr, master_port: where rank 0's rendezvous store listens; port 0 until
            `init()` agrees a free one when `port_key` is set.
        port_key: names the job (the same in all its ranks) when its ranks, all on this
            machine, agree a free port at `init()` (dtrain.agreed_port); else empty.
        job: the launcher's job id (SLURM's), for messages; else empty.
        backend: "gloo", "nccl", or "shm" (dtrain's shared memory between the ranks of a
            host, over a gloo process group); empty before `init()`.
        device: the device this process computes on.
        timeline: the recorder of this rank's timeline (dtrain.timeline), None when off.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    role: str = "worker"
    source: str = "single"
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    backend: str = ""
    device: torch.device = torch.device("cpu")
    timeline: Recorder | None = field(default=None, repr=False, compare=False)
    port_key: str = ""
    job: str = ""

    def describe(self) -> str:
        """Who started this process, in a few words for a banner: "rank 0 of 2 from SLURM
        (job 12, node 0)", "rank 1 of 2 from Open MPI (node 0)", "one process"."""
        if self.source == "single":
            return "one process"
        where = f"job {self.job}, node {self.node_rank}" if self.job else f"node {self.node_rank}"
        return (f"rank {self.rank} of {self.world_size} from "
                f"{LAUNCHERS.get(self.source, self.source)} ({where})")

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints, logs and writes shared files."""
        return self.rank == 0


_WORLD: World | None = None
_AT_SHUTDOWN: list[Callable[[], object]] = []  # callbacks of layers above, per-world state


def at_shutdown(callback: Callable[[], object]) -> None:
    """Call `callback()` when the world shuts down (for state tied to its process groups)."""
    if callback not in _AT_SHUTDOWN:
        _AT_SHUTDOWN.append(callback)


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise DtrainError(f"environment variable {key}={env[key]!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """Return the first host of a SLURM node list such as ``node[01-04,07],gpu5``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]

    def first_of_bracket(match: re.Match[str]) -> str:
        return match.group(1).split(",")[0].split("-")[0]

    return re.sub(r"\[([^\]]*)\]", first_of_bracket, first)


def _check_one_machine(source: str, size: int, local_size: int) -> None:
    """An MPI world without MASTER_ADDR must be on one machine: 127.0.0.1 reaches rank 0."""
    if local_size < size:
        raise DtrainError(
            f"{LAUNCHERS[source]} started {size} ranks on several machines ({local_size} on "
            "this one) but MASTER_ADDR is not set: export MASTER_ADDR=<host of rank 0> (and "
            "MASTER_PORT) for every rank, e.g. mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500")


def detect(env: Mapping[str, str]) -> World:
    """Describe the world from a launcher's environment variables (no side effects).

    Checked in order: dtrain's launcher and torchrun (RANK, WORLD_SIZE, LOCAL_RANK, ...),
    SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), OpenMPI (OMPI_COMM_WORLD_*), MPICH
    and Intel MPI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID). With none, a one-process world.
    SLURM on one node and MPI on one machine, without MASTER_ADDR and MASTER_PORT, give a
    `port_key`: `init()` then agrees a free port on 127.0.0.1 among the ranks.

    Raises:
        DtrainError: a variable is not an integer, or an MPI world spans machines (or has
            no job name in its environment) and MASTER_ADDR is not set.
    """
    role = contract.ROLE.get(env)
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    unset = "MASTER_ADDR" not in env and "MASTER_PORT" not in env

    if "RANK" in env and "WORLD_SIZE" in env:
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_size = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else size
        node = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // local_size
        source = "dtrain" if contract.RUN_ID.is_set(env) else "torchrun"
        return World(rank, size, local, local_size, node, role, source, addr, port)

    if all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")):
        rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID")
        per_node = env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
        match = re.match(r"\d+", per_node)
        local_size = int(match.group()) if match else size
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else rank // local_size
        job = env.get("SLURM_JOB_ID", "")
        nodes = next((env[k] for k in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES",
                                       "SLURM_JOB_NUM_NODES") if k in env), "")
        if unset and size > 1 and job and nodes == "1":
            key = f"slurm-{job}.{env.get('SLURM_STEP_ID', '')}"
            return World(rank, size, local, local_size, node, role, "slurm", "127.0.0.1", 0,
                         port_key=key, job=job)
        nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
        if "MASTER_ADDR" not in env and nodelist:
            addr = first_slurm_host(nodelist)
        if "MASTER_PORT" not in env and job:
            port = 10000 + _int(env, "SLURM_JOB_ID") % 20000
        return World(rank, size, local, local_size, node, role, "slurm", addr, port, job=job)

    mpi = {
        "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    }
    for source, (k_rank, k_size, k_local, k_local_size) in mpi.items():
        if k_rank in env and k_size in env:
            rank, size = _int(env, k_rank), _int(env, k_size)
            local = _int(env, k_local) if k_local in env else 0
            local_size = _int(env, k_local_size) if k_local_size in env else size
            node = rank // local_size
            if size > 1 and "MASTER_ADDR" not in env:
                _check_one_machine(source, size, local_size)
                job_name = env.get("PMIX_NAMESPACE", env.get("OMPI_MCA_ess_base_jobid", ""))
                if "MASTER_PORT" not in env and job_name:
                    return World(rank, size, local, local_size, node, role, source,
                                 "127.0.0.1", 0, port_key=f"{source}-{job_name}")
                if "MASTER_PORT" not in env:
                    raise DtrainError(
                        f"{LAUNCHERS[source]} started {size} ranks with no job name in their "
                        "environment (PMIX_NAMESPACE) to agree a port by: export MASTER_PORT="
                        "<free port> for every rank")
            return World(rank, size, local, local_size, node, role, source, addr, port)

    return World(role=role)


PEER_GONE = ("connection closed by peer", "connection reset", "socket closed", "broken pipe",
             "read error", "writev", "short read", "short write")
"""What gloo's TCP transport says when the other end of a pair went away. Which of them a
survivor sees depends on timing: the peer's FIN read by gloo's event loop ("Connection
closed by peer"), its RST ("Read error ...: Connection reset by peer"), a send issued
before the loop noticed ("writev ...: Broken pipe"), or a pair already torn down ("Socket
closed")."""


def connection_lost(error: str) -> bool:
    """Whether a collective's or the process group's `error` says that a peer went away:
    an I/O error of gloo's transport, not a timeout and not one of gloo's failed checks (a
    size mismatch is a bug, not a missing peer). Shared by the process group's set-up here
    and the collectives' diagnosis (dtrain.comm.debug)."""
    text = error.lower()
    if "timed out" in text or "timeout" in text:
        return False
    transport = "gloo/transport/" in text and "enforce fail" not in text
    return transport or any(phrase in text for phrase in PEER_GONE)


def _timeout_s(timeout: float | None) -> float:
    if timeout is not None:
        return float(timeout)
    configured = contract.TIMEOUT.get()
    return DEFAULT_TIMEOUT_S if configured is None else configured


def _torch_backend(world: World) -> str:
    return "gloo" if world.backend == "shm" else world.backend  # shm bootstraps over gloo


def _init_process_group(world: World, timeout: timedelta) -> World:
    """Initialize torch.distributed for `world`; returns it with the port it agreed on."""
    if world.world_size == 1:
        # A private in-memory store: no port, yet every collective works on the group of one.
        dist.init_process_group(
            _torch_backend(world), store=dist.HashStore(), rank=0, world_size=1,
            timeout=timeout,
        )
        return world
    if world.port_key:
        store = agreed_port.local_store(world.port_key, world.rank, world.world_size, timeout)
        world = replace(world, master_port=store.port, port_key="")
        dist.init_process_group(_torch_backend(world), store=store, rank=world.rank,
                                world_size=world.world_size, timeout=timeout)
        return world
    where = f"{world.master_addr}:{world.master_port}"
    init_method: str | None = f"tcp://{where}"
    agent_store: dist.Store | None = None
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # The agent's store outlives a restart, and with it the addresses the previous
            # attempt's ranks published there: each attempt (each rendezvous round of
            # dtrain's launcher) gets keys of its own.
            attempt = contract.ATTEMPT.get() or os.environ.get(
                "TORCHELASTIC_RESTART_COUNT", "0")
            agent = StoreAddress.from_env().connect(timeout.total_seconds())
            init_method, agent_store = None, prefixed(f"dtrain/attempt-{attempt}/", agent)
        dist.init_process_group(
            _torch_backend(world),
            rank=world.rank,
            world_size=world.world_size,
            timeout=timeout,
            init_method=init_method,
            store=agent_store,
        )
    except (RuntimeError, dist.DistError) as exc:
        text = str(exc)
        if "address already in use" in text.lower() or "EADDRINUSE" in text:
            raise DtrainError(
                f"port {world.master_port} on {world.master_addr} is in use: pick another "
                "master port (MASTER_PORT or --master HOST:PORT)"
            ) from None
        if connection_lost(text):
            # gloo connects every pair of ranks, and each rank finishes its half alone: a
            # rank that exits (or dies) just after its half leaves the others half-connected.
            raise DtrainError(
                f"rank {world.rank}: another rank closed its connection while the ranks "
                f"were connecting (master {where}): it exited or failed during start-up; "
                "its own output says why"
            ) from None
        if world.rank != 0 and ("timed out" in text.lower() or "timeout" in text.lower()):
            raise DtrainError(
                f"rank {world.rank} could not reach the master at {where} within "
                f"{timeout.total_seconds():.0f}s: check that rank 0 runs and the address is "
                "reachable"
            ) from None
        raise
    return world


def init(backend: str | None = None, timeout: float | None = None,
         timeline: str | None = None) -> World:
    """Join the job's process group and return this process's `World`.

    Args:
        backend: "gloo", "nccl" or "shm" (collectives through shared memory between the
            ranks of each host, dtrain.comm.shm); by default env DTRAIN_BACKEND (which
            `dtrain run --backend` sets), else NCCL when CUDA is available, else gloo.
        timeout: seconds any collective may wait before failing (default: env
            DTRAIN_TIMEOUT, else 180).
        timeline: record this rank's timeline for this path (dtrain.timeline); by default
            env DTRAIN_TIMELINE, which `dtrain run --timeline` sets (and merges).

    Returns:
        The world; calling `init()` again returns the same one (recording a timeline from
        then on if `timeline` is given and none is recorded yet). Its recorder is this
        process's (`dtrain.timeline.recorder()`) while it is the world.

    Raises:
        DtrainError: the environment is inconsistent, the master is unreachable, or its
            port is in use.
        ConfigError: the timeline's folder cannot be created.
    """
    if _WORLD is not None:
        if backend is not None and backend != _WORLD.backend:
            raise DtrainError(
                f"dtrain.init(backend={backend!r}) after the world was initialized with "
                f"{_WORLD.backend!r}: call dtrain.shutdown() first"
            )
        _become(_with_timeline(_WORLD, timeline))
        return _WORLD
    world = detect(os.environ)
    if backend is None:
        backend = contract.BACKEND.get() or (
            "nccl" if torch.cuda.is_available() else "gloo"
        )
    if backend not in BACKENDS:
        raise DtrainError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    device = torch.device("cpu")
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if world.local_world_size > gpus:
            raise ConfigError(
                f"{world.local_world_size} ranks on this host but {gpus} GPU(s): NCCL needs a "
                f"GPU of its own per rank; run at most {gpus} rank(s) per host (parallel.nproc, "
                "dtrain run -n), or use gloo (dtrain run --backend gloo, DTRAIN_BACKEND=gloo)")
        device = torch.device("cuda", world.local_rank % gpus)
        torch.cuda.set_device(device)
    world = replace(world, backend=backend, device=device)
    world = _with_timeline(world, timeline or contract.TIMELINE.get())
    if not dist.is_initialized():
        excepthook = sys.excepthook
        world = _init_process_group(world, timedelta(seconds=_timeout_s(timeout)))
        if world.source == "dtrain":
            sys.excepthook = excepthook  # dtrain run prefixes every line with the rank already
        atexit.register(_shutdown_at_exit)
    else:  # the script's own group: the script destroys it, dtrain lets go of it at exit
        atexit.register(_let_go)
    _become(world)
    return world


def _become(world: World | None) -> None:
    """Make `world` the world (None: none), its timeline recorder this process's."""
    global _WORLD
    _WORLD = world
    timeline_mod.install(world.timeline if world is not None else None)


def _with_timeline(world: World, path: str | None) -> World:
    """`world` recording a timeline for `path` (unless it records one already)."""
    if not path or world.timeline is not None:
        return world
    atexit.register(_close_timeline_at_exit)  # also when dist was initialized by others
    return replace(world, timeline=Recorder(timeline_mod.prepare(path), world.rank,
                                            alone=world.source == "single"))


def recorder() -> Recorder | None:
    """This rank's timeline recorder, or None when no timeline is recorded (the same as
    `dtrain.timeline.recorder()`)."""
    return timeline_mod.recorder()


def _close_timeline_at_exit() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as in _shutdown_at_exit
    close_timeline()


def close_timeline() -> None:
    """Write this rank's timeline now and stop recording (shutdown and exit do it too)."""
    if _WORLD is not None and _WORLD.timeline is not None:
        _WORLD.timeline.close()
        _become(replace(_WORLD, timeline=None))


def current() -> World:
    """The initialized world (calls `init()` with defaults if nobody has yet)."""
    return _WORLD if _WORLD is not None else init()


def _shutdown_at_exit() -> None:
    # This rank is exiting on its own. The launcher sends SIGTERM to every rank once it sees
    # another one fail; during this short teardown that must not replace our exit status.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    shutdown()


def _let_go() -> None:
    """dtrain lets go of the process groups (at_shutdown callbacks); forgets the world."""
    close_timeline()
    for callback in _AT_SHUTDOWN:
        callback()
    _become(None)


def shutdown() -> None:
    """Leave the process group and forget the world; safe to call more than once.

    The groups end here, not in interpreter exit: dtrain lets go of them (its group
    wrappers and meshes drop their references), then destroys them, and gloo joins its
    worker threads while the interpreter is whole. Left alive into finalization, a worker
    that took the GIL to free a finished collective's tensors was ended by Python, and the
    rank aborted with SIGABRT after the script had finished.
    """
    _let_go()
    if dist.is_initialized():
        dist.destroy_process_group()
