"""Compiled blocks keep communication behind backward: DataParallel's bucket all-reduces,
ZeRO-2's reduce-scatters and ZeRO-3's backward prefetch complete while backward still
computes, judged from dtrain's own comm timings (each collective's timeline span: its
issue, and `completed_us`, when the transport completed it), not from wall-clock totals.

A compiled block's backward returns all its gradients at its end (dtrain.models.compiled).
Buckets cut inside a block wait for the block's whole backward: the bucket holding most of
the model and a part of the first block started only when backward had ended, and ZeRO-3
prefetched a block's parameters at the next one's first gradient, its last. Each check
fails on that packing and passes when buckets are cut between blocks.

The blocks are compiled with AOTAutograd's "aot_eager" backend: the block's backward is one
graph, as inductor's, without generating code (seconds instead of a minute of compiling).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from dtrain import models
from dtrain.data_parallel import DataParallel, ZeRO
from dtrain.data_parallel.buckets import build_buckets
from dtrain.data_parallel.zero.flat import split_by_size
from dtrain.testing import run_ranks

SHAPE = {"arch": "llama", "n_layer": 4, "n_embd": 192, "n_head": 4, "block_size": 128}
"""Four blocks of 1.8 MB of gradients each: more than the 1 MB last bucket, so a packing
that ignores the blocks cuts the first block (the last in backward) in two."""
VOCAB, PER_RANK, STEPS = 256, 4, 3
ZERO2_BUCKET_MB = 6.0
"""ZeRO-2's units: the last three blocks fit in one (5.3 MB), the first block's gradients
do not: a unit cut by size alone holds part of the first block too."""


# ------------------------------------------------------------------ the packing
def _params(*sizes: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n)) for n in sizes]  # 4 bytes an element


def _ids(groups: list[list[nn.Parameter]]) -> list[list[int]]:
    return [[id(p) for p in group] for group in groups]


def test_buckets_are_cut_between_bursts_and_the_last_takes_the_whole_first_block() -> None:
    """Gradients in backward's order: a head (alone), two compiled blocks of three
    parameters (each a burst), an embedding (alone). The first bucket (cap 3,000 bytes)
    ends before a block it cannot hold whole. By size alone, the bucket before the last
    (cap 1,000 bytes: the embedding) holds the first block (the last in backward) and so
    starts when backward ends; with the bursts that block goes to the last bucket whole,
    and the bucket before holds the second block alone, started when its backward ends,
    while the first block's computes."""
    head, a, b, embed = _params(250), _params(250, 250, 250), _params(250, 250, 250), \
        _params(125)
    params = [*head, *a, *b, *embed]
    block = {id(p): k for k, ps in enumerate((a, b)) for p in ps}
    buckets = build_buckets(params, 10_000, None, 3_000, 1_000,
                            burst=lambda p: block.get(id(p)))
    assert _ids([bucket.params for bucket in buckets]) == _ids([head, a, [*b, *embed]])
    by_size = build_buckets(params, 10_000, None, 3_000, 1_000)  # blind to the bursts
    assert [len(bucket.params) for bucket in by_size] == [3, 4, 1]


def test_two_compiled_blocks_never_share_a_bucket() -> None:
    """Three compiled blocks of 1,000 bytes under a 10,000-byte cap, then an embedding:
    each block goes out in a bucket of its own as its backward ends (by size, the first
    two shared one, sent only once the second's backward had ended too); the embedding,
    whose gradient comes after the last block's, joins that block's bucket. ZeRO's units
    are cut alike."""
    a, b, c, embed = _params(125, 125), _params(125, 125), _params(125, 125), _params(125)
    params = [*a, *b, *c, *embed]
    block = {id(p): k for k, ps in enumerate((a, b, c)) for p in ps}
    buckets = build_buckets(params, 10_000, None, burst=lambda p: block.get(id(p)))
    assert _ids([bucket.params for bucket in buckets]) == _ids([a, b, [*c, *embed]])
    named = [(str(k), p) for k, p in enumerate(params)]
    assert [len(run) for run in split_by_size(named, 10_000, [a, b, c])] == [2, 2, 3]
    assert [len(run) for run in split_by_size(named, 10_000)] == [7]


