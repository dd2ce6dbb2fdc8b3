"""DataParallel on N ranks equals one process training on the concatenated batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dtrain
from dtrain.data_parallel.buckets import build_buckets
from dtrain.testing import run_ranks

STEPS = 4
PER_RANK = 4


class Net(nn.Module):
    """An MLP with a branch used only on request and a layer never used."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.extra = nn.Linear(8, 3)
        self.never = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        out = self.head(self.body(x))
        return out + self.extra(x) if use_extra else out


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def global_batch(step: int, world_size: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = world_size * PER_RANK * accum
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def uses_extra(rank: int, case: str) -> bool:
    return case == "partly_unused" and rank == 0


def make_optimizer(params, case: str) -> torch.optim.Optimizer:
    if case == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def last_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def train_ranks(case: str, bucket_mb: float, accum: int, algorithm: str = "auto") -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    grad_dtype = "bf16" if case == "bf16" else None
    model = dtrain.DataParallel(make_model(), bucket_mb=bucket_mb, grad_dtype=grad_dtype,
                                algorithm=algorithm)
    opt = make_optimizer(model.parameters(), case)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, world_size, accum)
        mine = slice(rank * PER_RANK * accum, (rank + 1) * PER_RANK * accum)
        xs, ys = x[mine].chunk(accum), y[mine].chunk(accum)
        opt.zero_grad()
        total = 0.0
        for micro in range(accum):
            out = model(xs[micro], use_extra=uses_extra(rank, case))
            loss = nn.functional.cross_entropy(out, ys[micro]) / accum
            if micro < accum - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.item()
        reduced = torch.tensor(total)
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world_size)
        grads = last_grads(model.module)
        opt.step()
    return {"losses": losses, "state": model.state_dict(), "grads": grads}


def bucket_average(grads: list[torch.Tensor | None], dtype: torch.dtype
                   ) -> torch.Tensor | None:
    """The average of the ranks' gradients of one parameter as a bucket in `dtype` makes it,
    written out: each rank's gradient divided by the group size and rounded to `dtype`,
    summed in rank order with a rounding after each addition, cast back to fp32 (None when
    no rank has one). For two ranks the order does not matter: one addition, one rounding."""
    if all(g is None for g in grads):
        return None
    total = None
    for g in grads:
        part = (torch.zeros_like(next(x for x in grads if x is not None)) if g is None
                else g / len(grads)).to(dtype)
        total = part if total is None else (total.float() + part.float()).to(dtype)
    return total.float()


def train_reference(case: str, world_size: int, accum: int) -> dict:
    """One process on the global batch. bf16: each rank's gradient computed apart (its own
    backward) and averaged as DataParallel's bf16 buckets do (`bucket_average`)."""
    model = make_model()
    opt = make_optimizer(model.parameters(), case)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, world_size, accum)
        opt.zero_grad()
        chunks = zip(x.chunk(world_size), y.chunk(world_size), strict=True)
        if case == "bf16":
            parts, per_rank = [], []
            for r, (xr, yr) in enumerate(chunks):
                model.zero_grad()
                part = nn.functional.cross_entropy(model(xr, use_extra=uses_extra(r, case)), yr)
                part.backward()
                parts.append(part.detach())
                per_rank.append(last_grads(model))
            for name, p in model.named_parameters():
                p.grad = bucket_average([g[name] for g in per_rank], torch.bfloat16)
            loss = torch.stack(parts).mean()
        else:
            parts = [nn.functional.cross_entropy(model(xr, use_extra=uses_extra(r, case)), yr)
                     for r, (xr, yr) in enumerate(chunks)]
            loss = torch.stack(parts).mean()
            loss.backward()
        losses.append(loss.item())
        grads = last_grads(model)
        opt.step()
    return {"losses": losses, "state": model.state_dict(), "grads": grads}


def assert_matches(results: list[dict], reference: dict, tol: float | None = None) -> None:
    """Losses, weights and the last step's gradients equal the reference's (within `tol`,
    relative and absolute, if given; float32's default tolerance otherwise)."""
    kw = {} if tol is None else {"atol": tol, "rtol": tol}
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]),
                                   torch.tensor(reference["losses"]), **kw)
        for name, value in reference["state"].items():
            torch.testing.assert_close(result["state"][name], value, msg=name, **kw)
        for name, grad in reference["grads"].items():
            if grad is None:
                assert result["grads"][name] is None, name
            else:
                torch.testing.assert_close(result["grads"][name], grad, msg=name, **kw)
    first = results[0]["state"]
    for result in results[1:]:  # replicas are bitwise identical
        for name, value in first.items():
            assert torch.equal(result["state"][name], value), name


QUICK = [("plain", 1e-5, 1), ("plain", 25.0, 1), ("plain", 0.002, 3),
         ("partly_unused", 0.002, 1)]
"""(case, bucket_mb, accum) of the quick tests' two-rank trainings: one pair of processes
trains them all, one after the other (a pair's start costs more than its training)."""


def _train_all(cases: list[tuple]) -> list[dict]:
    return [train_ranks(*case) for case in cases]


@pytest.fixture(scope="module")
def trained():
    """`trained(world_size, case, bucket_mb, accum)`: each rank's train_ranks result; the
    QUICK cases on two ranks come from one run_ranks, started at the first request."""
    done: dict[tuple, list[dict]] = {}

    def get(world_size: int, case: str, bucket_mb: float, accum: int) -> list[dict]:
        key = (case, bucket_mb, accum)
        if world_size != 2 or key not in QUICK:
            return run_ranks(train_ranks, world_size, case, bucket_mb, accum)
        if not done:
            ranks = run_ranks(_train_all, 2, QUICK)
            done.update({c: [r[i] for r in ranks] for i, c in enumerate(QUICK)})
        return done[key]

    return get


