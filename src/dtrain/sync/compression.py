"""Gradient compression for data parallelism: fewer bytes per step, nothing lost for good.

    compressor = make("powersgd", rank=4)            # or make("int8", chunk=1024)
    compressor.reduce(key, bucket, shapes, group)     # this rank's gradients -> the average

A compressor averages one bucket of fp32 gradients (parameters end to end) over a group,
sending less than an fp32 all-reduce's 2(n-1)/n x 4 bytes per element:

- PowerSGD (Vogels et al., NeurIPS 2019; as PyTorch's powerSGD_hook): each m x n gradient
  matrix travels as rank-r factors, one power iteration warm-started from the last step:
  (m + n) r floats instead of m n, in two all-reduces per bucket.
- int8: per-chunk scales, averaged by an all_to_all (rank j sums everyone's j-th shard)
  then an all_gather: 2(n-1)/n x (1 + 4 / chunk) bytes per element, about a quarter.

Both keep what compression dropped and add it to the next step's gradient (error
feedback: Seide et al. 2014, Karimireddy et al. 2019): delayed, not lost. That state is
per bucket and belongs in a checkpoint (`state_dict`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtrain import comm
from dtrain.comm.quantized import (
    WireDtype,
    dequantize,
    message_bytes,
    pack,
    quantize,
    sent_bytes,
    unpack,
)
from dtrain.errors import DtrainError

FLOAT_BYTES = 4


class Compressor:
    """Averages buckets of gradients over a group, compressed, keeping state per bucket.

    The state (`state_dict`) is tensors by kind and bucket key: `KINDS` names the kinds.
    `algorithm` is that of its `TUNED` collective (see dtrain.comm); "auto" measures the
    candidates on a group's first call, and `comm.traffic` counts those probes too.
    """

    name = ""
    KINDS: tuple[str, ...] = ()
    TUNED = ""

    def __init__(self, algorithm: str) -> None:
        choices = ("auto", *comm.AVAILABLE[self.TUNED])
        if algorithm not in choices:
            raise DtrainError(f"{self.name} algorithm={algorithm!r} is not one of its "
                              f"{self.TUNED}'s: {', '.join(choices)}")
        self.algorithm = algorithm
        self._state: dict[str, dict[int, torch.Tensor]] = {}

    def reduce(self, key: int, grads: torch.Tensor, shapes: Sequence[torch.Size],
               group: comm.GroupLike = None) -> None:
        """Replace this rank's gradients by their average over `group`, sent compressed.

        Args:
            key: names the bucket; error feedback and warm starts are kept per key.
            grads: this rank's gradients, not divided by the group size: a contiguous flat
                fp32 tensor holding the parameters' gradients end to end, in the order of
                `shapes`. Left holding the (approximate) average, identical on every rank.
            shapes: the parameters' shapes.
            group: the data-parallel group (None: the world). A group of one leaves
                `grads` as they are.

        Raises:
            DtrainError: `grads` is not such a tensor, or `key`'s state was made for a
                bucket of another size (a checkpoint of another model or world size).
        """
        _check_bucket(grads, shapes)
        g = comm.resolve(group)
        if g.size > 1 and grads.numel() > 0:
            self._reduce(key, grads, shapes, g)

    def _reduce(self, key: int, grads: torch.Tensor, shapes: Sequence[torch.Size],
                g: comm.Group) -> None:
        raise NotImplementedError

    def bytes_per_step(self, shapes: Sequence[torch.Size], n_ranks: int) -> float:
        """Bytes this rank sends (as `comm.traffic` counts them) per `reduce` of a bucket of
        `shapes` over `n_ranks` ranks."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the state, as {"kind/key": tensor}: what a resumed run needs to
        continue bit for bit."""
        return {f"{kind}/{key}": t.clone() for kind, per_key in self._state.items()
                for key, t in per_key.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from `state_dict()`'s tensors, replacing the state held.

        Raises:
            DtrainError: a name is not "kind/key" with one of this compressor's kinds.
        """
        loaded: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in state.items():
            kind, _, key = name.rpartition("/")
            if kind not in self.KINDS or not key.lstrip("-").isdigit():
                raise DtrainError(f"{name!r} is not {self.name} compression state (kinds: "
                                  f"{', '.join(self.KINDS)}): load the state this "
                                  "compressor saved")
            loaded.setdefault(kind, {})[int(key)] = tensor.detach().clone()
        self._state = loaded

    def _kept(self, kind: str, key: int, numel: int, device: torch.device,
              init: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """Bucket `key`'s `kind` state of `numel` elements on the gradients' `device`:
        zeros (or `init()`) at first."""
        per_key = self._state.setdefault(kind, {})
        if key not in per_key:
            if init is None:
                per_key[key] = torch.zeros(numel, dtype=torch.float32, device=device)
            else:
                per_key[key] = init().to(device)
        kept = per_key[key]
        if kept.numel() != numel:
            raise DtrainError(f"{self.name} state {kind}/{key} holds {kept.numel()} elements "
                              f"where bucket {key} needs {numel}: resume with the model, "
                              "bucket size and number of ranks that saved it")
        return kept


def _check_bucket(grads: torch.Tensor, shapes: Sequence[torch.Size]) -> None:
    """Raise DtrainError unless `grads` is what `reduce` takes: a contiguous flat fp32
    tensor with exactly the elements of `shapes`."""
    expected = sum(math.prod(s) for s in shapes)
    if (grads.dtype != torch.float32 or grads.dim() != 1 or not grads.is_contiguous()
            or grads.numel() != expected):
        raise DtrainError(f"a compressed bucket must be a contiguous flat fp32 tensor of "
                          f"{expected} elements (its shapes'), not {grads.dtype} "
                          f"{tuple(grads.shape)}")


@dataclass(frozen=True)
class _Matrix:
    """A parameter's gradient inside a bucket, viewed as rows x cols (dim 0 by the rest)."""

    start: int
    rows: int
    cols: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start : self.start + self.rows * self.cols].view(self.rows, self.cols)


