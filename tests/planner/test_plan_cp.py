"""dtrain plan (the traced planner) on context-parallel layouts: which it offers, each
rank's activations traced on its share of every sequence with the method's own attention,
the exchanges of each method by hand, the gradients over dp x cp, and the memory against
measured peaks of real cp runs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dtrain.errors import ConfigError
from dtrain.planner import Dims, Links, PlannedLayout, estimate, layouts, plan
from dtrain.planner.traced.measure import measured_peaks
from dtrain.testing import run_ranks
from tests.planner.test_plan import FREE, LLAMA, traced
from tests.support.cli import dtrain

pytestmark = pytest.mark.timeout(120)

KV = 2 * 4 * 32 * 2 * 16 * 4
"""A rank's key/value block at cp = 2 for a micro-batch of 4 sequences of LLAMA: keys and
values, 4 sequences, 32 of the 64 tokens, 2 key/value heads of 16, fp32."""
HEAD = 4 * 32 * 16 * 4  # one head of a rank's tokens, the same micro-batch
LAYERS = LLAMA.n_layer


def test_cp_layouts_where_the_sequence_and_model_allow() -> None:
    profile = traced(LLAMA, 4, ("none",))
    found = {str(layout) for layout in layouts(profile, 4, batch=16)}
    assert {"dp2 x cp2", "cp4", "cp2 x tp2", "cp2 x pp2 (1f1b, m=2)", "dp2 x cp2 zero3",
            "cp4 zero1", "dp4", "dp2 x tp2"} <= found
    assert all(layout.world_size == 4 for layout in layouts(profile, 4, batch=16))
    # 12 tokens cut into 4 chunks, not 8: cp2 and no cp4
    short = dataclasses.replace(profile, shape=dataclasses.replace(profile.shape, seq=12))
    assert {layout.cp for layout in layouts(short, 4, batch=16)} == {1, 2}
    dropped = dataclasses.replace(profile, shape=dataclasses.replace(profile.shape,
                                                                     dropout=True))
    assert {layout.cp for layout in layouts(dropped, 4, batch=16)} == {1}
    # experts split over ep only at cp = 1
    moe = dataclasses.replace(profile, shape=dataclasses.replace(profile.shape, experts=4,
                                                                 top_k=1))
    both = [(layout.cp, layout.ep) for layout in layouts(moe, 4, batch=16)]
    assert (1, 2) in both and (2, 1) in both and all(ep == 1 for cp, ep in both if cp > 1)


def test_activations_are_a_ranks_share_of_every_sequence() -> None:
    """The cp profile is traced on 32 of the 64 tokens: its activations about half of one
    process's on the same micro-batch, exactly the traced figures."""
    whole = estimate(traced(LLAMA, 4, ("none",)), Dims(1), 1e12, 1e12, FREE)
    half_profile = traced(LLAMA, 4, ("none",), cp=2)
    half = estimate(half_profile, Dims(1, cp=2), 1e12, 1e12, FREE)
    figures = half_profile.activations("none")
    assert half.activations == figures.embed.per_rank(1) + LAYERS * figures.block.per_rank(1) \
        + figures.head.per_rank(1) + figures.peak_extra.per_rank(1)
    assert 0.45 < half.activations / whole.activations < 0.55
    assert (half.params, half.optimizer) == (whole.params, whole.optimizer)  # replicated
    with pytest.raises(ConfigError, match="traced for cp = 1"):
        estimate(traced(LLAMA, 4, ("none",)), Dims(1, cp=2), 1e12, 1e12, FREE)


@pytest.mark.parametrize("method, mode, traffic", [
    ("ring", "none", {"cp send": LAYERS * (1 + 3) * KV}),  # n - 1 forward, n - 1 + n back
    ("ring", "full", {"cp send": LAYERS * (2 + 3) * KV}),  # forward again
    ("ring", "selective", {"cp send": LAYERS * (2 + 3) * KV}),  # attention again
    ("allgather", "none", {"cp all_gather": LAYERS * 2 * KV,
                           "cp reduce_scatter": LAYERS * 2 * KV}),
    ("alltoall", "none", {"cp all_to_all": LAYERS * 2 * 2 * (4 + 2) * HEAD}),
])
def test_each_methods_exchanges(method: str, mode: str, traffic: dict) -> None:
    profile = traced(LLAMA, 4, (mode,), cp=2, method=method)
    e = estimate(profile, Dims(1, cp=2), 1e12, 1e12, FREE, recompute=mode)
    psi = 4 * profile.params.total
    assert e.traffic == pytest.approx({"dp all_reduce": psi, **traffic})
    assert e.label == f"cp2 {method}" and e.to_dict()["cp_method"] == method


def test_ring_at_cp4_and_tp2() -> None:
    four = estimate(traced(LLAMA, 4, ("none",), cp=4), Dims(1, cp=4), 1e12, 1e12, FREE)
    assert four.traffic["cp send"] == pytest.approx(LAYERS * (3 + 7) * KV / 2)
    tp = estimate(traced(LLAMA, 4, ("none",), cp=2), Dims(1, cp=2, tp=2), 1e12, 1e12, FREE)
    assert tp.traffic["cp send"] == pytest.approx(LAYERS * 4 * KV / 2)  # its one kv head


