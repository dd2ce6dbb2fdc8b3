"""Collectives in a lower-precision wire dtype: ZeRO++'s quantized weights and gradients.

    from dtrain import comm
    comm.quantized_all_gather(shard, "int8", group=g, out=full)         # qwZ: weights
    h = comm.quantized_reduce_scatter(grad, "int8", op="avg", group=g,
                                      residual=kept, async_op=True)     # qgZ: gradients
    mine = h.wait()                                                     # this rank's shard
    comm.quantized_bytes("reduce_scatter", "int8", grad.numel(), g.size)  # = comm.traffic's

ZeRO++ (Wang et al., 2023) cuts ZeRO's traffic by sending weights and gradients in fewer
bits than they are computed in: qwZ all-gathers weights as int8 with a scale per block,
qgZ reduce-scatters gradients by quantizing each destination's chunk, exchanging the
chunks by all-to-all and summing them dequantized, in full precision, on the rank that
keeps the shard (never summing in int8, whose range a sum of n values overflows). These
are those two collectives, for any wire dtype (`WireDtype`):

- `int8`: one fp32 scale per block of `block` elements, absmax / 127; q = round(x /
  scale), symmetric. Each element errs by at most scale / 2 = absmax / 254 of its block.
- `fp8`: float8_e4m3fn with one fp32 scale per block mapping its absmax to the format's
  largest value, 448. e4m3 keeps 3 mantissa bits: an element errs by at most 2^-4 of
  itself, and those the scaling puts among e4m3's subnormals (below 2^-6 x scale) by at
  most 2^-10 x scale: |error| <= |x| / 16 + absmax / 458752.
- `bf16`, `fp16`, `fp32`: plain casts (bf16 errs by at most 2^-8 of each element; fp16
  by 2^-11, and overflows beyond 65504).

A block's values and its scale travel in one byte message per rank (`pack`), so one
collective carries both. The scales cost 4 / `block` bytes per element: 1.6% at the
default block of 256, small enough that a block can be short, and the shorter the block
the closer its scale fits its values (one outlier spoils its own block only).

Bytes one rank sends (`quantized_bytes`, exactly what `comm.traffic` counts), for a whole
buffer of N = n s elements over n ranks, with w(s) = s + 4 ceil(s / block) bytes for
int8 and fp8 and s x itemsize for the casts: (n - 1) w(s), under "all_gather" for the
all-gather and under "all_to_all" (int8, fp8) or "reduce_scatter" (casts) for the
reduce-scatter. An fp32 all-gather sends (n - 1) 4 s: int8 sends about a quarter of it.

fp8 needs a GPU that computes in it to be worth training with (`check_wire_dtype`, which
the config layer calls); the functions here run anywhere torch casts to float8, CPUs
included, which is how the tests run them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Generic, Literal, TypeVar, overload

import torch

from dtrain.comm import collectives
from dtrain.comm.ops import ReduceOp, bus_factor, parse_named, same_place
from dtrain.comm.registry import GroupLike, resolve
from dtrain.errors import ConfigError

WireName = Literal["fp32", "bf16", "fp16", "fp8", "int8"]
"""The names of the wire dtypes, as the `[comm]` keys take them."""

DEFAULT_BLOCK = 256
"""Elements per scale: the scales cost 1.6% of int8's bytes, and an outlier coarsens the
quantization of 255 neighbours only."""

SCALE_BYTES = 4
"""Each block's scale is one fp32."""

FP8_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with FP8 tensor cores (Ada: L4, RTX 4090;
Hopper: H100, H200 are 9.0)."""

_R = TypeVar("_R")


class WireDtype(enum.Enum):
    """What a collective's values travel as: blockwise-scaled int8 or fp8, or a plain cast."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"

    @classmethod
    def parse(cls, wire: WireDtype | str) -> WireDtype:
        """The wire dtype `wire` names.

        Raises:
            ValueError: an unknown name (the message lists the known ones).
        """
        return parse_named(cls, wire, "wire dtype")

    @property
    def blockwise(self) -> bool:
        """Whether values travel scaled per block (int8, fp8) rather than merely cast."""
        return self in (WireDtype.INT8, WireDtype.FP8)

    @property
    def element(self) -> torch.dtype:
        """The torch dtype of the values on the wire."""
        return _ELEMENTS[self]

    @property
    def itemsize(self) -> int:
        """Bytes per value on the wire (scales not counted)."""
        return torch.empty((), dtype=self.element).element_size()

    @property
    def largest(self) -> float:
        """The code a block's absmax is scaled to: 127 for int8 (symmetric: -128 is never
        used, so negation is exact), 448 for e4m3. Only for the blockwise formats."""
        return 127.0 if self is WireDtype.INT8 else torch.finfo(torch.float8_e4m3fn).max


