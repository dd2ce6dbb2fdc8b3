"""Activation checkpointing (dtrain.models.recompute) equals training without it: the same
loss and gradients, bit for bit with dropout on one process, and the same training steps in
every layout (DataParallel, ZeRO 1-3, tensor and pipeline parallelism) as one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dtrain
from dtrain import pipeline
from dtrain import tensor_parallel as tp
from dtrain.errors import ConfigError
from dtrain.models import ModelConfig, build, recompute, resolve
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.models.recompute import recompute_mode, recompute_modules
from dtrain.testing import run_ranks, run_threads

ALGORITHM = "native"  # "auto" would first calibrate itself on each group
BLOCK, VOCAB, STEPS = 16, 64, 2
EXACT = {"rtol": 0.0, "atol": 0.0}


def model_of(arch: str, dropout: float = 0.2) -> nn.Module:
    torch.manual_seed(0)
    return build(resolve(ModelConfig(arch=arch, n_layer=2, n_head=4, n_embd=32,
                                     block_size=BLOCK, dropout=dropout), VOCAB))


def tokens(step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randint(0, VOCAB, (n, BLOCK), generator=g),
            torch.randint(0, VOCAB, (n, BLOCK), generator=g))


def loss_grads_saved(model: nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, dict, int]:
    """(loss, every parameter's gradient, bytes autograd saved for backward outside
    recomputed modules), with torch's RNG seeded the same for every model."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)[1]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, saved[0]


def assert_same_training(plain: nn.Module, recomputed: nn.Module, *inputs: torch.Tensor) -> int:
    """Loss and gradients bit for bit; returns the bytes saved the recomputation spared."""
    loss, grads, saved = loss_grads_saved(plain, *inputs)
    loss_r, grads_r, saved_r = loss_grads_saved(recomputed, *inputs)
    torch.testing.assert_close(loss_r, loss, **EXACT)
    assert grads_r.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, **EXACT, msg=name)
    return saved - saved_r


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("mode, names", [
    ("full", ["blocks.0", "blocks.1"]),
    ("selective", ["blocks.0.attn.core", "blocks.1.attn.core"])])
def test_modes_equal_no_recomputation_with_dropout(arch: str, mode: str, names: list) -> None:
    """Each mode recomputes its modules (selective: Llama's SwiGLU products too) and
    trains as without recomputation, keeping less."""
    if mode == "selective" and arch == "llama":
        names = ["blocks.0.attn.core", "blocks.0.mlp.act", "blocks.1.attn.core",
                 "blocks.1.mlp.act"]
    plain, recomputed = model_of(arch), model_of(arch)
    assert recompute_mode(recomputed, mode) == names
    assert recompute_mode(recomputed, mode) == names  # again: nothing nests
    assert recompute.recomputed_names(recomputed) == names
    assert [n for n, _ in recomputed.named_modules()] == [n for n, _ in plain.named_modules()]
    assert assert_same_training(plain, recomputed, *tokens(0)) > 0
    assert recompute_mode(model_of(arch), "none") == []


@pytest.mark.timeout(60)
def test_custom_patterns_keep_the_outermost_module() -> None:
    plain, recomputed = model_of("llama"), model_of("llama")
    assert recompute_modules(recomputed, ["blocks.*.attn.core"]) == [
        "blocks.0.attn.core", "blocks.1.attn.core"]
    names = recompute_modules(recomputed, ["blocks.1", "blocks.*.mlp", "blocks.1.mlp.*"])
    assert names == ["blocks.0.attn.core", "blocks.0.mlp", "blocks.1"]
    core = recomputed.blocks[1].attn.core  # inside blocks.1 now: its own recomputation undone
    assert not recompute.is_recomputed(core) and "forward" not in vars(core)
    assert recompute.recomputed_names(recomputed) == names
    assert assert_same_training(plain, recomputed, *tokens(1)) > 0


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.fc(x)) * gate)


