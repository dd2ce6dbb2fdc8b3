"""The KV cache of `dtrain generate`: bytes per token of multi-head latent attention (MLA)
beside multi-head (MHA), grouped-query (GQA) and multi-query (MQA) attention at the same
width, read from the real cache objects after generating (no timing).

    python benchmarks/mla_cache.py [--json PATH] [--write]

Every model has the same width (2048) and 16 query heads of 128; MLA has DeepSeek-V3's
latent widths (kv_lora_rank 512, qk_rope_head_dim 64, 128 + 64 query/key and 128 value per
head). Each generates NEW tokens after a PROMPT-token prompt through dtrain's KV cache
(dtrain.models.generate); the table gives what its cache then holds per token and layer
(`KVCache.nbytes()` / tokens / layers) and the ratio to MHA, and what a 4096-token context
would hold over DeepSeek-V3's 61 layers at that rate (float32: bfloat16 halves every
figure alike).
"""

from __future__ import annotations

import argparse
import json

import torch
from results_md import replace_section

from dtrain.models import ModelConfig, build, resolve
from dtrain.models.generate import attach, detach

WIDTH, HEADS, HEAD = 2048, 16, 128
LAYERS, PROMPT, NEW = 2, 48, 16
SHAPES = {
    "MHA (16 kv heads)": {"n_kv_head": HEADS},
    "GQA (4 kv heads)": {"n_kv_head": 4},
    "MQA (1 kv head)": {"n_kv_head": 1},
    "MLA (latent 512 + rope 64)": {"attention": "mla", "kv_lora_rank": 512,
                                   "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                   "v_head_dim": 128},
}


def cache_bytes_per_token(keys: dict) -> int:
    """Bytes the KV cache holds per token and layer after generating with this attention."""
    torch.manual_seed(0)
    model = build(resolve(ModelConfig(arch="llama", n_layer=LAYERS, n_embd=WIDTH,
                                      n_head=HEADS, head_dim=HEAD if "attention" not in keys
                                      else 0, ffn_hidden=256, block_size=PROMPT + NEW,
                                      **keys), 256)).eval()
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = attach(model)
    assert cache is not None
    with torch.no_grad():
        for _ in range(NEW):  # greedy: the prompt once, then a token at a time
            fed = ids[:, cache.length:]
            logits = model(fed)[:, -1]
            cache.advance(fed.shape[1])
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    held = cache.nbytes()
    detach(model)
    return held // (cache.length * LAYERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = {name: cache_bytes_per_token(keys) for name, keys in SHAPES.items()}
    mha = rows["MHA (16 kv heads)"]
    table = ["| attention | bytes per token and layer | vs MHA | 4096 tokens x 61 layers |",
             "|---|---|---|---|",
             *[f"| {name} | {per:,} | {per / mha:.3f}x | {per * 4096 * 61 / 2**30:.2f} GiB |"
               for name, per in rows.items()]]
    print(f"KV cache per token, width {WIDTH}, {HEADS} heads of {HEAD}, float32:\n")
    print("\n".join(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"width": WIDTH, "heads": HEADS, "head_dim": HEAD,
                       "bytes_per_token_per_layer": rows}, f, indent=2)
    if args.write:
        replace_section("mla_cache", [
            "## Generation: the KV cache of latent attention (MLA) vs MHA, GQA and MQA",
            "",
            "Command: `python benchmarks/mla_cache.py --write`  ",
            f"What: `dtrain generate`'s cache (dtrain.models.kv_cache, and MLA's latent one) "
            f"after a {PROMPT}-token prompt and {NEW} new tokens, read from the cache "
            f"objects (`KVCache.nbytes()` / tokens / layers: no timing); every model of width "
            f"{WIDTH} with {HEADS} query heads of {HEAD}, MLA at DeepSeek-V3's latent widths "
            "(kv_lora_rank 512, a shared rotary key of 64); float32 (bfloat16 halves every "
            "figure alike). The last column is what a 4096-token context would hold over "
            "DeepSeek-V3's 61 layers at that rate.",
            "",
            *table,
            "",
            "MLA keeps the compressed latent (512) and the shared rotary key (64) per token, "
            "576 numbers, and decompresses the per-head keys and values from them at every "
            "step; MHA keeps 2 x 16 x 128 = 4,096. That is 0.141x MHA's bytes, less than "
            "GQA with 4 kv heads (0.25x) and close to MQA (0.0625x), with every head's own "
            "keys and values (DeepSeek-V2's paper: the cache of GQA with 2.25 groups).",
        ])


if __name__ == "__main__":
    main()
