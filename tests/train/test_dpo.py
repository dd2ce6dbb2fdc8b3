"""DPO (dtrain.train.objective.Preference) against TRL's DPOTrainer, code nobody here wrote:
the same transformers Llama with the same LoRA adapters (the reference: the base, adapters
off, on both sides: TRL adds a new adapter, set to dtrain's), the same pairs as TRL's own
collator makes them, the same beta and
label smoothing; the loss and TRL's reward metrics agree to 1e-5. With the adapters at
zero the policy is the reference and the loss is ln 2."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from dtrain import comm
from dtrain.adapters import AdapterConfig, apply
from dtrain.adapters.lora import adapters
from dtrain.config.objective import ObjectiveConfig
from dtrain.data.sequences import IGNORE
from dtrain.testing.chat import tiny_llama
from dtrain.train.objective import Preference
from tests.support.cli import exact_run

PAIRS = [
    {"prompt": "What is two plus two?", "chosen": " Four.", "rejected": " Five, surely."},
    {"prompt": "Capital of France?", "chosen": " Paris", "rejected": " Rome"},
    {"prompt": "Say hello in German.", "chosen": " Hallo!", "rejected": " Bonjour, mon ami."},
    {"prompt": "And of Italy?", "chosen": " Rome", "rejected": " Paris, I think"},
]
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _models(folder: Path) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(dtrain's adapted transformers Llama, B drawn non-zero so the policy is not the
    reference; a copy of the same base for TRL; the tokenizer)."""
    from transformers import LlamaForCausalLM

    from dtrain.models.hf import HFCausalLM

    tokenizer, config = tiny_llama(folder)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    ours = HFCausalLM(copy.deepcopy(base), block_size=128)
    apply(ours, AdapterConfig(kind="lora", rank=4, alpha=8, targets=TARGETS), "hf")
    torch.manual_seed(1)
    for layer in adapters(ours).values():
        layer.lora_B.weight.data.normal_(0, 0.3)
    return ours, base, tokenizer


def _trl(ours: torch.nn.Module, base: torch.nn.Module, tokenizer: object, out: Path,
         beta: float, smoothing: float, loss_type: str, pairs: list[dict]
         ) -> tuple[dict[str, torch.Tensor], float, dict[str, float]]:
    """TRL's batch of PAIRS (its collator's), its loss and its metrics: TRL adds a new
    adapter to `base` (so its reference is the base, adapters off), set to ours."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=len(pairs), beta=beta,
                     label_smoothing=smoothing, loss_type=loss_type, report_to="none",
                     max_length=128, use_cpu=True)
    trainer = DPOTrainer(model=base, args=args, train_dataset=Dataset.from_list(pairs),
                         processing_class=tokenizer,
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                lora_dropout=0.0, task_type="CAUSAL_LM"))
    theirs = trainer.model
    for name, layer in adapters(ours).items():
        peft_layer = theirs.base_model.model.get_submodule(name.removeprefix("hf."))
        peft_layer.lora_A["default"].weight.data.copy_(layer.lora_A.weight)
        peft_layer.lora_B["default"].weight.data.copy_(layer.lora_B.weight)
    batch = next(iter(trainer.get_train_dataloader()))
    theirs.eval()  # no dropout; TRL keeps the metrics under the model's mode
    loss = trainer._compute_loss(theirs, batch, return_outputs=False)
    metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    return batch, float(loss), metrics


def _rows(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's batch (all chosen rows, then all rejected) as dtrain's: pairs interleaved
    (chosen at even rows), inputs and next-token targets on the responses only."""
    ids, completion = batch["input_ids"], batch["completion_mask"]
    n = ids.shape[0] // 2
    order = torch.stack([torch.arange(n), torch.arange(n) + n], 1).flatten()
    ids, completion = ids[order], completion[order]
    targets = ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE)
    return ids[:, :-1], targets


