"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """The test process computes with one intra-op thread. Checking the collective matrix's
    million-element results costs seconds; with torch's intra-op threads, which on 2 cores
    only fight the ranks for them, it costs three times as long."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
