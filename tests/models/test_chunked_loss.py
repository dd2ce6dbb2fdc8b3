"""The chunked loss (`[train] loss = "chunked"`, dtrain.models.chunked_loss) equals the
plain one: the loss and the gradients of the hidden states, the head's weight and bias,
on random inputs, an uneven last chunk, a chunk longer than the tokens, masked targets
and a chunk with none; through dtrain's GPT and Llama and Hugging Face models; split by
vocabulary under tensor parallelism (with sequence parallelism too), on a pipeline's last
stage, under compile; and `dtrain train` with it equals `dtrain train` without, step for
step. It holds one chunk's logits at most (counted, not timed), and refuses in one line
what it cannot compute."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from dtrain import comm, models, pipeline
from dtrain import tensor_parallel as tp
from dtrain.checkpoint import universal
from dtrain.config import config_from_dict
from dtrain.errors import ConfigError
from dtrain.models import chunked_loss
from dtrain.models.chunked_loss import apply, linear_cross_entropy
from dtrain.models.compiled import compile_blocks
from dtrain.models.config import ModelConfig
from dtrain.pipeline.pieces import hidden_for_loss
from dtrain.planner import LiveBytes
from dtrain.testing import run_ranks, run_threads
from tests.support import cli

EXACT = {"rtol": 1e-6, "atol": 1e-6}
"""fp32, as tight as sums taken chunk by chunk allow (measured: 5e-8 apart at most)."""
ALGORITHM = "native"  # "auto" would first calibrate itself on each group
SHAPES = {
    "gpt": {"arch": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
    "llama": {"arch": "llama", "preset": "llama-tiny", "n_layer": 2, "n_embd": 32,
              "n_head": 4, "n_kv_head": 2, "ffn_hidden": 64, "block_size": 16},
}
VOCAB, T = 96, 16


def model_of(arch: str, vocab: int = VOCAB) -> nn.Module:
    torch.manual_seed(0)
    return models.build(models.resolve(ModelConfig(**SHAPES[arch]), vocab))


def batch(seed: int = 0, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows of token ids and targets; `masked`: a few targets masked (-100), and row
    1's first half all."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (4, T), generator=g)
    y = torch.randint(0, VOCAB, (4, T), generator=g)
    if masked:
        y[0, ::3] = -100
        y[1, : T // 2] = -100
    return x, y


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(plain: nn.Module, chunked: nn.Module, *args: torch.Tensor,
                     **kwargs: object) -> None:
    """`chunked(*args, **kwargs)` returns no logits, and the loss and every parameter's
    gradient of `plain`'s."""
    logits, want = plain(*args, **kwargs)
    none, got = chunked(*args, **kwargs)
    assert logits is not None and none is None
    torch.testing.assert_close(got, want, **EXACT)
    want.backward()
    got.backward()
    want_grads, got_grads = grads_of(plain), grads_of(chunked)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **EXACT, msg=name)


# ------------------------------------------------------------------ the function
def targets_of(n: int, vocab: int) -> torch.Tensor:
    """`n` targets, some masked, and tokens 14..20 (one chunk of 7) all masked."""
    t = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))
    t[::5] = -100
    t[14:21] = -100
    return t


