"""Preference pairs for DPO: a prompt, the response chosen and the one rejected, as two
rows of ids with their targets (dtrain.data.chat).

    chosen, rejected = encode_pair(record, tokenizer, template, where="pairs.jsonl:3")
    ids, targets = chosen        # prompt + chosen response; targets: the response's tokens

A record is in one of TRL's two forms (its "explicit prompt" preference data):

- standard, three strings: `{"prompt": "...", "chosen": "...", "rejected": "..."}`. A row
  is the prompt's ids then the response's, tokenized apart (no template), then the
  tokenizer's end-of-sequence token where it has one, as TRL's `DPOTrainer` adds
  `eos_token` (not twice when the response ends with it). The end-of-sequence token is the
  `eos_token` of the `tokenizer_config.json` beside the tokenizer.json, else its
  end-of-text token; the bytes tokenizer has none.
- conversational: `{"prompt": [messages], "chosen": [assistant message(s)], "rejected":
  [...]}`. A row is the conversation prompt + response rendered by the chat template, the
  ids `apply_chat_template(prompt + chosen)` gives; its targets are the response's
  assistant turns, found as chat data's are (`train_on = "completion"` from the response's
  first message): after the generation prompt, through the end-of-turn token, trailing
  whitespace excluded. TRL's `completion_mask` also counts that trailing whitespace (the
  newline ChatML writes after `<|im_end|>`); transformers' `{% generation %}` mask does not.

The targets are the response's tokens only; the prompt's are none. A record without a
prompt, chosen or rejected, with an empty response, or with fields of mixed kinds is
refused in one line naming the record and the field.

Torch is not imported here: `dtrain data prepare`'s workers encode with this alone.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from dtrain.data.chat import FIX, ChatTemplate, check_messages, encode_chat, eos_text
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.data.tokenizer import Tokenizer

FIELDS = ("prompt", "chosen", "rejected")
"""A preference record's fields."""
RESPONSES = ("chosen", "rejected")
"""Its responses, in the order of their rows: chosen first."""
Row = tuple[np.ndarray, np.ndarray]


@functools.lru_cache(maxsize=8)  # read once per tokenizer, not once per record
def end_of_sequence(tokenizer: Tokenizer) -> int | None:
    """The id a standard pair's response ends with (see the module doc); None for none."""
    text = eos_text(tokenizer.path or "bytes")
    ids = tokenizer.encode(text) if text else []
    return ids[0] if len(ids) == 1 else tokenizer.end_of_text


def check_column(column: str, key: str = "data.column") -> None:
    """Preference records have fixed fields: `column` must be unset.

    Raises:
        ConfigError: a column is given.
    """
    if column:
        raise ConfigError(f"{key} = {column!r} does not apply to preference data, whose "
                          f"fields are {', '.join(FIELDS)}: remove it")


def encode_pair(record: dict[str, object], tokenizer: Tokenizer,
                template: ChatTemplate | None, where: str = "") -> tuple[Row, Row]:
    """A preference record's two rows, chosen then rejected: each (ids, targets), the
    prompt then the response, the response's tokens the targets (see the module doc).

    Raises:
        ConfigError: a field missing, empty or of the wrong kind; lists of messages without
            a chat template, or a response with no assistant message.
    """
    for name in FIELDS:
        if name not in record or record[name] is None:
            fields = ", ".join(sorted(record)) or "none"
            raise ConfigError(f'{where}: a preference record needs "{name}" (it has '
                              f"{fields}): give {', '.join(FIELDS)}")
    prompt = record["prompt"]
    for name in RESPONSES:
        if record[name] in ("", []):
            raise ConfigError(f'{where}: "{name}" is empty: a preference pair needs a chosen '
                              "and a rejected response")
    chosen, rejected = record["chosen"], record["rejected"]
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        eos = end_of_sequence(tokenizer)
        head = tokenizer.encode_document(prompt)
        return _standard(head, chosen, tokenizer, eos), _standard(head, rejected, tokenizer, eos)
    if isinstance(prompt, list) and isinstance(chosen, list) and isinstance(rejected, list):
        if template is None:
            raise ConfigError(f"{where}: prompt, chosen and rejected are messages, which need "
                              f"a chat template: give {FIX}")
        return (_conversational(prompt, chosen, "chosen", tokenizer, template, where),
                _conversational(prompt, rejected, "rejected", tokenizer, template, where))
    raise ConfigError(f'{where}: "prompt", "chosen" and "rejected" must all be strings '
                      "(standard) or all lists of messages (conversational)")


def _standard(head: np.ndarray, response: str, tokenizer: Tokenizer, eos: int | None) -> Row:
    tail = tokenizer.encode_document(response)
    if eos is not None and (not len(tail) or int(tail[-1]) != eos):
        tail = np.append(tail, np.asarray(eos, dtype=tail.dtype))
    ids = np.concatenate([head, tail]).astype(head.dtype, copy=False)
    targets = np.zeros(len(ids), dtype=bool)
    targets[len(head):] = True
    return ids, targets


def _conversational(prompt: list[object], response: list[object], name: str,
                    tokenizer: Tokenizer, template: ChatTemplate, where: str) -> Row:
    messages = check_messages(prompt + response, where)
    if not any(m["role"] == "assistant" for m in messages[len(prompt):]):
        raise ConfigError(f'{where}: "{name}" holds no assistant message: give the response '
                          'as [{"role": "assistant", "content": "..."}]')
    return encode_chat(messages, template, tokenizer, "completion", answer_from=len(prompt),
                       where=where)
