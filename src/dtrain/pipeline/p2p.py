"""Activations and their gradients between neighbouring stages, shape agreed once.

The first message on a channel (a peer and a tag) carries a small header with the dtype
and shape; later messages are the raw tensor only, received into a buffer of that shape.
Every micro-batch must keep that shape; a change is refused on the sending side.
Pipeline messages use tags of their own, so they never match a collective's (tag 0).
A message to this rank itself (two chunks of one rank next to each other, the V
placement's turn) is handed over in memory, in the order sent.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from dtrain import comm
from dtrain.errors import DtrainError

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.bool]
_HEADER = 10  # ndim, dtype, then up to 8 sizes


class Channels:
    """Send and receive pipeline tensors over `group`, remembering each channel's shape."""

    def __init__(self, group: comm.Group, device: torch.device) -> None:
        self.group, self.device = group, device
        self._sent: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = {}
        self._known: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._local: dict[int, deque[torch.Tensor]] = {}  # tag -> sent to this rank
        self.waited = 0.0  # seconds spent in recv, so timelines can tell waiting from work

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Start sending `tensor` (not blocking); `flush()` waits for every send."""
        tensor = tensor.detach().contiguous()
        if peer == self.group.rank:
            self._local.setdefault(tag, deque()).append(tensor)
            return
        key, meta = (peer, tag), (tensor.shape, tensor.dtype)
        if key not in self._sent:
            self._post(self._header(tensor), peer, tag)
            self._sent[key] = meta
        elif self._sent[key] != meta:
            raise DtrainError(f"pipeline: a stage output changed from {tuple(self._sent[key][0])} "
                              f"{self._sent[key][1]} to {tuple(tensor.shape)} {tensor.dtype}; "
                              "every micro-batch must have the same shape")
        self._post(tensor, peer, tag)

    def _header(self, tensor: torch.Tensor) -> torch.Tensor:
        """What tells the receiver `tensor`'s dimensions, shape and dtype."""
        if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
            raise DtrainError(f"pipeline: cannot send a {tensor.dim()}-d {tensor.dtype} "
                              "tensor between stages")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        return header

    def _post(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self._pending.append((comm.send(tensor, peer, self.group, async_op=True, tag=tag),
                              tensor))

    def recv(self, peer: int, tag: int) -> torch.Tensor:
        """The next tensor from `peer` with `tag` (waits for it)."""
        if peer == self.group.rank:
            return self._handed(tag)
        key = (peer, tag)
        if key not in self._known:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            comm.recv(header, peer, self.group, tag=tag)
            ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
            self._known[key] = (torch.Size(header[2 : 2 + ndim].tolist()), dtype)
        shape, dtype = self._known[key]
        out = torch.empty(shape, dtype=dtype, device=self.device)
        start = time.perf_counter()
        comm.recv(out, peer, self.group, tag=tag)
        self.waited += time.perf_counter() - start
        return out

    def send_shaped(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Send `tensor` with its own header, whatever shape the last one on this channel
        had (generation: a prompt, then one token at a time); waits until sent."""
        tensor = tensor.detach().contiguous()
        if peer == self.group.rank:
            self._local.setdefault(tag, deque()).append(tensor)
            return
        comm.send(self._header(tensor), peer, self.group, tag=tag)
        comm.send(tensor, peer, self.group, tag=tag)

    def recv_shaped(self, peer: int, tag: int) -> torch.Tensor:
        """The next tensor `send_shaped` sent from `peer` with `tag` (waits for it)."""
        if peer == self.group.rank:
            return self._handed(tag)
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        comm.recv(header, peer, self.group, tag=tag)
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        out = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=self.device)
        return comm.recv(out, peer, self.group, tag=tag)

    def _handed(self, tag: int) -> torch.Tensor:
        """The oldest tensor this rank sent itself with `tag` (a new tensor object)."""
        waiting = self._local.get(tag)
        if not waiting:
            raise DtrainError(f"pipeline: a rank waits for its own message (tag {tag}) "
                              "before sending it; the schedule is out of order")
        return waiting.popleft().detach()

    def flush(self) -> None:
        """Wait until every started send has completed."""
        for handle, _ in self._pending:
            handle.wait()
        self._pending.clear()
