"""Synchronous data parallelism: every rank holds the whole model, gradients are averaged.

    wrapper   DataParallel: gradient buckets all-reduced from autograd hooks, overlapping
              backward (or summed by an `averaging`: dtrain.parallel.averaging)
    buckets   the flat gradient buckets and the order they are sent in
"""

from dtrain.parallel.data_parallel.wrapper import DataParallel, parse_dtype

__all__ = ["DataParallel", "parse_dtype"]
