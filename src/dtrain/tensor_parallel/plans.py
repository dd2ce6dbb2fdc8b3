"""Ready plans: dtrain's GPT and Llama, and Hugging Face's BERT as an example for a library model.

A plan names, for each layer, how it is split. Attention follows Megatron-LM: Q, K and V
split by heads (column-parallel), the output projection by its input (row-parallel), so a
block costs two all-reduces forward (after attention, after the MLP) and two backward.
"""

from __future__ import annotations

from dtrain.models.gpt import GPTConfig
from dtrain.models.llama import LlamaConfig
from dtrain.models.mla import MLAConfig
from dtrain.tensor_parallel.parallelize import Colwise, Style


def gpt_plan(cfg: GPTConfig) -> dict[str, Style | str]:
    """dtrain's GPT: vocab-parallel embedding, tied column-parallel head, vocab-parallel loss.

    The head shares its weight with the embedding (tied, as in GPT-2); both split the
    vocabulary the same way, so the tie survives and the logits are never gathered.
    """
    return {
        "wte": "vocab",
        "blocks.*.attn.qkv": Colwise(chunks=3, heads=cfg.n_head),
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "head": "colwise",
        "loss_fn": "vocab_loss",
    }


def llama_plan(cfg: LlamaConfig) -> dict[str, Style | str]:
    """dtrain's Llama: Q split by query heads, K and V by key/value heads (so the
    tensor-parallel degree must divide `cfg.n_kv_head`, and each rank's query heads read
    its own key/value heads), the SwiGLU's gate and up column-parallel and down
    row-parallel; the embedding and the head split by vocabulary (tied or not) and the loss
    vocab-parallel, as in `gpt_plan`. RMSNorms stay replicated; Qwen3's per-head norms
    (`qk_norm`) too, their gradients summed over the heads' ranks ("headwise"). Latent
    attention (`cfg.mla`) is split by `latent_attention_plan`.

    A mixture-of-experts block's MLP stays whole on every tensor-parallel rank (its router,
    experts and shared experts): only the dense blocks' MLPs are split. Expert parallelism
    then splits the experts over ep ranks folded over tp first (dtrain.mesh.dims), each tp
    rank computing the experts of its share of the tokens.

    `parallelize` raises ConfigError when tp does not divide the heads, the key/value heads,
    the MLP width or the vocabulary.
    """
    dense = ["*"] if cfg.moe is None else \
        [str(i) for i in range(cfg.n_layer) if i not in cfg.moe_layers]
    mlp = {f"blocks.{i}.mlp.{name}": style for i in dense
           for name, style in (("gate", "colwise"), ("up", "colwise"), ("down", "rowwise"))}
    attention: dict[str, Style | str] = {
        "blocks.*.attn.q_proj": Colwise(heads=cfg.n_head),
        "blocks.*.attn.k_proj": Colwise(heads=cfg.n_kv_head),
        "blocks.*.attn.v_proj": Colwise(heads=cfg.n_kv_head),
        "blocks.*.attn.o_proj": "rowwise",
        **({"blocks.*.attn.q_norm": "headwise", "blocks.*.attn.k_norm": "headwise"}
           if cfg.qk_norm else {}),
    }
    return {
        "embed": "vocab",
        **(attention if cfg.mla is None else latent_attention_plan(cfg.n_head, cfg.mla)),
        **mlp,
        "head": "colwise",
        "loss_fn": "vocab_loss",
    }


def latent_attention_plan(n_head: int, mla: MLAConfig) -> dict[str, Style | str]:
    """Multi-head latent attention's blocks (dtrain.models.mla) split by heads as Megatron
    splits attention: the up-projections (q_b_proj, or q_proj without a query bottleneck,
    and kv_b_proj) column-parallel by heads, o_proj row-parallel. The down-projections to
    the latents and their norms (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa,
    kv_a_layernorm) stay whole on every rank: they are small (DeepSeek-V3: 1536 and 576
    outputs of 7168), and split they would need a gather before the up-projections.

    Their gradients come out whole without a sum of their own: the up-projections'
    `copy_to_group` sums the latents' gradients over the group (each rank's heads give a
    part), and `share_rope` ("shared") does the same for the rotary key part all heads
    read. Under sequence parallelism they run on this rank's part of the sequence, the
    up-projections gather the latents (not the wider input), and their gradients are summed
    at the end of backward with the norms' (dtrain.tensor_parallel.sequence).

    The multi-token prediction modules (`mtp`) stay whole on every rank: computed alike on
    each, their gradients are already the whole model's.
    """
    heads = Colwise(heads=n_head)
    return {
        f"blocks.*.attn.{'q_b_proj' if mla.q_lora_rank else 'q_proj'}": heads,
        "blocks.*.attn.kv_b_proj": heads,
        "blocks.*.attn.share_rope": "shared",
        "blocks.*.attn.o_proj": "rowwise",
    }


def bert_plan(num_attention_heads: int, prefix: str = "") -> dict[str, Style | str]:
    """Hugging Face `transformers` BERT encoder (`BertModel`; pass `prefix="bert."` for a
    `BertFor...` model): word embeddings by vocabulary, every layer's attention by heads and
    its feed-forward network column- then row-parallel. Position and token-type embeddings,
    LayerNorms and the pooler stay replicated.

        model = BertModel(BertConfig(...))
        parallelize(model, bert_plan(model.config.num_attention_heads), mesh.group("tp"))

    BERT's attention reshapes to (-1 heads, head size), so it runs on its local heads as is.
    """
    layer = f"{prefix}encoder.layer.*."
    heads = Colwise(heads=num_attention_heads)
    return {
        f"{prefix}embeddings.word_embeddings": "vocab",
        f"{layer}attention.self.query": heads,
        f"{layer}attention.self.key": heads,
        f"{layer}attention.self.value": heads,
        f"{layer}attention.output.dense": "rowwise",
        f"{layer}intermediate.dense": "colwise",
        f"{layer}output.dense": "rowwise",
    }
