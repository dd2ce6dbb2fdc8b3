"""The planners on mixture-of-experts models: shapes, parameter counts, expert memory over
ep, the all-to-all's volume, and two published MoE training runs on H100s.

Everything here is arithmetic (and small traces of moe-tiny, one `dtrain plan` of it), so it
runs in make test. The published figures are data (benchmarks/RESULTS.md,
"Mixture-of-experts runs"):

- Megatron-Core's Mixtral 8x7B, 468 TFLOP/s per GPU in bf16 (MCore v0.9), with its
  reference mapping: 64 H100s, tp 1, ep 8, pp 4, 8 virtual stages, micro-batch 1, global
  batch 256 of 4096 tokens (Megatron-LM, megatron/core/transformer/moe/README.md);
- NeMo AutoModel's Qwen3-30B-A3B, 12,040 tokens/s per GPU in bf16 on 8 H100s: ep 8, FSDP
  over 8 (ZeRO 3), micro-batch 4, global batch 512 of 4096 tokens, activation
  checkpointing (NVIDIA-NeMo/Automodel, docs/performance-summary.md).
"""

from __future__ import annotations

import dataclasses

import pytest

from dtrain.errors import ConfigError
from dtrain.models import resolve
from dtrain.models.config import ModelConfig
from dtrain.models.llama import llama_config, parameter_count
from dtrain.planner.analytic.cluster import evaluate, planned_layout
from dtrain.planner.analytic.dispatch import all_to_all_bytes, all_to_all_seconds
from dtrain.planner.analytic.hardware import Cluster, hardware
from dtrain.planner.analytic.search import best_layout, check_layout, rank
from dtrain.planner.shape import ModelShape, parse_shape

pytestmark = pytest.mark.timeout(60)

TOLERANCE = 0.20
H100 = hardware("h100-80gb")


def _preset(name: str, seq: int = 0) -> ModelShape:
    cfg = llama_config(resolve(ModelConfig(arch="llama", preset=name), 256))
    shape = ModelShape.of(cfg)
    return ModelShape.of(llama_config(resolve(ModelConfig(
        arch="llama", preset=name, block_size=seq or shape.seq), 256))) if seq else shape


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b",
                                    "moe-tiny"])
def test_parameters_total_and_active_are_the_models(preset: str) -> None:
    cfg = llama_config(resolve(ModelConfig(arch="llama", preset=preset), 32000))
    shape = ModelShape.of(cfg)
    assert shape.parameters() == parameter_count(cfg)
    assert shape.active_parameters() == parameter_count(cfg, active=True)
    assert shape.active_parameters() < shape.parameters()


def test_flops_follow_the_active_parameters() -> None:
    shape = _preset("mixtral-8x7b")
    dense = ModelShape(32, 4096, 32, shape.seq, 32000, "llama", kv_heads=8, ffn=14336)
    per_layer = shape.attention_params() + 4096 * 8 + 2 * 3 * 4096 * 14336
    assert shape.model_flops_per_token() == pytest.approx(
        6 * (32 * per_layer + 32000 * 4096) + 12 * 32 * 4096 * shape.seq)
    # two experts per token: the MLP FLOPs of a dense model with two MLPs, plus the router
    assert shape.model_flops_per_token() - dense.model_flops_per_token() == pytest.approx(
        6 * 32 * (3 * 4096 * 14336 + 4096 * 8))


def test_model_shape_keys() -> None:
    shape = parse_shape("arch=llama,layers=48,hidden=2048,heads=32,kv_heads=4,head_dim=128,"
                        "qk_norm=true,seq=4096,vocab=151936,ffn=6144,experts=128,top_k=8,"
                        "moe_ffn=768")
    assert shape == dataclasses.replace(_preset("qwen3-30b-a3b", 4096), vocab=151936)
    mixed = parse_shape("arch=llama,layers=8,hidden=512,heads=8,seq=128,vocab=1000,"
                        "experts=16,top_k=2,shared_experts=1,moe_layers=6")
    assert (mixed.moe_ffn, mixed.dense_layers) == (mixed.ffn, 2)
    assert mixed.active_parameters() < mixed.parameters()


@pytest.mark.parametrize(("text", "message"), [
    ("layers=4,hidden=64,heads=4,seq=8,vocab=10,experts=8,top_k=2", "arch=llama"),
    ("arch=llama,layers=4,hidden=64,heads=4,seq=8,vocab=10,experts=8",
     "top_k=0 must lie in [1, experts=8]"),
    ("arch=llama,layers=4,hidden=64,heads=4,seq=8,vocab=10,experts=8,top_k=9", "top_k=9"),
    ("arch=llama,layers=4,hidden=64,heads=4,seq=8,vocab=10,top_k=2", "give experts=E"),
    ("arch=llama,layers=4,hidden=64,heads=4,seq=8,vocab=10,experts=x,top_k=2",
     "not a whole number"),
    ("arch=llama,layers=4,hidden=64,heads=4,seq=8,vocab=10,experts=8,top_k=2,moe_layers=5",
     "more than the 4 layers"),
    ("arch=llama,layers=4,hidden=64,heads=4,seq=8,vocab=10,experts=-8,top_k=2",
     "must be positive"),
])
def test_bad_moe_shapes_are_one_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as info:
        parse_shape(text)
    assert "\n" not in str(info.value)


