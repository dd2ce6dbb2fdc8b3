"""Preference tuning end to end: LoRA + DPO of a transformers Llama by dtrain, and side by
side by TRL's DPOTrainer, from the same folders, on the same pairs in the same order, with
the same optimizer; held-out reward accuracy before and after, and time per step.

    python benchmarks/dpo_end_to_end.py [--steps 120 --rounds 3 --write]
    python benchmarks/dpo_end_to_end.py --quick      # a smoke check, under a minute

No download. The base: a 4-layer transformers Llama of width 128, random, saved with
`save_pretrained` beside a small byte-level BPE tokenizer (dtrain.testing.chat's; no BOS,
`<|endoftext|>` its end-of-sequence token, which both sides append to each response). The
adapters: LoRA rank 8, alpha 16, on q/k/v/o and the MLP's projections, drawn once by PEFT
(`get_peft_model`, seeded, B zero) and saved as a PEFT folder: dtrain starts from it
(`[model] init_from` = the PEFT folder, whose base is the model folder); TRL is given the
plain base and a `LoraConfig` with the same settings (it then makes the reference by
switching the adapters off, as dtrain does), and its new adapter is set to the folder's.

The pairs (standard form, three strings): the prompt "Is N even?" for N in 10..99, the
chosen response the right answer (" Yes." or " No."), the rejected one the other. The
rule lies in the prompt: the same two responses are chosen and rejected in turn, so no
preference for a response's form can be learned, only the parity of N's last digit; the
held-out pairs are numbers never seen, whose last digits were. The pairs are shuffled
once (seeded); dtrain holds the last `--held-out` out (`val_fraction`), and TRL evaluates
on those same pairs.

The same order: dtrain draws one seeded permutation of the training pairs per epoch
(dtrain.data.sequences.batches); TRL's sampler is replaced by that order
(`_get_train_sampler`), its batches of `--batch` pairs cut from it with the tail dropped.
The same optimizer: AdamW (betas 0.9, 0.999; eps 1e-8; no weight decay) at a constant
`--lr`, no warm-up, no clipping (TRL: `optim="adamw_torch"`, `max_grad_norm=0`,
`lr_scheduler_type="constant"`); the same beta and the sigmoid loss. Both run on the CPU
with `--threads` threads, one process each: dtrain's Trainer in a spawned process
(dtrain.testing.run_ranks, one rank), TRL in this one.

Measured, per run: every step's loss and reward accuracy (the share of the step's pairs
whose chosen reward beta x (logp - ref) is the higher), the held-out reward accuracy and
margin at step 0 and every `--eval-every` steps (dtrain: `eval_reward_accuracy` in its
metrics JSON lines, step 0 by `Trainer.evaluate(0)` before `run()`; TRL:
`trainer.evaluate()` and `eval_rewards/accuracies`), and the median step time with the
first two steps left out (dtrain: `step_time_s`; TRL: a callback's clock from
`on_step_begin` to `on_step_end`, which covers the same forward, backward and optimizer
step). The runs alternate, `--rounds` times each; the median round is shown with every
round's. At step 0 the policy is the reference: every reward is 0, so no pair's chosen
reward is the higher and the reward accuracy is 0 (ties), on both sides.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_md import replace_section  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 8, 16
BLOCK = 24  # positions of a row: "Is 98 even? Yes." and the end of sequence are 17 tokens
SEED = 0


# ------------------------------------------------------------------ the base and the data
def make_base(folder: Path, width: int, layers: int) -> None:
    """The tokenizer and a random transformers Llama in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dtrain.testing.chat import make_chat_tokenizer

    make_chat_tokenizer(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width,
                         intermediate_size=width * 8 // 3, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=3, eos_token_id=0,
                         pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(str(folder))


def make_adapter(base: Path, folder: Path) -> None:
    """A PEFT LoRA folder over `base`: A drawn by PEFT (seeded), B zero."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(SEED + 1)
    get_peft_model(model, lora_config()).save_pretrained(str(folder))


def lora_config():  # noqa: ANN201  (peft is imported late)
    from peft import LoraConfig

    return LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0,
                      task_type="CAUSAL_LM")


def pairs(seed: int = SEED) -> list[dict[str, str]]:
    """"Is N even?" for N in 10..99, the right answer chosen, the wrong one rejected, in
    one seeded order (see the module doc)."""
    out = [{"prompt": f"Is {n} even?", "chosen": " Yes." if n % 2 == 0 else " No.",
            "rejected": " No." if n % 2 == 0 else " Yes."} for n in range(10, 100)]
    random.Random(seed).shuffle(out)
    return out


def train_order(n_train: int, batch: int, steps: int) -> list[int]:
    """dtrain's order of the training pairs (dtrain.data.sequences.batches): one seeded
    permutation per epoch, cut into batches of `batch` pairs, the tail dropped."""
    import torch

    per_epoch = n_train // batch
    order: list[int] = []
    epoch = 0
    while len(order) < steps * batch:
        drawn = torch.randperm(n_train, generator=torch.Generator().manual_seed(SEED + epoch))
        order += drawn[:per_epoch * batch].tolist()
        epoch += 1
    return order


# ------------------------------------------------------------------ dtrain
def dtrain_values(folder: Path, args: argparse.Namespace, n_pairs: int) -> dict:
    out = folder / f"dtrain-{time.monotonic_ns()}"
    return {
        "model": {"arch": "hf", "init_from": str(folder / "adapter"), "block_size": BLOCK},
        "adapter": {"kind": "lora"},  # the PEFT folder's rank, alpha and layers
        "objective": {"kind": "dpo", "beta": args.beta},
        "data": {"path": str(folder / "pairs.jsonl"), "format": "preference",
                 "tokenizer": str(folder / "base" / "tokenizer.json"), "packing": "pad",
                 "val_fraction": args.held_out / n_pairs},
        "optimizer": {"name": "adamw", "lr": args.lr, "betas": [0.9, 0.999],
                      "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 0,
                      "schedule": "constant"},
        "train": {"steps": args.steps, "batch_size": 2 * args.batch, "seed": SEED,
                  "eval_every": args.eval_every,
                  "eval_batches": args.held_out // args.batch, "out_dir": str(out)},
        "logging": {"sample_tokens": 0, "log_every": 1000,
                    "metrics": str(out / "metrics.jsonl")},
        "checkpoint": {"background": False, "every": 0},
        "parallel": {"nproc": 1},
    }


def _dtrain_run(values: dict, threads: int) -> list[dict]:
    """One run of dtrain's Trainer on this process (one rank): its metric rows, with the
    held-out figures at step 0 first."""
    import torch

    from dtrain.config import config_from_dict
    from dtrain.train.trainer import Trainer

    torch.set_num_threads(threads)
    trainer = Trainer(config_from_dict(values))
    trainer.evaluate(0)  # the policy is the reference: every reward 0
    trainer.run()
    path = Path(values["logging"]["metrics"])
    return [json.loads(line) for line in path.read_text().splitlines()]


def dtrain_run(folder: Path, args: argparse.Namespace, n_pairs: int) -> dict[str, Any]:
    from dtrain.testing import run_ranks

    values = dtrain_values(folder, args, n_pairs)
    rows = run_ranks(_dtrain_run, 1, values, args.threads, timeout=3600)[0]
    steps = [r for r in rows if "loss" in r]
    held = [r for r in rows if "eval_reward_accuracy" in r]
    return {"loss": [r["loss"] for r in steps],
            "accuracy": [r["reward_accuracy"] for r in steps],
            "margin": [r["reward_margin"] for r in steps],
            "step_s": [r["step_time_s"] for r in steps],
            "held_out": [(r["step"], r["eval_reward_accuracy"], r["eval_reward_margin"])
                         for r in held]}


# ------------------------------------------------------------------ TRL
def trl_run(folder: Path, args: argparse.Namespace, data: list[dict]) -> dict[str, Any]:
    """The same run by TRL's DPOTrainer on this process."""
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    n_train = len(data) - args.held_out
    order = train_order(n_train, args.batch, args.steps)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder / "base"))
    model = AutoModelForCausalLM.from_pretrained(str(folder / "base"), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    record: dict[str, Any] = {"loss": [], "accuracy": [], "margin": [], "step_s": [],
                              "held_out": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            record["step_s"].append(time.perf_counter() - self.begin)

    class SameOrder(DPOTrainer):
        def _get_train_sampler(self, *_: Any, **__: Any) -> list[int]:  # dtrain's order
            return order

        def log(self, logs: dict[str, float], *rest: Any, **kwargs: Any) -> None:
            super().log(logs, *rest, **kwargs)  # adds TRL's metrics to `logs`
            if "loss" in logs and "rewards/accuracies" in logs:
                record["loss"].append(logs["loss"])
                record["accuracy"].append(logs["rewards/accuracies"])
                record["margin"].append(logs["rewards/margins"])
            if "eval_rewards/accuracies" in logs:
                record["held_out"].append((self.state.global_step,
                                           logs["eval_rewards/accuracies"],
                                           logs["eval_rewards/margins"]))

    config = DPOConfig(
        output_dir=str(folder / f"trl-{time.monotonic_ns()}"), beta=args.beta,
        loss_type="sigmoid", per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, max_steps=args.steps, learning_rate=args.lr,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=1, eval_strategy="steps" if args.eval_every else "no",
        eval_steps=args.eval_every or None, report_to=[], save_strategy="no", use_cpu=True,
        dataloader_drop_last=True, seed=SEED, bf16=False, fp16=False, max_length=BLOCK + 1,
        dataset_num_proc=None, disable_tqdm=True)
    trainer = SameOrder(model=model, args=config, train_dataset=Dataset.from_list(data[:n_train]),
                        eval_dataset=Dataset.from_list(data[n_train:]), processing_class=tokenizer,
                        peft_config=lora_config(), callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # its log lines; `log` above keeps them
    # its new adapter set to the PEFT folder's (A as drawn there, B zero): dtrain's start
    start = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    for name, param in trainer.model.named_parameters():
        if ".lora_" in name:
            param.data.copy_(start[name.replace(".default.", ".")])
    trainer.state.global_step = 0
    trainer.evaluate()  # step 0
    trainer.train()
    if not record["held_out"] or record["held_out"][-1][0] != args.steps:
        trainer.evaluate()
    return record


# ------------------------------------------------------------------ the report
def median_round(runs: list[dict[str, Any]]) -> tuple[int, list[float]]:
    """(the index of the round of median step time, each round's median step time)."""
    times = [statistics.median(r["step_s"][2:] or r["step_s"]) for r in runs]
    return sorted(range(len(runs)), key=lambda i: times[i])[len(runs) // 2], times


def curve_points(steps: int) -> list[int]:
    """A few steps to show the curves at: 1, then about every eighth of the run."""
    return sorted({1, *range(max(1, steps // 8), steps + 1, max(1, steps // 8)), steps})


def report(args: argparse.Namespace, runs: dict[str, list[dict]], n_pairs: int,
           loads: tuple[float, float], minutes: float) -> list[str]:
    pick, times = {}, {}
    for side, side_runs in runs.items():
        i, times[side] = median_round(side_runs)
        pick[side] = side_runs[i]
    ours, theirs = pick["dtrain"], pick["trl"]
    t_ours, t_theirs = statistics.median(times["dtrain"]), statistics.median(times["trl"])
    final = {side: r["held_out"][-1] for side, r in pick.items()}
    first = {side: r["held_out"][0] for side, r in pick.items()}
    n = min(len(ours["loss"]), len(theirs["loss"]))
    loss_gap = max(abs(a - b) for a, b in zip(ours["loss"][:n], theirs["loss"][:n], strict=True))
    apart = next((i for i in range(n) if abs(ours["loss"][i] - theirs["loss"][i]) > 1e-4), n)
    acc_gap = max(abs(a - b) for a, b in zip(ours["accuracy"][:n], theirs["accuracy"][:n],
                                             strict=True))
    same_held = {s for s, _, _ in ours["held_out"]} & {s for s, _, _ in theirs["held_out"]}
    held_gap = max((abs(a[1] - b[1]) for a in ours["held_out"] for b in theirs["held_out"]
                    if a[0] == b[0]), default=float("nan"))
    rounds = ", ".join
    lines = [
        "## Preference tuning end to end: LoRA + DPO by dtrain and by TRL's DPOTrainer",
        "",
        f"Held-out reward accuracy after {args.steps} steps: **dtrain {final['dtrain'][1]:.3f}, "
        f"TRL {final['trl'][1]:.3f}** (step 0: {first['dtrain'][1]:.3f} and "
        f"{first['trl'][1]:.3f}, every reward 0: the policy is the reference). Time per step: "
        f"dtrain **{t_ours * 1e3:.1f} ms**, TRL {t_theirs * 1e3:.1f} ms "
        f"(dtrain at **{t_theirs / t_ours:.2f}x** TRL's speed).",
        "",
        f"Command: `python benchmarks/dpo_end_to_end.py --steps {args.steps} --rounds "
        f"{args.rounds} --batch {args.batch} --lr {args.lr} --beta {args.beta} --threads "
        f"{args.threads} --write`  ",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch "
        f"{_version('torch')}, transformers {_version('transformers')}, peft "
        f"{_version('peft')}, trl {_version('trl')}; {datetime.date.today()}; load average "
        f"{loads[0]:.1f} before, {loads[1]:.1f} after; {minutes:.0f} min in all.  ",
        f"The base: a {args.layers}-layer transformers Llama of width {args.width}, random "
        "(made here, no download), a byte-level BPE tokenizer; LoRA rank "
        f"{RANK}, alpha {ALPHA} on {', '.join(TARGETS)}, one PEFT folder for both starts. "
        f"{n_pairs} pairs \"Is N even?\" (N = 10..99) -> chosen the right \" Yes.\" or "
        f"\" No.\", rejected the other, {args.held_out} held out; {args.batch} pairs a step, beta "
        f"{args.beta}, AdamW at a constant {args.lr} (no warm-up, no clip, no weight "
        f"decay), the same order on both sides; one process, {args.threads} thread(s).",
        "",
        "| | dtrain | TRL DPOTrainer |",
        "|---|---|---|",
        f"| time per step, median round (ms) | {t_ours * 1e3:.1f} | {t_theirs * 1e3:.1f} |",
        f"| every round (ms) | {rounds(f'{t * 1e3:.1f}' for t in times['dtrain'])} | "
        f"{rounds(f'{t * 1e3:.1f}' for t in times['trl'])} |",
        f"| held-out reward accuracy, step 0 | {first['dtrain'][1]:.3f} | "
        f"{first['trl'][1]:.3f} |",
        f"| held-out reward accuracy, step {args.steps} | {final['dtrain'][1]:.3f} | "
        f"{final['trl'][1]:.3f} |",
        f"| held-out reward margin, step {args.steps} | {final['dtrain'][2]:.4f} | "
        f"{final['trl'][2]:.4f} |",
        "",
        "The curves of the median round (training loss and the step's reward accuracy, "
        "dtrain / TRL):",
        "",
        "| step | loss | reward accuracy |",
        "|---|---|---|",
        *(f"| {s} | {ours['loss'][s - 1]:.4f} / {theirs['loss'][s - 1]:.4f} | "
          f"{ours['accuracy'][s - 1]:.3f} / {theirs['accuracy'][s - 1]:.3f} |"
          for s in curve_points(n)),
        "",
        "Held-out reward accuracy (dtrain / TRL):",
        "",
        "| step | " + " | ".join(str(s) for s in sorted(same_held)) + " |",
        "|---|" + "---|" * len(same_held),
        "| accuracy | " + " | ".join(
            f"{dict((s, a) for s, a, _ in ours['held_out'])[s]:.3f} / "
            f"{dict((s, a) for s, a, _ in theirs['held_out'])[s]:.3f}"
            for s in sorted(same_held)) + " |",
        "",
        f"How close: the losses agree within 1e-4 through step {apart} of {n}; over the "
        f"whole run they differ by at most {loss_gap:.2e}, the steps' reward accuracies by "
        f"at most {acc_gap:.3f}, the held-out ones by at most {held_gap:.3f} (the two "
        "compute the same sums in a different order: the first steps differ by about 1e-7, "
        "and AdamW's steps carry such differences on and let them grow). Step 1's loss is "
        f"ln 2 = {math.log(2):.6f} on both "
        f"({ours['loss'][0]:.6f}, {theirs['loss'][0]:.6f}). Step times: dtrain's "
        "`step_time_s` (its whole step: forward of the reference and the policy, backward, "
        "AdamW); TRL's from `on_step_begin` to `on_step_end`; the first two steps left out.",
    ]
    return lines


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="pairs a step")
    parser.add_argument("--held-out", type=int, default=16, help="pairs held out")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke check: 12 steps, 1 round")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.eval_every = 12, 1, 6
    if args.held_out % args.batch:
        parser.error(f"--held-out {args.held_out} must be a multiple of --batch {args.batch} "
                     "(dtrain evaluates whole batches)")
    folder = Path(tempfile.mkdtemp(prefix="dtrain-dpo-"))
    make_base(folder / "base", args.width, args.layers)
    make_adapter(folder / "base", folder / "adapter")
    data = pairs()
    (folder / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in data))
    load = os.getloadavg()[0]
    started = time.time()
    runs: dict[str, list[dict]] = {"dtrain": [], "trl": []}
    for r in range(args.rounds):
        runs["dtrain"].append(dtrain_run(folder, args, len(data)))
        runs["trl"].append(trl_run(folder, args, data))
        print(f"round {r + 1}: held-out accuracy dtrain {runs['dtrain'][-1]['held_out'][-1]}, "
              f"TRL {runs['trl'][-1]['held_out'][-1]}", flush=True)
    lines = report(args, runs, len(data), (load, os.getloadavg()[0]),
                   (time.time() - started) / 60)
    print("\n".join(lines))
    if args.write and not args.quick:
        replace_section("dpo_end_to_end", lines)


if __name__ == "__main__":
    main()
