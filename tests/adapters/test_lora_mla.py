"""LoRA's default targets on multi-head latent attention (DeepSeek-V3's, dtrain.models.mla):
dtrain's Llama with `attention = "mla"` gets adapters on every latent projection and on
the dense and shared experts' MLP linears, none on the routed experts, the router, the
embeddings or the head, and computes what PEFT's adapters on the same layers compute;
`arch = "hf"` of a transformers DeepseekV3ForCausalLM adapts the layers PEFT's DeepseekV3
recipe names, with PEFT's logits and gradients; under tensor parallelism (the latent
projections and their adapters whole on every tp rank), with and without sequence
parallelism, the split model equals the unsplit one, and `dtrain train`'s loop at tp = 2
equals one process (slow)."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain.adapters import AdapterConfig, apply
from dtrain.adapters.lora import LoRALinear, adapters
from dtrain.models import ModelConfig, build, resolve
from dtrain.testing import run_ranks
from tests.adapters.test_lora_tensor_parallel import _adapted, _split_rank

TINY = ModelConfig(arch="llama", n_layer=2, n_embd=32, n_head=2, ffn_hidden=48, block_size=16,
                   tie_embeddings=False, norm_eps=1e-6, attention="mla", q_lora_rank=16,
                   kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                   n_experts=8, experts_per_token=2, n_shared_experts=1, moe_inter_size=16,
                   moe_layers="after 1", router="sigmoid_bias", n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, mtp_depth=1)
"""deepseek-tiny's architecture at tests/models/test_deepseek.py's small widths, written
out (a preset would fill q_lora_rank = 0 with its own): a dense first block, then a MoE
block (8 routed experts in 4 groups, one shared), one MTP module."""

PEFT_DEEPSEEK_V3 = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                    "gate_proj", "up_proj", "down_proj"]
"""PEFT's target_modules for a transformers DeepseekV3 as LoRA recipes write them."""


def _latent(block: str, queries: tuple[str, ...]) -> set[str]:
    return {f"{block}.attn.{n}" for n in (*queries, "kv_a_proj_with_mqa", "kv_b_proj",
                                          "o_proj")}


def _mlp(prefix: str) -> set[str]:
    return {f"{prefix}.{n}" for n in ("gate", "up", "down")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("q_lora_rank", [16, 0], ids=["query-bottleneck", "plain-queries"])
def test_defaults_adapt_latent_attention_and_the_dense_and_shared_mlps(q_lora_rank: int
                                                                       ) -> None:
    torch.manual_seed(0)
    model = build(resolve(replace(TINY, q_lora_rank=q_lora_rank), 256))
    names = apply(model, AdapterConfig(kind="lora", rank=4, alpha=8), "llama")
    queries = ("q_a_proj", "q_b_proj") if q_lora_rank else ("q_proj",)
    want = (_latent("blocks.0", queries) | _mlp("blocks.0.mlp")
            | _latent("blocks.1", queries) | _mlp("blocks.1.mlp.shared")
            | _latent("mtp.depths.0.block", queries) | _mlp("mtp.depths.0.block.mlp.shared"))
    assert set(names) == want
    assert set(adapters(model)) == want
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"{n}.{f}.weight" for n in want for f in ("lora_A", "lora_B")}
    unadapted = {n for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear)
                 and ".lora_" not in n}
    assert unadapted == {"head", "mtp.depths.0.eh_proj"}  # the routers are no nn.Linear
    routers = ("blocks.1.mlp.gate.", "mtp.depths.0.block.mlp.gate.")
    assert not any(n.startswith(("embed", "head", *routers)) or ".experts." in n
                   for n in trained)