def test_ep_divides_the_expert_memory_and_not_the_rest() -> None:
    shape = _preset("mixtral-8x7b", 4096)
    cluster = Cluster(H100, 8, 8)
    memory = {ep: evaluate(shape, cluster, 256, planned_layout(
        256, 1, 4, 16, 0, 1, 1, "full", ep=ep)).memory for ep in (1, 2, 8)}
    experts = shape.expert_layer_params() / 4  # the busiest stage's share of the experts
    for ep in (2, 8):
        saved = memory[1]["weights"] - memory[ep]["weights"]
        assert saved == pytest.approx(2 * experts * (1 - 1 / ep), rel=0.02)
        assert memory[1]["optimizer"] - memory[ep]["optimizer"] == pytest.approx(
            12 * experts * (1 - 1 / ep), rel=0.02)
    # ZeRO 1 shards the experts' state over the dp / ep GPUs holding the same experts
    zero = evaluate(shape, cluster, 256, planned_layout(256, 1, 4, 16, 1, 1, 1, "full", ep=8))
    dense_state = memory[8]["optimizer"] - 12 * experts / 8
    assert zero.memory["optimizer"] == pytest.approx(dense_state / 16 + 12 * experts / 8 / 2,
                                                     rel=0.02)


def test_all_to_all_volume_and_links() -> None:
    shape = _preset("mixtral-8x7b", 4096)
    # per MoE layer and micro-batch: tokens x k x hidden bf16 elements per exchange
    assert all_to_all_bytes(shape, 2, 1) == 2 * (2 * 4096) * 2 * 4096
    assert all_to_all_bytes(shape, 2, 4) == all_to_all_bytes(shape, 2, 1) / 4
    nbytes = all_to_all_bytes(shape, 1, 1)
    cluster = Cluster(H100, 4, 8)
    rate = H100.link_efficiency * 1e9
    inside = all_to_all_seconds(nbytes, 8, 1, cluster)  # one node: NVLink
    assert inside == pytest.approx(H100.intra_latency_us * 1e-6
                                   + nbytes * 7 / 8 / (H100.intra_gbps * rate))
    across = all_to_all_seconds(nbytes, 16, 1, cluster)  # half of the peers in another node
    assert across == pytest.approx(H100.inter_latency_us * 1e-6
                                   + nbytes * 8 / 16 / (H100.inter_gbps * rate))
    assert all_to_all_seconds(nbytes, 1, 1, cluster) == 0.0
    # a step: 2 exchanges each way per MoE layer and micro-batch (and again when recomputing)
    layout = planned_layout(256, 1, 1, 32, 0, 1, 1, "none", ep=8)
    step = evaluate(shape, cluster, 256, layout)
    assert step.parts["ep"] == pytest.approx(8 * 32 * 4 * inside)
    again = evaluate(shape, cluster, 256, planned_layout(256, 1, 1, 32, 0, 1, 1, "full", ep=8))
    assert again.parts["ep"] == pytest.approx(8 * 32 * 6 * inside)


def test_search_enumerates_ep_and_checks_it() -> None:
    shape = _preset("qwen3-30b-a3b", 4096)
    cluster = Cluster(H100, 2, 8)
    estimates = rank(shape, cluster, 64, recompute=("full",), sequence_parallel=(False,))
    assert {e.planned.dims.ep for e in estimates} >= {1, 2, 8, 16}
    assert any(e.fits and e.planned.dims.ep == 16 for e in estimates)
    with pytest.raises(ConfigError, match="ep = 3 does not divide"):
        check_layout(shape, cluster, 64, planned_layout(64, 1, 1, 16, ep=3))
    dense = ModelShape(4, 256, 4, 128, 1000, "llama")
    with pytest.raises(ConfigError, match="has none"):
        check_layout(dense, cluster, 64, planned_layout(64, 1, 1, 16, ep=2))


