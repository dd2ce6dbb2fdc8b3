"""Preference data for DPO: each pair two padded rows, chosen then rejected, the targets
on the responses' tokens only (the prompt/response split TRL's DPOTrainer makes of the
same pairs); pairs never parted by the batch order, across data-parallel ranks or
micro-batches; prepared shards reading as the JSON lines; bad records and packings
refused in one line."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from dtrain.data import load_tokenizer
from dtrain.data.chat import ChatTemplate
from dtrain.data.dataset import open_data
from dtrain.data.documents import Documents
from dtrain.data.packing import PackedRows, Packing, TooLong
from dtrain.data.preference import encode_pair
from dtrain.data.prepare import prepare
from dtrain.data.sequences import IGNORE, batches
from dtrain.errors import ConfigError
from dtrain.testing.chat import CHATML, LLAMA3, make_chat_tokenizer
from tests.support.cli import dtrain, one_error_line

USER = "user"


def _conversational(i: int) -> dict[str, object]:
    prompt = [{"role": USER, "content": f"What is {i} plus two?"}]
    if i % 3 == 1:  # a system prompt and an earlier exchange
        prompt = [{"role": "system", "content": "You answer in one word."},
                  {"role": USER, "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris"}, *prompt]
    return {"prompt": prompt,
            "chosen": [{"role": "assistant", "content": f"{i + 2}."}],
            "rejected": [{"role": "assistant", "content": "Five, I think." * (1 + i % 2)}]}


def _standard(i: int) -> dict[str, object]:
    return {"prompt": f"What is {i} plus two?", "chosen": f" {i + 2}.",
            "rejected": " Five, I think." * (1 + i % 2)}


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_the_targets_are_the_responses_trl_splits_off(tmp_path: Path, template: str) -> None:
    """TRL's DPOTrainer tokenizes the same pairs (its own `_prepare_dataset`, no model) into
    prompt_ids, chosen_ids and rejected_ids: each of our rows is prompt + response, the
    response's tokens exactly its targets; conversational pairs through the chat template,
    standard ones with the tokenizer's eos_token after the response."""
    pytest.importorskip("trl")
    import datasets
    from transformers import PreTrainedTokenizerFast
    from trl.trainer.dpo_trainer import DPOTrainer

    file = make_chat_tokenizer(tmp_path / "tok", template)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    ours, found = load_tokenizer(str(file)), ChatTemplate.find(str(file))
    stub = types.SimpleNamespace(_tokenizer=theirs)
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None,
                                 truncation_mode="keep_start")
    for make in (_conversational, _standard):
        records = [make(i) for i in range(3)]
        split = DPOTrainer._prepare_dataset(stub, datasets.Dataset.from_list(records), theirs,
                                            args, "train")
        for record, want in zip(records, split, strict=True):
            rows = encode_pair(record, ours, found, "pairs.jsonl:1")
            for (ids, targets), name in zip(rows, ("chosen_ids", "rejected_ids"), strict=True):
                prompt, response = want["prompt_ids"], want[name]
                assert ids.tolist() == prompt + response, make.__name__
                assert targets.tolist() == [False] * len(prompt) + [True] * len(response)


@pytest.mark.timeout(60)
def test_the_targets_are_what_transformers_marks_as_the_assistants(tmp_path: Path) -> None:
    """Without TRL: a conversational row's ids are `apply_chat_template(prompt + chosen)`'s
    and its targets the response's share of `return_assistant_tokens_mask` (the prompt's
    earlier assistant turn is no target)."""
    from transformers import PreTrainedTokenizerFast

    file = make_chat_tokenizer(tmp_path / "tok", LLAMA3)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    record = _conversational(1)
    rows = encode_pair(record, load_tokenizer(str(file)), ChatTemplate.find(str(file)))
    for (ids, targets), name in zip(rows, ("chosen", "rejected"), strict=True):
        prompt = record["prompt"]
        out = theirs.apply_chat_template(prompt + record[name], tokenize=True,
                                         return_dict=True, return_assistant_tokens_mask=True)
        asked = theirs.apply_chat_template(prompt, tokenize=True, return_dict=True,
                                           add_generation_prompt=True)
        mask = [0] * len(asked["input_ids"]) + out["assistant_masks"][len(asked["input_ids"]):]
        assert ids.tolist() == list(out["input_ids"])
        assert targets.astype(int).tolist() == mask and 0 < sum(mask) < sum(out["assistant_masks"])


@pytest.mark.timeout(30)
def test_each_pair_is_two_padded_rows_chosen_then_rejected(tmp_path: Path) -> None:
    """Rows 2i and 2i+1 are pair i's prompt + chosen and prompt + rejected, the next-token
    targets on the response only; the prompt and the padding get IGNORE. The bytes
    tokenizer has no end-of-sequence token, so nothing follows a standard response."""
    records = [_standard(i) for i in range(6)]
    data = open_data(str(_write(tmp_path / "p.jsonl", records)), "preference", "bytes",
                     block_size=48, val_fraction=0.34)
    assert data.pairs and data.train.pairs and data.packing is Packing.PAD
    assert (len(data.train), len(data.val)) == (8, 4)
    for i, record in enumerate(records[:4]):
        prompt = record["prompt"].encode()
        for row, name in ((2 * i, "chosen"), (2 * i + 1, "rejected")):
            x, y = data.train[row]
            text = prompt + record[name].encode()
            n = len(text) - 1
            assert bytes(x[:n].tolist()) == text[:-1] and (x[n:] == 0).all()
            want = [IGNORE] * (len(prompt) - 1) + list(record[name].encode())
            assert y[:n].tolist() == want and (y[n:] == IGNORE).all()
    assert "pad packing: 6 preference pairs in 8 training rows" in data.notes[-1]


