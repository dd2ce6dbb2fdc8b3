"""`dtrain train` on models nobody here wrote: dtrain's Llama, Hugging Face causal LMs and
a user's own module, in every layout, each equal to one process on the same global
batches; Hugging Face weights out (`dtrain export --format hf`, loaded by transformers)
and back in (`init_from`); and the one-line answers to bad models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain import models
from dtrain.checkpoint import universal
from tests.support.cli import dtrain, one_error_line

BASE = """
[data]
max_bytes = 100000

[optimizer]
name = "sgd"
momentum = 0.9
weight_decay = 0.0
grad_clip = 0.0
lr = 1e-2
warmup_steps = 2
schedule = "constant"

[train]
steps = 4
batch_size = 8
eval_every = 0
eval_batches = 2

[logging]
log_every = 10
sample_tokens = 0
"""

LLAMA = """
[model]
arch = "llama"
n_layer = 2
n_head = 4
n_kv_head = 2
n_embd = 32
ffn_hidden = 64
block_size = 32
tie_embeddings = false
"""

TP2 = ["--set", "parallel.tp=2"]
PP2 = ["--set", "parallel.pp=2", "--set", "parallel.microbatches=2"]
ZERO3 = ["--set", "parallel.zero=3"]


def run(folder: Path, name: str, model: str, args: list[str], *, cwd: Path | None = None
        ) -> tuple[list[float], float, Path, str, list[float]]:
    """`dtrain train` of `model` (a [model] section) on BASE (SGD without a clip: see
    tests.support.cli.EXACT_OPTIMIZER): (losses per step, the final held-out loss, its
    checkpoints, stdout, the gradient norm of each step)."""
    config = folder / f"{name}.toml"
    config.write_text(model + BASE)
    metrics = folder / f"{name}.jsonl"
    result = dtrain("train", str(config), *args, "--set", f"train.out_dir='{folder / name}'",
                    "--metrics", str(metrics), timeout=170, cwd=str(cwd) if cwd else None)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    final = [r["eval_loss"] for r in records if "eval_loss" in r][-1]
    norms = [r["grad_norm"] for r in records if "loss" in r]
    return losses, final, folder / name / "checkpoints", result.stdout, norms


def weights(checkpoints: Path) -> dict[str, torch.Tensor]:
    ckpt = universal.Checkpoint(checkpoints)
    return {n: ckpt.tensor(universal.MODEL + n) for n in ckpt.names()}


def assert_same_run(got: tuple, want: tuple) -> None:
    """The same losses, gradient norms (before any clip) and final weights."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[4], want[4], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weights(got[2]), weights(want[2]), rtol=1e-4, atol=5e-5)


