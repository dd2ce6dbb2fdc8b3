"""A tokenizer folder with a chat template, and conversations to render with it: what the
tests and benchmarks of chat data and instruction tuning share (no download)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>"
    "{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML (Qwen's, Hermes'), with the generation tags transformers reads to mark the
assistant's tokens."""

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")
"""Llama 3's layout (a begin-of-text token, headers, end-of-turn tokens), with tags."""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris"},
     {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome"}],
    [{"role": "user", "content": "Say hello in German."},
     {"role": "assistant", "content": "Hallo! Schön, dich zu sehen."},
     {"role": "user", "content": "Thanks"},
     {"role": "assistant", "content": "Gern geschehen."},
     {"role": "user", "content": "Bye"},
     {"role": "assistant", "content": "Tschüss"}],
]


def chat_texts() -> list[str]:
    """The texts a tokenizer for these conversations is trained on."""
    return [m["content"] for c in CONVERSATIONS for m in c] + ["user assistant system"]


def make_chat_tokenizer(folder: Path, template: str = CHATML) -> Path:
    """A folder with a small byte-level BPE `tokenizer.json` (the chat formats' special
    tokens added) and a `tokenizer_config.json` naming `template`; returns the
    tokenizer.json's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(chat_texts() * 20, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def write_chat_jsonl(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    """A JSON-lines file of {"messages": ...} rows."""
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def tiny_llama(folder: Path) -> tuple[object, object]:
    """A chat tokenizer in `folder` (`make_chat_tokenizer`, ChatML) and the config of a
    two-block transformers Llama for it: (PreTrainedTokenizerFast, LlamaConfig)."""
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    make_chat_tokenizer(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=3, eos_token_id=0, pad_token_id=0,
                         max_position_embeddings=128)
    return tokenizer, config