def _pair_documents(pairs: int, seed: int = 0) -> Documents:
    """Pairs whose rows say who they are: token 0 the pair, token 1 chosen (1) or
    rejected (2), then a prompt and a response of random lengths."""
    g = torch.Generator().manual_seed(seed)
    pieces, flags = [], []
    for p in range(pairs):
        prompt = int(torch.randint(1, 6, (1,), generator=g))
        for side in (1, 2):
            response = int(torch.randint(1, 6, (1,), generator=g))
            pieces.append(torch.tensor([p, side] + [7] * (prompt + response)))
            flags.append(torch.tensor([False] * (2 + prompt) + [True] * response))
    starts = np.concatenate([[0], np.cumsum([len(t) for t in pieces])]).astype(np.int64)
    return Documents(torch.cat(pieces), starts, torch.cat(flags))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dp_size, accum", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (3, 2)])
def test_batches_never_part_a_pair(dp_size: int, accum: int) -> None:
    """Every rank's micro-batch holds whole pairs, chosen at even and rejected at odd
    rows; a step's pairs are the same whatever the layout, each pair once an epoch."""
    rows = PackedRows(_pair_documents(40), 16, Packing.PAD, TooLong.TRUNCATE, pairs=True)
    global_batch = 2 * dp_size * accum * 2  # two pairs per rank's micro-batch
    per_epoch = len(rows) // global_batch
    seen: list[list[int]] = [[] for _ in range(per_epoch)]
    for rank in range(dp_size):
        stream = batches(rows, global_batch, dp_size, rank, seed=3, shuffle=True, accum=accum)
        for step in range(per_epoch):
            for _ in range(accum):
                batch = next(stream)
                assert batch.pairs and len(batch.inputs) == global_batch // (dp_size * accum)
                assert (batch.inputs[0::2, 1] == 1).all() and (batch.inputs[1::2, 1] == 2).all()
                assert torch.equal(batch.inputs[0::2, 0], batch.inputs[1::2, 0])
                seen[step] += batch.inputs[0::2, 0].tolist()
    single = batches(rows, global_batch, 1, 0, seed=3, shuffle=True)
    for step in range(per_epoch):
        assert sorted(seen[step]) == sorted(next(single).inputs[0::2, 0].tolist())
    every = [p for step in seen for p in step]
    assert len(every) == len(set(every)) == per_epoch * global_batch // 2


@pytest.mark.timeout(30)
def test_an_odd_share_of_rows_is_refused_naming_the_batch_size() -> None:
    rows = PackedRows(_pair_documents(8), 16, Packing.PAD, TooLong.TRUNCATE, pairs=True)
    for global_batch, dp_size, accum in ((6, 2, 1), (12, 2, 2), (4, 1, 4), (3, 1, 1)):
        with pytest.raises(ConfigError, match=r"train.batch_size = \d+ gives each") as refused:
            batches(rows, global_batch, dp_size, 0, seed=0, shuffle=False, accum=accum)
        assert "multiple of" in str(refused.value) and "\n" not in str(refused.value)
    assert next(batches(rows, 8, 2, 1, seed=0, shuffle=False, accum=2)).inputs.shape[0] == 2


@pytest.mark.timeout(30)
def test_prepared_shards_read_as_the_json_lines(tmp_path: Path) -> None:
    """`dtrain data prepare --format preference` keeps the targets, the documents and
    that they are pairs: the shards give the same rows and batches as the JSON lines."""
    file = make_chat_tokenizer(tmp_path / "tok")
    records = [(_conversational if i % 2 else _standard)(i) for i in range(12)]
    path = _write(tmp_path / "p.jsonl", records)
    summary = prepare([str(path)], str(tmp_path / "shards"), str(file), workers=2,
                      progress=False, format="preference")
    assert summary["documents"] == 24 and summary["skipped"] == 0
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert index["pairs"] is True and index["targets"] is True
    read = open_data(str(path), "preference", str(file), block_size=24, val_fraction=0.25)
    mapped = open_data(str(tmp_path / "shards"), "tokens", block_size=24, val_fraction=0.25)
    assert mapped.pairs and mapped.notes == read.notes
    for got, want in ((mapped.train, read.train), (mapped.val, read.val)):
        assert len(got) == len(want) > 0
        for i in range(len(want)):
            for a, b in zip(got[i], want[i], strict=True):
                assert torch.equal(a, b), i
    a, b = (next(batches(d.train, 4, 2, 1, seed=1, shuffle=True)) for d in (mapped, read))
    assert a.pairs and torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert a.targets_in_step == b.targets_in_step


