"""dtrain.testing.run_ranks: a rank that returned its result but hangs at exit, or exits
with an error, fails the call naming it (a test of a clean shutdown cannot pass by a rank
that never ended)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from dtrain.testing import processes, run_ranks


def _returns_then(what: str) -> int:
    """Return the rank; rank 1 then hangs at exit, or exits 3, from a thread the
    interpreter waits for."""
    import dtrain

    rank = dtrain.world.current().rank
    acts = {"hang": lambda: time.sleep(120), "exit": lambda: (time.sleep(0.5), os._exit(3))}
    if rank == 1 and what in acts:
        threading.Thread(target=acts[what], daemon=False).start()
    return rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what, words", [
    ("hang", "rank 1 sent its result but did not exit within 1s"),
    ("exit", "rank 1 sent its result but exited with code 3"),
])
def test_a_rank_that_hangs_or_fails_at_exit_is_named(what: str, words: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "EXIT_GRACE_S", 1.0)  # (every other test: exits in time)
    with pytest.raises(AssertionError, match=words):
        run_ranks(_returns_then, 2, what, timeout=40)
