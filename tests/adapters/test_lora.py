"""LoRA: the adapted layer equals PEFT's on the same weights (logits and gradients), only
the adapters train (the base unchanged bit for bit, no optimizer state for it), in
`dtrain train`'s layouts against one process; bad targets and ranks are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain.adapters import AdapterConfig, apply
from dtrain.adapters.lora import adapters
from dtrain.errors import ConfigError
from dtrain.testing import run_ranks
from tests.support.cli import exact_run

HF_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2}


def _hf(tmp_path: Path) -> torch.nn.Module:
    from dtrain import models
    from dtrain.models.config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
    torch.manual_seed(0)
    return models.build(models.resolve(
        ModelConfig(arch="hf", hf_config=str(tmp_path / "config.json"), block_size=32), 64))


def test_an_adapted_model_equals_peft_on_the_same_weights(tmp_path: Path) -> None:
    """dtrain's LoRA on a transformers Llama and PEFT's on a copy, A and B set alike (B
    random, so the adapters count): the same logits, and the same gradients of A and B."""
    import copy

    from peft import LoraConfig, get_peft_model

    ours = _hf(tmp_path)
    theirs = get_peft_model(copy.deepcopy(ours.hf), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    apply(ours, AdapterConfig(kind="lora", rank=4, alpha=8,
                              targets=["q_proj", "v_proj", "down_proj"]), "hf")
    torch.manual_seed(1)
    for name, layer in adapters(ours).items():
        layer.lora_B.weight.data.normal_(0, 0.1)
        peft_layer = theirs.base_model.model.get_submodule(name.removeprefix("hf."))
        peft_layer.lora_A["default"].weight.data.copy_(layer.lora_A.weight)
        peft_layer.lora_B["default"].weight.data.copy_(layer.lora_B.weight)
    x = torch.randint(0, 64, (2, 16))
    mine, peft_logits = ours(x), theirs(input_ids=x).logits
    torch.testing.assert_close(mine, peft_logits, rtol=1e-5, atol=1e-5)
    mine.square().mean().backward()
    peft_logits.square().mean().backward()
    for name, layer in adapters(ours).items():
        peft_layer = theirs.base_model.model.get_submodule(name.removeprefix("hf."))
        torch.testing.assert_close(layer.lora_A.weight.grad,
                                   peft_layer.lora_A["default"].weight.grad)
        torch.testing.assert_close(layer.lora_B.weight.grad,
                                   peft_layer.lora_B["default"].weight.grad)
    trained = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in ours.named_parameters() if ".lora_" in n}


def test_defaults_and_bad_targets(tmp_path: Path) -> None:
    model = _hf(tmp_path)
    names = apply(model, AdapterConfig(kind="lora"), "hf")
    assert len(names) == 2 * 7 and all("lora" not in n for n in names)
    with pytest.raises(ConfigError, match="'qproj' matches no linear layer"):
        apply(_hf(tmp_path), AdapterConfig(kind="lora", targets=["qproj"]), "hf")
    with pytest.raises(ConfigError, match="adapter.rank = 64 is above the size"):
        apply(_hf(tmp_path), AdapterConfig(kind="lora", rank=64), "hf")


DTRAIN_LLAMA = {"arch": "llama", "block_size": 32, "n_layer": 2, "n_embd": 32, "n_head": 4,
                "n_kv_head": 2, "ffn_hidden": 64}
"""dtrain's Llama, for sequence parallelism (which transformers' models do not take)."""


def _config(folder: Path, name: str, parallel: dict, model: dict | None = None) -> dict:
    """A two-step run of a transformers Llama (bytes: 256 ids) with LoRA, plain SGD."""
    out = folder / name
    return {"model": model or {"arch": "hf", "hf_config": str(folder / "config.json"),
                               "block_size": 32},
            "adapter": {"kind": "lora", "rank": 4, "alpha": 8},
            "data": {"max_bytes": 20_000},
            **exact_run(out, steps=2, batch=4, parallel=parallel)}


def _train(runs: list[tuple[str, dict]]) -> dict[str, dict]:
    """Each run by the Trainer: rank 0's losses, gradient norms and whole weights (the
    base too: every part of the layout saved, not the adapter checkpoint), and the
    parameters the optimizers hold state for."""
    from safetensors.torch import load_file

    import dtrain
    from dtrain.checkpoint import training, universal
    from dtrain.config import config_from_dict
    from dtrain.train.trainer import Trainer

    out = {}
    for name, values in runs:
        trainer = Trainer(config_from_dict(values))
        trainer.run()
        stateful = sum(len(o.state) for o in trainer.holding.optimizers)
        rows = [json.loads(line) for line in
                Path(values["logging"]["metrics"]).read_text().splitlines() if "loss" in line]
        zero = getattr(trainer.holding, "zero", None)
        out[name] = {"loss": [r["loss"] for r in rows if "loss" in r],
                     "grad_norm": [r["grad_norm"] for r in rows if "loss" in r],
                     "stateful": stateful,
                     "base_sharded": zero is not None and bool(zero.frozen)}
        folder = Path(values["train"]["out_dir"]) / "whole"
        path = training.save(folder, values["train"]["steps"], trainer.holding.saved,
                             trainer.schedulers, values, keep_last=1)
        if dtrain.world.current().rank == 0:
            file = universal.export(path, folder / "model.safetensors")
            out[name]["weights"] = load_file(file)
    return out


def _initial(folder: Path, model: dict | None = None) -> dict[str, torch.Tensor]:
    """The weights every run starts from (drawn by seed and name, dtrain.models.init)."""
    from dtrain import adapters, models
    from dtrain.config import config_from_dict
    from dtrain.models import init

    config = config_from_dict(_config(folder, "x", {"nproc": 1}, model))
    shape = models.resolve(config.model, 256)
    skeleton = init.skeleton(lambda: adapters.built(shape, config.adapter))
    model = init.materialized(skeleton, init.Initial(skeleton, config.train.seed))
    return {n: p.detach() for n, p in model.state_dict().items()}


LAYOUTS = {"dp": {}, "ZeRO-1": {"zero": 1}, "ZeRO-2": {"zero": 2}, "ZeRO-3": {"zero": 3},
           "tp": {"tp": 2},
           "pp": {"pp": 2, "microbatches": 2}, "cp": {"cp": 2}}
SEQUENCE_PARALLEL = {"tp": 2, "sequence_parallel": True}
"""On dtrain's Llama, against its own one-process run."""
DTRAIN_MOE = {**DTRAIN_LLAMA, "n_experts": 4, "experts_per_token": 2, "moe_layers": "after 1"}
"""dtrain's Llama with experts in its second block: adapters on the attention and the
first block's dense MLP, the experts frozen; under expert parallelism."""


