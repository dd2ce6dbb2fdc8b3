"""The collective test matrix, shared by the thread and the process backends.

`exercise(rank, size, cases)` runs every case on one rank and returns its results;
`check(results, size, cases)` compares them with a reference computed locally from the
same deterministic inputs, in plain torch: nothing of dtrain.comm's own reduction or
sharding code (dtrain.comm.ops), whose bugs the reference would share.
"""

from __future__ import annotations

import functools
import itertools

import torch

from dtrain import comm

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64)
REDUCE_OPS = ("sum", "avg", "max", "min", "prod")


def make_input(rank: int, length: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(length, generator=g).to(dtype)
    return torch.randint(-3, 4, (length,), generator=g).to(dtype)


def cases(dtypes, lengths, big_dtypes=(torch.float32,)) -> list[tuple]:
    """(op, algorithm, dtype, length, reduce op, root) for every combination worth running."""
    out = []
    for (op, algorithms), dtype, length in itertools.product(
        comm.AVAILABLE.items(), dtypes, lengths
    ):
        if op == "barrier" or (length > 1000 and dtype not in big_dtypes):
            continue
        reduce_ops = REDUCE_OPS if op in ("all_reduce", "reduce", "reduce_scatter") else ("-",)
        if length > 1000:
            reduce_ops = reduce_ops[:1]
        for algorithm, reduce_op in itertools.product((*algorithms, "auto"), reduce_ops):
            if reduce_op == "prod" and dtype in (torch.bfloat16, torch.float16):
                continue  # a product of several values rounds too far apart between orders
            out.append((op, algorithm, dtype, length, reduce_op, 1 if op != "all_reduce" else 0))
    return out


def exercise(rank: int, size: int, todo: list[tuple], group=None) -> list:
    results = []
    for salt, (op, algorithm, dtype, length, reduce_op, root) in enumerate(todo):
        root %= size
        x = make_input(rank, length, dtype, salt)
        kw = {"group": group, "algorithm": algorithm}
        if op == "all_reduce":
            results.append(comm.all_reduce(x, op=reduce_op, **kw))
        elif op == "reduce":
            results.append(comm.reduce(x, dst=root, op=reduce_op, **kw))
        elif op == "reduce_scatter":
            results.append(comm.reduce_scatter(x, op=reduce_op, **kw))
        elif op == "broadcast":
            results.append(comm.broadcast(x, src=root, **kw))
        elif op == "scatter":
            results.append(comm.scatter(x, src=root, **kw))
        elif op in ("all_gather", "gather", "all_to_all"):
            extra = {"dst": root} if op == "gather" else {}
            results.append(getattr(comm, op)(x, **extra, **kw))
    comm.barrier(group=group)
    return results


def _reduce(inputs: list[torch.Tensor], reduce_op: str) -> torch.Tensor:
    """The inputs combined element by element, in rank order: summed, averaged (an integer
    average truncated toward zero), largest, smallest, or multiplied."""
    if reduce_op == "avg":
        total = _reduce(inputs, "sum")
        if total.is_floating_point():
            return total / len(inputs)
        return torch.div(total, len(inputs), rounding_mode="trunc")
    combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum,
               "prod": torch.mul}[reduce_op]
    return functools.reduce(combine, inputs)


def _shard(flat: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Shard `rank` of `size` contiguous shards of `flat`, the first len % size of them one
    element longer."""
    base, longer = divmod(flat.numel(), size)
    start = rank * base + min(rank, longer)
    return flat[start : start + base + (rank < longer)]


def _tolerance(dtype: torch.dtype, size: int) -> dict:
    if dtype in (torch.bfloat16, torch.float16):
        return {"atol": 0.05 * size, "rtol": 0.05}
    return {}


def expected(size: int, case: tuple, salt: int) -> list[torch.Tensor | None]:
    """Each rank's result of `case` (None where a rank receives nothing), from every rank's
    input made once: the matrix's million-element cases would otherwise make every input
    again for each rank, `size` times the work of the check."""
    op, _algorithm, dtype, length, reduce_op, root = case
    root %= size
    inputs = [make_input(r, length, dtype, salt) for r in range(size)]
    ranks = range(size)
    if op in ("all_reduce", "reduce", "reduce_scatter"):
        combined = _reduce(inputs, reduce_op)
        if op == "all_reduce":
            return [combined] * size
        if op == "reduce":
            return [combined if rank == root else inputs[rank] for rank in ranks]
        return [_shard(combined, rank, size) for rank in ranks]
    if op == "broadcast":
        return [inputs[root]] * size
    if op == "scatter":
        return [_shard(inputs[root], rank, size) for rank in ranks]
    if op == "all_gather":
        return [torch.cat(inputs)] * size
    if op == "gather":
        return [torch.cat(inputs) if rank == root else None for rank in ranks]
    return [torch.cat([_shard(x, rank, size) for x in inputs]) for rank in ranks]  # all_to_all


def check(results: list[list], size: int, todo: list[tuple]) -> None:
    for salt, case in enumerate(todo):
        wants = expected(size, case, salt)
        for rank in range(size):
            got, want = results[rank][salt], wants[rank]
            label = f"{case} on rank {rank} of {size}"
            if want is None:
                assert got is None, label
                continue
            if want.dtype.is_floating_point:
                torch.testing.assert_close(got, want, msg=label, **_tolerance(want.dtype, size))
            else:
                assert torch.equal(got, want), label
        if case[0] == "all_reduce":  # every rank holds bitwise the same result
            for rank in range(1, size):
                assert torch.equal(results[rank][salt], results[0][salt]), case


IN_PLACE_LENGTHS = (7, 1_000_003)


def _in_place_cases() -> list[tuple[str, int]]:
    """(algorithm, length) of each in-place all-gather checked: every algorithm and auto."""
    return list(itertools.product((*comm.AVAILABLE["all_gather"], "auto"), IN_PLACE_LENGTHS))


def all_gather_in_place(rank: int, size: int, group=None) -> list[torch.Tensor]:
    """all_gather with `tensor` this rank's own part of `out` (ZeRO's refresh), by every
    algorithm, async, at a small and a large length: each result."""
    results = []
    for salt, (algorithm, length) in enumerate(_in_place_cases()):
        out = torch.full((size * length,), float("nan"))
        mine = out[rank * length : (rank + 1) * length]
        mine.copy_(make_input(rank, length, torch.float32, salt))
        comm.all_gather(mine, group=group, algorithm=algorithm, async_op=True,
                        out=out).wait()
        results.append(out)
    return results


def check_in_place(results: list[list[torch.Tensor]], size: int) -> None:
    """Every rank's in-place all-gather holds every rank's input, in rank order."""
    for salt, (_, length) in enumerate(_in_place_cases()):
        want = torch.cat([make_input(r, length, torch.float32, salt) for r in range(size)])
        for rank in range(size):
            assert torch.equal(results[rank][salt], want), (salt, rank)