class Net(nn.Module):
    """No Stages: "full" recomputes every element of every nn.ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Gated() for _ in range(3))
        self.gate = nn.Parameter(torch.rand(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers:
            x = layer(x, gate=self.gate)
        return x, nn.functional.mse_loss(x, y)


@pytest.mark.timeout(60)
def test_keywords_pass_through_and_a_copy_recomputes_itself() -> None:
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    plain, recomputed = Net(), Net()
    assert recompute_mode(recomputed, "full") == ["layers.0", "layers.1", "layers.2"]
    assert assert_same_training(plain, recomputed, x, y) > 0  # gate's gradient included
    recomputed.zero_grad(set_to_none=True)
    twin = copy.deepcopy(recomputed)
    assert_same_training(plain, twin, x, y)
    assert all(p.grad is None for p in recomputed.parameters())  # the copy ran its own


@pytest.mark.timeout(60)
def test_without_gradients_or_in_eval_the_forward_runs_once(monkeypatch) -> None:
    plain, recomputed = model_of("gpt"), model_of("gpt")
    recompute_mode(recomputed, "full")
    monkeypatch.setattr(recompute, "checkpoint", None)  # calling it would fail
    x, _ = tokens(2)
    with torch.no_grad():
        recomputed(x)
    plain.eval(), recomputed.eval()
    torch.testing.assert_close(recomputed(x), plain(x), **EXACT)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("patterns, message", [
    (["blocks.*.atn"], "'blocks.*.atn' names no module of the model: under 'blocks.*' "
                       "there are attn, ln1, ln2, mlp"),
    (["layers.*"], "'layers.*' names no module of the model: at the top there are blocks, "
                   "drop, head, ln_f, loss_fn, wpe, wte; its blocks are 'blocks.*'"),
    (["blocks"], "'blocks' names ModuleList 'blocks', which is never called: name its "
                 "elements, 'blocks.*'"),
])
def test_a_pattern_naming_no_module_is_one_clear_error(patterns: list, message: str) -> None:
    model = model_of("gpt")
    with pytest.raises(ConfigError) as info:
        recompute_modules(model, ["blocks.0", *patterns])
    assert str(info.value) == f"memory.recompute_modules: {message}"
    assert recompute.recomputed_names(model) == []  # nothing applied before the error


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model, mode, message", [
    (lambda: model_of("gpt"), "some", "memory.recompute = 'some' is unknown"),
    (lambda: nn.Sequential(nn.Linear(2, 2)), "full", "list the modules to recompute in "
                                                     "[memory] recompute_modules"),
    (lambda: Net(), "selective", "Net has no attention core dtrain can recompute"),
])
def test_a_mode_with_nothing_to_recompute_is_one_clear_error(model, mode: str,
                                                             message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as info:
        recompute_mode(model(), mode)
    assert "\n" not in str(info.value)


@pytest.mark.timeout(60)
def test_apply_reads_the_memory_section() -> None:
    memory = dtrain.config.MemoryConfig(recompute="selective")
    model = model_of("gpt")
    assert recompute.apply(model, memory) == ["blocks.0.attn.core", "blocks.1.attn.core"]
    memory.recompute_modules = ["blocks.*.mlp"]
    assert recompute.apply(model_of("gpt"), memory) == ["blocks.0.mlp", "blocks.1.mlp"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_hugging_face_models_equal_no_recomputation(family: str, mode: str) -> None:
    transformers = pytest.importorskip("transformers")
    from dtrain.models.hf import HFCausalLM

    tiny = {"vocab_size": VOCAB, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None}
    configs = {
        "llama": lambda: transformers.LlamaConfig(
            **tiny, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.3),
        "gpt2": lambda: transformers.GPT2Config(**tiny, n_embd=32, n_layer=2, n_head=4,
                                                n_positions=BLOCK, attn_pdrop=0.3)}

    def hf_model(attention: str = "sdpa") -> HFCausalLM:
        torch.manual_seed(0)
        return HFCausalLM(transformers.AutoModelForCausalLM.from_config(
            configs[family](), attn_implementation=attention), BLOCK)

    plain, recomputed = hf_model(), hf_model()
    names = recompute_mode(recomputed, mode)
    layers = "hf.model.layers" if family == "llama" else "hf.transformer.h"
    attention = ".self_attn" if family == "llama" else ".attn"
    assert names == [f"{layers}.{i}{attention if mode == 'selective' else ''}" for i in (0, 1)]
    assert recompute_mode(recomputed, mode) == names
    assert assert_same_training(plain, recomputed, *tokens(3)) > 0
    plain.eval(), recomputed.eval()
    with torch.no_grad():
        torch.testing.assert_close(recomputed(tokens(3)[0]), plain(tokens(3)[0]), **EXACT)
    if mode == "selective":
        with pytest.raises(ConfigError, match="attends with 'eager'"):
            recompute_mode(hf_model("eager"), mode)


# ----------------------------------------------------------------------- layouts
CFG = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def serial() -> dict:
    model = gpt()
    opt = sgd(model.parameters())
    for step in range(STEPS):
        model(*tokens(step))[1].backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train_in(kind: str, base: GPT) -> dict:
    """STEPS steps of a copy of `base`, recomputed ("full"), in layout `kind` over the
    whole world (2 ranks). Returns {name: (tensor, how it is split or None)} of what this
    rank holds: tp and pp gather nothing (their gathers would calibrate "auto" first)."""
    model, rank = copy.deepcopy(base), dtrain.world.current().rank
    if kind == "tp":
        tp.parallelize(model, tp.gpt_plan(CFG), algorithm=ALGORITHM)
    recompute_mode(model, "full")
    half = slice(2 * rank, 2 * rank + 2)  # a data-parallel rank's half of the batch
    if kind.startswith("zero"):
        z = dtrain.ZeRO(model, sgd, stage=int(kind[-1]), bucket_mb=0.01, algorithm=ALGORITHM)
        for step in range(STEPS):
            x, y = tokens(step)
            z.backward(z(x[half], y[half])[1])
            z.step()
            z.zero_grad()
        return {name: (value, None) for name, value in z.state_dict().items()}
    if kind == "pp":
        mine = pipeline.pieces_for(pipeline.cut(model, 2))
        pipe = pipeline.Pipeline(mine, microbatches=2, schedule="1f1b", loss_fn=pipeline.lm_loss,
                                 tied=pipeline.tied_weights(model, mine))
        opt = sgd(nn.ModuleList(mine).parameters())
        step_loss = pipe.step
    else:
        wrapped = dtrain.DataParallel(model, algorithm=ALGORITHM) if kind == "dp" else model
        opt = sgd(model.parameters())
        batch = half if kind == "dp" else slice(None)

        def step_loss(x: torch.Tensor, y: torch.Tensor) -> None:
            wrapped(x[batch], y[batch])[1].backward()

    for step in range(STEPS):
        step_loss(*tokens(step))
        opt.step()
        opt.zero_grad()
    held = {k: v for piece in mine for k, v in piece.state_dict().items()} if kind == "pp" \
        else model.state_dict()
    splits = {name: split for name, (split, _) in tp.placements(model).items()}
    return {name: (value, splits.get(name)) for name, value in held.items()}


def every_layout(base: GPT, layouts: list[str]) -> dict:
    return {kind: train_in(kind, base) for kind in layouts}


def check_layouts(results: list[dict], layouts: list[str]) -> None:
    """Every rank's tensors are the one-process model's (their blocks where split), and
    together the ranks hold all of it."""
    expected = serial()
    for kind in layouts:
        seen = set()
        for rank, states in enumerate(results):
            for name, (value, split) in states[kind].items():
                whole = expected[name]
                want = whole if split is None else split.shard(whole, rank, len(results))
                where = f"{kind}, rank {rank}: {name}"
                torch.testing.assert_close(value, want, msg=lambda message, at=where: (
                    f"{at}: {message}"))
                seen.add(name)
        assert seen == set(expected), kind


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layouts", [
    pytest.param(["dp", "zero1", "zero2", "zero3", "tp"], id="dp-zero-tp"),
    pytest.param(["pp"], id="pp", marks=pytest.mark.slow),  # its loss all-reduce calibrates
])
def test_full_recomputation_in_every_layout_equals_one_process(layouts: list[str]) -> None:
    """One world of 2 processes runs the layouts in turn: DataParallel, ZeRO 1-3, tp=2;
    pp=2 with the slow tests (the quick ones run it on threads, below)."""
    check_layouts(run_ranks(every_layout, 2, gpt(), layouts, timeout=120), layouts)


@pytest.mark.timeout(60)
def test_full_recomputation_in_a_pipeline_on_threads_equals_one_process() -> None:
    base = gpt()  # built here: threads share torch's RNG, so none of them may draw from it
    check_layouts(run_threads(lambda rank: every_layout(base, ["pp"]), 2, timeout=50), ["pp"])
