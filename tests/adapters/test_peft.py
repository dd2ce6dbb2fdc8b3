"""LoRA adapters in and out of PEFT's format: `dtrain export --format peft` gives a folder
that `peft.PeftModel.from_pretrained` loads onto the base with dtrain's logits (a
transformers Llama, dtrain's Llama, dtrain's GPT with its fused qkv); `--format hf
--merge` a model transformers loads with the same logits; an adapter checkpoint without
`--merge` is refused in one line; and `model.init_from` a folder PEFT saved starts
training from it, with PEFT's loss on the first batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dtrain.testing import run_ranks
from tests.adapters.test_adapter_checkpoints import LLAMA, dtrain_logits
from tests.support.cli import dtrain, one_error_line

GPT2 = {"vocab_size": 256, "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2,
        "activation_function": "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0}
"""A GPT-2 of dtrain's GPT's shape (exact GELU, as dtrain's)."""


def base_folder(folder: Path, arch: str) -> dict:
    """Save a random transformers base model in `folder` and return the `[model]` section
    of dtrain's model `arch` that starts from it."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = {"init_from": str(folder), "block_size": 32}
    if arch == "gpt":
        GPT2LMHeadModel(GPT2Config(**GPT2)).save_pretrained(folder)
        return {"arch": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, **common}
    LlamaForCausalLM(LlamaConfig(**LLAMA, rms_norm_eps=1e-5)).save_pretrained(folder)
    if arch == "hf":
        return {"arch": "hf", **common}
    return {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
            "ffn_hidden": 64, "tie_embeddings": False, "norm_eps": 1e-5, **common}


def run_config(folder: Path, model: dict, steps: int = 2, adapter: dict | None = None) -> dict:
    """A short LoRA run from `model`, AdamW at a rate that moves B well off zero."""
    out = folder / "run"
    lora = {"kind": "lora", "rank": 4, "alpha": 8} if adapter is None else adapter
    return {"model": model, "adapter": lora,
            "data": {"max_bytes": 20_000},
            "optimizer": {"name": "adamw", "lr": 0.05, "warmup_steps": 0, "grad_clip": 0.0},
            "train": {"steps": steps, "batch_size": 4, "eval_every": 0, "eval_batches": 1,
                      "out_dir": str(out)},
            "logging": {"sample_tokens": 0, "metrics": str(out / "metrics.jsonl")},
            "checkpoint": {"background": False}}


def train(values: dict) -> dict:
    """One run by the Trainer: its losses, the first step's batch, the final checkpoint."""
    from dtrain.config import config_from_dict
    from dtrain.train.trainer import Trainer

    trainer = Trainer(config_from_dict(values))
    first_loss = trainer.step()
    batch = trainer.step_rows
    assert batch is not None
    trainer.start = 1  # the rest of the run, its batches next in the stream
    summary = trainer.run()
    return {"losses": [first_loss, *summary["losses"]], "checkpoint": summary["checkpoint"],
            "inputs": batch.inputs, "targets": batch.targets}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["hf", "llama", "gpt"])
def test_peft_and_merged_exports_give_dtrains_logits(tmp_path: Path, arch: str) -> None:
    """Train adapters, then: PEFT on the base with `--format peft`'s folder, and
    transformers on `--format hf --merge`'s, give the adapted model's logits (fp32,
    1e-5); `--format hf` alone is refused in one line, nothing written."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = base_folder(tmp_path / "base", arch)
    result = run_ranks(train, 1, run_config(tmp_path, model), timeout=100)[0]
    ckpt = result["checkpoint"]
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    want = dtrain_logits(ckpt, x)

    exported = dtrain("export", ckpt, str(tmp_path / "adapter"), "--format", "peft")
    assert exported.returncode == 0, exported.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.0)
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert all(k.startswith("base_model.model.") and ".lora_" in k for k in keys)
        assert any(f.get_tensor(k).abs().max() > 1e-3 for k in keys if ".lora_B." in k)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)

    refused = dtrain("export", ckpt, str(tmp_path / "whole"), "--format", "hf")
    assert refused.returncode == 2 and "--merge" in one_error_line(refused)
    assert not (tmp_path / "whole").exists()
    merged = dtrain("export", ckpt, str(tmp_path / "merged"), "--format", "hf", "--merge")
    assert merged.returncode == 0, merged.stderr
    folded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(folded.eval()(input_ids=x).logits, want, rtol=1e-5,
                                   atol=1e-5)


def peft_folder(folder: Path) -> tuple[Path, torch.nn.Module]:
    """A base Llama and adapters made and saved by transformers and PEFT themselves, B
    random (so the adapters count): the PEFT folder and the PEFT model."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(folder / "base")
    base = LlamaForCausalLM.from_pretrained(folder / "base", dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj", "down_proj"],
                                           task_type="CAUSAL_LM"))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    peft.save_pretrained(folder / "adapter")
    return folder / "adapter", peft


@pytest.mark.timeout(120)
def test_init_from_a_peft_folder_starts_where_peft_is(tmp_path: Path) -> None:
    """`init_from` a PEFT folder, `[adapter]` left out: its base, rank, alpha and layers
    are taken; dtrain's first-step loss is PEFT's on the same batch, and training goes on
    (the loss falls). Another rank or other targets in `[adapter]`, and a base that is
    not a local folder, are refused in one line."""
    from dtrain import models
    from dtrain.adapters import AdapterConfig
    from dtrain.adapters.peft import PeftFolder
    from dtrain.errors import ConfigError
    from dtrain.models.config import ModelConfig

    adapter, peft = peft_folder(tmp_path)
    model = {"arch": "hf", "init_from": str(adapter), "block_size": 32}
    values = run_config(tmp_path, model, steps=4, adapter={})
    values["optimizer"]["lr"] = 0.01
    result = run_ranks(train, 1, values, timeout=100)[0]
    with torch.no_grad():
        logits = peft.eval()(input_ids=result["inputs"]).logits
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                               result["targets"].reshape(-1))
    torch.testing.assert_close(result["losses"][0], theirs.item(), rtol=1e-5, atol=1e-6)
    assert result["losses"][-1] < result["losses"][0]
    meta = json.loads((Path(result["checkpoint"]) / "index.json").read_text())["meta"]
    assert meta["config"]["adapter"]["rank"] == 4 and meta["config"]["adapter"]["alpha"] == 16
    assert len([n for n in meta["config"]["adapter"]["targets"]]) == 2 * 3
    assert meta["base"]["init_from"] == str((tmp_path / "base").resolve())

    folder = PeftFolder.read(adapter)
    assert folder is not None and folder.base == str(tmp_path / "base")
    shape = models.resolve(ModelConfig(arch="hf", init_from=folder.base, block_size=32), 256)
    with pytest.raises(ConfigError, match=r"adapter.rank = 2 but .* has r = 4"):
        folder.adapter_config(AdapterConfig(kind="lora", rank=2), shape)
    with pytest.raises(ConfigError, match=r"adapter.targets = \['q_proj'\] adapts 2 layers "
                                          r"and .* 6 \(hf.model.layers.0.mlp.down_proj is only"):
        folder.adapter_config(AdapterConfig(kind="lora", targets=["q_proj"]), shape)
    settings = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(
        {**settings, "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}))
    with pytest.raises(ConfigError, match="base_model_name_or_path = 'meta-llama/Llama-3.2-1B' "
                                          "is not a local model folder: set it in"):
        PeftFolder.read(adapter)
