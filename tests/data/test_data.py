"""Reading a corpus (text files, folders, JSON lines or the stdlib), tokenizing it, and
cutting it into sequences."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dtrain.data import (
    TokenSequences,
    batches,
    encode_documents,
    jsonl_documents,
    load_tokenizer,
    open_data,
    read_corpus,
    split,
    text_documents,
    vocab_of,
)
from dtrain.errors import ConfigError

TEXTS = ["the quick brown fox jumps over the lazy dog", "héllo wörld, hello world",
         "def main():\n    return 42\n", "pack my box with five dozen liquor jugs"]


def make_tokenizer(path: Path, end_of_text: bool = True) -> Path:
    """A small byte-level BPE tokenizer.json (about 300 ids), trained here: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"] if end_of_text else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEXTS * 20, trainer=trainer)
    tokenizer.save(str(path))
    return path


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_folder_of_text_files_is_read_in_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.bin").write_bytes(b"\0\1\2")
    assert read_corpus(str(tmp_path), 1000) == b"first\nsecond\nthird"
    assert read_corpus(str(tmp_path / "a.txt"), 3) == b"fir"


def test_stdlib_is_the_default_corpus() -> None:
    data = read_corpus("", 50_000)
    assert len(data) == 50_000 and b"def " in data


def test_empty_and_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="holds no text"):
        read_corpus(str(tmp_path / "empty.txt"), 100)
    with pytest.raises(ConfigError, match="does not exist"):
        read_corpus(str(tmp_path / "nope"), 100)


def test_sequences_predict_the_next_byte() -> None:
    data = TokenSequences(torch.frombuffer(bytearray(b"abcdefghij"), dtype=torch.uint8), 4)
    assert len(data) == 2
    x, y = data[1]
    assert bytes(x.tolist()) == b"efgh" and bytes(y.tolist()) == b"fghi"
    assert x.dtype == torch.long


def test_split_needs_a_sequence_on_both_sides() -> None:
    train, val = split(torch.zeros(100), 0.2, block_size=10)
    assert (len(train), len(val)) == (80, 20)
    assert train[78:82].tolist() == [0, 0] and len(val[0:100]) == 20
    with pytest.raises(ConfigError, match="too few for model.block_size = 30"):
        split(torch.zeros(100), 0.2, block_size=30)


