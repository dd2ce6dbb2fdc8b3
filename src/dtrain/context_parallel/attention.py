"""Attention over a sequence split between the ranks of a context-parallel group.

Each rank holds its two chunks of every sequence (dtrain.context_parallel.chunks): its
queries, keys and values are (batch, heads, 2c, head dim) for chunks of c tokens. Three
ways to attend over the whole sequence (`METHODS`):

- "ring": the key/value blocks go around the ring, one step per rank, each sent on while
  the block in hand is computed; each step's partial result is merged with the others by
  its log-sum-exp (the online softmax). With the zigzag chunks, a block from an earlier
  rank meets every local query with its first chunk only, and one from a later rank only
  the second local chunk, with all its keys: each step is half a block, on every rank.
  Backward goes round again: each block's key and value gradients travel with it and
  arrive at its owner at the end. Nothing but the local block and the one in flight is
  held at once. Each step's computation is a "cp ring step" span on the timeline, beside
  the sends and receives in flight.
- "allgather": the keys and values are all-gathered once (small with grouped-query
  attention: Llama 3's choice) and the local queries attend over them under the causal
  mask of the global positions; backward reduce-scatters their gradients.
- "alltoall" (DeepSpeed-Ulysses): an all-to-all turns the sequence shards of q, k and v
  into head shards of the whole sequence, attention runs as usual on a rank's heads, and
  another all-to-all turns the output back. The query and key/value heads must divide
  by the group size.

Packed documents (dtrain.models.rows) follow the chunks: given each local token's
place in its document (its `positions`), a query at global position i whose
document began at i - p attends to the keys at global positions j with i - p <= j <= i,
whatever rank holds them. The ring skips a block in which no local query sees a key, and
computes the others under that mask (by the plain formulas, the fused kernel taking no
mask); all-gather builds the same mask against the gathered keys; all-to-all gathers the
positions of the whole sequence and builds the block-causal mask over it.

Values may be narrower or wider than queries and keys (multi-head latent attention's,
dtrain.models.mla: keys of qk_nope + qk_rope per head, values of v_head_dim): the ring
sends each block's keys and values concatenated on their last dimension, one message per
step, and all-gather and all-to-all move them as two tensors. Latent attention exchanges
its decompressed per-head keys and values, not its latent: the latent (kv_lora_rank +
qk_rope_head_dim per token) is smaller to send, but every rank would then decompress every
other chunk's latent through kv_b_proj, at every step of the ring and again in backward,
and the core would have to know the model's projection; the per-head exchange keeps the
core a plain attention.

The ring computes its blocks in float32 (float64 inputs in float64) and returns the input
dtype: each block by torch's fused CPU attention, which returns the log-sum-exp the merge
needs, and whose backward takes the whole attention's output and log-sum-exp (so a block's
gradients are its share of the whole's); by the plain formulas where that kernel is
missing (another device, or values not as wide as keys). The other two methods call
torch's scaled_dot_product_attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dtrain import comm, timeline
from dtrain.context_parallel.chunks import every_position, positions
from dtrain.context_parallel.exchange import all_to_all, gather_sequence
from dtrain.errors import ConfigError
from dtrain.graph_break import graph_break
from dtrain.masks import document_mask, visible_keys
from dtrain.mesh.dims import CP_METHODS

METHODS = CP_METHODS  # the mesh's vocabulary: Dims.cp_method is one of them
Ctx = torch.autograd.function.FunctionCtx
KV_TAG, GRAD_TAG = 7101, 7102  # the ring's messages: blocks, and their gradients


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel group (any group dtrain.comm takes: `mesh.group("cp")`) and its
    attention method.

    Raises:
        ConfigError: an unknown method.
    """

    group: comm.Group
    method: str = "ring"

    def __post_init__(self) -> None:
        object.__setattr__(self, "group", comm.resolve(self.group))  # a torch group too
        if self.method not in METHODS:
            raise ConfigError(f"parallel.cp_method = {self.method!r} is unknown: use one of "
                              f"{', '.join(METHODS)}")

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def positions(self, local: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions of this rank's `local` tokens."""
        return positions(local, self.rank, self.size, device)

    @graph_break
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool = True, scale: float | None = None,
                  documents: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T * scale) v over the whole sequence for this rank's queries
        (batch, heads, 2c, dim); k and v may have fewer heads (grouped-query attention).
        `documents`: each local token's place in its packed document (batch, 2c), which
        then bounds what it sees (see the module doc).

        Raises:
            ConfigError: "alltoall" with heads that do not divide by the group size.
        """
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if documents is not None and self.size == 1:
            return _sdpa(q, k, v, False, scale, document_mask(documents))
        if self.size == 1:
            return _sdpa(q, k, v, causal, scale)
        starts = None
        if documents is not None:  # each query's document's first global position
            starts = self.positions(q.shape[2], q.device)[None, :] - documents
        if self.method == "ring":
            return _Ring.apply(q, k, v, self.group, causal, scale, starts)
        if self.method == "allgather":
            return self._allgather(q, k, v, causal, scale, starts)
        return self._alltoall(q, k, v, causal, scale, documents)

    def _allgather(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float, starts: torch.Tensor | None) -> torch.Tensor:
        k, v = gather_sequence(k, self.group), gather_sequence(v, self.group)
        mask = None
        if causal:
            local = q.shape[2]
            keys = every_position(local, self.size, q.device)
            mask = visible_keys(self.positions(local, q.device), keys, starts)
        k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def _alltoall(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float, documents: torch.Tensor | None = None) -> torch.Tensor:
        for what, heads in (("query", q.shape[1]), ("key/value", k.shape[1])):
            if heads % self.size:
                raise ConfigError(f"parallel.cp_method = \"alltoall\" splits the heads over "
                                  f"cp = {self.size}, which does not divide the {heads} "
                                  f"{what} heads this rank holds: use cp_method = \"ring\" "
                                  "or \"allgather\"")
        q, k, v = (all_to_all(t, self.group, split=1, cat=2) for t in (q, k, v))
        local = q.shape[2] // self.size  # the sequence in rank order, each rank's tokens
        order = every_position(local, self.size, q.device).argsort()
        back = order.argsort()
        q, k, v = (t[:, :, order] for t in (q, k, v))
        mask = None
        if documents is not None:  # the whole sequence's places, in order
            every = comm.all_gather(documents.contiguous(), group=self.group)
            whole = every.view(self.size, *documents.shape).permute(1, 0, 2).reshape(
                documents.shape[0], -1)[:, order]
            mask = document_mask(whole)
        out = _sdpa(q, k, v, causal and mask is None, scale, mask)[:, :, back]
        return all_to_all(out, self.group, split=2, cat=1)


def positions_of(cp: ContextParallel | None, t: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The positions of the `t` tokens a model's blocks see: 0..t-1, or under context
    parallelism (`cp` given) those of this rank's chunks in the whole sequence."""
    return torch.arange(t, device=device) if cp is None else cp.positions(t, device)


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that share each."""
    group = heads // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand`: the query heads' gradients summed per key/value head."""
    b, heads, t, d = grad.shape
    group = heads // kv_heads
    return grad if group == 1 else grad.view(b, kv_heads, group, t, d).sum(2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
          scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, _expand(k, q.shape[1]), _expand(v, q.shape[1]),
                                          is_causal=causal, scale=scale, attn_mask=mask)