@pytest.mark.parametrize("chunk", [1, 7, 40, 64], ids=["one", "uneven", "exact", "longer"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_equals_the_plain_loss_and_its_gradients(chunk: int, bias: bool) -> None:
    """40 tokens in chunks of 1, 7 (the last of 5), 40 and 64 (longer than the tokens):
    the loss and the gradients of the hidden states, weight and bias equal
    F.cross_entropy over F.linear's logits, masked targets and a chunk of only masked
    ones included."""
    torch.manual_seed(0)
    hidden = torch.randn(40, 24, requires_grad=True)
    weight = torch.randn(50, 24, requires_grad=True)
    b = torch.randn(50, requires_grad=True) if bias else None
    targets = targets_of(40, 50)
    leaves = [t for t in (hidden, weight, b) if t is not None]
    want = F.cross_entropy(F.linear(hidden, weight, b), targets)
    want_grads = torch.autograd.grad(want, leaves)
    got = linear_cross_entropy(hidden, weight, b, targets, chunk)
    torch.testing.assert_close(got, want, **EXACT)
    for g, w in zip(torch.autograd.grad(got, leaves), want_grads, strict=True):
        torch.testing.assert_close(g, w, **EXACT)


def test_shapes_no_grad_and_no_target() -> None:
    """(batch, time, d) hidden states with (batch, time) targets as the model gives them;
    without autograd the loss alone, the same; with no target at all a loss of 0 and zero
    gradients (the plain mean is 0 / 0 there)."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    want = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), targets.flatten())
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, None, targets, 4),
                                   want, **EXACT)
    none = linear_cross_entropy(hidden, weight, None, torch.full((3, 5), -100), 4)
    none.backward()
    assert none.item() == 0.0
    assert not hidden.grad.any() and not weight.grad.any()
    with pytest.raises(ValueError, match="14 targets for 15 hidden states"):
        linear_cross_entropy(hidden, weight, None, targets.flatten()[:14], 4)


def test_never_holds_the_logits_of_every_token() -> None:
    """Live tensor bytes over forward and backward (dtrain.planner.LiveBytes, counted, not
    timed), 1024 tokens at a vocabulary of 1024: the plain loss holds its N x V logits and
    their log-softmax (2 x 4 MiB) and more; the chunked one, 64 tokens at a time, stays
    under a quarter of one N x V tensor (a chunk's logits, the gradients of the hidden
    states and the weight)."""
    torch.manual_seed(0)
    n, vocab, d = 1024, 1024, 8
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    logits_bytes = n * vocab * 4

    def peak(loss_of) -> int:
        tracker = LiveBytes()
        with tracker:
            loss_of().backward()
        hidden.grad = weight.grad = None
        return tracker.peak

    plain = peak(lambda: F.cross_entropy(F.linear(hidden, weight), targets))
    chunked = peak(lambda: linear_cross_entropy(hidden, weight, None, targets, 64))
    assert plain >= 2 * logits_bytes
    assert chunked < logits_bytes / 4, (chunked, logits_bytes)


# ------------------------------------------------------------------ the models
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_models_equal_their_plain_loss(arch: str) -> None:
    """dtrain's GPT (its head tied to the embedding) and Llama, chunked by 24 tokens (the
    last chunk uneven): (None, loss), the loss and every parameter's gradient equal the
    plain model's, with packed documents and a loss weight; with weight 0, zero
    gradients for every parameter (none left without)."""
    plain, chunked = model_of(arch), model_of(arch)
    assert apply(chunked, "chunked", 24) == "chunked loss (24 tokens a chunk)"
    x, y = batch()
    positions = torch.arange(T).repeat(4, 1) % 10  # documents of 10 tokens
    assert_same_step(plain, chunked, x, y, positions=positions, weight=0.5)
    chunked.zero_grad()
    chunked(x, y, weight=0)[1].backward()
    assert all(p.grad is not None and not p.grad.any() for p in chunked.parameters())
    torch.testing.assert_close(chunked(x), plain(x))  # without targets: logits


HF_LLAMA = {"vocab_size": VOCAB, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32}
HF_GPT2 = {"vocab_size": VOCAB, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2,
           "bos_token_id": None, "eos_token_id": None, "resid_pdrop": 0.0,
           "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.mark.parametrize("kind, config", [("llama", HF_LLAMA), ("gpt2", HF_GPT2)])
def test_hugging_face_models_equal_their_plain_loss(tmp_path: Path, kind: str,
                                                    config: dict) -> None:
    """arch "hf": the base model's final hidden states through `lm_head` chunk by chunk
    equal transformers' own logits' loss, and every gradient; a model type whose head
    dtrain does not know keeps the plain loss under "auto" and is refused "chunked"."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": kind, **config}))
    shape = ModelConfig(arch="hf", hf_config=str(tmp_path), block_size=T)
    torch.manual_seed(0)
    plain = models.build(models.resolve(shape, VOCAB))
    chunked = copy.deepcopy(plain)
    apply(chunked, "chunked", 20)
    assert_same_step(plain, chunked, *batch())
    chunked.family = None  # as a model type outside dtrain.models.hf.FAMILIES
    assert apply(chunked, "auto") == "" and chunked.loss_chunk == 0
    with pytest.raises(ConfigError, match="not a head on its final hidden states"):
        apply(chunked, "chunked")