def test_megatron_core_mixtral_8x7b() -> None:
    """468 TFLOP/s per GPU (Megatron's count: 6N of the active weights + 12·l·h·s, no
    recomputation), tp1 ep8 pp4 vp8, 64 H100s."""
    shape = _preset("mixtral-8x7b", 4096)
    predicted = best_layout(shape, Cluster(H100, 8, 8), 256, 1, 4, 16, microbatches=(1,),
                            chunks=(8,), zeros=(1,), recompute=("none",),
                            sequence_parallel=(False,), ep=8)
    assert predicted is not None and predicted.fits
    assert abs(predicted.tflops_per_gpu / 468 - 1) <= TOLERANCE, predicted.tflops_per_gpu


def test_nemo_automodel_qwen3_30b() -> None:
    """12,040 tokens/s per GPU, ep 8 with FSDP (ZeRO 3) on 8 H100s, activations
    checkpointed. The planner predicts it does not fit (it counts fp32 logits, 20 GB here;
    the run kept them in bf16), so only the speed is compared."""
    cfg = llama_config(resolve(ModelConfig(arch="llama", preset="qwen3-30b-a3b",
                                           block_size=4096), 151936))
    shape = ModelShape.of(cfg)
    predicted = evaluate(shape, Cluster(H100, 1, 8), 512,
                         planned_layout(512, 1, 1, 8, 3, 4, 1, "full", ep=8))
    assert abs(predicted.tokens_per_s / 8 / 12040 - 1) <= TOLERANCE, predicted.tokens_per_s


def test_traced_planner_plans_a_moe_model() -> None:
    from dtrain.planner import plan, profile_model
    from dtrain.planner.traced.links import Links

    cfg = resolve(ModelConfig(arch="llama", preset="moe-tiny"), 256)
    estimates = plan(lambda b, cp=1, method="ring": profile_model(cfg, b, ("none",), cp, method),
                     2, 2**30, 2, 1e12, Links.given(10, 20), cp_method="ring")
    profile = profile_model(cfg, 1, ("none",))
    assert profile.params.total == parameter_count(llama_config(cfg))
    assert estimates and all(e.params > 0 for e in estimates)
    assert any(e.dims.cp == 2 for e in estimates)  # its dense stand-in's tokens halved


MOE_TINY = resolve(ModelConfig(arch="llama", preset="moe-tiny"), 256)
"""moe-tiny (4 MoE blocks of 8 experts, top 2, width 128, 128 positions) on a vocabulary
of 256: what the traced planner's expert-parallel tests plan."""


@pytest.fixture(scope="module")
def moe_profile():
    from dtrain.planner import profile_model

    return profile_model(MOE_TINY, 2, ("none", "full"))


def _expert_bytes(cfg: ModelConfig) -> int:
    """fp32 bytes of every routed expert of the model: what ep divides."""
    return 4 * ModelShape.of(llama_config(cfg)).expert_layer_params()


def test_traced_layouts_take_each_expert_degree(moe_profile) -> None:
    from dtrain.planner import layouts

    found = layouts(moe_profile, 4, batch=16)
    by_dp: dict[int, set[int]] = {}
    for layout in found:
        by_dp.setdefault(layout.dp, set()).add(layout.ep)
    assert by_dp[4] == {1, 2, 4} and by_dp[2] == {1, 2} and by_dp[1] == {1}
    labels = {str(layout) for layout in found}
    assert {"dp4", "dp4 ep2", "dp4 ep4 zero3", "dp2 x tp2 ep2"} <= labels
    # the profile marks exactly the routed experts' stacked tensors, and no more
    experts = sum(t.numel for t in moe_profile.tensors if t.expert) * MOE_TINY.n_layer
    assert 4 * experts == _expert_bytes(MOE_TINY) == 4 * moe_profile.params.experts
    assert not moe_profile.sequence_parallel(2)  # refused with experts by the config


def test_traced_ep_divides_the_experts_memory_and_zero_shards_them_over_dp(moe_profile) -> None:
    from dtrain.planner import Dims, Links, estimate

    free = Links.given(1e9, 0)
    experts = _expert_bytes(MOE_TINY)
    whole = 4 * moe_profile.params.total
    # the routers' balancing biases, which no optimizer steps, have no optimizer state
    p = moe_profile
    trained = 4 * (p.trained("embed") + p.trained("block") * p.n_layer + p.trained("head")).total
    assert whole - 4 * 64 <= trained < whole
    plain = {ep: estimate(moe_profile, Dims(4, ep=ep), 1e12, 1e12, free) for ep in (1, 2, 4)}
    assert plain[1].params == whole
    for ep in (2, 4):
        assert plain[ep].params == pytest.approx(whole - experts + experts / ep)
        assert plain[ep].optimizer == pytest.approx(2 * (trained - experts + experts / ep))
    # ZeRO shards a rank's E / ep experts over the dp / ep ranks holding them: every
    # expert's state divided by dp, as at ep = 1
    for zero in (1, 2, 3):
        sharded = [estimate(moe_profile, Dims(4, zero=zero, ep=ep), 1e12, 1e12, free)
                   for ep in (1, 2, 4)]
        assert all(e.optimizer == pytest.approx(2 * trained / 4) for e in sharded)
    zero2 = estimate(moe_profile, Dims(4, zero=2, ep=2), 1e12, 1e12, free)
    assert zero2.grads == pytest.approx(trained / 4)
    assert zero2.params == plain[2].params


