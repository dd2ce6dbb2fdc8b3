"""DeepSeek-V3's architecture in dtrain's Llama: group-limited routing against a reference
and against transformers' router, the presets' published parameter counts, a
`DeepseekV3ForCausalLM` folder in (`init_from`'s reader, `arch = "hf"`) and out (`dtrain
export --format hf`'s state and config) with transformers' logits, `dtrain train` of
deepseek-tiny on one process equal to itself under gradient accumulation, the chunked loss
and recomputation, and the one-line answers to bad keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.checkpoint.universal import MODEL
from dtrain.models import ModelConfig, build, hf_names, resolve
from dtrain.models.llama import llama_config, parameter_count
from dtrain.models.moe import MoE
from dtrain.models.moe.router import Router
from tests.models.test_moe import (
    test_hugging_face_moe_models_in_and_out_give_their_logits as hugging_face_in_and_out,
)
from tests.support import cli

E, K, GROUPS, KEPT = 8, 2, 4, 2


def router(rule: str) -> Router:
    torch.manual_seed(0)
    gate = Router(16, E, K, rule, norm_topk_prob=True, n_group=GROUPS, topk_group=KEPT)
    torch.nn.init.normal_(gate.weight, std=0.5)
    with torch.no_grad():
        gate.expert_bias.copy_(torch.linspace(-0.2, 0.2, E))
    gate.scale = 2.5
    return gate


def reference_route(gate: Router, x: torch.Tensor) -> list[tuple[set[int], dict[int, float]]]:
    """Each token on its own: the choice scores (sigmoid + bias, or softmax), each group's
    score the sum of its two best, the KEPT best groups, the K best experts in them; their
    weights the scores without bias, renormalized and scaled."""
    out = []
    for token in x:
        logits = gate.weight.detach() @ token
        sigmoid = gate.rule == "sigmoid_bias"
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1)
        choice = scores + gate.expert_bias if sigmoid else scores
        per = E // GROUPS
        group_score = [sorted(choice[g * per:(g + 1) * per].tolist())[-2:] for g in
                       range(GROUPS)]
        best = sorted(range(GROUPS), key=lambda g: -sum(group_score[g]))[:KEPT]
        allowed = [e for e in range(E) if e // per in best]
        chosen = sorted(allowed, key=lambda e: -float(choice[e].detach()))[:K]
        total = sum(float(scores[e]) for e in chosen)
        out.append((set(chosen), {e: 2.5 * float(scores[e]) / total for e in chosen}))
    return out


@pytest.mark.parametrize("rule", ["sigmoid_bias", "softmax_topk"])
def test_group_limited_routing_equals_the_reference(rule: str) -> None:
    gate = router(rule)
    x = torch.randn(20, 16)
    weights, experts, _ = gate(x)
    for i, (chosen, weight) in enumerate(reference_route(gate, x)):
        assert set(experts[i].tolist()) == chosen, i
        for w, e in zip(weights[i].tolist(), experts[i].tolist(), strict=True):
            assert w == pytest.approx(weight[e], rel=1e-5)
    groups = experts // (E // GROUPS)
    assert all(len(set(row)) <= KEPT for row in groups.tolist())


def test_group_limited_routing_equals_transformers_router() -> None:
    """transformers' DeepseekV3TopkRouter on the same weights and bias: the same experts
    and weights for every token."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gate = router("sigmoid_bias")
    theirs = DeepseekV3TopkRouter(transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=E, num_experts_per_tok=K, n_group=GROUPS,
        topk_group=KEPT, routed_scaling_factor=2.5, norm_topk_prob=True))
    with torch.no_grad():
        theirs.weight.copy_(gate.weight)
        theirs.e_score_correction_bias.copy_(gate.expert_bias)
    x = torch.randn(30, 16)
    weights, experts, _ = gate(x)
    _, their_weights, their_experts = theirs(x)
    order, their_order = experts.sort(-1), their_experts.sort(-1)
    assert torch.equal(order.values, their_order.values)
    torch.testing.assert_close(weights.gather(-1, order.indices),
                               their_weights.gather(-1, their_order.indices))


@pytest.mark.parametrize("preset, total, active, with_mtp", [
    ("deepseek-v3", 671, 37, 682_636_487_424), ("kimi-k2", 1026, 32, 1_026_408_232_448)])
