"""Flags in shared memory that processes wait on without burning a core.

A flag is an aligned 32-bit counter in a shared mapping. Its owner only ever raises it
(`publish`); others wait until it reaches a value (`Flags.wait`). Waiting spins briefly
(when every rank has a core of its own) and then sleeps in the kernel on the flag's
address with the futex system call: the kernel re-reads the flag before it puts the
waiter to sleep, and the owner wakes all sleepers after every raise, so no wake-up is
lost. Where futex is unavailable (not Linux), the waiter sleeps in short, growing steps.

Ordering. The data a rank writes before raising its flag must be visible to whoever sees
the raised flag. x86-64 keeps stores in order and loads in order (TSO), so the data
written by torch's copies and the flag store that follows are seen in that order. Other
architectures get a full barrier from a futex system call on both sides (`fence`).

Counters wrap at 2**32; "reached" compares modulo 2**32, so a job may run for ever.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from collections.abc import Callable, Sequence

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not the _PRIVATE variants: the waiters are other processes
_TSO = platform.machine() in ("x86_64", "AMD64", "i686", "i386")
SPIN = 200  # flag reads before sleeping, when ranks do not outnumber cores
POLL_S = 0.1  # longest single sleep: how often a waiter checks its deadline and its peers


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex() -> Callable[..., int] | None:
    number = _SYS_FUTEX.get(platform.machine())
    if number is None or not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    syscall = ctypes.CDLL(None, use_errno=True).syscall  # releases the GIL while it sleeps
    syscall.restype = ctypes.c_long
    return lambda *args: syscall(number, *args)


_SYSCALL = _futex()


def reached(value: int, target: int) -> bool:
    """`value` is at or past `target`, counting modulo 2**32."""
    return (value - target) & 0xFFFFFFFF < 0x80000000


class Flags:
    """`count` flags, one per 64-byte line (no false sharing) from address `base`.

    Args:
        base: address of the first flag, inside a shared mapping that outlives this object.
        count: number of flags (one per rank).
        spin: whether to spin before sleeping (False when ranks outnumber cores).
    """

    LINE = 64

    def __init__(self, base: int, count: int, spin: bool) -> None:
        self._cells = [ctypes.c_uint32.from_address(base + k * self.LINE) for k in range(count)]
        self._addresses = [base + k * self.LINE for k in range(count)]
        self._spin = SPIN if spin else 0

    def value(self, k: int) -> int:
        return self._cells[k].value

    def publish(self, k: int, value: int) -> None:
        """Raise flag `k` to `value` (its owner only), after the data it announces."""
        fence()
        self._cells[k].value = value & 0xFFFFFFFF
        if _SYSCALL is not None:
            _SYSCALL(ctypes.c_void_p(self._addresses[k]), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def wait(self, ranks: Sequence[int], target: int,
             check: Callable[[list[int]], None]) -> None:
        """Return once every flag in `ranks` has reached `target`.

        While some have not, `check(missing ranks)` runs about every POLL_S seconds; it
        raises to give up (past the deadline, a peer that died).
        """
        target &= 0xFFFFFFFF
        for k in ranks:
            cell = self._cells[k]
            for _ in range(self._spin):
                if reached(cell.value, target):
                    break
            else:
                self._sleep_until(k, target, ranks, check)
        fence()

    def _sleep_until(self, k: int, target: int, ranks: Sequence[int],
                     check: Callable[[list[int]], None]) -> None:
        cell, step = self._cells[k], 20e-6
        last_check = time.monotonic()
        while True:
            seen = cell.value
            if reached(seen, target):
                return
            if _SYSCALL is not None:  # sleeps only while the flag still reads `seen`
                _SYSCALL(ctypes.c_void_p(self._addresses[k]), _FUTEX_WAIT, ctypes.c_uint32(seen),
                         ctypes.byref(_POLL), None, 0)
            else:
                time.sleep(step)
                step = min(step * 2, 1e-3)
            now = time.monotonic()
            if now - last_check >= POLL_S:
                check([r for r in ranks if not reached(self._cells[r].value, target)])
                last_check = now


_POLL = _Timespec(0, int(POLL_S * 1e9))
_FENCE_CELL = ctypes.c_uint32(0)


def fence() -> None:
    """A full memory barrier where the hardware reorders stores (a no-op on x86-64)."""
    if not _TSO and _SYSCALL is not None:  # futex_wake runs the kernel's smp_mb()
        _SYSCALL(ctypes.c_void_p(ctypes.addressof(_FENCE_CELL)), _FUTEX_WAKE, 1, None, None, 0)