@pytest.mark.timeout(60)
def test_adapted_latent_attention_equals_peft_on_the_same_layers() -> None:
    """PEFT's LoRA injected into a copy of the same model on the layers dtrain adapted, A
    and B set alike (B random): the same logits and loss, the same gradients of A and B."""
    from peft import LoraConfig, inject_adapter_in_model

    ours = _adapted(TINY)
    torch.manual_seed(0)  # _adapted's base, drawn again
    theirs = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=sorted(adapters(ours))),
        build(resolve(TINY, 256)))
    for name, layer in adapters(ours).items():
        peft_layer = theirs.get_submodule(name)
        peft_layer.lora_A["default"].weight.data.copy_(layer.lora_A.weight)
        peft_layer.lora_B["default"].weight.data.copy_(layer.lora_B.weight)
    x, y = (torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(s))
            for s in (1, 2))
    (logits, loss), (peft_logits, peft_loss) = ours(x, y), theirs(x, y)
    torch.testing.assert_close(logits, peft_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, peft_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    peft_loss.backward()
    for name, layer in adapters(ours).items():
        peft_layer = theirs.get_submodule(name)
        for factor in ("lora_A", "lora_B"):
            torch.testing.assert_close(getattr(layer, factor).weight.grad,
                                       getattr(peft_layer, factor)["default"].weight.grad,
                                       msg=lambda m, n=name, f=factor: f"{n}.{f}: {m}")


class _Plain(nn.Module):
    """A transformers model as a plain module (`.hf`), for PEFT to adapt exactly the
    nn.Linear layers its target_modules name. On a transformers model of version 5 PEFT
    (0.21) retargets a DeepSeek-V3's gate_proj, up_proj and down_proj to the routed
    experts' fused tensors (its adapters of version 4 checkpoints), adapting no dense or
    shared MLP layer; the recipes' list means those layers, as on transformers 4."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf


@pytest.mark.timeout(120)
def test_arch_hf_deepseek_defaults_are_peft_recipes_layers_with_its_outputs(
        tmp_path: Path) -> None:
    """A transformers DeepseekV3ForCausalLM as `arch = "hf"` (dtrain's MoE layer in its
    sparse blocks, the shared experts under it): the default targets are, in the Hugging
    Face model, exactly the linear layers PEFT_DEEPSEEK_V3 names (every latent
    projection, the dense MLP, the shared experts; not the router or the routed experts);
    with A and B set alike, PEFT's adapters there give the same logits and the same
    gradients of A and B."""
    from peft import LoraConfig, inject_adapter_in_model

    from dtrain.adapters.peft import hf_layers
    from dtrain.checkpoint.universal import MODEL
    from dtrain.models import hf_names
    from dtrain.models.weights import HFWeights
    from tests.models.test_deepseek import deepseek_pair

    hf, _ = deepseek_pair()
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig(arch="hf", init_from=str(tmp_path), vocab_size=64, block_size=16)
    ours = build(cfg).eval()
    weights = HFWeights(tmp_path, hf_names(cfg, ours))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(weights.tensor(MODEL + name))
    names = apply(ours, AdapterConfig(kind="lora", rank=4, alpha=8), "hf")
    where = {layer: module for layer, (module, _) in
             hf_layers(hf_names(cfg, ours), names).items()}
    theirs = inject_adapter_in_model(LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PEFT_DEEPSEEK_V3),
        _Plain(copy.deepcopy(hf))).hf
    peft_layers = {n for n, m in theirs.named_modules()
                   if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)}
    assert set(where.values()) == peft_layers
    assert {m.rpartition(".")[2] for m in peft_layers} == set(PEFT_DEEPSEEK_V3)
    assert sum(".shared_experts." in m for m in peft_layers) == 2 * 3  # layers 1 and 2
    torch.manual_seed(1)
    for name, layer in adapters(ours).items():
        layer.lora_B.weight.data.normal_(0, 0.1)
        peft_layer = theirs.get_submodule(where[name])
        peft_layer.lora_A["default"].weight.data.copy_(layer.lora_A.weight)
        peft_layer.lora_B["default"].weight.data.copy_(layer.lora_B.weight)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    mine, peft_logits = ours(x), theirs(input_ids=x).logits
    torch.testing.assert_close(mine, peft_logits, rtol=1e-5, atol=1e-5)
    mine.square().mean().backward()
    peft_logits.square().mean().backward()
    for name, layer in adapters(ours).items():
        peft_layer = theirs.get_submodule(where[name])
        for factor in ("lora_A", "lora_B"):
            torch.testing.assert_close(getattr(layer, factor).weight.grad,
                                       getattr(peft_layer, factor)["default"].weight.grad,
                                       msg=lambda m, n=name, f=factor: f"{n}.{f}: {m}")
    trained = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in ours.named_parameters() if ".lora_" in n}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_split_latent_attention_adapters_equal_the_unsplit_model(sequence_parallel: bool
                                                                 ) -> None:
    """On two tp ranks (latent_attention_plan: q_b_proj and kv_b_proj column-parallel with
    their adapters, o_proj row-parallel, q_a_proj and kv_a_proj_with_mqa whole with
    theirs; the MoE block's shared experts whole): the logits, the loss and every
    adapter's whole gradient equal the unsplit adapted model's. Under sequence parallelism
    without the MTP module, which it does not take yet."""
    cfg = replace(TINY, mtp_depth=0) if sequence_parallel else TINY
    model = _adapted(cfg)
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
    logits, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(".q_a_proj.lora_" in n for n in grads)
    assert any(".kv_a_proj_with_mqa.lora_" in n for n in grads)
    assert grads and all(".lora_" in n for n in grads)
    for whole, part_loss, full, trained in run_ranks(
            _split_rank, 2, copy.deepcopy(model), x, y, sequence_parallel, timeout=150):
        assert trained == sorted(grads)
        torch.testing.assert_close(whole, logits.detach())
        torch.testing.assert_close(part_loss, loss.detach())
        for name, grad in grads.items():
            torch.testing.assert_close(full[name], grad, msg=lambda m, n=name: f"{n}: {m}")
        assert all(full[n] is None for n in full if n not in grads)


MLA_RUN = {"arch": "llama", **{k: v for k, v in vars(TINY).items()
                               if k in ("n_layer", "n_embd", "n_head", "ffn_hidden",
                                        "tie_embeddings", "norm_eps", "attention",
                                        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                        "qk_rope_head_dim", "v_head_dim", "n_experts",
                                        "experts_per_token", "n_shared_experts",
                                        "moe_inter_size", "moe_layers", "router", "n_group",
                                        "topk_group", "routed_scaling_factor", "mtp_depth")},
           "block_size": 32}
"""TINY as a `[model]` section for `dtrain train` (sequences of 32 bytes)."""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_of_latent_attention_trains_under_tp_as_in_one_process(tmp_path: Path) -> None:
    """`dtrain train`'s loop, LoRA with the default targets on TINY: at tp = 2 (and with
    sequence parallelism, without the MTP module) every step's loss and gradient norm and
    the final weights equal one process's, the base unchanged bit for bit (the routers'
    balancing biases move, as in one process)."""
    from tests.adapters.test_lora import _config, _initial, _train

    sp_model = {**MLA_RUN, "mtp_depth": 0}
    alone = run_ranks(_train, 1, [("tp", _config(tmp_path, "one", {"nproc": 1}, MLA_RUN)),
                                  ("tp-sp", _config(tmp_path, "one-sp", {"nproc": 1},
                                                    sp_model))], timeout=250)[0]
    got = run_ranks(_train, 2, [
        ("tp", _config(tmp_path, "tp", {"nproc": 2, "tp": 2}, MLA_RUN)),
        ("tp-sp", _config(tmp_path, "tp-sp", {"nproc": 2, "tp": 2, "sequence_parallel": True},
                          sp_model))], timeout=500)[0]
    for name, model in (("tp", MLA_RUN), ("tp-sp", sp_model)):
        want, initial = alone[name], _initial(tmp_path, model)
        assert {"blocks.0.attn.q_a_proj.lora_A.weight",
                "blocks.0.attn.kv_a_proj_with_mqa.lora_B.weight"} <= set(want["weights"])
        torch.testing.assert_close((got[name]["loss"], got[name]["grad_norm"]),
                                   (want["loss"], want["grad_norm"]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(got[name]["weights"], want["weights"], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
        base = [k for k in want["weights"]  # a router's balancing bias moves by its rule
                if ".lora_" not in k and not k.endswith(".expert_bias")]
        assert all(torch.equal(got[name]["weights"][k], initial[k]) for k in base), name
