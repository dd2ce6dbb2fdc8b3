"""A launcher's watchers (heartbeat, waker): a daemon thread each, until `stop()`."""

from __future__ import annotations

import threading


class Watcher:
    """Runs `self._run()` on a daemon thread named `name` from `start()`; `_run` ends once
    `self.stopped` is set (`stop()`)."""

    name = "dtrain-watcher"

    def start(self) -> None:
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        raise NotImplementedError