class PowerSGD(Compressor):
    """Rank-`rank` approximations of the gradient matrices, with error feedback.

    Per bucket: M = grad + residual for each compressed matrix; P = M Q with Q the last
    step's (at first from a generator seeded with `seed` + key, the same on every rank);
    all-reduce every P and the uncompressed tensors in one buffer; orthonormalize each P
    (QR); Q = M^T P; all-reduce the Qs in one buffer and divide by n; the average is
    P Q^T = P P^T mean(M), and residual = M - P Q^T stays with this rank. The sum over
    ranks of M is what the approximation sees, so a sum of rank <= `rank` comes out exact.

    Args:
        rank: r, the approximation's rank (>= 1).
        start_iter: the first reduces of each bucket are plain fp32 averages (warm-up).
        min_compression_rate: a matrix is compressed only if m n exceeds (m + n) r times
            this (>= 1); vectors and the other matrices are all-reduced whole.
        seed: seeds the first Q (per bucket: seed + key).
        algorithm: the all-reduces' (dtrain.comm).

    Raises:
        DtrainError: an argument out of range, or an unknown algorithm.
    """

    name = "powersgd"
    KINDS = ("residual", "q", "steps")
    TUNED = "all_reduce"

    def __init__(self, rank: int = 4, start_iter: int = 0, min_compression_rate: float = 1.0,
                 seed: int = 0, algorithm: str = "auto") -> None:
        super().__init__(algorithm)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise DtrainError(f"powersgd rank={rank!r} must be an integer of at least 1 "
                              "(the rank of each gradient matrix's approximation)")
        if start_iter < 0:
            raise DtrainError(f"powersgd start_iter={start_iter} must be 0 or more")
        if min_compression_rate < 1:
            raise DtrainError(f"powersgd min_compression_rate={min_compression_rate} must "
                              "be at least 1: below it a matrix's factors outweigh it")
        self.rank = rank
        self.start_iter = start_iter
        self.seed = seed
        self.min_compression_rate = min_compression_rate

    def plan(self, shapes: Sequence[torch.Size]) -> tuple[list[_Matrix], list[slice]]:
        """The bucket's matrices to compress, and the slices of what is sent whole."""
        matrices: list[_Matrix] = []
        whole: list[slice] = []
        start = 0  # where the parameter begins in the bucket
        for shape in shapes:
            numel = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else 0
            cols = numel // rows if rows else 0
            if rows and (rows + cols) * self.rank * self.min_compression_rate < numel:
                matrices.append(_Matrix(start, rows, cols))
            else:
                whole.append(slice(start, start + numel))
            start += numel
        return matrices, whole

    def bytes_per_step(self, shapes: Sequence[torch.Size], n_ranks: int) -> float:
        """4 x 2(n-1)/n x (sum of (m + n) r over compressed matrices + the rest's elements);
        a warm-up step sends a plain fp32 all-reduce of the bucket instead."""
        matrices, whole = self.plan(shapes)
        first = sum(m.rows for m in matrices) * self.rank + sum(s.stop - s.start for s in whole)
        second = sum(m.cols for m in matrices) * self.rank
        return sum(sent_bytes("all_reduce", FLOAT_BYTES * floats, n_ranks)
                   for floats in (first, second) if floats)

    def _reduce(self, key: int, grads: torch.Tensor, shapes: Sequence[torch.Size],
                g: comm.Group) -> None:
        steps = self._kept("steps", key, 1, torch.device("cpu"),
                           lambda: torch.zeros((), dtype=torch.int64))
        steps += 1
        if steps.item() <= self.start_iter:
            comm.all_reduce(grads, op="avg", group=g, algorithm=self.algorithm)
            return
        matrices, whole = self.plan(shapes)
        residual = self._kept("residual", key, grads.numel(), grads.device)
        grads.add_(residual)  # M; the residual is zero where tensors are sent whole
        q_numel = sum(m.cols for m in matrices) * self.rank  # the same first Q on every rank:
        q = self._kept("q", key, q_numel, grads.device, lambda: torch.randn(
            q_numel, generator=torch.Generator().manual_seed(self.seed + key)))
        ms = [m.of(grads) for m in matrices]
        qs = _views(q, [(m.cols, self.rank) for m in matrices])
        ps = self._sum_ps_and_whole(grads, ms, qs, whole, g)
        for m, p, q_view in zip(ms, ps, qs, strict=True):
            p.copy_(torch.linalg.qr(p).Q)
            torch.matmul(m.T, p, out=q_view)
        if q.numel():
            comm.all_reduce(q, group=g, algorithm=self.algorithm)
            q.div_(g.size)
        for matrix, m, p, q_view in zip(matrices, ms, ps, qs, strict=True):
            approx = p @ q_view.T
            torch.sub(m, approx, out=matrix.of(residual))
            m.copy_(approx)

    def _sum_ps_and_whole(self, grads: torch.Tensor, ms: list[torch.Tensor],
                          qs: list[torch.Tensor], whole: list[slice],
                          g: comm.Group) -> list[torch.Tensor]:
        """P = M Q summed over the group (not averaged: it is orthonormalized next), and the
        tensors sent whole averaged back into `grads`, in one all-reduce."""
        p_floats = sum(m.shape[0] for m in ms) * self.rank
        buffer = grads.new_empty(p_floats + sum(s.stop - s.start for s in whole))
        ps = _views(buffer[:p_floats], [(m.shape[0], self.rank) for m in ms])
        for m, q_view, p in zip(ms, qs, ps, strict=True):
            torch.matmul(m, q_view, out=p)
        tail = _views(buffer[p_floats:], [(s.stop - s.start,) for s in whole])
        for s, t in zip(whole, tail, strict=True):
            t.copy_(grads[s])
        comm.all_reduce(buffer, group=g, algorithm=self.algorithm)
        for s, t in zip(whole, tail, strict=True):
            torch.div(t, g.size, out=grads[s])
        return ps