@pytest.mark.timeout(300)
def test_adapters_train_alone_in_every_layout_as_in_one_process(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**HF_LLAMA, "vocab_size": 256}))
    alone = run_ranks(_train, 1, [("hf", _config(tmp_path, "one", {"nproc": 1})),
                                  ("llama", _config(tmp_path, "one-llama", {"nproc": 1},
                                                    DTRAIN_LLAMA)),
                                  ("moe", _config(tmp_path, "one-moe", {"nproc": 1},
                                                  DTRAIN_MOE))], timeout=120)[0]
    runs = [(name, _config(tmp_path, name, {"nproc": 2, **p})) for name, p in LAYOUTS.items()]
    runs.append(("tp-sp", _config(tmp_path, "tp-sp", {"nproc": 2, **SEQUENCE_PARALLEL},
                                  DTRAIN_LLAMA)))
    runs.append(("ep", _config(tmp_path, "ep", {"nproc": 2, "ep": 2}, DTRAIN_MOE)))
    got = run_ranks(_train, 2, runs, timeout=250)[0]
    for name, (model, initial) in {**{n: ("hf", _initial(tmp_path)) for n in LAYOUTS},
                                   "tp-sp": ("llama", _initial(tmp_path, DTRAIN_LLAMA)),
                                   "ep": ("moe", _initial(tmp_path, DTRAIN_MOE))}.items():
        want = alone[model]
        assert got[name]["base_sharded"] == (name == "ZeRO-3"), name  # ZeRO-3 shards the base
        adapted = {n for n in want["weights"] if ".lora_" in n}
        assert adapted and want["stateful"] == len(adapted)
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(got[name][key], want[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        for key, tensor in want["weights"].items():
            torch.testing.assert_close(got[name]["weights"][key], tensor, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
            if key not in adapted:  # the base: unchanged, bit for bit
                assert torch.equal(got[name]["weights"][key], initial[key]), (name, key)


@pytest.mark.timeout(240)
def test_a_bfloat16_base_trains_as_in_one_process_in_half_the_bytes(tmp_path: Path) -> None:
    """`[adapter] base_dtype = "bfloat16"`: the frozen base held in bfloat16 (its products
    under autocast), the adapters in float32; ZeRO-3 and a pipeline equal one process, and
    the run stays near the float32 base's."""
    (tmp_path / "config.json").write_text(json.dumps({**HF_LLAMA, "vocab_size": 256}))

    def config(name: str, parallel: dict, dtype: str = "bfloat16") -> dict:
        values = _config(tmp_path, name, parallel, DTRAIN_LLAMA)
        return {**values, "adapter": {**values["adapter"], "base_dtype": dtype}}

    alone = run_ranks(_train, 1, [("bf16", config("one", {"nproc": 1})),
                                  ("fp32", config("fp32", {"nproc": 1}, "float32"))],
                      timeout=120)[0]
    got = run_ranks(_train, 2, [("ZeRO-3", config("zero3", {"nproc": 2, "zero": 3})),
                                ("pp", config("pp", {"nproc": 2, "pp": 2, "microbatches": 2}))],
                    timeout=200)[0]
    want = alone["bf16"]
    base = [k for k in want["weights"] if ".lora_" not in k]
    assert base and all(want["weights"][k].dtype == torch.bfloat16 for k in base)
    for name in got:
        torch.testing.assert_close(got[name]["loss"], want["loss"], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(want["loss"], alone["fp32"]["loss"], rtol=1e-2, atol=1e-2)
