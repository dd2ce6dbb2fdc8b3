"""One way to wait in a test: poll a condition until it holds, failing with what was
awaited, and why, as soon as waiting cannot succeed.

    until(lambda: checkpoint_listed(folder, 5), 60, "the checkpoint of step 5",
          running=[job.poll], describe=job.output)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


def until(condition: Callable[[], object], timeout: float, what: str, *,
          running: Iterable[Callable[[], int | None]] = (),
          describe: Callable[[], str] = lambda: "", every: float = 0.1) -> None:
    """Return once `condition()` is true; checked every `every` seconds.

    Args:
        condition: what is awaited.
        timeout: seconds before giving up.
        what: the awaited thing in words, for the failure.
        running: a process's `poll` (None while it runs, else its exit code) for each
            process that must stay alive while waiting: one that ends fails the wait.
        describe: more to say on failure (the processes' output).

    Raises:
        AssertionError: the timeout passed, or a process of `running` ended, first.
    """
    deadline = time.monotonic() + timeout
    running = list(running)
    while not condition():
        for poll in running:
            code = poll()
            if code is not None:
                raise AssertionError(f"a process ended (code {code}) before {what}:\n"
                                     f"{describe()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g}s:\n{describe()}")
        time.sleep(every)
