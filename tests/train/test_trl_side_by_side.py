"""Instruction tuning side by side with TRL's SFTTrainer (code nobody here wrote): the same
tiny transformers Llama (from one folder), tokenizer, chat template, conversations, order,
optimizer and learning rate, one process, no packing. Every step's loss agrees within
1e-4.

The TRL defaults matched, and how:
- the order: TRL's Trainer draws a random order of its own; its sampler is replaced by
  dtrain's order of the same rows (one seeded permutation per epoch, `dtrain.data.batches`);
- the rows: dtrain holds the last documents out for evaluation (`val_fraction`); TRL is
  given the others; TRL's `max_length` is dtrain's block_size + 1 (tokens, where
  block_size counts positions: the inputs of the tokens but the last);
- the loss: TRL's is the mean over the batch's assistant tokens (`assistant_only_loss`,
  read from the template's generation tags); dtrain's too (`train_on = "assistant"`,
  `packing = "pad"`);
- the optimizer: plain SGD at a constant rate, no clip, no weight decay, no warm-up on
  both sides (TRL: `optim="sgd"`, `max_grad_norm=0`, `lr_scheduler_type="constant"`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain.testing.chat import tiny_llama, write_chat_jsonl
from tests.train.test_instructions import _conversations

STEPS, BATCH, LR, SEED = 5, 4, 0.5, 7


def _folder(tmp_path: Path) -> Path:
    """A transformers Llama folder (config, weights, tokenizer with its chat template)."""
    from transformers import LlamaForCausalLM

    folder = tmp_path / "model"
    _, config = tiny_llama(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def _train_rows(values: dict) -> int:
    """Train the run `values` describes on this process's world; its training rows."""
    from dtrain.config import config_from_dict
    from dtrain.train.trainer import Trainer

    trainer = Trainer(config_from_dict(values))
    trainer.run()
    return len(trainer.data.train)


def _dtrain_losses(tmp_path: Path, folder: Path, data: Path) -> tuple[list[float], int]:
    from dtrain.testing import run_ranks

    out = tmp_path / "dtrain"
    values = {"model": {"arch": "hf", "init_from": str(folder), "block_size": 64},
              "data": {"path": str(data), "format": "chat",
                       "tokenizer": str(folder / "tokenizer.json"), "packing": "pad",
                       "val_fraction": 0.17},
              "optimizer": {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0,
                            "grad_clip": 0.0, "warmup_steps": 0, "schedule": "constant"},
              "train": {"steps": STEPS, "batch_size": BATCH, "eval_every": 0,
                        "eval_batches": 1, "out_dir": str(out), "seed": SEED},
              "logging": {"sample_tokens": 0, "metrics": str(out / "metrics.jsonl")},
              "checkpoint": {"background": False}, "parallel": {"nproc": 1}}

    rows = run_ranks(_train_rows, 1, values, timeout=120)[0]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r], rows


def _trl_losses(tmp_path: Path, folder: Path, conversations: list, rows: int) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    tokenizer.pad_token = "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa",
                                                 dtype=torch.float32)
    dataset = Dataset.from_list([{"messages": c} for c in conversations[:rows]])
    order: list[int] = []
    for epoch in range(STEPS * BATCH // rows + 1):  # dtrain's order (dtrain.data.batches)
        per_epoch = rows // BATCH * BATCH
        drawn = torch.randperm(rows, generator=torch.Generator().manual_seed(SEED + epoch))
        order += drawn[:per_epoch].tolist()
    losses: list[float] = []

    class SameOrder(SFTTrainer):
        def _get_train_sampler(self, *args, **kwargs):  # noqa: ANN202
            return order

        def compute_loss(self, model, inputs, *args, **kwargs):  # noqa: ANN001, ANN202
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    args = SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=BATCH,
                     max_steps=STEPS, learning_rate=LR, optim="sgd", weight_decay=0.0,
                     max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0,
                     assistant_only_loss=True, packing=False, max_length=65,
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                     dataloader_drop_last=True, seed=SEED, bf16=False, fp16=False,
                     dataset_num_proc=None)
    SameOrder(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()
    return losses


@pytest.mark.timeout(240)
def test_chat_sft_equals_trl_sft_trainer_step_by_step(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    folder = _folder(tmp_path)
    conversations = [c for c in _conversations(40)][:24]
    data = write_chat_jsonl(tmp_path / "chats.jsonl", conversations)
    ours, rows = _dtrain_losses(tmp_path, folder, data)
    theirs = _trl_losses(tmp_path, folder, conversations, rows)
    assert len(ours) == len(theirs) == STEPS
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
