"""Hugging Face causal LMs as dtrain models (`arch = "hf"`): data parallelism, ZeRO-3,
tensor and pipeline parallelism equal one process; GPT-2's Conv1D conversion and the
name map keep the logits; clear configuration errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import dtrain
from dtrain import comm, pipeline
from dtrain import tensor_parallel as tp
from dtrain.errors import ConfigError
from dtrain.models import ModelConfig, build, resolve
from dtrain.models.hf import HFCausalLM, hf_names
from dtrain.testing import run_threads

transformers = pytest.importorskip("transformers")

ALGORITHM = "native"  # "auto" would first calibrate itself on each group
BLOCK, BATCH, STEPS = 16, 4, 3
TINY = {"vocab_size": 256, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None}
ROTARY = {**TINY, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**ROTARY),  # untied head, grouped-query
    "gpt2": lambda: transformers.GPT2Config(**TINY, n_embd=64, n_layer=2, n_head=4,
                                            n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                            attn_pdrop=0.0),  # tied head, Conv1D
    "qwen2": lambda: transformers.Qwen2Config(**ROTARY, tie_word_embeddings=True),  # QKV biases
}


def same(actual, expected, what: str) -> None:
    """assert_close, naming what differs."""
    torch.testing.assert_close(actual, expected, msg=lambda message: f"{what}: {message}")


def config_dir(tmp: Path, name: str, config=None) -> str:
    folder = tmp / name
    (config or CONFIGS[name]()).save_pretrained(folder)
    return str(folder)


def model_of(path: str, block_size: int = BLOCK) -> HFCausalLM:
    torch.manual_seed(0)
    return build(resolve(ModelConfig(arch="hf", hf_config=path, block_size=block_size), 256))


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(400 + step)
    return (torch.randint(0, 256, (BATCH, BLOCK), generator=g),
            torch.randint(0, 256, (BATCH, BLOCK), generator=g))


def adamw(params) -> torch.optim.Optimizer:
    """eps well above rounding noise: a key bias's gradient is zero in exact arithmetic."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)


def train(step_loss, params) -> torch.Tensor:
    """STEPS AdamW steps; `step_loss(x, y)` runs forward and backward, returns the loss.
    The losses come back as a float32 tensor, compared at float32's tolerance."""
    opt = adamw(params)
    losses = []
    for step in range(STEPS):
        losses.append(step_loss(*tokens(step)).item())
        opt.step()
        opt.zero_grad()
    return torch.tensor(losses)


def backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def serial(path: str) -> tuple[torch.Tensor, dict]:
    model = model_of(path)
    return train(lambda x, y: backward(model(x, y)[1]), model.parameters()), model.state_dict()


def every_layout(rank: int, base: HFCausalLM) -> dict[str, tuple[torch.Tensor, dict]]:
    """On each of 2 ranks: DataParallel and ZeRO-3 (half of each global batch), tensor
    parallelism (hf_plan, after_split) and a 2-stage pipeline (the whole batch); each
    strategy's losses and final weights. Every model is a copy of `base` (model_of's):
    the ranks are threads, which would race on torch's global seed."""
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    out = {}

    model = copy.deepcopy(base)
    data_parallel = dtrain.DataParallel(model, algorithm=ALGORITHM)
    losses = train(lambda x, y: backward(data_parallel(x[half], y[half])[1]),
                   data_parallel.parameters())
    out["dp"] = losses, model.state_dict()

    zero = dtrain.ZeRO(copy.deepcopy(base), adamw, stage=3, algorithm=ALGORITHM)
    losses = []
    for step in range(STEPS):
        x, y = tokens(step)
        loss = zero(x[half], y[half])[1]
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
    out["zero3"] = torch.tensor(losses), zero.state_dict()

    model = copy.deepcopy(base)
    tp.parallelize(model, tp.hf_plan(model), algorithm=ALGORITHM)
    model.after_split(2)
    losses = train(lambda x, y: backward(model(x, y)[1]), model.parameters())
    out["tp"] = losses, tp.full_state_dict(model)

    model = copy.deepcopy(base)
    mine = pipeline.pieces_for(pipeline.cut(model, 2))
    pipe = pipeline.Pipeline(mine, microbatches=2, schedule="1f1b",
                             loss_fn=pipeline.loss_of(model),
                             tied=pipeline.tied_weights(model, mine))
    losses = train(pipe.step, nn.ModuleList(mine).parameters())
    out["pp"] = losses, {k: v for piece in mine for k, v in piece.state_dict().items()}
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_every_layout_on_two_ranks_equals_one_process(tmp_path: Path, name: str) -> None:
    """On two in-process ranks (dtrain.testing): processes would each import transformers
    and build the models again, for the same collectives."""
    path = config_dir(tmp_path, name)
    losses, state = serial(path)
    results = run_threads(every_layout, 2, model_of(path), timeout=120)
    for kind in ("dp", "zero3"):  # each rank's loss is its half's
        mean = (results[0][kind][0] + results[1][kind][0]) / 2
        same(mean, losses, kind)
        for r in results:
            same(r[kind][1], state, kind)
    for r in results:  # the whole batch on every rank
        same(r["tp"][0], losses, "tp")
        same(r["tp"][1], state, "tp")
        same(r["pp"][0], losses, "pp")
    pieces = [r["pp"][1] for r in results]
    assert set().union(*pieces) == set(state)
    for piece in pieces:
        for key, value in piece.items():
            same(value, state[key], key)