def test_apply_chooses_and_refuses_in_one_line() -> None:
    """"auto" chunks from 32000 token ids on, "plain" never; "chunked" is refused for a
    LoRA-adapted head and a module of its own, naming the reason and the fix."""
    from dtrain.adapters import AdapterConfig
    from dtrain.adapters.lora import apply as adapt

    small, large = model_of("gpt"), model_of("gpt", vocab=chunked_loss.AUTO_VOCABULARY)
    assert apply(small, "auto") == "" and small.loss_chunk == 0
    assert apply(large, "auto", 512) == "chunked loss (512 tokens a chunk)"
    assert large.loss_chunk == 512
    assert apply(large, "plain") == "" and large.loss_chunk == 0
    adapted = model_of("llama")
    adapt(adapted, AdapterConfig(kind="lora", rank=2, alpha=4, targets=["head"]), "llama")
    with pytest.raises(ConfigError) as caught:
        apply(adapted, "chunked")
    message = str(caught.value)
    assert "\n" not in message and "adapted by LoRA" in message
    assert message.endswith('use train.loss = "plain"')
    assert apply(adapted, "auto") == ""
    with pytest.raises(ConfigError, match="Linear computes its own loss"):
        apply(nn.Linear(2, 2), "chunked")


# ------------------------------------------------------------------ the layouts
def split_rank(rank: int, base: nn.Module, sequence_parallel: bool) -> dict:
    """`base` split over 2 thread ranks (vocab-parallel head and loss), chunked by 24
    tokens: its loss and the whole model's gradients."""
    model = tp.split_model(copy.deepcopy(base), None, sequence_parallel=sequence_parallel,
                           algorithm=ALGORITHM)
    apply(model, "chunked", 24)
    x, y = batch()
    none, loss = model(x, y)
    assert none is None
    loss.backward()
    return {"loss": loss.detach(), "grads": tp.full_grads(model)}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_split_vocabulary_equals_one_process(arch: str,
                                                             sequence_parallel: bool) -> None:
    """tp = 2: each rank multiplies its vocabulary block of the head chunk by chunk, the
    softmax's statistics all-reduced per chunk; with sequence parallelism the final
    norm's output is gathered whole first. The loss and every gradient equal the plain
    loss of the unsplit model."""
    base = model_of(arch)
    serial = copy.deepcopy(base)
    want = serial(*batch())[1]
    want.backward()
    want_grads = grads_of(serial)
    for r in run_threads(split_rank, 2, base, sequence_parallel):
        torch.testing.assert_close(r["loss"], want.detach(), **EXACT)
        for name, grad in want_grads.items():
            torch.testing.assert_close(r["grads"][name], grad, **EXACT, msg=name)


STEPS = 3


