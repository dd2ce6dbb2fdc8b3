"""Adapter checkpoints: a LoRA run saves its adapters and their optimizer state without the
frozen base (no base tensor in its files), resumes over the rebuilt base in any layout as
the unbroken run goes on (losses and adapters), and refuses, in one line through the CLI,
to resume over another base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dtrain.testing import run_ranks
from tests.adapters.test_lora import HF_LLAMA
from tests.support.cli import dtrain, one_error_line

LLAMA = {**HF_LLAMA, "vocab_size": 256}
"""A transformers Llama for byte-level data (256 ids)."""


def config(folder: Path, name: str, steps: int, model: dict | None = None,
           parallel: dict | None = None, **more: dict) -> dict:
    """A LoRA run of `steps` steps on a transformers Llama (config.json in `folder`, or the
    `model` section given), AdamW, a checkpoint every 2 steps."""
    out = folder / name
    values = {
        "model": model or {"arch": "hf", "hf_config": str(folder / "config.json"),
                           "block_size": 32},
        "adapter": {"kind": "lora", "rank": 4, "alpha": 8},
        "data": {"max_bytes": 20_000},
        "optimizer": {"name": "adamw", "lr": 0.01, "warmup_steps": 0, "grad_clip": 0.0,
                      "schedule": "constant"},  # a run cut short: the same rates
        "train": {"steps": steps, "batch_size": 4, "eval_every": 0, "eval_batches": 1,
                  "out_dir": str(out)},
        "logging": {"sample_tokens": 0, "metrics": str(out / "metrics.jsonl")},
        "checkpoint": {"background": False, "every": 2},
        "parallel": parallel or {"nproc": 1}}
    for section, keys in more.items():
        values.setdefault(section, {}).update(keys)
    return values


def train(runs: list[dict]) -> list[dict]:
    """Each run by the Trainer (on every rank): rank 0's losses and final checkpoint."""
    from dtrain.config import config_from_dict
    from dtrain.train.trainer import Trainer

    out = []
    for values in runs:
        summary = Trainer(config_from_dict(values)).run()
        out.append({"losses": summary["losses"], "checkpoint": summary["checkpoint"]})
    return out


def adapters_of(checkpoint: str) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint (an adapter checkpoint's: its adapters)."""
    from dtrain.checkpoint.universal import Checkpoint

    return Checkpoint(checkpoint).model_state()


def dtrain_logits(checkpoint: str, x: torch.Tensor) -> torch.Tensor:
    """The logits of dtrain's adapted model restored from `checkpoint` (its base rebuilt)."""
    from dtrain.adapters.checkpoints import checkpoint_weights
    from dtrain.checkpoint.universal import Checkpoint
    from dtrain.models import init
    from dtrain.tools.export_hf import skeleton_of

    ckpt = Checkpoint(checkpoint)
    shape, skeleton = skeleton_of(ckpt)
    model = init.materialized(skeleton, checkpoint_weights(ckpt, shape, skeleton)).eval()
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, tuple) else out


