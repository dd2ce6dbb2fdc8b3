"""`dtrain data prepare` and the token-shard format: prepared shards train on exactly the
sequences the same text gives, are read lazily, and bad input is refused with nothing
written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dtrain.data import (
    ShardWriter,
    TokenShards,
    encode_documents,
    load_tokenizer,
    open_data,
    text_documents,
    vocab_of,
)
from dtrain.data.prepare import add_arguments, prepare, run
from dtrain.data.shards import choose_dtype
from dtrain.errors import ConfigError
from tests.data.test_data import TEXTS, make_tokenizer, write_jsonl


def corpus(root: Path) -> Path:
    """A folder of text files (one empty, one in a subfolder) and a stray binary file."""
    root.mkdir()
    for i, text in enumerate(TEXTS * 3):
        (root / f"{i:02d}.txt").write_text(text * (i + 1))
    (root / "05.txt").write_text("")
    (root / "sub").mkdir()
    (root / "sub" / "z.txt").write_text("the end\n")
    (root / "image.bin").write_bytes(b"\0PNG")
    return root


def same_sequences(a, b) -> None:
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        assert all(torch.equal(u, v) for u, v in zip(a[i], b[i], strict=True)), i


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("tokenizer", ["bytes", "file"])
def test_prepared_shards_give_the_text_runs_sequences(tmp_path: Path, tokenizer: str) -> None:
    text = corpus(tmp_path / "corpus")
    spec = "bytes" if tokenizer == "bytes" else str(make_tokenizer(tmp_path / "tok.json"))
    summary = prepare([str(text)], str(tmp_path / "out"), spec, shard_size=97, workers=2,
                      progress=False)
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert summary["tokens"] == index["tokens"] and summary["shards"] == len(index["shards"]) > 3
    assert index["format"] == "dtrain.tokens/1" and index["dtype"] == "uint16"
    assert index["tokenizer"] == ("bytes" if tokenizer == "bytes" else "tok.json")
    tokens = open_data(str(tmp_path / "out"), "tokens", "bytes", 0, 0.1, 16)
    texts = open_data(str(text), "text", spec, 10**9, 0.1, 16)
    assert tokens.vocab_size == texts.vocab_size == vocab_of(str(tmp_path / "out"), "tokens")
    assert tokens.tokenizer.name == ("bytes" if tokenizer == "bytes"
                                     else str(tmp_path / "out" / "tokenizer.json"))
    same_sequences(tokens.train, texts.train)
    same_sequences(tokens.val, texts.val)
    assert leftovers(tmp_path) == []


def test_shards_are_the_documents_encoded_whatever_the_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dtrain.data.prepare.CHUNK_DOCUMENTS", 2)  # many chunks in flight
    tok_path = str(make_tokenizer(tmp_path / "tok.json"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", TEXTS * 2)
    (mixed / "b.txt").write_text("plain text, one document\n")
    write_jsonl(tmp_path / "more.jsonl", TEXTS[::-1])
    inputs = [str(mixed), str(tmp_path / "more.jsonl")]
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        prepare(inputs, str(out), tok_path, shard_size=50, workers=workers, progress=False)
        outs.append(TokenShards(str(out))[:])
    tok = load_tokenizer(tok_path)
    documents = TEXTS * 2 + ["plain text, one document\n"] + TEXTS[::-1]
    expected = encode_documents(documents, tok)
    assert outs[0].tolist() == outs[1].tolist() == expected.tolist()
    assert tok.decode(outs[0].tolist()) == "<|endoftext|>".join(documents)
    shards = open_data(str(tmp_path / "out2"), "tokens", "ignored: the index names it", 0,
                       0.2, 8)
    assert shards.tokenizer.decode(tok.encode(TEXTS[1])) == TEXTS[1]


def test_jsonl_prepared_equals_jsonl_read(tmp_path: Path) -> None:
    tok_path = str(make_tokenizer(tmp_path / "tok.json"))
    write_jsonl(tmp_path / "docs.jsonl", TEXTS * 6)
    prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / "out"), tok_path, shard_size=64,
            workers=2, progress=False)
    read = open_data(str(tmp_path / "docs.jsonl"), "jsonl", tok_path, 10**9, 0.25, 8)
    mapped = open_data(str(tmp_path / "out"), "tokens", "bytes", 0, 0.25, 8)
    same_sequences(read.train, mapped.train)
    same_sequences(read.val, mapped.val)


def test_shards_are_memory_mapped_and_sliced_across_boundaries(tmp_path: Path) -> None:
    ids = np.arange(1000) % 300
    with ShardWriter(str(tmp_path / "out"), vocab_size=300, shard_size=7) as writer:
        writer.write(ids[:500])
        writer.write(ids[500:])
        writer.finish()
    shards = TokenShards(str(tmp_path / "out"))
    assert len(shards) == 1000 and len(shards._maps) == 143
    assert all(m is None for m in shards._maps)  # nothing is read before it is asked for
    window = shards[12:16]  # shards 1 and 2
    assert window.dtype == torch.long and window.tolist() == ids[12:16].tolist()
    opened = [i for i, m in enumerate(shards._maps) if m is not None]
    assert opened == [1, 2] and all(isinstance(shards._maps[i], np.memmap) for i in opened)
    for a, b in ((0, 7), (6, 8), (13, 29), (990, 1000), (5, 5), (998, 2000)):
        assert shards[a:b].tolist() == ids[a:b].tolist()
    assert shards[-1] == ids[-1]


def test_uint32_when_the_vocabulary_needs_it(tmp_path: Path) -> None:
    assert choose_dtype(65536) == "uint16" and choose_dtype(65537) == "uint32"
    assert choose_dtype(256, "uint32") == "uint32"
    with ShardWriter(str(tmp_path / "big"), vocab_size=100_000, shard_size=3) as writer:
        writer.write([0, 70_000, 99_999, 5])
        index = writer.finish()
    assert index["dtype"] == "uint32"
    assert (tmp_path / "big" / "shard-00000.bin").stat().st_size == 3 * 4
    assert TokenShards(str(tmp_path / "big"))[:].tolist() == [0, 70_000, 99_999, 5]
    with pytest.raises(ConfigError, match="token id 70000 does not fit the shards' dtype uint16:"
                                          " give --dtype uint32"):
        with ShardWriter(str(tmp_path / "small"), vocab_size=100_000, dtype="uint16") as writer:
            writer.write([1, 70_000])
    assert not (tmp_path / "small").exists() and leftovers(tmp_path) == []
    prepare([str(corpus(tmp_path / "c"))], str(tmp_path / "forced"), dtype="uint32",
            workers=1, progress=False)
    forced = open_data(str(tmp_path / "forced"), "tokens", "bytes", 0, 0.1, 16)
    same_sequences(forced.train, open_data(str(tmp_path / "c"), "text", "bytes", 10**9, 0.1,
                                           16).train)


def test_prepare_refuses_bad_input_and_writes_nothing(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    text = corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    (tmp_path / "bad.json").write_text('{"model": 3}')
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    (tmp_path / "empty" / "blank.jsonl").write_text('{"text": ""}\n')
    cases = [
        (dict(tokenizer=str(tmp_path / "bad.json")),
         r"--tokenizer '\S+bad.json' is not a Hugging Face tokenizer.json"),
        (dict(inputs=[str(tmp_path / "missing")]), r"input '\S+missing' does not exist"),
        (dict(inputs=[str(tmp_path / "empty")]), "hold no text"),
        (dict(dtype="int8"), "--dtype 'int8' is not a token dtype"),
        (dict(inputs=[str(tmp_path / "corpus" / "image.bin")]), "looks binary"),
    ]
    for overrides, message in cases:
        args = dict(inputs=[str(text)], out=str(out), workers=2, progress=False) | overrides
        with pytest.raises(ConfigError, match=message):
            prepare(**args)
        assert not out.exists() and leftovers(tmp_path) == [], message

    real = Path.read_bytes

    def unreadable(path: Path) -> bytes:
        if path.name == "03.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    with pytest.raises(ConfigError, match=r"03.txt cannot be read \(Permission denied\)"):
        prepare([str(text)], str(out), workers=2, progress=False)
    assert not out.exists() and leftovers(tmp_path) == []
    monkeypatch.undo()

    out.mkdir()
    (out / "old.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="exists and is not empty: remove it or choose"):
        prepare([str(text)], str(out), progress=False)
    assert [p.name for p in out.iterdir()] == ["old.bin"] and leftovers(tmp_path) == []


def test_damaged_shards_are_refused(tmp_path: Path) -> None:
    prepare([str(corpus(tmp_path / "c"))], str(tmp_path / "out"), shard_size=100, workers=1,
            progress=False)
    index_file = tmp_path / "out" / "index.json"
    good = index_file.read_text()
    shard = tmp_path / "out" / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"shard shard-00001.bin has 198 bytes, not 100 tokens "
                                          r"x 2 = 200 \(truncated or damaged\)"):
        open_data(str(tmp_path / "out"), "tokens", "bytes", 0, 0.1, 16)
    shard.unlink()
    with pytest.raises(ConfigError, match="shard shard-00001.bin is missing"):
        TokenShards(str(tmp_path / "out"))
    index_file.write_text(good.replace('"uint16"', '"int8"'))
    with pytest.raises(ConfigError, match="index.json names dtype 'int8', not uint16 or uint32"):
        TokenShards(str(tmp_path / "out"))
    index_file.write_text(good[:-5])
    with pytest.raises(ConfigError, match="index.json cannot be read"):
        vocab_of(str(tmp_path / "out"), "tokens")
    index_file.write_text(good.replace('"tokenizer": "bytes"', '"tokenizer": "gpt2.json"'))
    (tmp_path / "out" / "shard-00001.bin").write_bytes(b"\0" * 200)
    with pytest.raises(ConfigError, match="encoded with 'gpt2.json' but holds no tokenizer.json"):
        open_data(str(tmp_path / "out"), "tokens", "bytes", 0, 0.1, 16)


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = corpus(tmp_path / "c")
    run(parser.parse_args([str(text), str(tmp_path / "out"), "--shard-size", "1K",
                           "--workers", "1", "--dtype", "uint32"]))
    total = len(encode_documents(text_documents(str(text)), load_tokenizer("bytes")))
    assert f"wrote {total:,} tokens of 13 documents in 3 uint32 shards" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--shard-size '1 token' is not a count of tokens"):
        run(parser.parse_args([str(text), str(tmp_path / "o2"), "--shard-size", "1 token"]))