def test_a_burst_over_the_cap_is_cut_on_its_own() -> None:
    one, big = _params(250), _params(500, 500, 500)
    block = {id(p): 0 for p in big}
    buckets = build_buckets([*one, *big], 4_000, None, burst=lambda p: block.get(id(p)))
    assert _ids([bucket.params for bucket in buckets]) == _ids([one, big[:2], big[2:]])


def test_zero_units_are_cut_between_compiled_blocks() -> None:
    named = [(str(k), p) for k, p in enumerate(_params(200, 300, 300, 300, 100))]
    together = [[p for _, p in named[1:4]]]
    assert [len(run) for run in split_by_size(named, 4_000, together)] == [1, 4]
    assert [len(run) for run in split_by_size(named, 4_000)] == [3, 2]


def test_gradients_together_are_each_compiled_blocks_parameters() -> None:
    from dtrain.models.compiled import compile_blocks, gradients_together

    torch.manual_seed(0)
    model = models.build(models.resolve(models.ModelConfig(**SHAPE), VOCAB))
    assert gradients_together(model) == []
    compile_blocks(model, backend="eager")
    assert _ids(gradients_together(model)) == \
        _ids([list(block.parameters()) for block in model.blocks])


# ------------------------------------------------------------------ the steps, timed
def _model() -> nn.Module:
    from dtrain.models.compiled import compile_blocks

    torch.manual_seed(0)
    model = models.build(models.resolve(models.ModelConfig(**SHAPE), VOCAB))
    compile_blocks(model, backend="aot_eager")
    return model


def _wrap(layout: str) -> tuple[nn.Module, torch.optim.Optimizer | ZeRO]:
    """The compiled model held by `layout`, and what steps it."""
    model = _model()
    sgd = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
    if layout.startswith("dp"):
        held = DataParallel(model, algorithm="ring" if layout == "dp-ring" else "native")
        return held, sgd(held.parameters())
    # gloo's own reduce-scatter says it has completed only when waited for (its work has no
    # future): ZeRO-2's run dtrain's ring, whose completion the timeline sees
    stage = int(layout[-1])
    zero = ZeRO(model, sgd, stage=stage, bucket_mb=ZERO2_BUCKET_MB,
                algorithm="ring" if stage == 2 else "native")
    return zero, zero


def _traced_steps(layouts: tuple[str, ...]) -> dict[str, list[list[dict]]]:
    """Each layout's timeline events of STEPS steps after a first one (which compiles, and
    after which DataParallel repacks its buckets), one list per step."""
    from dtrain import comm, timeline

    rank = comm.resolve(None).rank
    ids = torch.randint(0, VOCAB, (2 * PER_RANK, SHAPE["block_size"] + 1),
                        generator=torch.Generator().manual_seed(0))
    mine = ids.chunk(2)[rank]
    x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    out: dict[str, list[list[dict]]] = {}
    for layout in layouts:
        held, stepper = _wrap(layout)
        out[layout] = []
        for step in range(STEPS + 1):
            recorder = timeline.Recorder("unused.json", rank)  # never closed: nothing written
            comm.barrier()
            timeline.install(recorder if step else None)
            try:
                with timeline.span("forward", "forward"):
                    loss = held(x, y)[1]
                with timeline.span("backward", "backward"):
                    loss.backward()
            finally:
                timeline.install(None)
            stepper.step()
            stepper.zero_grad()
            if step:
                out[layout].append([e for e in recorder.events() if e.get("ph") == "X"])
    return out


def _completed(event: dict) -> float:
    """When the transport completed a collective's span (µs since the epoch)."""
    return event["ts"] + event["args"]["completed_us"]


def _share_done_before_compute_ends(events: list[dict], op: str) -> float:
    """The share of `op`'s bytes whose collective completed before backward's compute
    ended (the "finish backward" span's start: the end-of-backward callback)."""
    end = next(e["ts"] for e in events if e["name"] == "finish backward")
    sent = [e for e in events if e.get("cat") == "comm" and e["name"] == op]
    total = sum(e["args"]["bytes"] for e in sent)
    assert total, f"no {op} in the step"
    return sum(e["args"]["bytes"] for e in sent if _completed(e) <= end) / total