def test_bytes_tokenizer_is_utf8() -> None:
    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.separator, tok.path, tok.name) == (256, [10], None, "bytes")
    assert tok.encode("hé") == [104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
    assert tok.decode([104, 300, 105]) == "hi"  # a larger model's ids beyond the bytes


def test_tokenizer_file_round_trips_and_adds_no_special_tokens(tmp_path: Path) -> None:
    tok = load_tokenizer(str(make_tokenizer(tmp_path / "tok.json")))
    assert tok.vocab_size <= 300 and tok.path == tok.name == str(tmp_path / "tok.json")
    assert len(tok.separator) == 1 and tok.decode(tok.separator) == "<|endoftext|>"
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and tok.separator[0] not in ids
        assert len(ids) < len(text.encode())  # merges were learned
    plain = load_tokenizer(str(make_tokenizer(tmp_path / "plain.json", end_of_text=False)))
    assert plain.separator == plain.encode("\n")


def test_bad_tokenizers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.tokenizer '\S*nope.json' does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json' is not a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))


def test_jsonl_documents_and_their_errors(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", TEXTS[2:])
    write_jsonl(tmp_path / "a.jsonl", TEXTS[:2])
    (tmp_path / "notes.txt").write_text("not read: only *.jsonl files of a folder")
    assert list(jsonl_documents(str(tmp_path))) == TEXTS
    (tmp_path / "blank.jsonl").write_text('{"text": "x"}\n\n{"text": "y"}\n')
    assert list(jsonl_documents(str(tmp_path / "blank.jsonl"))) == ["x", "y"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        list(jsonl_documents(str(tmp_path / "bad.jsonl")))
    (tmp_path / "bad.jsonl").write_text('{"body": "no text"}\n')
    with pytest.raises(ConfigError, match=r'bad.jsonl:1: no "text" string field'):
        list(jsonl_documents(str(tmp_path / "bad.jsonl")))
    with pytest.raises(ConfigError, match="data.path is empty"):
        list(jsonl_documents(""))


@pytest.mark.parametrize("max_bytes", [1, 5, 6, 7, 12, 13, 1000])
def test_bytes_encoding_is_the_corpus_read_as_today(tmp_path: Path, max_bytes: int) -> None:
    for name, text in (("a", "first"), ("b", ""), ("c", "second"), ("d", "third")):
        (tmp_path / f"{name}.txt").write_text(text)
    ids = encode_documents(text_documents(str(tmp_path)), load_tokenizer("bytes"), max_bytes)
    assert ids.tobytes() == b"first\n\nsecond\nthird"[:max_bytes]
    assert ids.tobytes() == read_corpus(str(tmp_path), max_bytes)


def test_a_subword_stream_stops_near_max_bytes(tmp_path: Path) -> None:
    tok = load_tokenizer(str(make_tokenizer(tmp_path / "tok.json")))
    ids = encode_documents(TEXTS, tok)
    sep = tok.separator
    expected = tok.encode(TEXTS[0]) + sep + tok.encode(TEXTS[1]) + sep + tok.encode(TEXTS[2]) \
        + sep + tok.encode(TEXTS[3])
    assert ids.tolist() == expected and ids.dtype == np.int32
    short = encode_documents(TEXTS, tok, max_bytes=50)  # 43 bytes, then 7 of the next
    assert short.tolist() == tok.encode(TEXTS[0]) + sep + tok.encode("héllo ")


def test_open_text_data_is_todays_byte_sequences(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abcdefghijklmnopqrstuvwxyz" * 20)
    data = open_data(str(tmp_path), "text", "bytes", 4000, 0.1, 16)
    corpus = read_corpus(str(tmp_path), 4000)
    cut = len(corpus) - int(len(corpus) * 0.1)
    assert data.vocab_size == 256 and data.tokenizer.name == "bytes"
    assert len(data.train) == (cut - 1) // 16 and len(data.val) == (len(corpus) - cut - 1) // 16
    x, y = data.train[3]
    assert bytes(x.tolist()) == corpus[48:64] and bytes(y.tolist()) == corpus[49:65]
    assert bytes(data.val[0][0].tolist()) == corpus[cut : cut + 16]


def test_open_jsonl_data_with_a_tokenizer_file(tmp_path: Path) -> None:
    tok_path = make_tokenizer(tmp_path / "tok.json")
    write_jsonl(tmp_path / "docs.jsonl", TEXTS * 5)
    data = open_data(str(tmp_path / "docs.jsonl"), "jsonl", str(tok_path), 10**6, 0.2, 8)
    ids = encode_documents(TEXTS * 5, data.tokenizer)
    x, y = data.train[2]
    assert x.tolist() == ids[16:24].tolist() and y.tolist() == ids[17:25].tolist()
    assert data.vocab_size == vocab_of("", "jsonl", str(tok_path)) == data.tokenizer.vocab_size


def test_open_data_names_the_config_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.format = 'csv' is not a data format"):
        open_data(str(tmp_path), "csv")
    with pytest.raises(ConfigError, match="data.tokenizer 'gpt9' does not exist"):
        open_data(str(tmp_path), "text", "gpt9")
    with pytest.raises(ConfigError, match="data.path .* holds no index.json"):
        open_data(str(tmp_path), "tokens")
    with pytest.raises(ConfigError, match="data.path .* holds no text"):
        open_data(str(tmp_path), "jsonl")
    assert vocab_of("", "text", "bytes") == 256


def test_batches_cover_sequences_in_order() -> None:
    data = TokenSequences(torch.arange(41), block_size=4)
    stream = batches(data, global_batch=4, dp_size=2, dp_rank=1, seed=0, shuffle=False)
    x, _ = next(stream)
    assert x[:, 0].tolist() == [4, 12]