def test_traced_ep_traffic_all_to_all_and_expert_gradients(moe_profile) -> None:
    from dtrain.planner import Dims, Links, estimate

    free = Links.given(1e9, 0)
    experts = _expert_bytes(MOE_TINY)
    dense = 4 * moe_profile.params.total - experts
    tokens, k, hidden = 2 * 128, 2, 128  # a micro-batch of 2 sequences
    # dispatch and combine forward, the same two backward, in each of the 4 MoE blocks
    exchanges = tokens * k * hidden * 4 * 2 * 2 * 4
    ep1 = estimate(moe_profile, Dims(4), 1e12, 1e12, free)
    assert ep1.traffic == {"dp all_reduce": 4 * moe_profile.params.total}
    ep2 = estimate(moe_profile, Dims(4, ep=2), 1e12, 1e12, free)
    assert ep2.traffic == pytest.approx({"dp all_reduce": dense,
                                         "edp all_reduce": experts / 2,
                                         "ep all_to_all": exchanges})
    # ep = dp: each rank's experts are its own, their gradients go nowhere
    ep4 = estimate(moe_profile, Dims(4, ep=4), 1e12, 1e12, free)
    assert "edp all_reduce" not in ep4.traffic and ep4.traffic["ep all_to_all"] == exchanges
    zero = estimate(moe_profile, Dims(4, zero=1, ep=2), 1e12, 1e12, free).traffic
    assert zero["edp reduce_scatter"] == zero["edp all_gather"] == pytest.approx(experts / 2)
    again = estimate(moe_profile, Dims(4, ep=2), 1e12, 1e12, free, recompute="full")
    assert again.traffic["ep all_to_all"] == pytest.approx(exchanges * 6 / 4)
    # a pipeline stage exchanges its own blocks' tokens, for each of its micro-batches
    stage = estimate(moe_profile, Dims(2, pp=2, microbatches=4, ep=2), 1e12, 1e12, free)
    assert stage.traffic["ep all_to_all"] == pytest.approx(exchanges / 2 * 4)
    # half the blocks with experts: half the exchanges
    half = dataclasses.replace(moe_profile, shape=dataclasses.replace(moe_profile.shape,
                                                                      moe_layers=2))
    assert estimate(half, Dims(4, ep=2), 1e12, 1e12, free).traffic["ep all_to_all"] == \
        pytest.approx(exchanges / 2)


def test_traced_all_to_all_is_exposed(moe_profile) -> None:
    """The gradients' collectives hide behind a slow backward; the all-to-all does not:
    (ep - 1) / ep of its bytes, at 1 GB/s."""
    from dtrain.planner import Dims, Links, estimate

    bandwidth = Links.given(1, 0)
    slow = 1e6  # FLOP/s: a backward long enough to hide every gradient collective
    for ep in (2, 4):
        e = estimate(moe_profile, Dims(4, ep=ep), 1e12, slow, bandwidth)
        assert e.comm_s == pytest.approx(e.traffic["ep all_to_all"] * (ep - 1) / ep / 1e9)
    assert estimate(moe_profile, Dims(4), 1e12, slow, bandwidth).comm_s == 0


@pytest.mark.timeout(120)
def test_plan_command_lists_ep_layouts(tmp_path) -> None:
    import json

    from tests.support.cli import dtrain, one_error_line

    out = tmp_path / "plan.json"
    moe = ("--set", "model.arch=llama", "--set", "model.preset=moe-tiny")
    result = dtrain("plan", *moe, "--set", "parallel.ep=2", "-n", "4", "--batch", "8",
                    "--tflops", "1", "--bandwidth", "10", "--recompute", "none",
                    "--sequence-parallel", "off", "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["layout"]: row for row in json.loads(out.read_text())["layouts"]}
    assert {"dp4 ep2", "dp4 ep4", "dp2 x tp2 ep2"} <= set(rows)
    assert rows["dp4 ep4"]["ep"] == 4 and "ep all_to_all" in rows["dp4 ep2"]["traffic_bytes"]
    assert rows["dp4 ep2"]["memory_bytes"]["params"] < rows["dp4"]["memory_bytes"]["params"]
    assert "dp4 ep2" in result.stdout
    own = dtrain("plan", *moe, "--set", "parallel.ep=2", "--model", "tests.support.cli:nothing")
    assert own.returncode != 0 and "--model" in one_error_line(own)
