"""Generation: a KV cache gives the full forward's logits, and `dtrain generate` writes the
same text for the same checkpoint and seed in any layout (one process, tp, pp, ZeRO-3)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dtrain import models
from dtrain.checkpoint.universal import Checkpoint
from dtrain.config import load_config
from dtrain.data import load_tokenizer
from dtrain.models.config import ModelConfig
from dtrain.models.generate import attach, detach, generate
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.train import trainer
from tests.support.cli import dtrain, train_rows


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt":
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    shape = models.resolve(ModelConfig(arch="llama", preset="llama-tiny", n_layer=2,
                                       n_embd=32, ffn_hidden=64, block_size=16), 64)
    return models.build(shape)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_cached_logits_equal_full_forward(arch: str) -> None:
    model = _model(arch).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = attach(model)
        parts = []
        for lo, hi in ((0, 5), (5, 6), (6, 9), (9, 10), (10, 11), (11, 12)):  # prompt, steps
            parts.append(model(ids[:, lo:hi]))
            cache.advance(hi - lo)
        detach(model)
        again = model(ids)
    torch.testing.assert_close(torch.cat(parts, dim=1), full)
    torch.testing.assert_close(again, full)  # detached: the full forward again


@pytest.mark.filterwarnings("ignore::FutureWarning")  # newer transformers rename the keyword
def test_hugging_face_cache_equals_full_forward() -> None:
    transformers = pytest.importorskip("transformers")
    from dtrain.models.hf import HFCausalLM

    torch.manual_seed(0)
    model = HFCausalLM(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)), 32).eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = attach(model)
        first = model(ids[:, :6])
        cache.advance(6)
        second = model(ids[:, 6:7])
        detach(model)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full[:, :7])


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_generate_past_block_size_matches_uncached(arch: str) -> None:
    model = _model(arch)
    prompt = torch.tensor([[1, 2, 3]])
    cached = generate(model, prompt, 20, block_size=16,
                      generator=torch.Generator().manual_seed(0))
    idx = prompt  # the same draws, re-running the whole window each token
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(20):
            logits = model(idx[:, -16:])[:, -1, :]
            probs = torch.softmax(logits.float() / 0.8, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)], dim=1)
    assert cached.tolist() == idx.tolist()
    assert model.training  # left as it was


CONFIG = """
[model]
n_layer = 2
n_head = 2
n_embd = 32
block_size = 32
[data]
max_bytes = 200000
[train]
batch_size = 4
eval_every = 0
[logging]
sample_tokens = 40
"""
"""A GPT of two blocks (pp = 2 cuts one each), trained a few steps on the stdlib."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints folder of a tiny run of 3 steps on one process."""
    _, checkpoints = train_rows(tmp_path_factory.mktemp("generate"), CONFIG, ["-n", "1"], 3)
    return checkpoints


def _generated(checkpoints: Path, *args: str) -> str:
    result = dtrain("generate", str(checkpoints), "--prompt", "def ", "--tokens", "40",
                    "--seed", "3", *args, timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_same_text_in_every_layout(trained: Path) -> None:
    alone = _generated(trained)
    assert alone.startswith("def ") and alone.count("\n") >= 1
    for layout in (["parallel.tp=2"], ["parallel.pp=2"], ["parallel.zero=3"]):
        split = _generated(trained, "-n", "2", *(f"--set={s}" for s in layout))
        assert split == alone, layout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_sample_split_equals_whole(tmp_path: Path) -> None:
    """The final sample of a tp = 2 run (generated in split form) is the text rank 0 gets
    from the same checkpoint built whole."""
    folder = tmp_path / "tp"
    folder.mkdir()
    (folder / "config.toml").write_text(CONFIG)
    result = dtrain("train", str(folder / "config.toml"), "-n", "2", "--set", "parallel.tp=2",
                    "--set", "train.steps=3", "--set", f"train.out_dir='{folder / 'run'}'",
                    timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    # generated in split form (the whole model on no rank), not from the checkpoint
    split = result.stdout.split("sample (in split form: tp2):\n", 1)[1]
    ckpt = Checkpoint(folder / "run" / "checkpoints")
    config = load_config(str(folder / "config.toml"))
    shape = ModelConfig(**{k: v for k, v in ckpt.meta["model"].items()
                           if k in {f.name for f in dataclasses.fields(ModelConfig)}})
    whole = trainer.sample(shape, ckpt, load_tokenizer("bytes"), config.logging,
                           torch.device("cpu"))
    assert split.startswith(whole)