def sgd_steps(model: nn.Module, step: Callable[[tuple[torch.Tensor, torch.Tensor]],
                                               torch.Tensor]) -> list[float]:
    """The losses of STEPS steps of SGD without a clip, each by `step(batch) -> loss` on
    a batch without masked targets (the pipeline's micro-batches then weigh alike)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for i in range(STEPS):
        losses.append(float(step(batch(i, masked=False))))
        opt.step()
        opt.zero_grad()
    return losses


def pipelined_rank(rank: int, base: nn.Module, schedule: str) -> dict:
    """pp = 2 over 2 thread ranks, two micro-batches, chunked by 24: the last stage gives
    the loss its final hidden states; `infer` still returns the logits."""
    model = copy.deepcopy(base)
    apply(model, "chunked", 24)
    group = comm.resolve(None)
    mine = pipeline.pieces_for(pipeline.cut(model, 2), group)
    pipe = pipeline.Pipeline(mine, group, microbatches=2, schedule=schedule,
                             loss_fn=pipeline.loss_of(model),
                             tied=pipeline.tied_weights(model, mine, group))
    assert [hidden_for_loss(p) for p in mine] == [rank == 1]
    losses = sgd_steps(nn.ModuleList(mine), lambda b: pipe.step(*b))
    logits = pipe.infer(batch()[0])
    state = {k: v for piece in mine for k, v in piece.state_dict().items()}
    return {"losses": losses, "state": state, "logits": logits}


@pytest.mark.parametrize("arch, schedule", [("gpt", "1f1b"), ("llama", "zb1p")])
def test_pipeline_last_stage_equals_one_process(arch: str, schedule: str) -> None:
    """pp = 2: three SGD steps of the chunked loss on the last stage give the losses and
    weights of one process's plain loss, GPT's head tied to the first stage's embedding,
    and under a zero-bubble schedule (the head's weight gradient made in forward, not
    deferred to W); generation's `infer` gets the logits."""
    base = model_of(arch)
    serial = copy.deepcopy(base)
    losses = sgd_steps(serial, lambda b: _backward(serial(*b)[1]))
    state = serial.state_dict()
    results = run_threads(pipelined_rank, 2, base, schedule)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), **EXACT)
        for name, value in r["state"].items():
            torch.testing.assert_close(value, state[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(results[1]["logits"], serial(batch()[0]))


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def test_compiled_blocks_equal_eager() -> None:
    """Regional compilation (dynamo's eager backend here; inductor in the `dtrain train`
    test): the chunked loss runs between the compiled blocks and equals the plain loss
    of the eager model, with every gradient; the whole model compiled too."""
    plain, chunked = model_of("llama"), model_of("llama")
    apply(chunked, "chunked", 24)
    compile_blocks(chunked, backend="eager")
    x, y = batch()
    assert_same_step(plain, chunked, x, y)
    inner = model_of("gpt")
    apply(inner, "chunked", 24)
    whole = torch.compile(inner, backend="eager")
    torch.testing.assert_close(whole(x, y)[1], model_of("gpt")(x, y)[1], **EXACT)


# ------------------------------------------------------------------ dtrain train
def test_bad_values_are_refused_in_one_line(tmp_path: Path) -> None:
    """An unknown `train.loss`, a chunk of 0 and "chunked" for a custom module are refused
    by the config check, in one line each (which `dtrain train` prints, exiting 2 with
    nothing written, as for every key: tests/config/test_bad_input.py)."""
    for values, message in (({"train": {"loss": "chunky"}},
                             "train.loss = 'chunky' must be one of plain, chunked, auto"),
                            ({"train": {"loss_chunk": 0}}, "train.loss_chunk = 0 must be "
                                                           "positive"),
                            ({"train": {"loss": "chunked"},
                              "model": {"arch": "custom", "factory": "torch.nn:Linear"}},
                             'train.loss = "chunked": model.arch = "custom" computes its own '
                             'loss: use train.loss = "plain" or "auto"')):
        with pytest.raises(ConfigError) as caught:
            config_from_dict(values)
        assert str(caught.value) == message


RUN = cli.TINY_MODEL + cli.EXACT_OPTIMIZER + """
lr = 0.5
warmup_steps = 0
schedule = "constant"

[data]
max_bytes = 100000

[train]
batch_size = 4
eval_every = 0
eval_batches = 1

[logging]
sample_tokens = 0
"""
"""The tiny GPT (byte vocabulary: "auto" would keep the plain loss) with SGD without a clip
(tests.support.cli.EXACT_OPTIMIZER), 4 sequences of 32 tokens a step."""


def _train_with_loss(runs: list[tuple[str, list[str], str]]) -> int:
    """On each rank: cli's `_train_each` of `runs` (dtrain.layouts.build applies each
    run's `[train] loss`); returns how many times the chunked loss ran."""
    from tests.support.cli import _train_each

    chunks = chunked_loss._chunks
    calls = []

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return chunks(*args, **kwargs)

    chunked_loss._chunks = counted
    try:
        _train_each(runs)
    finally:
        chunked_loss._chunks = chunks
    return len(calls)


def train_pair(folder: Path, overrides: list[str], nproc: int, steps: int = 3
               ) -> tuple[tuple[list[dict], Path], tuple[list[dict], Path], list[int]]:
    """`dtrain train` of RUN with `overrides`, plain then chunked (by 48 tokens: the last
    of a step's 128 uneven), by the Trainer on `nproc` ranks forked once: each run's
    (metrics rows, checkpoints), and how often each rank ran the chunked loss."""
    planned = []
    for loss in ("plain", "chunked"):
        run = folder / loss
        run.mkdir(parents=True)
        config = run / "config.toml"
        config.write_text(RUN)
        planned.append((str(config), [*overrides, f"train.loss='{loss}'",
                                      "train.loss_chunk=48", f"train.steps={steps}",
                                      f"train.out_dir='{run / 'run'}'",
                                      f"parallel.nproc={nproc}"], str(run / "metrics.jsonl")))
    calls = run_ranks(_train_with_loss, nproc, planned, timeout=240)
    out = []
    for _, _, metrics in planned:
        rows = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
        out.append(([r for r in rows if "loss" in r],
                    Path(metrics).parent / "run" / "checkpoints"))
    return out[0], out[1], calls


def assert_same_runs(plain: tuple[list[dict], Path], chunked: tuple[list[dict], Path]
                     ) -> None:
    """The same losses and gradient norms per step and the same final weights."""
    cli.assert_same_steps(chunked[0], plain[0])
    want = load_file(universal.export(plain[1], plain[1].parent / "model.safetensors"))
    got = load_file(universal.export(chunked[1], chunked[1].parent / "model.safetensors"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_dtrain_train_one_process_equals_the_plain_loss(tmp_path: Path) -> None:
    """One process: every step's loss and gradient norm and the final weights of
    `loss = "chunked"` equal `loss = "plain"`'s; the chunked loss ran (3 steps, then the
    held-out batch without autograd)."""
    plain, chunked, calls = train_pair(tmp_path, [], 1)
    assert calls == [4]
    assert_same_runs(plain, chunked)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [["parallel.tp=2"],
                                    ["parallel.tp=2", "parallel.sequence_parallel=true"],
                                    ["parallel.pp=2", "parallel.microbatches=2",
                                     "model.n_layer=2"]],
                         ids=["tp2", "tp2-sp", "pp2"])
def test_dtrain_train_on_two_ranks_equals_the_plain_loss(tmp_path: Path,
                                                         layout: list[str]) -> None:
    """tp = 2 (the vocab-parallel loss, chunk by chunk; with sequence parallelism too) and
    pp = 2 (the last stage, two micro-batches): per step and final weights, chunked equals
    plain in the same layout."""
    plain, chunked, calls = train_pair(tmp_path, layout, 2)
    # tp: each rank its block, 3 steps and the held-out batch; pp: the last stage's rank,
    # a call per micro-batch
    assert calls == ([0, 8] if "parallel.pp=2" in layout else [4, 4])
    assert_same_runs(plain, chunked)


@pytest.mark.slow
@pytest.mark.timeout(420)  # inductor's first compile of the block: minutes on 2 busy cores
def test_dtrain_train_compiled_equals_the_plain_loss_eager(tmp_path: Path) -> None:
    """`train.compile = true` (inductor, the blocks compiled regionally; the loss between
    them, eager): chunked and compiled equals plain and eager step for step."""
    eager, _, _ = train_pair(tmp_path / "eager", [], 1)
    _, compiled, calls = train_pair(tmp_path / "compiled", ["train.compile=true"], 1)
    assert calls == [4]
    assert_same_runs(eager, compiled)
