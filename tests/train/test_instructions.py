"""Instruction tuning in every layout: chat data rendered by its template, the loss on the
assistant's tokens, documents packed so that none sees another, trained by `dtrain
train`'s Trainer in a layout and by one process on the same global batch with plain SGD
and no clip: every step's loss and gradient norm agree, and so do the final weights. The
loss is the mean over the targets of the whole step, which the layouts only reach by
weighing each rank's share: a run that averages the ranks' own means instead is seen
(the negative control)."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dtrain.testing import run_ranks
from dtrain.testing.chat import make_chat_tokenizer, write_chat_jsonl

STEPS = 2
WORDS = ("the cat sat on a mat while two dogs ran far away from home and then came back "
         "later to eat some food").split()


def _conversations(n: int) -> list[list[dict[str, str]]]:
    """`n` conversations of one to three exchanges of random lengths, so that ranks hold
    different numbers of targets."""
    rng = random.Random(0)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": say(3)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": say(rng.randint(2, 8))},
                      {"role": "assistant", "content": say(rng.randint(1, 8))}]
        out.append(turns)
    return out


def _hf_config(folder: Path) -> str:
    config = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "bos_token_id": 3, "eos_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder / "config.json")


def _config(folder: Path, name: str, model: dict, parallel: dict, packing: str) -> dict:
    out = folder / name
    return {"model": {**model, "block_size": 64},
            "data": {"path": str(folder / "chats.jsonl"), "format": "chat",
                     "tokenizer": str(folder / "tok" / "tokenizer.json"),
                     "packing": packing, "val_fraction": 0.1},
            "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0,
                          "grad_clip": 0.0, "warmup_steps": 0, "schedule": "constant"},
            "train": {"steps": STEPS, "batch_size": 4, "eval_every": 0, "eval_batches": 1,
                      "out_dir": str(out)},
            "logging": {"sample_tokens": 0, "log_every": 100,
                        "metrics": str(out / "metrics.jsonl")},
            "checkpoint": {"background": False},
            "parallel": parallel}


@contextlib.contextmanager
def _unweighted() -> Iterator[None]:
    """Each rank's loss its own mean, as a loop unaware of the targets' count would."""
    from dtrain.data.sequences import Batch

    original = Batch.shared
    Batch.shared = lambda self, shares: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        Batch.shared = original  # type: ignore[method-assign]


def _train(runs: list[tuple[str, dict, bool]]) -> dict[str, dict[str, list[float]]]:
    """Each run trained by the Trainer on this process's world: rank 0's per-step loss and
    gradient norm, and the final weights (exported) under "weights"."""
    from dtrain.checkpoint import universal
    from dtrain.config import config_from_dict
    from dtrain.train.trainer import Trainer

    out: dict[str, dict] = {}
    for name, values, wrong in runs:
        with _unweighted() if wrong else contextlib.nullcontext():
            summary = Trainer(config_from_dict(values)).run()
        rows = [json.loads(line) for line in
                Path(values["logging"]["metrics"]).read_text().splitlines()]
        out[name] = {key: [r[key] for r in rows if "loss" in r]
                     for key in ("loss", "grad_norm", "target_tokens", "padding")}
        if dtrain_rank() == 0:
            from safetensors.torch import load_file

            file = universal.export(summary["checkpoint"],
                                    Path(values["train"]["out_dir"]) / "model.safetensors")
            out[name]["weights"] = load_file(file)
    return out


def dtrain_rank() -> int:
    import dtrain

    return dtrain.world.current().rank


HF = "hf"
LLAMA = {"arch": "llama", "preset": "llama-tiny", "n_layer": 4, "n_embd": 32}
MOE = {**LLAMA, "preset": "moe-tiny", "n_layer": 2, "moe_inter_size": 32,
       "capacity_factor": 0.0, "aux_loss_weight": 0.0}
CASES = {  # name: (model, packing, [parallel])
    "dp": (HF, "block_causal", {}),
    "dp, accumulation": (HF, "block_causal", {"grad_accum": 2}),
    "ZeRO-3": (HF, "block_causal", {"zero": 3}),
    "tp": (HF, "block_causal", {"tp": 2}),
    "tp + sp (dtrain's Llama)": ("llama", "block_causal", {"tp": 2, "sequence_parallel": True}),
    "cp ring": (HF, "block_causal", {"cp": 2}),
    "cp all-gather (dtrain's Llama)": ("llama", "block_causal",
                                       {"cp": 2, "cp_method": "allgather"}),
    "cp all-to-all": (HF, "block_causal", {"cp": 2, "cp_method": "alltoall"}),
    "cp ring (pad)": (HF, "pad", {"cp": 2}),
    "ep": ("moe", "block_causal", {"ep": 2}),
    "pp, 1f1b": (HF, "block_causal", {"pp": 2, "microbatches": 2}),
    "pp, interleaved (dtrain's Llama)": ("llama", "block_causal",
                                         {"pp": 2, "microbatches": 2, "virtual_stages": 2,
                                          "schedule": "interleaved"}),
    "pp (pad)": (HF, "pad", {"pp": 2, "microbatches": 4}),
}


@pytest.mark.timeout(300)
def test_chat_sft_in_every_layout_equals_one_process(tmp_path: Path) -> None:
    make_chat_tokenizer(tmp_path / "tok")
    write_chat_jsonl(tmp_path / "chats.jsonl", _conversations(40))
    models = {HF: {"arch": "hf", "hf_config": _hf_config(tmp_path)}, "llama": LLAMA,
              "moe": MOE}
    references = {(model, packing) for model, packing, _ in CASES.values()}
    one = [(f"{m}-{p}", _config(tmp_path, f"one-{m}-{p}", models[m], {"nproc": 1}, p), False)
           for m, p in sorted(references)]
    want = run_ranks(_train, 1, one, timeout=120)[0]
    runs = []
    for name, (model, packing, parallel) in CASES.items():
        values = {"nproc": 2, **parallel}
        grad_accum = values.pop("grad_accum", 1)
        config = _config(tmp_path, name.replace(" ", "_"), models[model], values, packing)
        config["train"]["grad_accum"] = grad_accum
        runs.append((name, config, False))
    control = _config(tmp_path, "unweighted", models[HF], {"nproc": 2}, "block_causal")
    runs.append(("dp (unweighted)", control, True))
    got = run_ranks(_train, 2, runs, timeout=240)[0]
    for name, (model, packing, _) in CASES.items():
        _assert_same(got[name], want[f"{model}-{packing}"], name)
    with pytest.raises(AssertionError):  # the negative control: it must not pass
        _assert_same(got["dp (unweighted)"], want[f"{HF}-block_causal"], "unweighted")


def _assert_same(got: dict, want: dict, name: str) -> None:
    """Every step's loss, gradient norm, target tokens and padding; the final weights."""
    assert got["target_tokens"] == want["target_tokens"] and min(want["target_tokens"]) > 0
    assert got["padding"] == want["padding"] and 0 <= max(want["padding"]) < 1
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=key: f"{name} {k}: {m}")
    assert got["weights"].keys() == want["weights"].keys()
    for key, tensor in want["weights"].items():
        torch.testing.assert_close(got["weights"][key], tensor, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, k=key: f"{name} {k}: {m}")