# Three ranks (a non-power of two) run here with Adam; the middle bucket size, and the
# bucket sizes and features on three ranks, run with `make test-slow`.
@pytest.mark.parametrize("world_size, bucket_mb", [
    (2, 1e-5), pytest.param(2, 0.002, marks=pytest.mark.slow), (2, 25.0),
    pytest.param(3, 25.0, marks=pytest.mark.slow),
    pytest.param(3, 1e-5, marks=pytest.mark.slow), pytest.param(3, 0.002, marks=pytest.mark.slow),
])
def test_equals_single_process(trained, world_size: int, bucket_mb: float) -> None:
    results = trained(world_size, "plain", bucket_mb, 1)
    assert_matches(results, train_reference("plain", world_size, 1))


@pytest.mark.slow
def test_adam_equals_single_process() -> None:
    results = run_ranks(train_ranks, 3, "adam", 0.002, 1)
    assert_matches(results, train_reference("adam", 3, 1))


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_no_sync_accumulation_equals_large_batch(trained, world_size: int) -> None:
    results = trained(world_size, "plain", 0.002, 3)
    assert_matches(results, train_reference("plain", world_size, 3))


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_parameter_unused_on_some_or_all_ranks(trained, world_size: int) -> None:
    results = trained(world_size, "partly_unused", 0.002, 1)
    reference = train_reference("partly_unused", world_size, 1)
    assert reference["grads"]["never.weight"] is None
    assert reference["grads"]["extra.weight"] is not None
    assert_matches(results, reference)


BF16_TOL = 1e-5
"""bf16 gradients against the one-process reference that rounds them the same way: they
differ by float32 rounding only (a bf16 rounding that float32 noise tipped would show as
one bf16 ulp, 0.4% or more). A gradient not averaged is off by 100%, and one not rounded
to bf16 at all (grad_dtype ignored) by up to half an ulp, 0.2%, which moves even the loss
by 2e-5."""


@pytest.mark.slow
def test_bf16_gradient_communication() -> None:
    results = run_ranks(train_ranks, 2, "bf16", 0.002, 1)
    assert_matches(results, train_reference("bf16", 2, 1), tol=BF16_TOL)


def _different_models() -> None:
    width = 4 + dist.get_rank()
    dtrain.DataParallel(nn.Linear(width, 2))


def test_different_models_on_ranks_named() -> None:
    with pytest.raises(AssertionError, match="rank 1 has a different model than rank 0"):
        run_ranks(_different_models, 2)


class Inverted(nn.Module):
    """Layers registered in the order backward reaches them (the reverse of the usual), so
    the buckets packed at wrap come complete last: DataParallel repacks them after the
    first step in the order it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.last = nn.Linear(6, 3)
        self.middle = nn.Linear(6, 6)
        self.first = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


def _inverted_steps(rank: int, size: int, start: Inverted, grad_dtype: str | None) -> list[dict]:
    model = dtrain.DataParallel(copy.deepcopy(start), bucket_mb=1e-4, grad_dtype=grad_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        model(x.chunk(size)[rank]).pow(2).mean().backward()
        out.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("grad_dtype", [None, pytest.param("bf16", marks=pytest.mark.slow)])
def test_buckets_repacked_in_backwards_order_still_average(grad_dtype: str | None) -> None:
    """Steps before and after the repack equal one process (bf16: within its rounding)."""
    torch.manual_seed(0)
    reference = Inverted()
    start = copy.deepcopy(reference)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        if grad_dtype is None:
            torch.stack([reference(c).pow(2).mean() for c in x.chunk(2)]).mean().backward()
        else:  # each rank's gradient apart, averaged as the bf16 buckets do
            per_rank = []
            for c in x.chunk(2):
                reference.zero_grad()
                reference(c).pow(2).mean().backward()
                per_rank.append({n: p.grad.clone() for n, p in reference.named_parameters()})
            for n, p in reference.named_parameters():
                p.grad = bucket_average([g[n] for g in per_rank], torch.bfloat16)
        expected.append({n: p.grad.clone() for n, p in reference.named_parameters()})
        opt.step()
        opt.zero_grad()
    tol = {} if grad_dtype is None else {"atol": BF16_TOL, "rtol": BF16_TOL}
    for steps in dtrain.testing.run_threads(_inverted_steps, 2, 2, start, grad_dtype):
        for got, want in zip(steps, expected, strict=True):
            for name in want:
                torch.testing.assert_close(got[name], want[name], msg=name, **tol)


def test_buckets_first_and_last_are_small() -> None:
    """The first bucket (launched first) and the last (its all-reduce starts only when
    backward ends, so nothing hides it) hold at most their caps; the rest fill the cap;
    a model that the first bucket nearly holds is not cut further."""
    params = [nn.Parameter(torch.zeros(250)) for _ in range(20)]  # 1000 bytes each in fp32
    sizes = [b.numel * 4 for b in build_buckets(params, 10_000, None, 3_000, 2_000)]
    assert sizes == [3_000, 10_000, 5_000, 2_000]
    assert sum(sizes) == 20_000
    tail = build_buckets(params, 10_000, None, 3_000, 2_000)[-1].params
    assert tail == params[-2:]  # the parameters whose gradients come last
    small = [b.numel * 4 for b in build_buckets(params[:4], 10_000, None, 3_000, 2_000)]
    assert small == [3_000, 1_000]
    assert [b.numel * 4 for b in build_buckets(params, 10_000, None)] == [10_000, 10_000]