def test_presets_have_the_published_parameter_counts(preset: str, total: int, active: int,
                                                     with_mtp: int) -> None:
    """DeepSeek-V3: 671B total and 37B active as DeepSeek counts them, the main model alone
    (671.03B, 37.55B); with its MTP module 682.64B here, whose 11.61B share the main
    model's embedding and head (DeepSeek's checkpoint stores its own copies of both, 1.85B
    more: the "14B" of MTP weights in its 685B). Kimi K2: "1T" (1026.4B) and 32B (32.86B),
    no MTP module. Each within the published figures' digits: truncated to whole
    billions."""
    cfg = llama_config(resolve(ModelConfig(arch="llama", preset=preset), 256))
    assert parameter_count(cfg, mtp=False) // 10**9 == total
    assert parameter_count(cfg, active=True, mtp=False) // 10**9 == active
    assert parameter_count(cfg) == with_mtp


@pytest.mark.parametrize("keys", [{}, {"q_lora_rank": 0, "mtp_depth": 2},
                                  {"n_experts": 0, "attention": "mla"}],
                         ids=["deepseek-tiny", "plain-queries-mtp2", "dense-mla"])
def test_parameter_count_counts_the_built_model(keys: dict) -> None:
    cfg = resolve(ModelConfig(arch="llama", preset="deepseek-tiny", **keys), 256)
    model = build(cfg)
    assert parameter_count(model.cfg) == sum(p.numel() for p in model.parameters())


def deepseek_pair(vocab: int = 64, positions: int = 16) -> tuple[torch.nn.Module, ModelConfig]:
    """A tiny DeepseekV3ForCausalLM (a dense first layer, then MoE layers of 8 experts in
    4 groups, a shared expert, a query bottleneck, routing far from uniform and a moved
    correction bias) and dtrain's `[model]` of the same shape."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(3)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=E, num_experts_per_tok=K, n_group=GROUPS, topk_group=KEPT,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
        max_position_embeddings=positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None))
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            torch.nn.init.normal_(layer.mlp.gate.weight, std=0.5)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, E))
    ours = ModelConfig(arch="llama", vocab_size=vocab, n_embd=32, n_layer=3, n_head=4,
                       ffn_hidden=48, block_size=positions, tie_embeddings=False, norm_eps=1e-6,
                       attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=8, v_head_dim=12, n_experts=E, experts_per_token=K,
                       moe_inter_size=16, n_shared_experts=1, moe_layers="after 1",
                       router="sigmoid_bias", n_group=GROUPS, topk_group=KEPT,
                       routed_scaling_factor=2.5)
    return hf.eval(), ours


def test_a_deepseek_folder_in_and_out_gives_transformers_logits(tmp_path: Path) -> None:
    """A DeepseekV3ForCausalLM saved as transformers saves it (a tensor per expert): dtrain's
    Llama of the same shape reads the folder (`init_from`'s reader) and gives its logits;
    written back (`dtrain export --format hf`'s state and config), transformers loads a
    DeepseekV3ForCausalLM with the same logits (fp32): the Mixtral and Qwen3-MoE check of
    tests/models/test_moe.py, on this pair."""
    pytest.importorskip("transformers")
    hugging_face_in_and_out(deepseek_pair, tmp_path)


def test_arch_hf_swaps_deepseek_moe_blocks_and_keeps_the_logits(tmp_path: Path) -> None:
    """`arch = "hf"` of a DeepseekV3 folder: each MoE block is dtrain's layer with the
    router's weight, correction bias and scaling, the experts and the shared experts under
    transformers' names; `init_from`'s reader fills it, and it gives transformers' logits."""
    pytest.importorskip("transformers")
    from dtrain.models.hf import HFCausalLM
    from dtrain.models.weights import HFWeights

    hf, _ = deepseek_pair()
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig(arch="hf", init_from=str(tmp_path), vocab_size=64, block_size=16)
    model = dtrain.models.build(cfg).eval()
    assert isinstance(model, HFCausalLM)
    assert [isinstance(layer.mlp, MoE) for layer in model.hf.model.layers] == [False, True,
                                                                               True]
    names = hf_names(cfg, model)
    assert names["hf.model.layers.1.mlp.gate.expert_bias"][0] == \
        "model.layers.1.mlp.gate.e_score_correction_bias"
    weights = HFWeights(tmp_path, names)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.tensor(MODEL + name))
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-5, atol=1e-6)