@pytest.fixture(scope="module")
def llama_one(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return run(tmp_path_factory.mktemp("llama"), "one", LLAMA, ["-n", "1"])


SP = ["--set", "parallel.sequence_parallel=true"]
FULL = ["--set", "memory.recompute='full'"]
SELECTIVE = ["--set", "memory.recompute='selective'"]


@pytest.mark.parametrize("args, banner", [
    pytest.param(["-n", "4", *TP2, *PP2, *SP, *SELECTIVE], "pipeline of 2 stages (1f1b, 2 "
                 "micro-batches) x tensor parallel over 2 x data parallel over 1; sequence "
                 "parallel; recomputing 4 attention cores and activations",
                 marks=pytest.mark.slow),
    pytest.param(["-n", "2"], "data parallel over 2", marks=pytest.mark.slow),
    pytest.param(["-n", "2", *ZERO3, *FULL], "ZeRO stage 3 over 2; recomputing 2 blocks",
                 marks=pytest.mark.slow),
    pytest.param(["-n", "2", *TP2, *SP, *FULL], "tensor parallel over 2 x data parallel over 1; "
                 "sequence parallel; recomputing 2 blocks", marks=pytest.mark.slow),
    pytest.param(["-n", "2", *TP2], "tensor parallel over 2", marks=pytest.mark.slow),
    pytest.param(["-n", "2", *PP2], "pipeline of 2 stages", marks=pytest.mark.slow),
], ids=["tp2xpp2-sp-selective", "dp2", "zero3-full", "tp2-sp-full", "tp2", "pp2"])
def test_llama_in_every_layout_equals_one_process(tmp_path: Path, llama_one: tuple,
                                                  args: list[str], banner: str) -> None:
    """dtrain's Llama (grouped-query attention, untied head): losses per step and final
    weights equal one process's, with sequence parallelism and activation checkpointing
    too."""
    got = run(tmp_path, "many", LLAMA, args)
    assert banner in got[3] and "Llama" in got[3]
    assert_same_run(got, llama_one)


def hf_llama_config(folder: Path) -> Path:
    """A tiny Hugging Face Llama config (grouped-query attention) in `folder`."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=64).save_pretrained(folder)
    return folder / "config.json"


def hf_gpt2_config(folder: Path) -> Path:
    """A tiny Hugging Face GPT-2 config (Conv1D layers, tied head) in `folder`."""
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).save_pretrained(folder)
    return folder / "config.json"


def hf_model(config: Path) -> str:
    return f'[model]\narch = "hf"\nhf_config = "{config}"\nblock_size = 32\n'


@pytest.fixture(scope="module")
def hf_one(tmp_path_factory: pytest.TempPathFactory):
    """`hf_one(family)`: the [model] section of a tiny Hugging Face Llama or GPT-2 and its
    one-process run, run once for the module, whichever test asks first."""
    runs: dict[str, tuple[str, tuple]] = {}

    def one(family: str) -> tuple[str, tuple]:
        if family not in runs:
            folder = tmp_path_factory.mktemp(f"hf-{family}")
            make = hf_llama_config if family == "llama" else hf_gpt2_config
            model = hf_model(make(folder / family))
            runs[family] = model, run(folder, "one", model, ["-n", "1"])
        return runs[family]

    return one


@pytest.mark.parametrize("family, args", [
    pytest.param("llama", ["-n", "2", *TP2], marks=pytest.mark.slow),
    pytest.param("gpt2", ["-n", "2", *TP2], marks=pytest.mark.slow),
    pytest.param("llama", ["-n", "2", *ZERO3], marks=pytest.mark.slow),
    pytest.param("gpt2", ["-n", "2", *ZERO3], marks=pytest.mark.slow),
    pytest.param("llama", ["-n", "2", *PP2], marks=pytest.mark.slow),
    pytest.param("gpt2", ["-n", "4", *PP2, *TP2], marks=pytest.mark.slow),
    pytest.param("gpt2", ["-n", "2"], marks=pytest.mark.slow),
], ids=["llama-tp2", "gpt2-tp2", "llama-zero3", "gpt2-zero3", "llama-pp2", "gpt2-tp2xpp2",
        "gpt2-dp2"])
def test_hugging_face_models_in_layouts_equal_one_process(tmp_path: Path, family: str,
                                                          args: list[str], hf_one) -> None:
    """A Hugging Face Llama (GQA) or GPT-2 (Conv1D, tied head) built from a config.json:
    losses and final weights equal one process's. (All slow: make test covers these models
    in every layout at the library level, tests/models/test_hf_models.py.)"""
    model, one = hf_one(family)
    got = run(tmp_path, "many", model, args)
    assert "Hugging Face" in got[3]
    assert_same_run(got, one)


@pytest.mark.slow
def test_export_to_hugging_face_and_back_in_another_layout(tmp_path: Path,
                                                          llama_one: tuple) -> None:
    """`dtrain export --format hf`: transformers loads the folder and gives dtrain's logits;
    `init_from` the folder on 2 tensor-parallel ranks (one step of lr 1e-20) gives the
    run's final held-out loss."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    result = dtrain("export", str(llama_one[2]), str(out), "--format", "hf")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    ckpt = universal.Checkpoint(llama_one[2])
    ours = models.build(models.ModelConfig(**ckpt.meta["model"])).eval()
    ours.load_state_dict(weights(llama_one[2]))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-4, atol=1e-5)

    again = run(tmp_path, "again", LLAMA + f'init_from = "{out}"\n',
                ["-n", "2", *TP2, "--set", "optimizer.lr=1e-20", "--set", "train.steps=1"])
    assert f"weights from {out}" in again[3]
    assert again[1] == pytest.approx(llama_one[1], abs=1e-5)

    again_out = dtrain("export", str(llama_one[2]), str(out), "--format", "hf")
    assert again_out.returncode == 2 and "not empty" in one_error_line(again_out)


@pytest.mark.slow
def test_gpt_exports_as_gpt2(tmp_path: Path) -> None:
    """dtrain's GPT exports as a Hugging Face GPT-2 (exact GELU, Conv1D weights
    transposed) with the same logits."""
    from transformers import AutoModelForCausalLM

    gpt = '[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\n'
    _, _, checkpoints, _, _ = run(tmp_path, "gpt", gpt, ["-n", "1", "--set", "train.steps=1"])
    out = tmp_path / "hf"
    assert dtrain("export", str(checkpoints), str(out), "--format", "hf").returncode == 0
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    ours = models.build(models.ModelConfig(**universal.Checkpoint(checkpoints).meta["model"]))
    ours.load_state_dict(universal.Checkpoint(checkpoints).model_state())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours.eval()(ids), rtol=1e-4, atol=1e-5)