def test_gradients_average_and_shard_over_dp_x_cp() -> None:
    profile = traced(LLAMA, 4, ("none",), cp=2)
    psi = 4 * profile.params.total
    slow = Links.given(1, 0)  # 1 GB/s, no latency: bus bytes alone
    e = estimate(profile, Dims(2, cp=2), 1e12, 1e6, slow)  # a backward hiding everything
    assert e.traffic["dp all_reduce"] == psi
    assert slow.seconds({"dp all_reduce": psi}, {"dp all_reduce": 1}, e.dims) == \
        pytest.approx(psi * 2 * 3 / 4 / 1e9)  # a group of 4
    zero = estimate(profile, Dims(2, cp=2, zero=2), 1e12, 1e12, FREE)
    assert (zero.grads, zero.optimizer) == pytest.approx((psi / 4, 2 * psi / 4))
    assert zero.traffic["dp reduce_scatter"] == zero.traffic["dp all_gather"] == psi


def test_the_ring_hides_behind_its_steps_and_the_others_do_not() -> None:
    """At 1 GB/s: behind a slow attention only each layer's last gradients' send counts;
    with no arithmetic every send; the all-gather's and the all-to-all's whole."""
    slow = Links.given(1, 0)
    ring = traced(LLAMA, 4, ("none",), cp=2)
    hidden = estimate(ring, Dims(1, cp=2), 1e12, 1e3, slow)
    assert hidden.comm_s == pytest.approx(LAYERS * KV / 1e9)
    bare = estimate(ring, Dims(1, cp=2), 1e12, 1e30, slow)
    dp = 4 * ring.params.total  # over the 2 ranks, not hidden either
    assert bare.comm_s == pytest.approx(LAYERS * 4 * KV / 1e9 + dp / 1e9)
    gathered = estimate(traced(LLAMA, 4, ("none",), cp=2, method="allgather"), Dims(1, cp=2),
                        1e12, 1e3, slow)
    assert gathered.comm_s == pytest.approx(2 * LAYERS * 2 * KV / 2 / 1e9)  # (n-1)/n each


def test_plan_takes_the_method_asked_where_it_runs() -> None:
    """alltoall splits each rank's 2 key/value heads over cp: cp2, not cp4 or cp2 x tp2;
    no method asked, no cp layout."""
    def trace(b: int, cp: int = 1, method: str = "ring"):
        return traced(LLAMA, b, ("none",), cp, method)

    labels = {e.label for e in plan(trace, 4, 1e12, 8, 1e12, FREE, cp_method="alltoall")}
    assert {"dp2 x cp2 alltoall", "cp2 x pp2 (1f1b, m=2) alltoall"} <= labels
    assert not any("cp4" in label or "cp2 x tp2" in label for label in labels)
    assert not any("cp" in e.label for e in plan(trace, 4, 1e12, 8, 1e12, FREE))  # by default


def test_a_planned_cp_layout_goes_through_json_and_back() -> None:
    planned = PlannedLayout(Dims(2, tp=2, cp=2, sequence_parallel=True, cp_method="allgather"),
                            "full")
    assert PlannedLayout.from_dict(json.loads(json.dumps(planned.to_dict()))) == planned
    assert str(planned) == "dp2 x cp2 x tp2 allgather sp"
    assert str(PlannedLayout(Dims(4, cp_method="alltoall"))) == "dp4"
    with pytest.raises(ConfigError, match="cp_method='zigzag': use one of"):
        PlannedLayout(Dims(1, cp=2, cp_method="zigzag"))


def test_plan_command_lists_cp_layouts(tmp_path) -> None:
    out = tmp_path / "plan.json"
    result = dtrain("plan", "--set", "model.arch=llama", "--set", "model.block_size=64",
                    "-n", "4", "--batch", "8", "--tflops", "1", "--bandwidth", "10",
                    "--recompute", "none", "--sequence-parallel", "off", "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["layout"]: row for row in json.loads(out.read_text())["layouts"]}
    assert {"dp2 x cp2 ring", "cp4 ring", "cp2 x tp2 ring"} <= set(rows)
    assert rows["cp4 ring"]["cp"] == 4 and rows["cp4 ring"]["cp_method"] == "ring"
    assert "cp send" in rows["dp2 x cp2 ring"]["traffic_bytes"]
    assert rows["dp4"]["cp_method"] is None
    assert "cp2" in result.stdout.replace("dp2 x cp2", "cp2")


def _measure(cases: list[tuple]) -> list:
    return [measured_peaks(cfg, layout, batch, 2, recompute=mode, cp_method=method)
            for cfg, layout, batch, mode, method in cases]


LONG = dataclasses.replace(LLAMA, block_size=256)
"""128 tokens a rank at cp = 2: the ring's scores, block by block, weigh."""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_memory_matches_measured_peaks_at_cp2(native: dict) -> None:  # tests/conftest.py
    """Planned against measured peaks of real runs of each method at cp = 2 on 2 ranks,
    within 15%, the busiest rank."""
    cases = [(LONG, Dims(1, cp=2), 8, mode, method)
             for mode, method in (("none", "ring"), ("none", "allgather"),
                                  ("none", "alltoall"), ("selective", "ring"))]
    cases.append((LONG, Dims(1, cp=2, zero=3), 8, "full", "ring"))
    measured = run_ranks(_measure, 2, cases, timeout=200, env=native)
    for i, (cfg, layout, batch, mode, method) in enumerate(cases):
        peak = max(rank[i].train for rank in measured)
        e = estimate(traced(cfg, batch // layout.dp, (mode,), layout.cp, method), layout,
                     1e12, 1e12, FREE, recompute=mode)
        assert abs(e.total / peak - 1) <= 0.15, \
            f"{e.label} {mode}: planned {e.total:.0f}, measured {peak}"
