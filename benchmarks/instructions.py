"""Documents and instructions, measured: packed (`block_causal`) against padded (`pad`) rows
of the same conversations, and `dtrain data prepare` against `datasets.map` with the
tokenizer's `apply_chat_template`.

    python benchmarks/instructions.py [--conversations 2000 --rounds 3 --write]

The data: synthetic conversations (one to three exchanges, a system prompt in a third of
them), each turn a run of words whose count is drawn from a log-normal distribution
(median 10 words for a user turn, 25 for an answer, long right tails), the shape of
chat sets' turn lengths; a byte-level BPE tokenizer trained on them, with ChatML special
tokens and template (dtrain.testing.chat).

Packing. dtrain's Llama (llama-tiny's shape, 4 layers of 128) trains `--steps` steps of
16 rows of 512 positions, one process, on the same conversations packed and padded: the
figure is the median over steps (the first two left out) of target tokens per second
(the tokens the loss counts: the assistants' turns), and the rows' padding share. The two
runs alternate, `--rounds` times each; the median round is shown with every round's.

Preparation. The same conversations as JSON lines, tokenized with their loss masks by
`dtrain data prepare --format chat --workers W`, and by `datasets`' `map` (`num_proc W`),
the set written `--prepare-copies` times over,
calling transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` on
the same tokenizer and template, each in a fresh process under a small wrapper: wall
time, and the peak resident memory of the largest one process of the run (the tool or
any of its workers: the wrapper's `ru_maxrss` of its children, which the kernel takes as
the maximum over every descendant waited for).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_md import replace_section  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his it an were are "
         "which this be or has had not but what all their when there can more one new "
         "also would time after two first into may over most other some these than "
         "model data train step loss layer rank token batch answer question").split()


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`n` conversations of log-normal turn lengths (see the module doc)."""
    rng = random.Random(seed)

    def say(median: float) -> str:
        count = max(1, int(rng.lognormvariate(0, 0.8) * median))
        return " ".join(rng.choice(WORDS) for _ in range(count))

    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": say(6)}] if rng.random() < 0.33 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": say(10)},
                      {"role": "assistant", "content": say(25)}]
        out.append(turns)
    return out


def _train(folder: Path, packing: str, steps: int) -> dict[str, float]:
    """One run of dtrain train's loop on this process: median target tokens/s, padding."""
    from dtrain.config import config_from_dict
    from dtrain.train.trainer import Trainer

    out = folder / f"run-{packing}-{time.monotonic_ns()}"
    values = {"model": {"arch": "llama", "preset": "llama-tiny", "block_size": 512},
              "data": {"path": str(folder / "chats.jsonl"), "format": "chat",
                       "tokenizer": str(folder / "tok" / "tokenizer.json"),
                       "packing": packing, "val_fraction": 0.05},
              "train": {"steps": steps, "batch_size": 16, "eval_every": 0,
                        "eval_batches": 1, "out_dir": str(out)},
              "logging": {"sample_tokens": 0, "log_every": 1000,
                          "metrics": str(out / "metrics.jsonl")},
              "checkpoint": {"background": False, "every": 0},
              "parallel": {"nproc": 1}}
    Trainer(config_from_dict(values)).run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r][2:]
    return {"target_tokens_per_s": statistics.median(r["target_tokens_per_s"] for r in rows),
            "padding": statistics.median(r["padding"] for r in rows)}


def packing_figures(folder: Path, steps: int, rounds: int) -> dict[str, list[dict]]:
    from dtrain.testing import run_ranks

    runs: dict[str, list[dict]] = {"block_causal": [], "pad": []}
    for _ in range(rounds):
        for packing in ("pad", "block_causal"):
            runs[packing].append(run_ranks(_train, 1, folder, packing, steps,
                                           timeout=1200)[0])
    return runs


PREPARE_HF = """
import json, sys
from datasets import load_dataset
from transformers import PreTrainedTokenizerFast
tok = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])
ds = load_dataset("json", data_files=sys.argv[2], split="train",
                  cache_dir=sys.argv[3])
def render(row):
    out = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}
done = ds.map(render, remove_columns=["messages"], num_proc=int(sys.argv[4]) or None,
              cache_file_name=sys.argv[3] + "/mapped.arrow")
print(sum(len(i) for i in done["input_ids"]))
"""


