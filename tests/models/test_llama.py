"""dtrain's Llama: Hugging Face's logits from the mapped weights, presets, tensor and
pipeline parallelism equal to one process, clear configuration errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dtrain import comm, pipeline
from dtrain import tensor_parallel as tp
from dtrain.errors import ConfigError
from dtrain.models import ModelConfig, build, resolve
from dtrain.models.convert import hf_config_of, hf_names
from dtrain.models.generate import generate
from dtrain.models.llama import Llama, LlamaConfig, llama_config, parameter_count
from dtrain.testing import run_ranks, run_threads

ALGORITHM = "native"
SMALL = {"block_size": 16, "n_layer": 2, "n_embd": 32, "n_head": 4}
TIED = ModelConfig(arch="llama", **SMALL, n_kv_head=2, ffn_hidden=64, tie_embeddings=True)
UNTIED = dataclasses.replace(TIED, tie_embeddings=False, rope_theta=500000.0)
QK_NORM = dataclasses.replace(TIED, qk_norm=True)  # Qwen3's per-head norms, shared by heads


def model_of(cfg: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return build(resolve(cfg, 256))


def tokens(step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randint(0, 256, (n, SMALL["block_size"]), generator=g),
            torch.randint(0, 256, (n, SMALL["block_size"]), generator=g))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", [
    ModelConfig(arch="gpt", **SMALL), TIED, UNTIED,
    dataclasses.replace(TIED, n_kv_head=0, ffn_hidden=0, norm_eps=1e-6),  # MHA, Llama's width
], ids=["gpt", "llama-tied-gqa", "llama-untied-gqa", "llama-mha"])
def test_logits_equal_hugging_face_with_the_mapped_weights(cfg: ModelConfig) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = resolve(cfg, 256)
    model = model_of(cfg).eval()
    config = transformers.AutoConfig.for_model(**hf_config_of(cfg))
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    names = hf_names(cfg)
    assert names.keys() == dict(model.named_parameters()).keys()
    state = {theirs: p.T if transposed else p
             for ours, p in model.named_parameters() for theirs, transposed in [names[ours]]}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    tied = cfg.arch == "gpt" or cfg.tie_embeddings
    assert not unexpected and missing == (["lm_head.weight"] if tied else [])
    assert (hf.lm_head.weight is hf.get_input_embeddings().weight) == tied
    idx = tokens(0)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-5, rtol=1e-5)


def test_hugging_face_config_round_trips() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = resolve(ModelConfig(arch="llama", preset="llama-3-8b"), 256)
    config = transformers.AutoConfig.for_model(**hf_config_of(cfg))
    assert type(config).__name__ == "LlamaConfig"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.vocab_size,
            config.max_position_embeddings, config.tie_word_embeddings) == (
        4096, 14336, 32, 32, 8, 128256, 8192, False)
    assert config.rope_parameters["rope_theta"] == 500000.0
    again = transformers.AutoConfig.for_model(**config.to_dict())
    assert again.rope_parameters["rope_theta"] == 500000.0
    with pytest.raises(ConfigError, match="only its built-in models"):
        hf_config_of(ModelConfig(arch="hf"))


@pytest.mark.parametrize("preset, count", [
    ("llama-3.2-1b", 1_235_814_400), ("llama-3-8b", 8_030_261_248),
    ("llama-3-70b", 70_553_706_496),
])
def test_presets_have_the_published_parameter_counts(preset: str, count: int) -> None:
    assert parameter_count(llama_config(resolve(ModelConfig(arch="llama", preset=preset),
                                                256))) == count


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_counts_the_built_model(tie: bool) -> None:
    cfg = LlamaConfig(vocab_size=100, n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                      ffn_hidden=48, tie_embeddings=tie)
    assert parameter_count(cfg) == sum(p.numel() for p in Llama(cfg).parameters())


def test_preset_resolves_and_builds() -> None:
    cfg = resolve(ModelConfig(arch="llama", preset="llama-tiny"), 256)
    model = build(cfg)
    assert isinstance(model, Llama)
    assert (model.cfg.n_layer, model.cfg.n_embd, model.cfg.n_kv_head, model.cfg.ffn_hidden,
            model.cfg.vocab_size, model.cfg.tie_embeddings) == (4, 128, 2, 352, 256, False)
    assert model.head.weight is not model.embed.weight
    assert model.blocks[0].attn.k_proj.out_features == 2 * 32
    idx, targets = tokens(0, 2)
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 256) and loss.item() == pytest.approx(5.545, abs=0.05)
    out = generate(model, idx[:, :4], 3, model.cfg.block_size,
                   generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 7) and torch.equal(out[:, :4], idx[:, :4])
    assert llama_config(dataclasses.replace(cfg, ffn_hidden=0)).ffn_hidden == 512  # 341 -> 512


def test_grouped_query_attention_shares_each_key_value_head() -> None:
    """A GQA model equals the multi-head model whose key/value heads repeat each of its
    own `n_head / n_kv_head` times, in order (query head i reads key/value head i // 2)."""
    gqa = model_of(TIED)
    mha = Llama(dataclasses.replace(gqa.cfg, n_kv_head=gqa.cfg.n_head))
    state = gqa.state_dict()
    for name, value in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = value.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    idx = tokens(1)[0]
    torch.testing.assert_close(gqa(idx), mha(idx))


def split_rank(base: Llama, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """One tensor-parallel rank: its gathered logits, loss, whole gradients and state."""
    model = tp.parallelize(base, tp.llama_plan(base.cfg), algorithm=ALGORITHM)
    part, part_loss = model(x, y)
    part_loss.backward()
    assert model.blocks[0].attn.k_proj.weight.shape == (8, 32)  # one key/value head
    whole = tp.gather_last(part, comm.resolve(None), ALGORITHM)
    return whole.detach(), part_loss.detach(), tp.full_grads(model), tp.full_state_dict(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cfg", [TIED, QK_NORM, pytest.param(UNTIED, marks=pytest.mark.slow)],
                         ids=["tied", "qk-norm", "untied"])
def test_tensor_parallel_loss_and_gradients_equal_unsplit(cfg: ModelConfig) -> None:
    """Two processes on gloo, each holding one of the two key/value heads (with Qwen3's
    per-head norms: whole on each rank, their gradients summed over its heads)."""
    base = model_of(cfg)
    x, y = tokens(0)
    split = copy.deepcopy(base)
    logits, loss = base(x, y)
    loss.backward()
    grads = {n: p.grad for n, p in base.named_parameters()}
    for whole, part_loss, full_grads, state in run_ranks(split_rank, 2, split, x, y,
                                                         timeout=100):
        torch.testing.assert_close(whole, logits.detach())
        torch.testing.assert_close(part_loss, loss.detach())
        assert full_grads.keys() == grads.keys() | {"head.weight"}
        for name, grad in grads.items():
            torch.testing.assert_close(full_grads[name], grad, msg=name)
        torch.testing.assert_close(state, base.state_dict())


@pytest.mark.timeout(60)
def test_tensor_parallel_degree_must_divide_the_key_value_heads() -> None:
    base = model_of(TIED)

    def body(rank: int) -> None:
        tp.parallelize(copy.deepcopy(base), tp.llama_plan(base.cfg), algorithm=ALGORITHM)

    with pytest.raises(RuntimeError) as info:
        run_threads(body, 4)
    assert isinstance(info.value.__cause__, ConfigError)
    assert "tp=4 does not divide the 2 attention heads of blocks.0.attn.k_proj" in str(
        info.value.__cause__)


@pytest.mark.parametrize("change, message", [
    ({"n_head": 3}, "model.n_head = 3 does not divide model.n_embd = 32"),
    ({"n_kv_head": 3}, "model.n_kv_head = 3 does not divide model.n_head = 4"),
    ({"n_embd": 36}, "model.n_embd / model.n_head = 9 is odd"),
])
def test_inconsistent_shapes_are_config_errors(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        build(resolve(dataclasses.replace(TIED, **change), 256))


def test_pieces_in_sequence_equal_the_whole_model() -> None:
    model = model_of(UNTIED)
    x = tokens(2)[0]
    h = x
    for piece in pipeline.cut(model, 2):
        h = piece(h)
    torch.testing.assert_close(h, model(x))


STEPS = 2


def train_pipeline(cfg: ModelConfig, group: object = None) -> dict:
    model = model_of(cfg)
    mine = pipeline.pieces_for(pipeline.cut(model, 2), group)
    tied = pipeline.tied_weights(model, mine, group)
    pipe = pipeline.Pipeline(mine, group, microbatches=2, schedule="1f1b",
                             loss_fn=pipeline.loss_of(model), tied=tied)
    opt = torch.optim.AdamW(torch.nn.ModuleList(mine).parameters(), lr=1e-2, eps=1e-4)
    losses = []
    for step in range(STEPS):
        losses.append(pipe.step(*tokens(step)).item())
        opt.step()
        opt.zero_grad()
    state = {k: v for piece in mine for k, v in piece.state_dict().items()}
    return {"losses": losses, "state": state, "tied": len(tied)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_rank_pipeline_equals_one_process() -> None:
    """1F1B on two processes, the tied embedding and head on different ranks."""
    model = model_of(TIED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses = []
    for step in range(STEPS):
        loss = model(*tokens(step))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    results = run_ranks(train_pipeline, 2, TIED, timeout=100)
    assert [r["tied"] for r in results] == [1, 1]
    state = model.state_dict()
    want = torch.tensor(losses, dtype=torch.float32)  # compared at float32's tolerance
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float32), want)
        for name, value in r["state"].items():
            torch.testing.assert_close(value, state[name], msg=name)
    assert set().union(*(r["state"] for r in results)) == set(state)


def _written_out_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, written out: in float32 (float64 for float64), cast
    back, then the weight."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rms_norm_is_the_written_out_norm_bit_for_bit(dtype: torch.dtype) -> None:
    """dtrain's RMSNorm (torch's F.rms_norm, one kernel on CUDA) gives Hugging Face's
    written-out norm's values and gradients exactly on a CPU (tests/gpu: within bf16's
    rounding on CUDA)."""
    from dtrain.models.llama_parts import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    weight = norm.weight.detach().clone().requires_grad_()
    grad = torch.randn(3, 5, 64, dtype=dtype)
    got, want = norm(x), _written_out_rms_norm(x_ref, weight, 1e-5)
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(got, want)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(norm.weight.grad, weight.grad)
