"""The shared-memory backend: ranks of one host reduce through a segment they all map.

    group     ShmGroup: the collectives over the segment, bootstrapped over gloo
    segment   the segments' names, creation and removal (nothing is left after a crash)
    flags     per-rank flags the kernel wakes sleepers on (futex), for the epochs
"""

from dtrain.comm.shm.group import ShmGroup

__all__ = ["ShmGroup"]