CUSTOM = '''
import torch
from torch import nn


class Tiny(nn.Module):
    """A user's model: embedding, two MLP blocks, a head; (logits, loss) from forward."""

    def __init__(self, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(),
                                                  nn.Linear(64, 32)) for _ in range(2))
        self.head = nn.Linear(32, vocab)
        self.loss_fn = nn.CrossEntropyLoss()

    def stage_parts(self):
        return ["embed"], "layers", ["head"]

    def stage_in(self, idx):
        return self.embed(idx)

    def stage_block(self, block, h):
        return h + block(h)

    def stage_out(self, h):
        return self.head(h)

    def forward(self, idx, targets=None):
        h = self.stage_in(idx)
        for block in self.layers:
            h = self.stage_block(block, h)
        logits = self.stage_out(h)
        if targets is None:
            return logits
        return logits, self.loss_fn(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(cfg):
    return Tiny(cfg.vocab_size)


def not_a_module():
    return "a string"
'''

CUSTOM_MODEL = '[model]\narch = "custom"\nfactory = "my_models:build"\nblock_size = 32\n'
CUSTOM_PLAN = ('tp_plan = { "layers.*.0" = "colwise", "layers.*.2" = "rowwise", '
               '"embed" = "vocab", "head" = "colwise", "loss_fn" = "vocab_loss" }\n')