@pytest.mark.timeout(120)
@pytest.mark.parametrize("beta, smoothing, loss_type, pairs", [
    (0.1, 0.0, "sigmoid", 4), (0.5, 0.0, "sigmoid", 4),
    # label smoothing (cDPO): TRL's sigmoid loss ignores it; its "aot" loss is cDPO's
    # formula on sorted log-ratios, which on one pair is cDPO itself
    (0.5, 0.2, "aot", 1)])
def test_loss_and_metrics_equal_trl(tmp_path: Path, beta: float, smoothing: float,
                                    loss_type: str, pairs: int) -> None:
    ours, base, tokenizer = _models(tmp_path / "model")
    batch, want, metrics = _trl(ours, base, tokenizer, tmp_path / "trl", beta, smoothing,
                                loss_type, PAIRS[:pairs])
    ours.eval()
    dpo = Preference(ObjectiveConfig(kind="dpo", beta=beta, label_smoothing=smoothing), ours,
                     adapted=True, vocab_size=len(tokenizer), tp=comm.resolve(None))
    got = dpo(ours, _rows(batch))
    assert abs(want - math.log(2)) > 1e-3  # the adapters count: not the reference's ln 2
    torch.testing.assert_close(got.item(), want, rtol=1e-5, atol=1e-5)
    figures = dpo.take(False, None, torch.device("cpu"))
    for ours_name, trl_name in [("reward_chosen", "rewards/chosen"),
                                ("reward_rejected", "rewards/rejected"),
                                ("reward_margin", "rewards/margins"),
                                ("reward_accuracy", "rewards/accuracies"),
                                ("logp_chosen", "logps/chosen"),
                                ("logp_rejected", "logps/rejected")]:
        assert figures[ours_name] == pytest.approx(metrics[trl_name], rel=1e-4, abs=1e-5), \
            ours_name


@pytest.mark.timeout(60)
def test_the_first_step_is_ln_2(tmp_path: Path) -> None:
    """Adapters as drawn (B zero): the policy is the reference, delta 0, loss ln 2."""
    ours, _, tokenizer = _models(tmp_path / "model")
    for layer in adapters(ours).values():
        layer.lora_B.weight.data.zero_()
    dpo = Preference(ObjectiveConfig(kind="dpo", beta=0.1), ours, adapted=True,
                     vocab_size=len(tokenizer), tp=comm.resolve(None))
    x = torch.randint(0, len(tokenizer), (4, 12))
    y = x.roll(-1, 1).masked_fill(torch.arange(12) < 6, IGNORE)
    loss = dpo(ours, (x, y))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    loss.backward()  # the gradient flows to the adapters only
    assert all(p.grad is not None for n, p in ours.named_parameters() if ".lora_" in n)


HF_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2}


def _pairs(path: Path, n: int = 48) -> Path:
    """Preference pairs of sums: the right answer chosen, a wrong one rejected."""
    import json

    with path.open("w") as f:
        for i in range(n):
            a, b = i % 7, (3 * i) % 5
            f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": f"{a + b}.",
                                "rejected": f"{a + b + 1 + i % 3}."}) + "\n")
    return path


def _dpo_config(folder: Path, name: str, parallel: dict, adapter: bool = True) -> dict:
    out = folder / name
    return {"model": {"arch": "hf", "hf_config": str(folder / "config.json"), "block_size": 16},
            "adapter": {"kind": "lora", "rank": 4, "alpha": 8} if adapter else {},
            "objective": {"kind": "dpo", "beta": 0.5},
            "data": {"path": str(folder / "pairs.jsonl"), "format": "preference",
                     "val_fraction": 0.2},
            **exact_run(out, steps=3, batch=8, parallel=parallel)}


