"""Testing distributed code: ranks as threads in one process, or as real processes.

    threads     `run_threads(fn, n)`: n ranks as threads on the in-process backend, in
                milliseconds (dtrain.comm, DataParallel, ZeRO run unchanged)
    processes   `run_ranks(fn, n, *args)`: n ranks as processes on gloo, forked from a
                server that loaded torch once; each must exit 0
    ps_drill    a parameter-server kill drill (servers in processes, one killed mid-run),
                shared by dtrain's tests and its failover benchmark
    chat        a tokenizer folder with chat templates and conversations, trained here
                (no download), shared by the tests and benchmarks of chat data
"""

from dtrain.testing.processes import fork_server, run_ranks
from dtrain.testing.threads import run_threads

__all__ = ["fork_server", "run_ranks", "run_threads"]