def _part(step: int, rank: int, size: int, local: int, causal: bool
          ) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) that meet at ring step `step` on `rank`: the block
    in hand is that of rank (rank - step) mod size. Step 0 (its own block) is causal: the
    local tokens' positions increase, so the mask is the lower triangle. An earlier rank's
    first chunk is before every local query, its second after them all; a later rank's
    chunks are all before the second local chunk and after the first."""
    whole, half = slice(0, local), local // 2
    if not causal:
        return whole, whole, False
    owner = (rank - step) % size
    if owner == rank:
        return whole, whole, True
    if owner < rank:
        return whole, slice(0, half), False
    return slice(half, local), whole, False


def _fused(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's fused CPU attention (which returns the log-sum-exp, forward and
    backward) computes ring blocks here: on the CPU in float32 and float64, where this
    torch has it; otherwise the blocks use the plain formulas (tests check both against
    scaled_dot_product_attention). The kernel takes one head size: values not as wide as
    keys (latent attention's) take the plain formulas too (the ring checks)."""
    kernels = ("_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward")
    return (device_type == "cpu" and dtype in (torch.float32, torch.float64)
            and all(hasattr(torch.ops.aten, k) for k in kernels))


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
            visible: torch.Tensor | None = None) -> torch.Tensor:
    """q k^T * scale, the upper triangle -inf when `causal`, or what `visible` hides
    (the plain formulas)."""
    s = q @ k.transpose(-2, -1) * scale
    if visible is not None:
        return s.masked_fill(~visible, float("-inf"))
    if not causal:
        return s
    return s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(),
                         float("-inf"))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
             fused: bool, visible: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and log-sum-exp per query (k and v have q's heads); a
    query that sees no key of the block gets 0 and a log-sum-exp of -inf."""
    if fused and visible is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse
    s = _scores(q, k, causal, scale, visible)
    lse = s.logsumexp(-1)
    return (torch.exp(s - lse[..., None]) @ v).nan_to_num(0.0), lse


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, fused: bool,
              visible: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the q, k and v gradients, given the whole attention's output
    and log-sum-exp for these queries (so each block's probabilities are final ones)."""
    if fused and visible is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    p = torch.exp(_scores(q, k, causal, scale, visible) - lse[..., None])
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout


class _RingCtx(Ctx):
    """_Ring's ctx as its forward fills it (torch types a ctx as a bare FunctionCtx)."""

    saved_tensors: tuple[torch.Tensor, ...]
    group: comm.Group
    causal: bool
    scale: float
    starts: torch.Tensor | None


def _block_mask(starts: torch.Tensor | None, step: int, rank: int, size: int, local: int,
                rows: slice, cols: slice, device: torch.device) -> torch.Tensor | None:
    """Which of the block's keys (`cols` of the block in hand at `step`) the local queries
    `rows` see, with documents' `starts`: (batch, 1, rows, cols); None without."""
    if starts is None:
        return None
    owner = (rank - step) % size
    queries = positions(local, rank, size, device)[rows]
    keys = positions(local, owner, size, device)[cols]
    return visible_keys(queries, keys, starts[:, rows])


class _Ring(torch.autograd.Function):
    """Ring attention, forward and backward (see the module doc)."""

    @staticmethod
    def forward(ctx: _RingCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: comm.Group, causal: bool, scale: float,
                starts: torch.Tensor | None = None) -> torch.Tensor:
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        widths = (k.shape[-1], v.shape[-1])
        fused = _fused(q.device.type, work) and widths[0] == widths[1]
        size, rank, local, heads = group.size, group.rank, q.shape[2], q.shape[1]
        qw = q.to(work)
        out = torch.zeros(*q.shape[:3], widths[1], dtype=work, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=work, device=q.device)
        block = _kv_block(k, v, work)
        for step in range(size):
            pending = _pass_on(block, group, KV_TAG) if step < size - 1 else None
            rows, cols, masked = _part(step, rank, size, local, causal)
            visible = _block_mask(starts, step, rank, size, local, rows, cols, q.device)
            if visible is not None and not visible.any():  # no query sees this block
                if pending is not None:
                    block = pending()
                continue
            with timeline.span("cp ring step", "cp", step=step, backward=False):
                kb, vb = (_expand(t[:, :, cols], heads) for t in block.split(widths, -1))
                part_out, part_lse = _forward(qw[:, :, rows], kb, vb, masked, scale, fused,
                                              visible)
                merged = torch.logaddexp(lse[:, :, rows], part_lse)
                # -inf - -inf: neither part has seen a key yet, and both weigh nothing
                out[:, :, rows] = (
                    out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).nan_to_num(0.0)[
                        ..., None]
                    + part_out * torch.exp(part_lse - merged).nan_to_num(0.0)[..., None])
                lse[:, :, rows] = merged
            if pending is not None:
                block = pending()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.starts = group, causal, scale, starts
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: _RingCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        size, rank, local, heads = group.size, group.rank, q.shape[2], q.shape[1]
        work, kv_heads, widths = out.dtype, k.shape[1], (k.shape[-1], v.shape[-1])
        fused = _fused(q.device.type, work) and widths[0] == widths[1]
        qw, dout = q.to(work), grad.to(work).contiguous()
        dq = torch.zeros_like(qw)
        block = _kv_block(k, v, work)
        # the gradient of the block in hand from the ranks before
        arriving: Callable[[], torch.Tensor] | None = None
        for step in range(size):
            pending = _pass_on(block, group, KV_TAG) if step < size - 1 else None
            rows, cols, masked = _part(step, rank, size, local, causal)
            visible = _block_mask(ctx.starts, step, rank, size, local, rows, cols, q.device)
            mine_grad = torch.zeros_like(block)
            if visible is None or visible.any():  # else no query saw this block
                with timeline.span("cp ring step", "cp", step=step, backward=True):
                    kb, vb = (_expand(t[:, :, cols], heads) for t in block.split(widths, -1))
                    dq_part, dk, dv = _backward(dout[:, :, rows], qw[:, :, rows], kb, vb,
                                                out[:, :, rows], lse[:, :, rows], masked,
                                                scale, fused, visible)
                    dq[:, :, rows] += dq_part
                    mine_grad[:, :, cols, :widths[0]] = _fold(dk, kv_heads)
                    mine_grad[:, :, cols, widths[0]:] = _fold(dv, kv_heads)
            carried = mine_grad if arriving is None else arriving() + mine_grad
            arriving = _pass_on(carried, group, GRAD_TAG)  # on with the block, then home
            if pending is not None:
                block = pending()
        assert arriving is not None  # the loop ran at least once (size >= 1)
        dk, dv = arriving().split(widths, -1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _kv_block(k: torch.Tensor, v: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """The keys and values that travel the ring as one tensor (batch, kv heads, tokens,
    key width + value width), in the working dtype: one message per step, whatever the
    two widths (latent attention's values are narrower than its keys); split back by
    `Tensor.split((key width, value width), -1)`."""
    return torch.cat((k, v), dim=-1).to(work)


def _pass_on(t: torch.Tensor, group: comm.Group, tag: int) -> Callable[[], torch.Tensor]:
    """Send `t` to the next rank of the ring and receive the previous rank's into a new
    tensor; returns a callable that waits for both and gives what arrived."""
    size, rank = group.size, group.rank
    arrived = torch.empty_like(t)
    sent = comm.send(t, (rank + 1) % size, group=group, async_op=True, tag=tag)
    got = comm.recv(arrived, (rank - 1) % size, group=group, async_op=True, tag=tag)

    def wait() -> torch.Tensor:
        got.wait()
        sent.wait()
        return arrived

    return wait