WRAPPER = """
import resource, subprocess, sys, time
start = time.perf_counter()
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def _timed(command: list[str]) -> tuple[float, float]:
    """(seconds, peak resident MiB of the largest one process of the run)."""
    done = subprocess.run([sys.executable, "-c", WRAPPER, *command], capture_output=True,
                          text=True, check=True)
    seconds, kib = done.stdout.split()
    return float(seconds), int(kib) / 1024


def prepare_figures(folder: Path, workers: int, rounds: int, copies: int
                    ) -> dict[str, list[tuple[float, float]]]:
    """Each tool `rounds` times, alternating, each run in a fresh process, on the
    conversations written `copies` times over (so that start-up weighs little)."""
    script = folder / "hf_prepare.py"
    script.write_text(PREPARE_HF)
    lines = (folder / "chats.jsonl").read_text()
    (folder / "prepare.jsonl").write_text(lines * copies)
    runs: dict[str, list[tuple[float, float]]] = {"dtrain": [], "datasets": []}
    for r in range(rounds):
        out = folder / f"shards-{r}"
        runs["dtrain"].append(_timed([
            sys.executable, "-m", "dtrain.cli", "data", "prepare", str(folder / "prepare.jsonl"),
            str(out), "--format", "chat", "--tokenizer", str(folder / "tok" / "tokenizer.json"),
            "--workers", str(workers)]))
        cache = Path(tempfile.mkdtemp(dir=folder))
        runs["datasets"].append(_timed([
            sys.executable, str(script), str(folder / "tok"), str(folder / "prepare.jsonl"),
            str(cache), str(workers)]))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prepare-copies", type=int, default=10)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from dtrain.testing.chat import make_chat_tokenizer, write_chat_jsonl

    folder = Path(tempfile.mkdtemp(prefix="dtrain-instructions-"))
    chats = conversations(args.conversations)
    make_chat_tokenizer(folder / "tok")
    write_chat_jsonl(folder / "chats.jsonl", chats)
    load = os.getloadavg()[0]
    packing = packing_figures(folder, args.steps, args.rounds)
    prepared = prepare_figures(folder, args.workers, args.rounds, args.prepare_copies)
    lines = report(args, packing, prepared, load)
    print("\n".join(lines))
    if args.write:
        replace_section("instructions", lines)


def report(args: argparse.Namespace, packing: dict[str, list[dict]],
           prepared: dict[str, list[tuple[float, float]]], load: float) -> list[str]:
    def middle(values: list[float]) -> float:
        return statistics.median(values)

    rate = {k: [r["target_tokens_per_s"] for r in v] for k, v in packing.items()}
    pad = {k: middle([r["padding"] for r in v]) for k, v in packing.items()}
    ratio = middle(rate["block_causal"]) / middle(rate["pad"])
    seconds = {k: [t for t, _ in v] for k, v in prepared.items()}
    memory = {k: [m for _, m in v] for k, v in prepared.items()}
    rounds = ", ".join
    return [
        "## Documents and instructions: packed vs padded rows, preparing chat data",
        "",
        f"Command: `python benchmarks/instructions.py --conversations {args.conversations} "
        f"--steps {args.steps} --rounds {args.rounds} --workers {args.workers} "
        f"--prepare-copies {args.prepare_copies} --write`  ",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, load average {load:.1f} "
        f"before the run, nothing else running; {datetime.date.today()}. Data: "
        f"{args.conversations} synthetic conversations of log-normal turn lengths "
        "(benchmarks/instructions.py), a byte-level BPE tokenizer with ChatML.",
        "",
        "| rows | target tokens/s (median round) | every round | padding |",
        "|---|---|---|---|",
        f"| `pad` (one conversation per row) | {middle(rate['pad']):,.0f} | "
        f"{rounds(f'{x:,.0f}' for x in rate['pad'])} | {pad['pad']:.1%} |",
        f"| `block_causal` (packed, none sees another) | {middle(rate['block_causal']):,.0f} | "
        f"{rounds(f'{x:,.0f}' for x in rate['block_causal'])} | {pad['block_causal']:.1%} |",
        "",
        f"Packed / padded: **{ratio:.2f}x** the target tokens per second (dtrain's Llama, "
        "llama-tiny's shape, 16 rows of 512 positions, one process, CPU). The packed rows "
        "hold the same conversations with almost no padding; each position costs the same "
        "in the MLPs, and attention over the dense block-causal mask costs the whole row's "
        "square on the CPU, so the gain is the padding removed.",
        "",
        f"Preparing the same conversations written {args.prepare_copies} times over "
        f"({args.conversations * args.prepare_copies:,} records), each tool in a fresh "
        "process:",
        "",
        "| tool | wall time (median) | every round | peak resident memory (median) |",
        "|---|---|---|---|",
        f"| `dtrain data prepare --format chat --workers {args.workers}` | "
        f"{middle(seconds['dtrain']):.1f} s | {rounds(f'{x:.1f}' for x in seconds['dtrain'])} | "
        f"{middle(memory['dtrain']):,.0f} MiB |",
        f"| `datasets` `map(apply_chat_template(return_assistant_tokens_mask=True), "
        f"num_proc={args.workers})` | {middle(seconds['datasets']):.1f} s | "
        f"{rounds(f'{x:.1f}' for x in seconds['datasets'])} | "
        f"{middle(memory['datasets']):,.0f} MiB |",
        "",
        "Both produce the same ids and masks (tests/data/test_chat.py checks the masks "
        "equal on templates with generation tags); times include each process's start "
        "(imports); peak memory is the largest resident set of one process of the run.",
    ]


if __name__ == "__main__":
    main()
