"""Chat and prompt/completion data: rendered by the tokenizer's chat template, the loss on
the tokens transformers marks as the assistant's, and bad input refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dtrain.data import load_tokenizer
from dtrain.data.chat import ChatTemplate, assistant_spans, encode_chat, encode_prompt_completion
from dtrain.data.dataset import open_data
from dtrain.errors import ConfigError
from dtrain.testing.chat import (
    CHATML,
    CONVERSATIONS,
    LLAMA3,
    make_chat_tokenizer,
    write_chat_jsonl,
)
from tests.support.cli import dtrain


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_targets_are_the_tokens_transformers_marks_as_the_assistants(
        tmp_path: Path, template: str) -> None:
    """On a template with generation tags, `apply_chat_template(...,
    return_assistant_tokens_mask=True)` marks exactly our targets (system prompts, several
    assistant turns), and its ids are ours."""
    from transformers import PreTrainedTokenizerFast

    file = make_chat_tokenizer(tmp_path / "tok", template)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    ours, found = load_tokenizer(str(file)), ChatTemplate.find(str(file))
    for conversation in CONVERSATIONS:
        out = theirs.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        ids, targets = encode_chat(conversation, found, ours)
        assert ids.tolist() == list(out["input_ids"])
        assert targets.astype(int).tolist() == list(out["assistant_masks"])
        assert targets.any() and not targets.all()


def test_completion_is_the_last_turn_and_all_is_every_token(tmp_path: Path) -> None:
    file = make_chat_tokenizer(tmp_path / "tok")
    tok, found = load_tokenizer(str(file)), ChatTemplate.find(str(file))
    conversation = CONVERSATIONS[1]
    text, every = assistant_spans(conversation, found, "assistant")
    _, last = assistant_spans(conversation, found, "completion")
    assert len(every) == 2 and last == every[-1:]
    assert text[slice(*last[0])] == "Rome<|im_end|>"
    _, targets = encode_chat(conversation, found, tok, "all")
    assert targets.all()


def test_prompt_completion_pairs(tmp_path: Path) -> None:
    tok = load_tokenizer("bytes")
    ids, targets = encode_prompt_completion("2+2=", "4", tok, None, "completion")
    assert bytes(ids.tolist()) == b"2+2=4\n" and targets.tolist() == [0, 0, 0, 0, 1, 1]
    _, every = encode_prompt_completion("2+2=", "4", tok, None, "all")
    assert every.all()
    file = make_chat_tokenizer(tmp_path / "tok")
    found = ChatTemplate.find(str(file))
    prompt, answer = CONVERSATIONS[1][:-1], CONVERSATIONS[1][-1:]
    ids, targets = encode_prompt_completion(prompt, answer, load_tokenizer(str(file)), found,
                                            "completion")
    assert load_tokenizer(str(file)).decode(ids[targets].tolist()) == "Rome<|im_end|>"


def test_a_template_given_in_the_config_and_the_bytes_tokenizer(tmp_path: Path) -> None:
    conversation = CONVERSATIONS[0]
    found = ChatTemplate.find("bytes", CHATML)
    ids, targets = encode_chat(conversation, found, load_tokenizer("bytes"))
    assert bytes(ids[targets].tolist()) == b"Four.<|im_end|>"
    (tmp_path / "t.jinja").write_text(CHATML)
    assert ChatTemplate.find("bytes", str(tmp_path / "t.jinja")).source == CHATML


def test_records_without_a_target_are_skipped_and_counted(tmp_path: Path) -> None:
    file = make_chat_tokenizer(tmp_path / "tok")
    rows = CONVERSATIONS + [[{"role": "user", "content": "no answer"}]]
    data = open_data(str(write_chat_jsonl(tmp_path / "c.jsonl", rows * 2)), "chat",
                     str(file), block_size=64, val_fraction=0.4)
    assert "2 record(s) without a target token skipped" in data.notes


def _refused(tmp_path: Path, rows: list[object], **keys: str) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    file = keys.pop("tokenizer", str(make_chat_tokenizer(tmp_path / "tok")))
    with pytest.raises(ConfigError) as refused:
        open_data(str(path), keys.pop("format", "chat"), file, block_size=64, **keys)
    return str(refused.value)


def test_bad_records_are_refused_naming_the_line(tmp_path: Path) -> None:
    good = {"messages": CONVERSATIONS[0]}
    assert "bad.jsonl:2: no \"messages\" field" in _refused(tmp_path, [good, {"text": "x"}])
    odd = {"messages": [{"role": "wizard", "content": "hi"}]}
    assert "bad.jsonl:1: unknown role 'wizard'" in _refused(tmp_path, [odd])
    message = _refused(tmp_path, [good], tokenizer="bytes")
    assert "has no chat template" in message and "[data] chat_template" in message
    assert 'needs "prompt" and "completion"' in _refused(tmp_path, [good],
                                                         format="prompt_completion")
    message = _refused(tmp_path, [good], format="text", train_on="assistant")
    assert "needs chat or prompt_completion data" in message


def test_train_refuses_a_chat_set_without_a_template_in_one_line(tmp_path: Path) -> None:
    path = write_chat_jsonl(tmp_path / "c.jsonl", CONVERSATIONS)
    out = tmp_path / "run"
    result = dtrain("train", "-n", "1", "--set", f"data.path='{path}'", "--set",
                    "data.format='chat'", "--set", f"train.out_dir='{out}'", timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "chat template" in lines[0] and not out.exists()


def test_the_mask_follows_characters_not_bytes(tmp_path: Path) -> None:
    """The bytes tokenizer marks every byte of a non-ASCII character in a span."""
    found = ChatTemplate.find("bytes", CHATML)
    conversation = [{"role": "user", "content": "é?"}, {"role": "assistant", "content": "ü"}]
    ids, targets = encode_chat(conversation, found, load_tokenizer("bytes"))
    assert bytes(ids[targets].tolist()).decode() == "ü<|im_end|>"
    assert np.count_nonzero(targets) == len("ü<|im_end|>".encode())


@pytest.mark.parametrize("template, end", [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>")],
                         ids=["chatml", "llama3"])
def test_a_chat_prompt_and_the_end_of_its_answer(tmp_path: Path, template: str,
                                                 end: str) -> None:
    """`dtrain generate --chat`'s prompt: the user's message with the generation prompt,
    as transformers renders it; and the token that ends an answer."""
    from transformers import PreTrainedTokenizerFast

    from dtrain.data.chat import chat_prompt

    file = make_chat_tokenizer(tmp_path / "tok", template)
    tok = load_tokenizer(str(file))
    ids, stop = chat_prompt(ChatTemplate.find(str(file)), tok, "Capital of France?")
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    asked = [{"role": "user", "content": "Capital of France?"}]
    want = theirs.apply_chat_template(asked, tokenize=True, add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
    assert ids == list(want) and stop == tok.encode(end)[0]