_ELEMENTS = {
    WireDtype.FP32: torch.float32, WireDtype.BF16: torch.bfloat16,
    WireDtype.FP16: torch.float16, WireDtype.FP8: torch.float8_e4m3fn,
    WireDtype.INT8: torch.int8,
}
_BLOCKWISE_ELEMENTS = (torch.int8, torch.float8_e4m3fn)


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive integer (elements per scale)")


def _parts(rows: torch.Tensor, block: int) -> list[tuple[torch.Tensor, slice]]:
    """`rows` (count x s, its last dim contiguous) as views count x blocks x elements:
    the whole blocks, then the short last block if s is not a multiple of `block`; each
    with the slice of the block columns (scales) it spans. Views, never padded copies."""
    count, s = rows.shape
    whole = s // block
    parts = [(rows[:, : whole * block].view(count, whole, block), slice(0, whole))]
    if s > whole * block:
        parts.append((rows[:, whole * block :].unsqueeze(1), slice(whole, whole + 1)))
    return parts


def quantize(rows: torch.Tensor, wire: WireDtype | str,
             block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `rows` (count x s, any float dtype) in `wire`: its values (count x s,
    of `wire.element`) and fp32 scales (count x ceil(s / block); count x 0 for a cast).

    Each row is cut into blocks of `block` elements from its start, the last one shorter
    when s is not a multiple. A block's scale is its absmax / `wire.largest`; an all-zero
    block gets scale 0 and codes 0. int8 rounds to nearest; fp8 rounds as torch casts
    (nearest, ties to even), its codes clamped to +-448 first (CUDA turns what is beyond
    into NaN, and x / scale may pass 448 by a rounding).

    Raises:
        ValueError: `rows` is not 2-D, an unknown wire dtype, or a bad block.
    """
    wire = WireDtype.parse(wire)
    _check_block(block)
    if rows.dim() != 2:
        raise ValueError(f"quantize takes rows (count x elements), not shape {list(rows.shape)}")
    if not wire.blockwise:
        return rows.to(wire.element), rows.new_empty((rows.shape[0], 0), dtype=torch.float32)
    x = rows.contiguous().float()
    count, s = x.shape
    values = torch.empty(count, s, dtype=wire.element, device=x.device)
    scales = torch.empty(count, math.ceil(s / block), dtype=torch.float32, device=x.device)
    for (part, columns), (codes, _) in zip(_parts(x, block), _parts(values, block),
                                           strict=True):
        scale = part.abs().amax(dim=2) / wire.largest
        scales[:, columns] = scale
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block
        scaled = part / safe.unsqueeze(2)
        if wire is WireDtype.INT8:
            codes.copy_(torch.round(scaled).clamp_(-wire.largest, wire.largest))
        else:
            codes.copy_(scaled.clamp_(-wire.largest, wire.largest))
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, block: int = DEFAULT_BLOCK,
               dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """`quantize` undone: `values` (count x s) times their blocks' `scales`, computed in
    fp32 and written as `dtype` (into `out`, count x s, when given); returns the result.
    Values of a plain cast (no scales) are cast to `dtype`."""
    if out is None:
        out = torch.empty(values.shape, dtype=dtype, device=values.device)
    if values.dtype not in _BLOCKWISE_ELEMENTS:
        return out.copy_(values)
    if values.dtype != torch.int8:  # float8 takes part in no arithmetic (type promotion)
        values = values.float()
    for (codes, columns), (result, _) in zip(_parts(values, block), _parts(out, block),
                                             strict=True):
        torch.mul(codes, scales[:, columns].unsqueeze(2), out=result)
    return out


def pack(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One byte row per row of `values`: its values' bytes, then its scales' (so that one
    collective carries both, instead of two)."""
    return torch.cat([values.contiguous().view(torch.uint8),
                      scales.contiguous().view(torch.uint8)], dim=1)


def unpack(rows: torch.Tensor, numel: int,
           wire: WireDtype | str) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack` undone: each byte row's `numel` values in `wire` (views of `rows`) and its
    fp32 scales."""
    wire = WireDtype.parse(wire)
    size = numel * wire.itemsize
    values = rows[:, :size].view(wire.element)
    return values, rows[:, size:].contiguous().view(torch.float32)


def message_bytes(numel: int, wire: WireDtype | str, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of `pack`'s row for `numel` elements: numel + 4 ceil(numel / block) for int8
    and fp8, numel x itemsize for a cast."""
    wire = WireDtype.parse(wire)
    scales = SCALE_BYTES * math.ceil(numel / block) if wire.blockwise else 0
    return numel * wire.itemsize + scales


def sent_bytes(collective: str, whole_bytes: int, n_ranks: int) -> int:
    """Bytes one rank sends in `collective` of `whole_bytes`, as `comm.traffic` counts."""
    return int(bus_factor(collective, n_ranks) * whole_bytes) if n_ranks > 1 else 0


def quantized_bytes(collective: Literal["all_gather", "reduce_scatter"],
                    wire: WireDtype | str, numel: int, ranks: int,
                    block: int = DEFAULT_BLOCK) -> int:
    """Bytes one rank sends in `quantized_all_gather` or `quantized_reduce_scatter` of a
    whole buffer of `numel` elements (the all-gather's `out`, the reduce-scatter's input)
    over `ranks` ranks, exactly as `comm.traffic` counts them: (n - 1) x the message of
    one shard of s = numel / n elements (`message_bytes`), 0 for one rank.

    Raises:
        ValueError: `numel` does not divide by `ranks`, or an unknown collective.
    """
    if collective not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"quantized_bytes: {collective!r} is not all_gather or reduce_scatter")
    if numel % ranks:
        raise ValueError(f"quantized_bytes: {numel} elements do not split into {ranks} "
                         "equal shards")
    wire = WireDtype.parse(wire)
    underneath = "all_to_all" if collective == "reduce_scatter" and wire.blockwise else collective
    return sent_bytes(underneath, ranks * message_bytes(numel // ranks, wire, block), ranks)


def check_wire_dtype(dtype: WireDtype | str, device: torch.device | str,
                     key: str = "comm.gather_dtype/comm.reduce_dtype") -> None:
    """Refuse a wire dtype this rank's `device` cannot train with: fp8 anywhere but a CUDA
    GPU of compute capability >= 8.9. `key` names the setting in the message.

    Raises:
        ConfigError: one line naming `key`, what the device is and what to set instead;
            also for an unknown name.
    """
    try:
        wire = WireDtype.parse(dtype)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if wire is not WireDtype.FP8:
        return
    device = torch.device(device)
    fix = "set it to \"int8\" or \"bf16\""
    needs = "needs a GPU with FP8 (compute capability >= 8.9: H100, H200, L4, RTX 4090)"
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"{key} = \"fp8\" {needs}; this run computes on {device.type}: {fix}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"{key} = \"fp8\" {needs}; this machine has "
                          f"{torch.cuda.get_device_name(device)} (compute capability "
                          f"{capability[0]}.{capability[1]}): {fix}")


class Decoding(Generic[_R]):
    """Handle of a quantized collective: `wait()` waits for the collective beneath, decodes
    what arrived into the result, and returns it (the same result on every later call)."""

    def __init__(self, finish: Callable[[], _R]) -> None:
        self._finish: Callable[[], _R] | None = finish
        self._result: _R | None = None

    def wait(self) -> _R:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        return self._result  # type: ignore[return-value]  # set above, of type _R


def _described(tensor: torch.Tensor) -> str:
    """A tensor's dtype and shape, and whether it is not contiguous, for an error message."""
    return (f"{tensor.dtype} {list(tensor.shape)}"
            f"{'' if tensor.is_contiguous() else ', not contiguous'}")


def _ready(pending: Decoding[_R], async_op: bool) -> _R | Decoding[_R]:
    """The handle when asked for one (`async_op`), else its result, waited for now."""
    return pending if async_op else pending.wait()


@overload
def quantized_all_gather(shard: torch.Tensor, wire: WireDtype | str, group: GroupLike = ...,
                         async_op: Literal[False] = ..., algorithm: str = ...,
                         out: torch.Tensor | None = ..., block: int = ...,
                         exact_own: bool = ...) -> torch.Tensor: ...
@overload
def quantized_all_gather(shard: torch.Tensor, wire: WireDtype | str, group: GroupLike = ...,
                         *, async_op: Literal[True], algorithm: str = ...,
                         out: torch.Tensor | None = ..., block: int = ...,
                         exact_own: bool = ...) -> Decoding[torch.Tensor]: ...
@overload
def quantized_all_gather(shard: torch.Tensor, wire: WireDtype | str, group: GroupLike = ...,
                         async_op: bool = ..., algorithm: str = ...,
                         out: torch.Tensor | None = ..., block: int = ...,
                         exact_own: bool = ...) -> torch.Tensor | Decoding[torch.Tensor]: ...


def quantized_all_gather(shard: torch.Tensor, wire: WireDtype | str, group: GroupLike = None,
                         async_op: bool = False, algorithm: str = "auto",
                         out: torch.Tensor | None = None, block: int = DEFAULT_BLOCK,
                         exact_own: bool = False) -> torch.Tensor | Decoding[torch.Tensor]:
    """`comm.all_gather` with the shards sent in `wire`: every rank's `shard` (the same
    number of elements on each), in rank order, dequantized into `out`; returns `out`.

    Each rank quantizes its shard (blocks counted from the shard's start, the last one
    short when the shard is not a multiple of `block`), the packed bytes are all-gathered
    (`algorithm`: comm.all_gather's), and each rank's part is dequantized into `out` at
    `wait()`, one part at a time (no whole-size temporary). Where nothing would be lost (a
    cast to the shard's and `out`'s own dtype) it is `comm.all_gather` itself. A group of
    one (or an empty shard) copies the shard, exactly, and sends nothing.

    Args:
        shard: this rank's part, contiguous, any float dtype; read during the call (it may
            change once this returns).
        wire: what the values travel as (`WireDtype` or its name).
        out: where the whole goes: contiguous, float, of n x shard's elements (a new
            tensor shaped as comm.all_gather's, in the shard's dtype, when None).
        block: elements per scale (int8, fp8).
        exact_own: this rank's part of `out` gets the shard itself rather than its
            quantized copy: more accurate, and what an all-gather in place (the shard
            being that part, ZeRO's master) needs; the ranks' `out` then differ, each in
            its own part, by that part's quantization error. Default: every rank's `out`
            is the same, bit for bit.
        async_op: return a `Decoding` whose `wait()` decodes and returns `out`.

    Raises:
        ValueError: an unknown wire dtype, a bad block, a shard or `out` not as above, or
            the shard is `out`'s own part (in place) with a lossy wire and not `exact_own`
            (its quantized copy would overwrite it).
    """
    wire = WireDtype.parse(wire)
    _check_block(block)
    g = resolve(group)
    if not shard.is_floating_point() or not shard.is_contiguous():
        raise ValueError(f"quantized_all_gather: the shard must be a contiguous float tensor, "
                         f"not {_described(shard)}")
    s = shard.numel()
    if out is None:
        shape = (g.size * shard.shape[0], *shard.shape[1:]) if shard.dim() else (g.size,)
        out = torch.empty(shape, dtype=shard.dtype, device=shard.device)
    elif (out.numel() != g.size * s or not out.is_floating_point()
          or not out.is_contiguous()):
        raise ValueError(f"quantized_all_gather(out=): a contiguous float tensor of "
                         f"{g.size} x {s} elements is needed, got {_described(out)}")
    whole = out
    parts = out.view(g.size, s)
    if g.size == 1 or s == 0:  # nothing to send (comm.all_gather sends nothing either)
        if not same_place(parts[0], shard.view(-1)):
            parts[0].copy_(shard.view(-1))
        return _ready(Decoding(lambda: whole), async_op)
    if not wire.blockwise and wire.element == shard.dtype == out.dtype:
        gathered = collectives.all_gather(shard.view(-1), group=g, async_op=True,
                                          algorithm=algorithm, out=out.view(-1))

        def done() -> torch.Tensor:
            gathered.wait()
            return whole

        return _ready(Decoding(done), async_op)
    in_place = same_place(parts[g.rank], shard.view(-1))
    if in_place and not exact_own:
        raise ValueError("quantized_all_gather: the shard is out's own part (in place) and "
                         f"{wire.value} would overwrite it with its quantized copy: pass "
                         "exact_own=True")
    packed = pack(*quantize(shard.view(1, s), wire, block))
    if exact_own and not in_place:
        parts[g.rank].copy_(shard.view(-1))
    arriving = collectives.all_gather(packed.view(-1), group=g, async_op=True,
                                      algorithm=algorithm)

    def decode() -> torch.Tensor:
        width = message_bytes(s, wire, block)
        values, scales = unpack(arriving.wait().view(g.size, width), s, wire)
        for r in range(g.size):
            if r != g.rank or not exact_own:
                dequantize(values[r : r + 1], scales[r : r + 1], block,
                           out=parts[r : r + 1])
        return whole

    return _ready(Decoding(decode), async_op)


@overload
def quantized_reduce_scatter(tensor: torch.Tensor, wire: WireDtype | str,
                             op: ReduceOp | str = ..., group: GroupLike = ...,
                             async_op: Literal[False] = ..., algorithm: str = ...,
                             block: int = ..., residual: torch.Tensor | None = ...
                             ) -> torch.Tensor: ...
@overload
def quantized_reduce_scatter(tensor: torch.Tensor, wire: WireDtype | str,
                             op: ReduceOp | str = ..., group: GroupLike = ..., *,
                             async_op: Literal[True], algorithm: str = ...,
                             block: int = ..., residual: torch.Tensor | None = ...
                             ) -> Decoding[torch.Tensor]: ...
@overload
def quantized_reduce_scatter(tensor: torch.Tensor, wire: WireDtype | str,
                             op: ReduceOp | str = ..., group: GroupLike = ...,
                             async_op: bool = ..., algorithm: str = ...,
                             block: int = ..., residual: torch.Tensor | None = ...
                             ) -> torch.Tensor | Decoding[torch.Tensor]: ...


def quantized_reduce_scatter(tensor: torch.Tensor, wire: WireDtype | str,
                             op: ReduceOp | str = "sum", group: GroupLike = None,
                             async_op: bool = False, algorithm: str = "auto",
                             block: int = DEFAULT_BLOCK, residual: torch.Tensor | None = None
                             ) -> torch.Tensor | Decoding[torch.Tensor]:
    """`comm.reduce_scatter` with the values sent in `wire`: this rank's shard (elements
    [r s, (r + 1) s) of the flattened `tensor`, s = numel / n) of the sum or average over
    the group, in `tensor`'s dtype.

    int8 and fp8, as ZeRO++'s qgZ: each destination's chunk is quantized (blocks counted
    from the chunk's start), the chunks exchanged by `comm.all_to_all`, and at `wait()`
    the n chunks received are dequantized and summed in fp32 (then divided by n for
    "avg"). Each of rank i's elements errs by its block's bound (module docstring), so the
    average errs by at most the mean over ranks of those bounds: for int8, mean_i absmax_i
    / 254, absmax_i that of rank i's block holding the element. `algorithm`: a choice of
    comm.all_to_all's ("native", "pairwise"), else that collective's "auto".

    Casts (bf16, fp16, fp32): `comm.reduce_scatter` of the cast tensor (`algorithm`:
    its), which sums in the wire dtype: with unit roundoff u (bf16 2^-8) the average errs
    by at most about (n + 1) u mean_i |x_i|. A cast to `tensor`'s own dtype without
    residual is comm.reduce_scatter itself.

    Error feedback (Seide et al. 2014; Karimireddy et al. 2019): with `residual`, what the
    quantization (or cast) of this rank's values dropped is not lost but delayed. The call
    sends tensor + residual and leaves in `residual` (in place, before it returns) what
    that lost on the way; the next call sends it. Summed over steps, what the ranks
    received differs from what they meant to send by the last residuals only: one step's
    quantization error, not a sum of them.

    Args:
        tensor: this rank's whole flat buffer (any shape, contiguous, float), of a length
            the group size divides (ZeRO pads its units so). Read during the call.
        wire: what the values travel as (`WireDtype` or its name).
        op: "sum" or "avg".
        block: elements per scale (int8, fp8).
        residual: fp32, as many elements as `tensor`, contiguous, on its device; zeros
            at first. Kept by the caller per buffer (and in its checkpoint).
        async_op: return a `Decoding` whose `wait()` returns the shard.

    Raises:
        ValueError: an unknown wire dtype or op, an op other than sum and avg, a bad
            block, or `tensor` or `residual` not as above.
    """
    wire = WireDtype.parse(wire)
    op = ReduceOp.parse(op)
    _check_block(block)
    g = resolve(group)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"quantized_reduce_scatter: op {op.value!r} is not sum or avg")
    if not tensor.is_floating_point() or not tensor.is_contiguous() or tensor.numel() % g.size:
        raise ValueError(f"quantized_reduce_scatter: a contiguous float tensor of a length "
                         f"{g.size} ranks divide is needed, not {_described(tensor)}")
    if residual is not None and (residual.dtype != torch.float32
                                 or residual.numel() != tensor.numel()
                                 or not residual.is_contiguous()
                                 or residual.device != tensor.device):
        raise ValueError(f"quantized_reduce_scatter(residual=): a contiguous fp32 tensor of "
                         f"{tensor.numel()} elements on {tensor.device} is needed, got "
                         f"{_described(residual)} on {residual.device}")
    flat, n = tensor.view(-1), g.size
    s = flat.numel() // n
    if n == 1 or s == 0:  # nothing sent, nothing dropped: the residual is delivered now
        mine = flat.clone()
        if residual is not None:
            mine += residual.view(-1)
            residual.zero_()
        return _ready(Decoding(lambda: mine), async_op)
    if residual is None and not wire.blockwise and wire.element == tensor.dtype:
        summing = collectives.reduce_scatter(flat, op=op, group=g, async_op=True,
                                             algorithm=algorithm)
        return _ready(Decoding(summing.wait), async_op)
    sending = flat
    if residual is not None:
        sending = flat.float() + residual.view(-1)
    if not wire.blockwise:
        cast = sending.to(wire.element)
        if residual is not None:
            torch.sub(sending, cast, out=residual.view(-1))
        summing = collectives.reduce_scatter(cast, op=op, group=g, async_op=True,
                                             algorithm=algorithm)
        return _ready(Decoding(lambda: summing.wait().to(tensor.dtype)), async_op)
    values, scales = quantize(sending.view(n, s), wire, block)
    if residual is not None:
        torch.sub(sending, dequantize(values, scales, block).view(-1), out=residual.view(-1))
    exchange = algorithm if algorithm in collectives.AVAILABLE["all_to_all"] else "auto"
    arriving = collectives.all_to_all(pack(values, scales).view(-1), group=g, async_op=True,
                                      algorithm=exchange)

    def decode() -> torch.Tensor:
        width = message_bytes(s, wire, block)
        got_values, got_scales = unpack(arriving.wait().view(n, width), s, wire)
        total = dequantize(got_values[:1], got_scales[:1], block)
        chunk = torch.empty_like(total)
        for r in range(1, n):
            total += dequantize(got_values[r : r + 1], got_scales[r : r + 1], block, out=chunk)
        if op is ReduceOp.AVG:
            total /= n
        return total.view(-1).to(tensor.dtype)

    return _ready(Decoding(decode), async_op)

