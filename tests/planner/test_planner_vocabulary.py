"""What both planners share (dtrain.planner): one ModelShape from any model config, one
PlannedLayout that goes through JSON whole (as an elastic round sends it), one bubble."""

from __future__ import annotations

import json

import pytest

from dtrain.errors import ConfigError
from dtrain.mesh import Dims
from dtrain.models.config import ModelConfig
from dtrain.models.gpt import GPTConfig
from dtrain.models.llama import llama_config
from dtrain.planner import ModelShape, PlannedLayout, bubble, profile_gpt
from dtrain.planner.analytic.cluster import cluster_label
from dtrain.planner.costs import pipeline_seconds
from dtrain.planner.traced.profile import model_config
from dtrain.testing import run_ranks

GPT = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)
PSI = 256 * 64 + 64 * 64 + 4 * (128 + (64 * 192 + 192) + (64 * 64 + 64) + 128
                                + (64 * 256 + 256) + (256 * 64 + 64)) + 128


def test_one_model_shape_from_any_config() -> None:
    """A GPTConfig, its `[model]` section and the traced profile know one shape; a
    LlamaConfig and its section too; a model with no shape here is one line."""
    shape = ModelShape.of(GPT)
    assert shape == ModelShape.of(model_config(GPT)) == profile_gpt(GPT, 1).shape
    assert shape.parameters() == PSI
    llama = ModelConfig(arch="llama", vocab_size=256, n_layer=2, n_head=4, n_kv_head=2)
    assert ModelShape.of(llama) == ModelShape.of(llama_config(llama))
    assert ModelShape.of(llama).kv_heads == 2 and not ModelShape.of(llama).dropout
    with pytest.raises(ConfigError, match="arch = 'hf' has no shape"):
        ModelShape.of(ModelConfig(arch="hf"))


def test_a_planned_layout_goes_through_json_and_back() -> None:
    layout = Dims(2, 2, 2, 1, 4, "interleaved", 2)
    assert Dims.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert Dims.from_dict({"dp": 4, "tp": 2}) == Dims(4, 2)  # an older checkpoint's
    with pytest.raises(ValueError, match="world_size"):
        Dims.from_dict({**layout.to_dict(), "world_size": 4})
    planned = PlannedLayout(layout.replace(sequence_parallel=True), "selective", 8)
    assert PlannedLayout.from_dict(json.loads(json.dumps(planned.to_dict()))) == planned
    assert str(planned) == "dp2 x tp2 x pp2 (interleaved v2, m=4) zero1 mb8 sp"
    assert cluster_label(planned) == "tp2 x pp2 x dp2 x v2 mb8 zero1 sp"
    assert str(PlannedLayout(Dims(4))) == "dp4"
    with pytest.raises(ConfigError, match="recompute 'most'"):
        PlannedLayout(layout, "most")


def test_one_bubble_for_both_planners() -> None:
    """The analytic planner's step of equal stages is the traced planner's compute
    stretched by 1 / (1 - bubble)."""
    for pp, m, v in ((1, 4, 1), (2, 4, 1), (4, 8, 2), (8, 16, 4)):
        assert 0.5 * m / pipeline_seconds([0.5] * pp, m, v) == pytest.approx(1 - bubble(pp, m, v))
    assert bubble(2, 4) == pytest.approx(1 / 5) and bubble(1, 4) == 0.0


def _agreed(sent: list[dict | None]) -> list[dict | None]:
    """Each of `sent` as an elastic round's `agreed` hands it to this rank: rank 0 plans
    it (the planner replaced by the list), every rank gets it."""
    import dtrain
    from dtrain.ft import elastic

    world = dtrain.init()
    got = []
    for value in sent:
        elastic.planned = lambda *_, value=value: (  # only rank 0 may plan
            None if value is None else PlannedLayout.from_dict(value))
        chosen = elastic.agreed(world)(None, 3, 1)
        got.append(None if chosen is None else chosen.to_dict())
    return got


def test_an_elastic_round_sends_rank_0s_planned_layout() -> None:
    """What rank 0 planned reaches every rank whole (its Dims's `to_dict()` inside);
    "nothing fits" too."""
    sent = [PlannedLayout(Dims(1, 1, 3, 0, 6, "interleaved", 2), "full").to_dict(),
            None, PlannedLayout(Dims(3, zero=2), "selective").to_dict()]
    assert run_ranks(_agreed, 2, sent, timeout=60) == [sent, sent]