@pytest.fixture(scope="module")
def custom_one(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """The user's module of CUSTOM in one process, run once for the module."""
    folder = tmp_path_factory.mktemp("custom")
    (folder / "my_models.py").write_text(CUSTOM)
    return run(folder, "one", CUSTOM_MODEL + CUSTOM_PLAN, ["-n", "1"], cwd=folder)


@pytest.mark.parametrize("args", [
    pytest.param(["-n", "2", *ZERO3], marks=pytest.mark.slow),
    pytest.param(["-n", "2", *TP2], marks=pytest.mark.slow),
    pytest.param(["-n", "2", *PP2], marks=pytest.mark.slow),
], ids=["zero3", "tp2", "pp2"])
def test_your_own_module_equals_one_process(tmp_path: Path, args: list[str],
                                            custom_one: tuple) -> None:
    """arch = "custom": a factory in the working folder; ZeRO takes it as it is, tensor
    parallelism with its tp_plan, the pipeline by its Stages methods."""
    (tmp_path / "my_models.py").write_text(CUSTOM)
    one = custom_one
    got = run(tmp_path, "many", CUSTOM_MODEL + CUSTOM_PLAN, args, cwd=tmp_path)
    assert "Tiny" in got[3]
    assert_same_run(got, one)


def _bert_config(folder: Path) -> str:
    from transformers import BertConfig

    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(folder)
    return str(folder)


def _broken_tokenizer(folder: Path) -> str:
    (folder / "tokenizer.json").write_text("{not json")
    return str(folder / "tokenizer.json")


def _truncated_shards(folder: Path) -> str:
    shards = folder / "shards"
    shards.mkdir()
    (shards / "shard-00000.bin").write_bytes(b"\0" * 101)
    (shards / "index.json").write_text(json.dumps({
        "format": "dtrain.tokens/1", "dtype": "uint16", "vocab_size": 256,
        "tokenizer": "bytes", "tokens": 100,
        "shards": [{"file": "shard-00000.bin", "tokens": 100}]}))
    return str(shards)


def _wrong_dtype_shards(folder: Path) -> str:
    path = _truncated_shards(folder)
    index = json.loads((Path(path) / "index.json").read_text())
    (Path(path) / "index.json").write_text(json.dumps(index | {"dtype": "float16"}))
    return path


BAD = {
    "unknown arch": (lambda d: ["model.arch='mamba'"], "model.arch"),
    "unknown preset": (lambda d: ["model.arch='llama'", "model.preset='llama-9'"],
                       "model.preset"),
    "preset of another arch": (lambda d: ["model.preset='llama-tiny'"], "model.arch"),
    "not a causal LM": (lambda d: ["model.arch='hf'", f"model.hf_config='{_bert_config(d)}'"],
                        "causal"),
    "missing hf config": (lambda d: ["model.arch='hf'", f"model.hf_config='{d / 'none'}'"],
                          "model.hf_config"),
    "factory does not import": (lambda d: ["model.arch='custom'",
                                           "model.factory='no_such_module:build'"],
                                "cannot import no_such_module"),
    "factory returns no module": (lambda d: ["model.arch='custom'",
                                             "model.factory='my_models:not_a_module'"],
                                  "not an nn.Module"),
    "tokenizer does not parse": (lambda d: [f"data.tokenizer='{_broken_tokenizer(d)}'"],
                                 "tokenizer"),
    "truncated shard": (lambda d: ["data.format='tokens'",
                                   f"data.path='{_truncated_shards(d)}'"], "shard-00000.bin"),
    "wrong dtype": (lambda d: ["data.format='tokens'", f"data.path='{_wrong_dtype_shards(d)}'"],
                    "float16"),
    "vocab smaller than the data's": (lambda d: ["model.vocab_size=100"], "model.vocab_size"),
    "no tp plan": (lambda d: ["model.arch='custom'", "model.factory='my_models:build'",
                              "parallel.tp=2"], "tp_plan"),
}


QUICK_BAD = ("unknown preset", "not a causal LM", "factory returns no module",
             "tokenizer does not parse", "truncated shard", "vocab smaller than the data's",
             "no tp plan")


@pytest.mark.parametrize("case", [c if c in QUICK_BAD else pytest.param(c, marks=pytest.mark.slow)
                                  for c in BAD])
def test_bad_models_and_data_are_one_line(tmp_path: Path, case: str) -> None:
    """Each mistake: one line naming what to fix, exit 2, no checkpoint written (checked
    before any rank starts). The library-level tests cover each again (test_hf_models,
    test_data_prepare), so make test runs a few of these and CI all."""
    (tmp_path / "my_models.py").write_text(CUSTOM)
    make, words = BAD[case]
    sets = [x for value in make(tmp_path) for x in ("--set", value)]
    out = tmp_path / "run"
    ranks = "2" if "parallel.tp=2" in sets else "1"
    result = dtrain("train", "-n", ranks, *sets, "--set", f"train.out_dir='{out}'",
                    "--set", "train.steps=1", cwd=str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert words in one_error_line(result)
    assert not (out / "checkpoints").exists()


@pytest.mark.slow
def test_hugging_face_gpt2_round_trip(tmp_path: Path, hf_one) -> None:
    """A Hugging Face GPT-2 trained by dtrain exports as GPT-2 again (Conv1D weights
    transposed back), with dtrain's logits; `init_from` reads it into 2 tensor-parallel
    ranks (each reading its slices of the transposed weights) at the same held-out loss."""
    from transformers import AutoModelForCausalLM

    model, (losses, final, checkpoints, _, _) = hf_one("gpt2")
    out = tmp_path / "hf"
    assert dtrain("export", str(checkpoints), str(out), "--format", "hf").returncode == 0
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "GPT2LMHeadModel"
    ckpt = universal.Checkpoint(checkpoints)
    ours = models.build(models.ModelConfig(**ckpt.meta["model"])).eval()
    ours.load_state_dict(ckpt.model_state())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-4, atol=1e-5)

    again = run(tmp_path, "again", model + f'init_from = "{out}"\n',
                ["-n", "2", *TP2, "--set", "optimizer.lr=1e-20", "--set", "train.steps=1"])
    assert again[1] == pytest.approx(final, abs=1e-5)


def test_hugging_face_weights_are_read_in_slices(tmp_path: Path) -> None:
    """`init_from`'s reader: a tensor-parallel block and a ZeRO span of each tensor, read
    as slices of the file, are those of the whole tensor (transposed or not)."""
    from safetensors.torch import save_file

    from dtrain.models.weights import HFWeights
    from dtrain.split import Split

    g = torch.Generator().manual_seed(0)
    stored = {"a": torch.randn(6, 4, generator=g), "b": torch.randn(4, 6, generator=g),
              "c": torch.randn(10, generator=g)}
    save_file(stored, str(tmp_path / "model.safetensors"))
    source = HFWeights(tmp_path, {"x": ("a", False), "y": ("b", True), "z": ("c", False)})
    for name, whole in (("x", stored["a"]), ("y", stored["b"].t()), ("z", stored["c"])):
        key = "model/" + name
        torch.testing.assert_close(source.tensor(key), whole)
        assert source.shape(key) == tuple(whole.shape)
        for lo, hi in ((0, 5), (3, 10), (7, 7), (5, whole.numel())):
            torch.testing.assert_close(source.rows(key, lo, hi), whole.reshape(-1)[lo:hi])
        if whole.dim() == 2:
            for split in (Split(0), Split(1), Split(0, chunks=3)):
                for part in range(2):
                    torch.testing.assert_close(source.block(key, split, part, 2),
                                               split.shard(whole, part, 2))


@pytest.mark.slow
@pytest.mark.parametrize("args", [["-n", "2", *ZERO3], ["-n", "2", *PP2]], ids=["zero3", "pp2"])
def test_init_from_into_sharded_layouts(tmp_path: Path, llama_one: tuple,
                                        args: list[str]) -> None:
    """`init_from` into ZeRO-3 (each rank reading the rows of its shards) and into a
    pipeline (each stage its own blocks): the run's final held-out loss."""
    out = tmp_path / "hf"
    assert dtrain("export", str(llama_one[2]), str(out), "--format", "hf").returncode == 0
    again = run(tmp_path, "again", LLAMA + f'init_from = "{out}"\n',
                [*args, "--set", "optimizer.lr=1e-20", "--set", "train.steps=1"])
    assert again[1] == pytest.approx(llama_one[1], abs=1e-5)