def test_export_refuses_what_deepseek_v3_does_not_compute() -> None:
    from dtrain.errors import ConfigError
    from dtrain.models.convert import hf_config_of

    cfg = resolve(ModelConfig(arch="llama", preset="deepseek-tiny", moe_layers="1"), 256)
    with pytest.raises(ConfigError, match=r"set model\.moe_layers = \"after K\""):
        hf_config_of(cfg)
    config = hf_config_of(resolve(ModelConfig(arch="llama", preset="deepseek-v3"), 256))
    assert (config["model_type"], config["first_k_dense_replace"], config["n_group"],
            config["num_nextn_predict_layers"], config["routed_scaling_factor"]) == (
        "deepseek_v3", 3, 8, 1, 2.5)


# ------------------------------------------------------------------ dtrain train
TINY = """
[model]
arch = "llama"
preset = "deepseek-tiny"
n_layer = 2
n_embd = 32
n_head = 2
ffn_hidden = 48
block_size = 32
q_lora_rank = 16
kv_lora_rank = 16
qk_nope_head_dim = 8
qk_rope_head_dim = 8
v_head_dim = 8
moe_inter_size = 16
aux_loss_weight = 0.01

[data]
max_bytes = 60000
""" + cli.EXACT_OPTIMIZER + """
[train]
batch_size = 4
eval_every = 0
eval_batches = 1

[logging]
sample_tokens = 0
"""


@pytest.mark.timeout(300)
def test_deepseek_tiny_trains_equal_with_accumulation_chunked_loss_and_recompute(
        tmp_path: Path) -> None:
    """`dtrain train` of deepseek-tiny (latent attention, a dense first block then grouped
    sigmoid routing with a shared expert, the balance loss, one MTP module) on one
    process, 3 steps: the same run with the batch in two accumulated micro-batches, the
    chunked loss and full recomputation gives the same losses and gradient norms (the MTP
    and balance losses weigh alike), and the loss falls."""
    (want, _), (got, _) = cli.train_rows_together([
        (tmp_path / "one", TINY, [], 3),
        (tmp_path / "other", TINY, ["train.grad_accum=2", "train.loss='chunked'",
                                    "memory.recompute='full'"], 3)], 1)
    cli.assert_same_steps(got, want)
    assert want[-1]["loss"] < want[0]["loss"]


WITHOUT_MTP = TINY.replace('preset = "deepseek-tiny"', 'preset = "deepseek-tiny"\nmtp_depth = 0')
"""deepseek-tiny's shape without its MTP module (a key the config sets wins over the preset,
even at its default)."""
assert "mtp_depth = 0" in WITHOUT_MTP


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepseek_tiny_in_two_rank_layouts_equals_one_process(tmp_path: Path) -> None:
    """deepseek-tiny on two ranks, data parallel, ZeRO-3 (each MTP module a unit of its
    own), ep = 2 and ZeRO-2 x ep = 2 (the MTP module's MoE block split too), and in two
    pipeline stages, its MTP module on the last with a copy of the embedding tied to the
    first stage's (1F1B; and zero-bubble ZB-1P with the chunked loss, the MTP module's
    products split in B and W too): every step's loss and gradient norm equal one
    process's on the same global batch."""
    text = TINY.replace("batch_size = 4", "batch_size = 8")
    ((want, _),) = cli.train_rows_together([(tmp_path / "one", text, [], 3)], 1)
    pp2 = ["parallel.pp=2", "parallel.microbatches=2"]
    runs = cli.train_rows_together([
        (tmp_path / "dp2", text, [], 3), (tmp_path / "zero3", text, ["parallel.zero=3"], 3),
        (tmp_path / "ep2", text, ["parallel.ep=2"], 3),
        (tmp_path / "zero2-ep2", text, ["parallel.zero=2", "parallel.ep=2"], 3),
        (tmp_path / "pp2", text, pp2, 3),
        (tmp_path / "pp2-zb1p-chunked", text, [*pp2, "parallel.schedule='zb1p'",
                                               "train.loss='chunked'"], 3)], 2)
    for name, (got, _) in zip(["dp2", "zero3", "ep2", "zero2-ep2", "pp2", "pp2-zb1p"], runs,
                              strict=True):
        try:
            cli.assert_same_steps(got, want)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