@pytest.mark.timeout(30)
def test_hugging_face_tables_read_as_json_lines(tmp_path: Path) -> None:
    """A parquet file and a saved dataset (its `split`) of the same pairs give the JSON
    lines' rows."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = make_chat_tokenizer(tmp_path / "tok")
    records = [_conversational(i) for i in range(6)]
    want = open_data(str(_write(tmp_path / "p.jsonl", records)), "preference", str(file),
                     block_size=32, val_fraction=0.3)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(records)}).save_to_disk(
        str(tmp_path / "saved"))
    for path, split in ((tmp_path / "p.parquet", "train"), (tmp_path / "saved", "test")):
        got = open_data(str(path), "preference", str(file), block_size=32, val_fraction=0.3,
                        split=split)
        assert len(got.train) == len(want.train)
        for i in range(len(want.train)):
            assert all(torch.equal(a, b) for a, b in zip(got.train[i], want.train[i],
                                                          strict=True))


@pytest.mark.timeout(30)
def test_too_long_pairs_lose_their_responses_end_or_are_refused(tmp_path: Path) -> None:
    """truncate keeps the prompt and cuts the response's end; a pair whose prompt leaves
    no response token in a row is skipped whole (and said); refuse names the pair."""
    records = [_standard(i) for i in range(6)]
    records[5] = {**records[5], "prompt": "x" * 40}  # no room for a response in 24 positions
    path = _write(tmp_path / "p.jsonl", records)
    data = open_data(str(path), "preference", "bytes", block_size=24, val_fraction=0.4)
    assert len(data.train) == 8 and len(data.val) == 2  # pairs 4, 5 held out, 5 dropped
    assert any("1 preference pair(s) whose prompt leaves no response" in n for n in data.notes)
    x, y = data.train[3]  # pair 1's rejected: a prompt of 19 bytes, a response cut short
    text = (records[1]["prompt"] + records[1]["rejected"]).encode()[:25]
    assert bytes(x.tolist()) == text[:-1] and y[-1].item() == text[-1]
    with pytest.raises(ConfigError, match=r"preference pair 0 .* rejected row of 34 tokens"):
        open_data(str(path), "preference", "bytes", block_size=24, too_long="refuse")


@pytest.mark.timeout(30)
def test_bad_records_are_one_line_naming_the_record_and_the_field(tmp_path: Path) -> None:
    good = _standard(0)
    cases = [({"prompt": "hi", "rejected": "no"}, 'bad.jsonl:2: a preference record needs '
              '"chosen" (it has prompt, rejected)'),
             ({**good, "rejected": ""}, 'bad.jsonl:2: "rejected" is empty'),
             ({**_conversational(0), "chosen": []}, 'bad.jsonl:2: "chosen" is empty'),
             ({**good, "chosen": [{"role": "assistant", "content": "4"}]},
              "must all be strings (standard) or all lists of messages"),
             ({**_conversational(0), "rejected": [{"role": "user", "content": "4"}]},
              '"rejected" holds no assistant message')]
    file = str(make_chat_tokenizer(tmp_path / "tok"))
    for number, (bad, message) in enumerate(cases):
        path = _write(tmp_path / "bad.jsonl", [good, bad, good, good])
        with pytest.raises(ConfigError) as refused:
            open_data(str(path), "preference", file, block_size=64)
        assert message in str(refused.value) and "\n" not in str(refused.value)
        out = tmp_path / f"out{number}"
        with pytest.raises(ConfigError) as refused:
            prepare([str(path)], str(out), file, workers=1, progress=False,
                    format="preference")
        assert message in str(refused.value)
        assert not out.exists() and not [p for p in tmp_path.iterdir()
                                         if p.name.startswith(f".out{number}")]
    path = _write(tmp_path / "bad.jsonl", [good, {"prompt": "hi", "chosen": "yes"}])
    result = dtrain("data", "prepare", str(path), str(tmp_path / "cli"), "--format",
                    "preference", "--workers", "1", timeout=60)
    assert result.returncode == 2 and not (tmp_path / "cli").exists()
    assert 'bad.jsonl:2: a preference record needs "rejected"' in one_error_line(result)


@pytest.mark.timeout(30)
def test_packings_and_keys_that_would_part_a_pair_are_refused(tmp_path: Path) -> None:
    path = str(_write(tmp_path / "p.jsonl", [_standard(i) for i in range(4)]))
    refusals = [({"packing": "stream"}, 'data.packing = \'stream\' does not keep preference '
                 'pairs whole'),
                ({"packing": "block_causal"}, "data.packing = 'block_causal' does not keep"),
                ({"too_long": "split"}, 'data.too_long = "split" does not apply to preference'),
                ({"train_on": "all"}, "data.train_on = 'all' does not apply to preference"),
                ({"column": "text"}, "data.column = 'text' does not apply to preference")]
    for keys, message in refusals:
        with pytest.raises(ConfigError) as refused:
            open_data(path, "preference", "bytes", block_size=64, **keys)
        assert message in str(refused.value) and "\n" not in str(refused.value)
