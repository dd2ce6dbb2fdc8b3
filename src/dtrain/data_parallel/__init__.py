"""Data parallelism: the ranks of dp x cp hold the same model and average its gradients.

    wrapper     DataParallel: every rank the whole model (or its tp blocks), gradient
                buckets all-reduced from autograd hooks, overlapping backward
    buckets     the flat gradient buckets and the order they are sent in
    zero        ZeRO stages 1-3: optimizer state, gradients and parameters sharded
    averaging   the hook by which both average over members that change (live replicas)
    agreement   ranks that start identical: the same model checked, state broadcast
    clip        the one global gradient-norm clip over replicated, split and sharded parts
    late_grads  gradients that arrive after their bucket was sent (tied weights)

Gradient compression and infrequent synchronization over slow links are dtrain.sync's.
"""

from dtrain.data_parallel.wrapper import DataParallel, parse_dtype
from dtrain.data_parallel.zero import ZeRO

__all__ = ["DataParallel", "ZeRO", "parse_dtype"]