NOT_TINY = TINY[TINY.index("[data]"):]
"""TINY's run without its [model] section: the default model (dtrain's GPT), or a model
named by --set alone."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_arch_hf_deepseek_trains_as_dtrains_llama_from_the_same_folder(tmp_path: Path) -> None:
    """`dtrain train` of a DeepseekV3ForCausalLM folder as `arch = "hf"` (transformers'
    latent attention, dtrain's MoE layer in its blocks) and as `arch = "llama"` with the
    same shape and `init_from` (dtrain's latent attention): the same loss and gradient norm
    at every step, the routers' correction biases moving alike."""
    pytest.importorskip("transformers")
    hf, cfg = deepseek_pair(vocab=256, positions=32)
    hf.save_pretrained(tmp_path / "deepseek")
    folder = f'init_from = "{tmp_path / "deepseek"}"\nblock_size = 32\n'
    keys = {k: getattr(cfg, k) for k in ("n_embd", "n_layer", "n_head", "ffn_hidden",
                                          "tie_embeddings", "norm_eps", "attention",
                                          "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                          "qk_rope_head_dim", "v_head_dim", "n_experts",
                                          "experts_per_token", "moe_inter_size",
                                          "n_shared_experts", "moe_layers", "router",
                                          "n_group", "topk_group", "routed_scaling_factor")}
    llama = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    (theirs, _), (ours, _) = cli.train_rows_together([
        (tmp_path / "hf", '[model]\narch = "hf"\n' + folder + NOT_TINY, [], 3),
        (tmp_path / "llama", '[model]\narch = "llama"\n' + folder + llama + NOT_TINY, [], 3)],
        1)
    cli.assert_same_steps(ours, theirs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text, overrides, message", [
    (NOT_TINY, ["model.arch='llama'", "model.kv_lora_rank=16"],
     "model.kv_lora_rank = 16 is a width of multi-head latent attention: set "
     "model.attention = \"mla\""),
    (TINY, ["model.qk_rope_head_dim=7"], "model.qk_rope_head_dim = 7 is odd"),
    (TINY, ["model.topk_group=5"], "model.topk_group = 5 is above model.n_group = 4"),
    (TINY, ["model.n_group=3"], "model.n_group = 3 does not divide model.n_experts = 8"),
    (TINY, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.aux_loss_weight=0"],
     "model.mtp_depth = 1 with parallel.sequence_parallel is not supported yet"),
    (TINY, ["parallel.pp=2", "parallel.schedule='dualpipev'", "parallel.microbatches=4"],
     'model.mtp_depth = 1 with parallel.schedule = "dualpipev" is not supported yet'),
    (NOT_TINY, ["model.mtp_depth=1"], "model.mtp_depth is a key of dtrain's Llama"),
], ids=["latent-width-with-mha", "odd-rope", "topk-group-above-groups", "groups-not-dividing",
        "mtp-sequence-parallel", "mtp-dualpipev", "mtp-on-gpt"])
def test_bad_deepseek_keys_are_one_line(tmp_path: Path, text: str, overrides: list[str],
                                        message: str) -> None:
    """`dtrain train --set ...`: exit 2, one line naming the key, nothing written."""
    cli.assert_refused(tmp_path, text, overrides, message)


def test_a_yarn_folder_is_refused_for_dtrains_llama(tmp_path: Path) -> None:
    """`init_from` of a folder whose config.json scales positions by yarn (DeepSeek-V3's
    published one does): one line naming it and what to use instead."""
    from dtrain.errors import ConfigError
    from dtrain.mesh.config import ParallelConfig
    from dtrain.models.rules import check_layout

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "rope_scaling": {"type": "yarn", "factor": 40}}))
    cfg = resolve(ModelConfig(arch="llama", preset="deepseek-tiny", init_from=str(tmp_path)),
                  256)
    with pytest.raises(ConfigError, match="scales rotary positions by yarn.*use model.arch"):
        check_layout(cfg, ParallelConfig())