def stored_names(checkpoint: Path) -> set[str]:
    """The logical tensors whose pieces the checkpoint's rank files hold."""
    names = set()
    for file in checkpoint.glob("rank-*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names |= {key.partition("|")[0] for key in f.keys() if not key.startswith("rank/")}
    return names


@pytest.mark.timeout(120)
def test_a_resumed_lora_run_equals_the_unbroken_one_and_saves_no_base(tmp_path: Path) -> None:
    """4 steps at once in one process against 2 steps, the checkpoint, and 2 more: the same
    losses and adapters (AdamW: its state is in the checkpoint). The checkpoint's files
    hold the adapters and their optimizer state alone, and the base's identity (drawn
    from the seed: its state_dict export is the adapters, its merged export draws the
    base again and gives the adapted model's logits)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    whole = config(tmp_path, "whole", 4)
    at_2 = tmp_path / "whole" / "checkpoints" / "step-00000002"
    resumed_run = config(tmp_path, "resumed", 4, checkpoint={"resume": str(at_2)})
    # one process runs both in turn (the resumed run after the whole one has saved step 2)
    [unbroken, resumed] = run_ranks(train, 1, [whole, resumed_run], timeout=150)[0]

    torch.testing.assert_close(resumed["losses"], unbroken["losses"][2:], rtol=1e-5, atol=1e-6)
    theirs, ours = adapters_of(unbroken["checkpoint"]), adapters_of(resumed["checkpoint"])
    assert theirs.keys() == ours.keys() and all(".lora_" in n for n in ours)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-7)

    stored = stored_names(at_2)
    layers = {n.removesuffix(".lora_A.weight") for n in theirs if n.endswith("lora_A.weight")}
    assert len(layers) == 2 * 7  # every projection of both blocks (the defaults)
    assert stored == {f"{kind}{n}{state}" for n in theirs for kind, state in
                      (("model/", ""), ("optim/", "/exp_avg"), ("optim/", "/exp_avg_sq"))}
    meta = json.loads((at_2 / "index.json").read_text())["meta"]
    assert meta["base"]["init_from"] == "" and meta["base"]["seed"] == 1337 \
        and len(meta["base"]["sha256"]) == 64

    from transformers import AutoModelForCausalLM

    from dtrain.checkpoint.universal import export
    from dtrain.tools.export_hf import export_hf

    with safe_open(str(export(at_2, tmp_path / "adapters.safetensors")), "pt") as f:
        assert set(f.keys()) == set(adapters_of(str(at_2)))  # the adapters' state_dict
    merged = export_hf(at_2, tmp_path / "merged", merge=True)  # the base drawn again
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=x).logits
    torch.testing.assert_close(logits, dtrain_logits(str(at_2), x), rtol=1e-5, atol=1e-5)


LAYOUTS = {"zero3-to-pp": ({"nproc": 2, "zero": 3}, {"nproc": 2, "pp": 2, "microbatches": 2}),
           "pp-to-zero2": ({"nproc": 2, "pp": 2, "microbatches": 2}, {"nproc": 2, "zero": 2})}


@pytest.mark.slow  # three worlds of the Trainer: 15 s; a resume in one layout is quick
@pytest.mark.timeout(240)
def test_an_adapter_checkpoint_resumes_in_another_layout(tmp_path: Path) -> None:
    """Adapters saved by 2 ranks in one layout resume in another and go on as one
    process's unbroken run does (ZeRO-3 to pp, pp to ZeRO-2). The base starts from a
    Hugging Face folder (init_from), which the resumed runs read again beneath the
    adapters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(tmp_path / "base")
    model = {"arch": "hf", "init_from": str(tmp_path / "base"), "block_size": 32}
    [unbroken] = run_ranks(train, 1, [config(tmp_path, "whole", 4, model)], timeout=100)[0]
    run_ranks(train, 2, [config(tmp_path, f"{name}-first", 2, model, saved_in)
                         for name, (saved_in, _) in LAYOUTS.items()], timeout=150)
    again = [config(tmp_path, f"{name}-again", 4, model, resumed_in, checkpoint={
        "resume": str(tmp_path / f"{name}-first" / "checkpoints")})
        for name, (_, resumed_in) in LAYOUTS.items()]
    theirs = adapters_of(unbroken["checkpoint"])
    for name, resumed in zip(LAYOUTS, run_ranks(train, 2, again, timeout=150)[0], strict=True):
        torch.testing.assert_close(resumed["losses"], unbroken["losses"][2:], rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        ours = adapters_of(resumed["checkpoint"])
        assert theirs.keys() == ours.keys()
        for key, tensor in theirs.items():
            torch.testing.assert_close(ours[key], tensor, rtol=1e-4, atol=1e-6)
        saved = stored_names(tmp_path / f"{name}-first" / "checkpoints" / "step-00000002")
        assert saved and all(".lora_" in n for n in saved)


TOML = """
[model]
arch = "hf"
init_from = "{base}"
block_size = 32
[adapter]
kind = "lora"
rank = 4
[data]
max_bytes = 20000
[train]
steps = {steps}
batch_size = 4
eval_every = 0
out_dir = "{out}"
[logging]
sample_tokens = 4
[checkpoint]
background = false
"""


@pytest.mark.timeout(120)
def test_resuming_over_another_base_is_refused_in_one_line(tmp_path: Path) -> None:
    """`dtrain train --resume` after the base folder's weights changed: exit 2, one line
    naming the folder and both digests, and no checkpoint written. (The first run closes
    with a sample from its adapter checkpoint, over the base read again.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    base, out = tmp_path / "base", tmp_path / "run"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(base)
    for steps in (2, 4):
        (tmp_path / f"run{steps}.toml").write_text(TOML.format(base=base, out=out, steps=steps))
    first = dtrain("train", str(tmp_path / "run2.toml"), "--nproc", "1")
    assert first.returncode == 0, first.stderr
    assert "sample:" in first.stdout
    before = sorted(p.name for p in (out / "checkpoints").iterdir())

    torch.manual_seed(1)  # the same folder, other weights
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(base)
    refused = dtrain("train", str(tmp_path / "run4.toml"), "--nproc", "1", "--resume")
    assert refused.returncode == 2, refused.stderr
    line = one_error_line(refused)
    assert "holds adapters trained on the files of model.init_from" in line, line
    assert str(base.resolve()) in line and "have changed since" in line, line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