def _prefetch_lead(events: list[dict]) -> float:
    """ZeRO-3: how much of each block's backward the all-gather of the block before it had
    to hide behind, summed: from the gather's issue to when that block needed its
    parameters (a "gather for backward" span's start), over the time between the two
    blocks' needs (the later block's backward). The first block in backward has no
    prefetch and is left out."""
    start = next(e["ts"] for e in events if e["name"] == "backward")
    needs = sorted(e["ts"] for e in events if e["name"] == "gather for backward")
    lead = window = 0.0
    for gather in (e for e in events if e.get("cat") == "comm" and e["name"] == "all_gather"
                   and e["ts"] >= start):
        j = next(j for j, t in enumerate(needs) if t >= gather["ts"])
        if j:
            lead += needs[j] - gather["ts"]
            window += needs[j] - needs[j - 1]
    assert window, "no all-gather prefetched in backward"
    return lead / window


Traced = list[dict[str, list[list[dict]]]]  # per rank: per layout, per step, its events


@pytest.fixture(scope="module")
def traced_dp() -> Traced:
    """DataParallel's traced steps on 2 ranks."""
    return run_ranks(_traced_steps, 2, ("dp",), timeout=240)


@pytest.fixture(scope="module")
def traced_more() -> Traced:
    """The other layouts' traced steps on 2 ranks (one spawn, one compile of the block)."""
    return run_ranks(_traced_steps, 2, ("dp-ring", "zero2", "zero3"), timeout=240)


def _best(traced: Traced, layout: str, share: Callable[[list[dict]], float]) -> float:
    """The largest share over the steps and ranks: a collective completes only once both
    ranks have issued it, so on a loaded machine the rank ahead may finish backward first
    in any one step; the packing that makes every bucket wait for the end never passes."""
    return max(share(events) for rank in traced for events in rank[layout])


def _all_reduced(events: list[dict]) -> float:
    return _share_done_before_compute_ends(events, "all_reduce")


@pytest.mark.timeout(300)
def test_compiled_data_parallel_all_reduces_complete_during_backward(traced_dp: Traced
                                                                     ) -> None:
    """Most of the gradient bytes are all-reduced before backward's compute ends: the
    bucket of the last three blocks starts when the second block's backward ends, hidden
    by the first block's (about 3/4 of the bytes). Cut by size alone, only the first
    bucket (1 MB of 7) could."""
    share = _best(traced_dp, "dp", _all_reduced)
    assert share >= 0.5, f"{share:.0%} of the all-reduced bytes complete before backward ends"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_data_parallel_on_dtrains_ring_thread(traced_more: Traced) -> None:
    """The same with the "ring" all-reduce, which runs on dtrain's own Python thread:
    the compiled backward holds the GIL only between its operations and in inductor's
    fused kernels (its matrix products and attention go through ATen, which lets it go),
    so the thread keeps sending. (This one does not tell the packings apart: on a loaded
    machine the ring's thread can slow the end of backward enough to hide a bucket that
    starts late.)"""
    share = _best(traced_more, "dp-ring", _all_reduced)
    assert share >= 0.5, f"{share:.0%} of the all-reduced bytes complete before backward ends"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_zero2_reduce_scatters_complete_during_backward(traced_more: Traced) -> None:
    share = _best(traced_more, "zero2",
                  lambda events: _share_done_before_compute_ends(events, "reduce_scatter"))
    assert share >= 0.5, f"{share:.0%} of the reduce-scattered bytes complete before " \
                         "backward ends"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_zero3_prefetches_during_the_block_before(traced_more: Traced) -> None:
    """Each block's gather in backward starts as the block after it starts its backward,
    not when that block's gradients (all at once, at its end) arrive: in flight for
    nearly all of that backward, where the prefetch at the first gradient is in flight
    only while the gradients are packed (a tenth to a third of it on a loaded machine)."""
    lead = _best(traced_more, "zero3", _prefetch_lead)
    assert lead >= 0.7, f"the backward all-gathers were in flight for {lead:.0%} of the " \
                        "backward of the block before"