def _run(runs: list[tuple[str, dict]]) -> dict[str, dict]:
    """Each run by the Trainer: rank 0's metric rows and its trainable weights at the end."""
    import json

    from dtrain.config import config_from_dict
    from dtrain.tensor_parallel import full_state_dict
    from dtrain.train.trainer import Trainer

    out = {}
    for name, values in runs:
        trainer = Trainer(config_from_dict(values))
        trainer.run()
        rows = [json.loads(line) for line in
                Path(values["logging"]["metrics"]).read_text().splitlines()]
        module = getattr(trainer.holding.module, "module", trainer.holding.module)
        trained = {n for n, p in module.named_parameters() if p.requires_grad}
        zero = getattr(trainer.holding, "zero", None)
        whole = zero.state_dict() if zero is not None and zero.stage == 3 else \
            full_state_dict(module)
        out[name] = {"rows": [r for r in rows if "loss" in r],
                     "held_out": [r for r in rows if "eval_loss" in r],
                     "weights": {n: t for n, t in whole.items() if n in trained}}
    return out


LAYOUTS = {
    "quick": [("ZeRO-2", {"nproc": 2, "zero": 2}, True), ("tp", {"nproc": 2, "tp": 2}, True)],
    "more": [("ZeRO-3", {"nproc": 2, "zero": 3}, True), ("dp-whole", {"nproc": 2}, False)],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["quick", pytest.param("more", marks=pytest.mark.slow)])
def test_dpo_in_every_layout_equals_one_process(tmp_path: Path, which: str) -> None:
    """LoRA + DPO under ZeRO-2, ZeRO-3 and tp over 2 ranks, and DPO of the whole model (a
    frozen copy for the reference) under data parallelism x 2: every step's loss, gradient
    norm and reward metrics, and the trained weights, equal one process's; step 1's loss
    is ln 2."""
    import json

    from dtrain.testing import run_ranks

    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
    _pairs(tmp_path / "pairs.jsonl")
    adapted = {a for _, _, a in LAYOUTS[which]}
    alone = run_ranks(_run, 1, [(str(a), _dpo_config(tmp_path, f"one-{a}", {"nproc": 1},
                                                     adapter=a)) for a in adapted],
                      timeout=150)[0]
    layouts = [(name, _dpo_config(tmp_path, name, parallel, adapter=a), str(a))
               for name, parallel, a in LAYOUTS[which]]
    got = run_ranks(_run, 2, [(n, c) for n, c, _ in layouts], timeout=250)[0]
    for name, _, baseline in layouts:
        want = alone[baseline]
        assert want["rows"][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert want["rows"][-1]["loss"] < math.log(2) - 1e-3  # it learns
        for key in ("loss", "grad_norm", "reward_margin", "reward_accuracy", "logp_chosen",
                    "logp_rejected"):
            torch.testing.assert_close([r[key] for r in got[name]["rows"]],
                                       [r[key] for r in want["rows"]], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        torch.testing.assert_close(got[name]["held_out"][-1]["eval_reward_accuracy"],
                                   want["held_out"][-1]["eval_reward_accuracy"])
        for key, tensor in want["weights"].items():
            torch.testing.assert_close(got[name]["weights"][key], tensor, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change, message", [
    ({"data.format": '"jsonl"'}, 'objective.kind = "dpo" needs preference pairs'),
    ({"data.packing": '"stream"'}, 'objective.kind = "dpo" with data.packing = \'stream\''),
    ({"objective.kind": '"sft"'}, 'data.format = "preference" is pairs'),
    ({"parallel.pp": "2"}, 'objective.kind = "dpo" with parallel.pp > 1 is not supported'),
    ({"objective.beta": "0"}, "objective.beta = 0.0 must be above 0"),
])
def test_bad_dpo_setups_are_one_line(tmp_path: Path, change: dict[str, str],
                                     message: str) -> None:
    """Each refused before anything starts: exit 2, one line, nothing written."""
    import json

    from tests.support import cli

    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
    _pairs(tmp_path / "pairs.jsonl")
    config = _dpo_config(tmp_path, "run", {"nproc": 1})
    sets = [f"{section}.{key}={json.dumps(value)}" for section, body in config.items()
            if section not in ("parallel", "adapter") for key, value in body.items()]
    sets += ["adapter.kind=\"lora\"", *(f"{k}={v}" for k, v in change.items())]
    result = cli.dtrain("train", *(arg for s in sets for arg in ("--set", s)), cwd=str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert message in cli.one_error_line(result)
    assert not (tmp_path / "run").exists()
