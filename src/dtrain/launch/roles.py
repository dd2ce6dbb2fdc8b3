"""One process of a parameter-server job: `python -m dtrain.launch.roles W S -- COMMAND...`.

`dtrain run -n W --servers S` asks the elastic agent for W + S processes per machine, each
started here. Local ranks 0..W-1 become workers: they run the user's COMMAND with a world
of workers only (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE renumbered, role
"worker"), so collectives among workers still work. The others become servers and run
dtrain's server loop (`python -m dtrain.launch.roles serve`); they need no user code.
Either runs as a child of the role process, which watches how it ends.

A worker killed by a signal it was not sent by the launcher (SIGKILL, the OOM killer) does
not end the job: the servers drop it from the clocks after its worker_timeout, or fail the
job if its settings say on_worker_loss="fail". With restarts left (`--max-restarts`) it
fails the job instead, so that the agent restarts every process and training resumes
from the checkpoint and the servers' snapshots. A worker that exits with an error does end
the job, as in any dtrain run.

A server killed that way does not end the job either when worker 0's settings keep
backups (`copies` >= 2, read from the job's store: dtrain.ps.job): the next copy of each
of its shards takes over (dtrain.ps.chain), and its role process says so in one line and
starts a new server in its slot, which copies the slot's shards from live copies while
the workers go on and joins their chains (dtrain.ps.joining): each shard has its
`copies` copies again, and the next death is survived the same way. A new server is
started after each such death, without the drill of DTRAIN_FAULT (it struck the first).
Should every copy of a shard die, the workers stop the job with an error naming the
shard. With `copies` = 1 a killed server fails the job (the agent restarts it with
restarts left, and servers resume from their snapshots).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dtrain import env
from dtrain.errors import ConfigError, exit_code_of
from dtrain.launch import bootstrap
from dtrain.ps import job

SERVE, JOIN = "serve", "--join"


def plan(command: list[str], workers: int, servers: int, nnodes: int, host: str = "127.0.0.1",
         snapshot_dir: str | None = None, snapshot_every: int = 0
         ) -> tuple[list[str], int, dict[str, str]]:
    """The command, processes per machine and environment that start a parameter-server
    job of `workers` workers and `servers` servers per machine.

    Raises:
        ConfigError: a count below 1, snapshots without a folder, or several machines
            without a shared DTRAIN_PS_SECRET.
    """
    if servers < 1 or workers < 1:
        raise ConfigError(f"--servers {servers} with -n {workers}: a parameter-server job "
                          "needs at least one server and one worker per machine")
    if snapshot_every and not snapshot_dir:
        raise ConfigError("--snapshot-every needs --snapshot-dir (where servers save shards)")
    key = env.PS_SECRET.get()
    if key is None and nnodes > 1:
        raise ConfigError(f"--servers across machines: set {env.PS_SECRET.name} to the same "
                          "hex key on every machine (for example `openssl rand -hex 32`)")
    passed = {**env.PS_SECRET.pair(key or job.new_secret()), **env.PS_HOST.pair(host),
              **env.PS_SNAPSHOT_EVERY.pair(snapshot_every)}
    if snapshot_dir:
        env.PS_SNAPSHOT_DIR.set(os.path.abspath(snapshot_dir), passed)
    wrapped = [sys.executable, "-u", "-m", "dtrain.launch.roles", str(workers), str(servers),
               "--", *command]
    return wrapped, workers + servers, passed


def _env_int(name: str) -> int:
    return int(os.environ[name])


def _supervise(command: list[str], leave_out: tuple[str, ...] = ()) -> tuple[int, str | None]:
    """Run `command` as a child (it dies with this process), with this environment less
    the variables `leave_out` names, and pass it the launcher's SIGTERM and SIGINT; its
    exit code, and the name of the signal that killed it when that was not one passed on
    (None otherwise)."""
    # This process (run through bootstrap) notes the exit time for the launcher, not the
    # child: the launcher blames the failed rank that ended first.
    quiet = {k: v for k, v in os.environ.items()
             if k != env.EXIT_DIR.name and k not in leave_out}
    child = subprocess.Popen(bootstrap.command(command), env=quiet)
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    return code, signal.Signals(-code).name if code < 0 and not stopping else None


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _run_server(index: int) -> int:
    serve = [sys.executable, "-u", "-m", "dtrain.launch.roles", SERVE]
    join: list[str] = []
    leave_out: tuple[str, ...] = ()
    while True:
        code, killed_by = _supervise([*serve, *join], leave_out)
        if killed_by is None:
            return _exit_code(code)
        copies = job.copies()
        if copies < 2:
            print(f"dtrain: parameter server {index} was killed by {killed_by}; with no "
                  "backup of its shard ([ps] copies = 1) the job stops", file=sys.stderr,
                  flush=True)
            return _exit_code(code)
        print(f"dtrain: parameter server {index} was killed by {killed_by}; the next copies "
              f"of its shards take over ({copies} copies of each) and the job goes on\n"
              f"dtrain: a new parameter server {index} starts and joins their chains in its "
              "place", file=sys.stderr, flush=True)
        join, leave_out = [JOIN], (env.FAULT.name,)


def _run_worker(index: int, command: list[str]) -> int:
    code, killed_by = _supervise(command)
    restarts_left = (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
                     - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    if killed_by is not None:
        if restarts_left > 0:  # a restart resumes every worker from the checkpoint
            print(f"dtrain: worker {index} was killed by {killed_by}; the job restarts "
                  f"({restarts_left} restart(s) left)", file=sys.stderr, flush=True)
            return _exit_code(code)
        print(f"dtrain: worker {index} was killed by {killed_by}; the parameter servers drop it "
              "from the clocks and the job goes on", file=sys.stderr, flush=True)
        return 0
    return _exit_code(code)


def main(argv: list[str]) -> int:
    if argv[:1] == [SERVE]:  # the child of a server's role process
        return exit_code_of(lambda: job.serve_from_env(join=argv[1:] == [JOIN]))
    workers, servers = int(argv[0]), int(argv[1])
    command = argv[3:]  # after "--"
    local, node = _env_int("LOCAL_RANK"), _env_int("GROUP_RANK")
    nodes = _env_int("WORLD_SIZE") // (workers + servers)
    env.PS_WORKERS.set(workers * nodes)
    env.PS_SERVERS.set(servers * nodes)
    if local >= workers:
        index = node * servers + local - workers
        os.environ.update({**env.ROLE.pair("server"), **env.PS_INDEX.pair(index)})
        return _run_server(index)
    index = node * workers + local
    os.environ.update({
        **env.ROLE.pair("worker"), **env.PS_INDEX.pair(index), "RANK": str(index),
        "WORLD_SIZE": str(workers * nodes), "LOCAL_WORLD_SIZE": str(workers),
    })
    return _run_worker(index, command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