def _views(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Consecutive views of `flat` with these shapes."""
    views = []
    start = 0
    for shape in shapes:
        numel = math.prod(shape)
        views.append(flat[start : start + numel].view(shape))
        start += numel
    return views


class Int8(Compressor):
    """int8 values with one fp32 scale per `chunk`, averaged in two phases, error feedback
    on both quantizations.

    The bucket (padded with zeros) is split into n shards of s = ceil(N / n) elements,
    each quantized in chunks of `chunk` (scale = max|x| / 127, q = round(x / scale):
    dtrain.comm.quantized's int8, whose blocks are these chunks):
    1. all_to_all: rank j receives every rank's j-th shard (int8 and scales, as bytes),
       dequantizes and averages them;
    2. rank j re-quantizes its averaged shard and all_gather hands it to everyone, who
       dequantizes the whole bucket.
    Each rank keeps the error of its phase-1 quantization (`residual`) and of phase 2's
    for its shard (`shard_residual`) and adds them back next step: summed over steps, the
    averages handed out trail the true ones by the residuals only.

    One reduce from empty state errs, per element of chunk c, by at most the mean over
    ranks i of max |M_i| over c / 127 (M_i: rank i's input): each phase rounds to half a
    scale, and phase 2's scale is at most the mean of phase 1's.

    Args:
        chunk: elements per scale (>= 1); 256 to 1024 keeps the scales' bytes at 1.6% to
            0.4% of the values'.
        algorithm: the all_gather's (dtrain.comm).

    Raises:
        DtrainError: `chunk` is not a positive integer, or an unknown algorithm.
    """

    name = "int8"
    KINDS = ("residual", "shard_residual")
    TUNED = "all_gather"

    def __init__(self, chunk: int = 1024, algorithm: str = "auto") -> None:
        super().__init__(algorithm)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise DtrainError(f"int8 chunk={chunk!r} must be a positive integer (elements "
                              "per scale, e.g. 256 to 1024)")
        self.chunk = chunk

    def _message_bytes(self, numel: int, n_ranks: int) -> tuple[int, int]:
        """Shard elements s, and the bytes of one shard's message."""
        shard = -(-numel // n_ranks)
        return shard, message_bytes(shard, WireDtype.INT8, self.chunk)

    def bytes_per_step(self, shapes: Sequence[torch.Size], n_ranks: int) -> float:
        """An all_to_all and an all_gather of n messages of s + 4 ceil(s / chunk) bytes,
        s = ceil(N / n): 2 (n-1)/n x n (s + 4 ceil(s / chunk))."""
        _, width = self._message_bytes(sum(math.prod(s) for s in shapes), n_ranks)
        to_all = sent_bytes("all_to_all", n_ranks * width, n_ranks)
        gather = sent_bytes("all_gather", n_ranks * width, n_ranks)
        return to_all + gather

    def _reduce(self, key: int, grads: torch.Tensor, shapes: Sequence[torch.Size],
                g: comm.Group) -> None:
        n = g.size
        numel = grads.numel()
        shard, width = self._message_bytes(numel, n)
        residual = self._kept("residual", key, numel, grads.device)
        padded = grads.new_zeros(n * shard)
        torch.add(grads, residual, out=padded[:numel])
        q, scales = quantize(padded.view(n, shard), WireDtype.INT8, self.chunk)
        torch.sub(padded[:numel], self._dequantize(q, scales).reshape(-1)[:numel], out=residual)
        received = comm.all_to_all(pack(q, scales).view(-1), group=g).view(n, width)
        mine = self._dequantize(*unpack(received, shard, WireDtype.INT8)).sum(0).div_(n)
        mine += self._kept("shard_residual", key, shard, grads.device)
        q, scales = quantize(mine.view(1, shard), WireDtype.INT8, self.chunk)
        torch.sub(mine, self._dequantize(q, scales).reshape(-1),
                  out=self._kept("shard_residual", key, shard, grads.device))
        gathered = comm.all_gather(pack(q, scales).view(-1), group=g,
                                   algorithm=self.algorithm).view(n, width)
        grads.copy_(self._dequantize(*unpack(gathered, shard, WireDtype.INT8)).reshape(-1)[:numel])

    def _dequantize(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """fp32 values (count x s) of int8 `q` with its `scales`."""
        return dequantize(q, scales, self.chunk)


COMPRESSORS: dict[str, type[Compressor]] = {"powersgd": PowerSGD, "int8": Int8}


def _options(cls: type[Compressor]) -> list[str]:
    return list(inspect.signature(cls.__init__).parameters)[1:]


def make(name: str, **options: Any) -> Compressor | None:
    """The compressor called `name` ("powersgd", "int8") built with `options`; None for
    "none". An option only another compressor takes is ignored, so one configuration can
    carry every compressor's settings (`rank=` reaches int8 too).

    Raises:
        DtrainError: an unknown name, an option no compressor takes, or a value out of
            range.
    """
    if name == "none":
        return None
    if name not in COMPRESSORS:
        raise DtrainError(f"unknown compression {name!r}: use one of none, "
                          f"{', '.join(COMPRESSORS)}")
    cls = COMPRESSORS[name]
    unknown = sorted(set(options) - {o for c in COMPRESSORS.values() for o in _options(c)})
    if unknown:
        raise DtrainError(f"unknown compression option(s) {', '.join(unknown)}: {name} "
                          f"takes {', '.join(_options(cls))}")
    return cls(**{k: v for k, v in options.items() if k in _options(cls)})
