"""A MoE preset against a dense Llama of equal active parameters: `dtrain train` on 4
ranks, the same data, batch, schedule and steps; the loss reached and the tokens/s of each.

    python benchmarks/moe_vs_dense.py [--pair moe-tiny --steps 300 --write]
    python benchmarks/moe_vs_dense.py --pair deepseek-tiny [--steps 300 --write]

moe-tiny: the dense model is llama-tiny's shape with a SwiGLU of 256 (3 x 128 x 256 =
98,304 parameters per block's MLP), which is what each token uses of moe-tiny's 8 experts
of 128 (2 x 3 x 128 x 128, plus its router's 1,032): equal active parameters, 4x the MLP
parameters in total for the MoE. The MoE runs at ep = 2 with a light balance loss.

deepseek-tiny (DeepSeek-V3's architecture scaled down: latent attention, a dense first
block, two MoE blocks of 8 experts of 64 with a shared one, grouped sigmoid routing, one
MTP module): the dense model is a 3-block Llama of width 128 with 4 full heads (MHA) and a
SwiGLU of 208 in every block, 502,656 parameters against deepseek-tiny's 505,008 active
ones (at a vocabulary of 256, without its MTP module, which only training runs). Its
training objective adds the MTP loss (x 0.3) and the balance loss to the next-token loss,
so the held-out loss (the main model's next-token loss alone) is the one to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_md import replace_section

ROOT = Path(__file__).resolve().parents[1]
COMMON = """
[data]
max_bytes = 2000000

[optimizer]
lr = 3e-3
warmup_steps = 20

[train]
batch_size = 16
eval_every = 0
eval_batches = 8

[logging]
log_every = 50
sample_tokens = 0
"""
MOE_TINY = {
    "moe-tiny (ep = 2)": """
[model]
arch = "llama"
preset = "moe-tiny"
aux_loss_weight = 0.01

[parallel]
ep = 2
""",
    "dense Llama, equal active": """
[model]
arch = "llama"
preset = "llama-tiny"
ffn_hidden = 256
""",
}
DEEPSEEK_TINY = {
    "deepseek-tiny (ep = 2)": """
[model]
arch = "llama"
preset = "deepseek-tiny"
aux_loss_weight = 0.01

[parallel]
ep = 2
""",
    "dense Llama (MHA), equal active": """
[model]
arch = "llama"
preset = "llama-tiny"
n_layer = 3
n_kv_head = 4
ffn_hidden = 208
""",
}
PAIRS = {"moe-tiny": MOE_TINY, "deepseek-tiny": DEEPSEEK_TINY}
SECTIONS = {"moe-tiny": "moe_vs_dense", "deepseek-tiny": "deepseek_vs_dense"}


WHAT = {
    "moe-tiny": ["Equal active parameters: each token computes the same MLP width in both. The "
                 "MoE has 4x the MLP parameters to learn from, and pays for routing and the "
                 "all-to-all exchanges."],
    "deepseek-tiny": [
        "Equal active parameters: deepseek-tiny's 505,008 active (without its MTP module) "
        "against the dense model's 502,656, at a vocabulary of 256. deepseek-tiny's training "
        "loss column is its objective, the next-token loss plus 0.3 x the MTP loss plus the "
        "balance loss, so it is not comparable to the dense one's; the held-out loss is the "
        "main model's next-token loss in both. Its tokens/s pay for latent attention's extra "
        "projections, routing, the all-to-all exchanges and the MTP module's block and head."],
}


def run(name: str, model: str, steps: int, folder: Path) -> dict:
    config = folder / f"{len(list(folder.glob('*.toml')))}.toml"
    config.write_text(model + COMMON)
    metrics = config.with_suffix(".jsonl")
    command = [sys.executable, "-m", "dtrain.cli", "train", str(config), "-n", "4",
               "--set", f"train.steps={steps}", "--set",
               f"train.out_dir='{config.with_suffix('')}'", "--metrics", str(metrics)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        raise SystemExit(f"{name}: dtrain train failed:\n{result.stdout}{result.stderr}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    banner = next(line for line in result.stdout.splitlines() if "parameters" in line)
    return {"name": name, "loss": statistics.mean(losses[-20:]),
            "eval": [r["eval_loss"] for r in rows if "eval_loss" in r][-1],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows
                                              if "tokens_per_s" in r),
            "params": banner.split(") ")[1].split(" parameters")[0] if ") " in banner else "",
            "imbalance": rows[-2].get("moe_imbalance")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="moe-tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, model, args.steps, Path(tmp))
                for name, model in PAIRS[args.pair].items()]
    for r in rows:
        print(f"{r['name']}: {r['params']} parameters, last-20 loss {r['loss']:.4f}, held-out "
              f"{r['eval']:.4f}, {r['tokens_per_s']:,.0f} tokens/s, imbalance {r['imbalance']}")
    if args.write:
        lines = [
            f"## {args.pair} vs a dense Llama of equal active parameters (`dtrain train`, 4 "
            "ranks)",
            "",
            f"Command: `python benchmarks/moe_vs_dense.py --pair {args.pair} --steps "
            f"{args.steps} --write`  ",
            f"Machine: {os.cpu_count()} cores, {platform.machine()}, gloo; both on the bytes "
            f"of the default corpus (2 MB), global batch 16 x 128 tokens, AdamW 3e-3 cosine, "
            f"{args.steps} steps, the same seed and batches.",
            "",
            "| model | parameters | loss (mean of the last 20 steps) | held-out loss | "
            "tokens/s (median step) |",
            "|---|---|---|---|---|",
            *[f"| {r['name']} | {r['params']} | {r['loss']:.4f} | {r['eval']:.4f} | "
              f"{r['tokens_per_s']:,.0f} |" for r in rows],
            "",
            *WHAT[args.pair],
            f"The MoE's last step's load max/mean per MoE block: {rows[0]['imbalance']}"
            f"{' (the MTP module’s block last)' if args.pair == 'deepseek-tiny' else ''}. "
            "The two runs follow each other (4 ranks on 2 cores each), so their tokens/s "
            f"share the machine's noise less well than alternating rounds; load average at "
            f"the end: {os.getloadavg()[0]:.1f}.",
        ]
        replace_section(SECTIONS[args.pair], lines)


if __name__ == "__main__":
    main()