@pytest.mark.timeout(60)
def test_qwen2_tied_with_biases_splits_like_one_process(tmp_path: Path) -> None:
    base = model_of(config_dir(tmp_path, "qwen2"))
    x, y = tokens(0)
    logits, loss = base(x, y)
    loss.backward()
    grads = {n: p.grad for n, p in base.named_parameters()}

    def body(rank: int) -> tuple:
        model = copy.deepcopy(base)
        tp.parallelize(model, tp.hf_plan(model), algorithm=ALGORITHM)
        model.after_split(2)
        model.zero_grad()
        part, part_loss = model(x, y)
        part_loss.backward()
        whole = tp.gather_last(part, comm.resolve(None), ALGORITHM)
        assert model.hf.model.layers[0].self_attn.k_proj.bias.shape == (16,)  # 1 of 2 kv heads
        assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
        return whole.detach(), part_loss.detach(), tp.full_grads(model)

    for whole, part_loss, full in run_threads(body, 2):
        torch.testing.assert_close(whole, logits.detach())
        torch.testing.assert_close(part_loss, loss.detach())
        for name, grad in grads.items():
            same(full[name], grad, name)


def test_conv1d_conversion_and_name_map_keep_the_logits(tmp_path: Path) -> None:
    config = CONFIGS["gpt2"]()
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = HFCausalLM(copy.deepcopy(hf), BLOCK)
    attn = model.hf.transformer.h[0].attn
    assert type(attn.c_attn) is nn.Linear and attn.c_attn.weight.shape == (192, 64)
    assert "hf.transformer.h.1.mlp.c_proj.weight" in model.transposed
    idx = tokens(0)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits)

    for name in ("gpt2", "llama"):  # a fresh model loads HF's state dict through hf_names
        theirs = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
        ours = model_of(config_dir(tmp_path, name))
        state = theirs.state_dict()
        names = hf_names(ours)
        assert names.keys() == dict(ours.named_parameters()).keys()
        ours.load_state_dict({n: state[h].T if t else state[h] for n, (h, t) in names.items()},
                             strict=False)
        with torch.no_grad():
            same(ours(idx), theirs(idx).logits, name)


def _config_error(job) -> str:
    with pytest.raises(ConfigError) as info:
        job()
    message = str(info.value)
    assert "\n" not in message
    return message


def write(tmp: Path, text: str) -> str:
    (tmp / "config.json").write_text(text)
    return str(tmp / "config.json")


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist: give a Hugging Face config.json"),
    ("empty folder", "does not exist: give a Hugging Face config.json"),
    ("not json", "is not JSON"),
    ("unknown type", "does not know model_type 'no-such-model'"),
    ("bert", "model_type 'bert' ("),
    ("t5", "model_type 't5' ("),
    ("small vocabulary", "vocab_size = 128 in"),
    ("long block", "model.block_size = 128 exceeds n_positions = 64"),
    ("nothing named", "needs model.hf_config"),
])
def test_bad_configs_are_one_line_errors(tmp_path: Path, case: str, message: str) -> None:
    block = 128 if case == "long block" else BLOCK
    paths = {
        "missing": lambda: str(tmp_path / "nope.json"),
        "empty folder": lambda: str(tmp_path),
        "not json": lambda: write(tmp_path, "{not json"),
        "unknown type": lambda: write(tmp_path, json.dumps({"model_type": "no-such-model"})),
        "bert": lambda: config_dir(tmp_path, "bert", transformers.BertConfig(
            vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=64)),
        "t5": lambda: config_dir(tmp_path, "t5", transformers.T5Config(
            vocab_size=256, d_model=32, d_ff=64, num_layers=1, num_heads=2)),
        "small vocabulary": lambda: config_dir(tmp_path, "llama", transformers.LlamaConfig(
            **{**ROTARY, "vocab_size": 128})),
        "long block": lambda: config_dir(tmp_path, "gpt2"),
        "nothing named": lambda: "",
    }
    found = _config_error(lambda: model_of(paths[case](), block))
    assert message in found
    if case in ("bert", "t5"):
        assert "arch \"hf\" needs a causal LM" in found


def test_families_without_plans_or_stages_say_what_to_do(tmp_path: Path) -> None:
    opt = model_of(config_dir(tmp_path, "opt", transformers.OPTConfig(
        **TINY, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32)))
    assert "'opt'" in _config_error(lambda: tp.hf_plan(opt))
    assert "[model] tp_plan" in _config_error(lambda: tp.hf_plan(opt))
    assert "pipeline stages for model type 'opt' are not known" in _config_error(
        lambda: pipeline.cut(opt, 2))
    mistral = model_of(config_dir(tmp_path, "mistral", transformers.MistralConfig(
        **ROTARY, sliding_window=8)))
    assert "sliding_window = 8" in _config_error(lambda: pipeline.cut(mistral, 2))


@pytest.mark.timeout(60)
def test_tp_must_divide_the_key_value_heads(tmp_path: Path) -> None:
    base = model_of(config_dir(tmp_path, "llama"))  # 4 query heads, 2 key/value heads

    def body(rank: int) -> None:
        model = copy.deepcopy(base)
        tp.parallelize(model, tp.hf_plan(model), algorithm=ALGORITHM)

    with pytest.raises(RuntimeError) as info:
        run_threads(body, 4)
    assert isinstance(info.value.__cause__, ConfigError)
    assert ("tp=4 does not divide the 2 attention heads of "
            "hf.model.layers.0.self_attn.k_proj") in str(info.value.__cause__)
