"""Instruction tuning end to end: a transformers Llama folder fine-tuned by `dtrain train`
on a chat set (`init_from`, `format = "chat"`, packed), exported with `dtrain export
--format hf`, loaded back by transformers and asked held-out questions through its own
`apply_chat_template` and `generate`; and `dtrain generate --chat` on the checkpoint.

    python benchmarks/sft_end_to_end.py [--steps 400 --write]

No download: the tokenizer (byte-level BPE with ChatML, dtrain.testing.chat's way) and
the base model (a 4-layer Llama of width 128, randomly initialized and saved with
`save_pretrained`) are made here, so the base knows nothing and everything it answers
it learned from the chat set. The set: "What is A plus B?" answered "A plus B is C." for
A, B in 0..29, but for the held-out pairs `HELD_OUT`, which are asked afterwards.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_md import replace_section  # noqa: E402

HELD_OUT = [(7, 3), (12, 15), (21, 8), (4, 25)]
NUMBERS = range(30)


def question(a: int, b: int) -> str:
    return f"What is {a} plus {b}?"


def answer(a: int, b: int) -> str:
    return f"{a} plus {b} is {a + b}."


def make_base(folder: Path) -> None:
    """A tokenizer folder with ChatML, and a random 4-layer Llama saved beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dtrain.testing.chat import CHATML, make_chat_tokenizer

    make_chat_tokenizer(folder, CHATML)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=3, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))


def write_set(path: Path) -> int:
    rows = [[{"role": "user", "content": question(a, b)},
             {"role": "assistant", "content": answer(a, b)}]
            for a in NUMBERS for b in NUMBERS if (a, b) not in HELD_OUT]
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return len(rows)


def dtrain(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", *args], capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(done.stdout + done.stderr)
    return done.stdout


def ask_transformers(model_dir: Path, tokenizer_dir: Path, questions: list[str]
                     ) -> list[str]:
    """Greedy answers of the exported model, as transformers renders and generates."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            made = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=end,
                                  pad_token_id=end)
        out.append(tokenizer.decode(made[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="dtrain-sft-"))
    base = folder / "base"
    make_base(base)
    conversations = write_set(folder / "chats.jsonl")
    config = folder / "sft.toml"
    config.write_text(f"""
[model]
arch = "hf"
init_from = "{base}"
block_size = 128

[data]
path = "{folder / 'chats.jsonl'}"
format = "chat"
tokenizer = "{base / 'tokenizer.json'}"
val_fraction = 0.1

[train]
steps = {args.steps}
batch_size = 16
eval_every = 0
out_dir = "{folder / 'run'}"

[optimizer]
lr = 0.003
warmup_steps = 20

[logging]
sample_tokens = 0

[parallel]
nproc = {args.nproc}
""")
    started = time.perf_counter()
    log = dtrain("train", str(config), "--metrics", str(folder / "metrics.jsonl"))
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    checkpoints = folder / "run" / "checkpoints"
    dtrain("export", str(checkpoints), str(folder / "exported"), "--format", "hf")
    questions = [question(a, b) for a, b in HELD_OUT]
    theirs = ask_transformers(folder / "exported", base, questions)
    ours = [dtrain("generate", str(checkpoints), "--chat", "--prompt", q, "--tokens", "24",
                   "--temperature", "0.01").strip() for q in questions]
    banner = [line for line in log.splitlines() if line.startswith(("dtrain:", "data:"))]
    lines = [
        "## Instruction tuning end to end: trained, exported, answered by transformers",
        "",
        f"Command: `python benchmarks/sft_end_to_end.py --steps {args.steps} --nproc "
        f"{args.nproc} --write`  ",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}; {datetime.date.today()}. "
        f"The base: a 4-layer transformers Llama of width 128, random (made here, no "
        f"download), a byte-level BPE tokenizer with ChatML; {conversations} conversations "
        f"\"What is A plus B?\" -> \"A plus B is C.\" (A, B < 30; {len(HELD_OUT)} pairs held "
        "out); "
        f"`dtrain train` from the folder (`init_from`), chat data packed block-causally, "
        f"AdamW, {args.steps} steps of 16, data parallel over {args.nproc} ranks, "
        f"{seconds:.0f} s with start-up.",
        "",
        "```",
        *banner,
        f"loss: step 1 {losses[0]:.3f}, step {len(losses)} {losses[-1]:.3f}",
        "```",
        "",
        "Held-out questions, answered by the exported folder loaded with "
        "`AutoModelForCausalLM.from_pretrained`, rendered by the tokenizer's own "
        "`apply_chat_template(add_generation_prompt=True)`, greedy `generate` to "
        "`<|im_end|>`; and by `dtrain generate --chat` on the checkpoint (temperature 0.01):",
        "",
        "| question | transformers | dtrain generate --chat | right answer |",
        "|---|---|---|---|",
        *(f"| {q} | {t} | {o} | {answer(*pair)} |"
          for q, t, o, pair in zip(questions, theirs, ours, HELD_OUT, strict=True)),
    ]
    print("\n".join(lines))
    if args.write:
        replace_section("sft_end_to_end", lines)


if __name__ == "__main__":
    main()
