"""The all-to-all hidden under compute (dtrain.models.moe.overlap): the exchange cut into
chunks of experts, each chunk's all-to-all in flight while another's experts compute,
equals one exchange bit for bit in fp32, forward and backward, whatever the routing."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtrain import timeline
from dtrain.models.moe import MoE, MoEConfig
from dtrain.testing import run_ranks, run_threads

DIM, E = 16, 8
_SEEDED = threading.Lock()  # ranks as threads share torch's generator: one draws at a time


def _layer(shared: int, skew: bool) -> MoE:
    """A MoE layer of 8 experts, top-2; `skew` steers every token to the first 4 experts,
    so that the ranks holding the others (at ep = 2, rank 1) receive no token at all."""
    with _SEEDED:
        torch.manual_seed(0)
        layer = MoE(MoEConfig(n_experts=E, experts_per_token=2, hidden=24,
                              n_shared_experts=shared, router="sigmoid_bias"), DIM)
    nn.init.normal_(layer.gate.weight, std=0.5)  # routing far from uniform: uneven loads
    if skew:
        with torch.no_grad():
            layer.gate.expert_bias.copy_(torch.tensor([10.0] * (E // 2) + [-10.0] * (E // 2)))
    return layer


def _run(base: MoE, rank: int, ep: int, chunks: int, recompute: bool, input_grad: bool
         ) -> dict[str, torch.Tensor]:
    """This rank's output, input gradient (if `input_grad`) and parameter gradients of one
    forward and backward of `base` at ep (the whole group), the exchange in `chunks`
    chunks; and the output of a forward without gradients."""
    layer = copy.deepcopy(base)
    layer.expert_parallel(None, rank, ep, overlap_chunks=chunks)
    x = torch.randn(2, 5 + rank, DIM, generator=torch.Generator().manual_seed(100 + rank))
    x.requires_grad_(input_grad)  # the ranks hold different numbers of tokens
    y = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    with torch.no_grad():
        quiet = layer(x)
    assert (x.grad is not None) == input_grad
    return {"y": y.detach(), "no grad": quiet,
            **({"x.grad": x.grad} if x.grad is not None else {}),
            **{f"{n}.grad": p.grad for n, p in layer.named_parameters() if p.grad is not None}}


def _compare(rank: int, ep: int, chunks: int, shared: int, skew: bool, recompute: bool,
             input_grad: bool = True) -> list[str]:
    base = _layer(shared, skew)
    plain = _run(base, rank, ep, 1, False, input_grad)
    split = _run(base, rank, ep, chunks, recompute, input_grad)
    assert split.keys() == plain.keys()
    return [name for name in plain if not torch.equal(split[name], plain[name])]


@pytest.mark.parametrize(("ep", "chunks"), [(2, 2), (2, 4), (4, 2), (2, 9)],
                         ids=["ep2-2", "ep2-4", "ep4-2", "ep2-more-than-experts"])
@pytest.mark.parametrize("shared", [0, 1], ids=["routed", "shared"])
@pytest.mark.parametrize("skew", [False, True], ids=["uneven", "a-rank-gets-none"])
def test_the_chunked_exchange_equals_one_exchange_bit_for_bit(ep: int, chunks: int,
                                                              shared: int, skew: bool) -> None:
    """On `ep` ranks (threads), each with its own number of tokens routed unevenly (or
    every token to the first half of the experts, so that a rank's experts get none): the
    output, the input's gradient and every parameter's gradient of the chunked exchange are
    the one exchange's, bit for bit (torch.equal in fp32); a forward without gradients
    too. 9 chunks of 4 experts per rank act as 4."""
    for rank, differ in enumerate(run_threads(_compare, ep, ep, chunks, shared, skew, False)):
        assert not differ, f"rank {rank}: {differ} differ"


def test_the_chunked_exchange_recomputed_in_backward_equals_one_exchange() -> None:
    """Under activation checkpointing (recomputed in backward, exchanging again), the
    chunked exchange still gives the one exchange's output and gradients bit for bit."""
    for rank, differ in enumerate(run_threads(_compare, 2, 2, 2, 1, False, True)):
        assert not differ, f"rank {rank}: {differ} differ"


def test_an_input_without_gradient_sends_no_gradient_back() -> None:
    """A layer whose input takes no gradient (everything before it frozen): the experts',
    router's and shared expert's gradients still equal one exchange's, and no rank sends
    the dispatches' gradients back (none waits for them either: no collective is left
    over, the next call's exchanges meet)."""
    for rank, differ in enumerate(run_threads(_compare, 2, 2, 2, 1, False, False, False)):
        assert not differ, f"rank {rank}: {differ} differ"


def _waits(out: str) -> dict:
    """On gloo (processes): the chunked exchange against one, and the timeline's waits
    of each (one span per all-to-all waited for)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    recorder = timeline.Recorder(out, rank)
    timeline.install(recorder)
    try:
        differ = _compare(rank, 2, 2, 1, True, False)
        names = [e["name"] for e in recorder.events() if e.get("cat") == "moe wait"]
    finally:
        timeline.install(None)
    return {"differ": differ, "waits": len(names)}


@pytest.mark.timeout(60)
def test_on_gloo_the_chunks_overlap_and_each_wait_is_on_the_timeline(tmp_path) -> None:
    """On two processes over gloo (its async all-to-alls in flight on its own threads):
    bit for bit the one exchange's; and every all-to-all the layer waits for is an
    "all-to-all wait" span (category "moe wait"), what benchmarks/moe_overlap.py sums:
    one exchange is 2 waits forward and 2 backward per call, 2 chunks 4 and 4."""
    for rank, result in enumerate(run_ranks(_waits, 2, str(tmp_path / "trace.json"),
                                            timeout=50)):
        assert not result["differ"], f"rank {rank}: {result['differ']} differ"
        # plain: (2 + 2) + 2 without gradients; chunked: (4 + 4) + 4; twice each (_compare)
        assert result["waits"] == 6 + 12, result
