"""Documents packed into rows: whole documents that do not see each other (block_causal),
one per padded row (pad), long ones split, cut or refused; the loss a mean over the
targets of the whole batch, so packed and padded training of the same documents agree,
and a packed row trains each document as if it were alone. The models' attention mask is
checked against a reference built position by position, forward and backward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dtrain.data.dataset import open_data
from dtrain.data.documents import Documents
from dtrain.data.packing import PackedRows, Packing, TooLong, best_fit, pieces
from dtrain.data.prepare import prepare
from dtrain.data.sequences import IGNORE, Batch, batches
from dtrain.errors import ConfigError
from dtrain.masks import document_mask
from dtrain.testing.chat import CONVERSATIONS, make_chat_tokenizer, write_chat_jsonl

VOCAB = 64


def _documents(lengths: list[int], seed: int = 0, masked: bool = True) -> Documents:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (sum(lengths),), generator=g)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    targets = None
    if masked:  # each document's first third is a prompt
        targets = torch.ones(sum(lengths), dtype=torch.bool)
        for a, n in zip(starts[:-1], lengths, strict=True):
            targets[a : a + n // 3] = False
    return Documents(ids, starts, targets)


def test_pieces_split_truncate_and_refuse() -> None:
    lengths = np.array([1, 5, 11, 22])
    doc, start, size, cut = pieces(lengths, 10, TooLong.SPLIT)  # 22 tokens: 21 positions
    assert cut == 1 and list(zip(doc.tolist(), start.tolist(), size.tolist(), strict=True)) == [
        (1, 0, 4), (2, 0, 10), (3, 0, 10), (3, 10, 10), (3, 20, 1)]
    doc, start, size, cut = pieces(lengths, 10, TooLong.TRUNCATE)
    assert size.tolist() == [4, 10, 10] and cut == 1
    with pytest.raises(ConfigError, match="document 3 has 22 tokens"):
        pieces(lengths, 10, TooLong.REFUSE)


def test_best_fit_fills_rows_and_keeps_every_piece_once() -> None:
    sizes = np.array([7, 3, 5, 2, 8, 1, 4])
    rows = best_fit(sizes, 10)
    assert sorted(i for r in rows for i in r) == list(range(len(sizes)))
    assert all(sum(sizes[r]) <= 10 for r in rows) and len(rows) == 3


def test_a_packed_row_restarts_positions_and_never_targets_across_documents() -> None:
    docs = _documents([6, 4, 9], masked=False)
    rows = PackedRows(docs, 20, Packing.BLOCK_CAUSAL)
    assert len(rows) == 1 and rows.padding() == pytest.approx(4 / 20)
    x, y, positions = rows[0]
    first = docs.ids(0)  # documents in order: 6, 4 and 9 tokens give 5, 3 and 8 positions
    assert x[:5].tolist() == first[:-1].tolist() and y[:5].tolist() == first[1:].tolist()
    assert positions.tolist() == [*range(5), *range(3), *range(8), *range(4)]
    assert y[4].item() == first[-1].item() and x[5].item() == docs.ids(1)[0].item()
    assert (y[16:] == IGNORE).all()
    assert rows.targets_in([0]) == 16


def test_pad_rows_and_loss_masks() -> None:
    docs = _documents([6, 9])
    rows = PackedRows(docs, 10, Packing.PAD)
    x, y = rows[1]
    ids, wanted = docs.ids(1), docs.targets_of(1)
    assert x[:8].tolist() == ids[:-1].tolist()
    assert y[:8].tolist() == ids[1:].masked_fill(~wanted[1:], IGNORE).tolist()
    assert (y[8:] == IGNORE).all() and rows.targets_in([1]) == int(wanted[1:].sum())


def _loss_and_grads(model: torch.nn.Module, batch: Batch, shares: int = 1
                    ) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    batch = batch.shared(shares)
    _, loss = model(batch.inputs, batch.targets, **batch.model_kwargs())
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _model(arch: str) -> torch.nn.Module:
    from dtrain import models
    from dtrain.models.config import ModelConfig

    torch.manual_seed(0)
    if arch == "hf":
        return _hf_llama()
    shape = {"gpt": {"arch": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32},
             "llama": {"arch": "llama", "preset": "llama-tiny", "n_layer": 2}}[arch]
    return models.build(models.resolve(ModelConfig(**shape, block_size=32), VOCAB))


def _hf_llama() -> torch.nn.Module:
    import json
    import tempfile

    from dtrain import models
    from dtrain.models.config import ModelConfig

    config = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2}
    file = Path(tempfile.mkdtemp()) / "config.json"
    file.write_text(json.dumps(config))
    return models.build(models.resolve(ModelConfig(arch="hf", hf_config=str(file),
                                                   block_size=32), VOCAB))


@pytest.mark.parametrize("arch", ["gpt", "llama", "hf"])
def test_packed_and_padded_steps_of_the_same_documents_agree(arch: str) -> None:
    """The same documents in one step, packed (2 rows) or padded (one per row): equal loss
    and gradients, the loss being the mean over all targets of the batch."""
    docs = _documents([7, 12, 5, 9, 15])
    packed, padded = (PackedRows(docs, 24, how) for how in (Packing.BLOCK_CAUSAL, Packing.PAD))
    model = _model(arch)
    results = []
    for rows in (packed, padded):
        (batch,) = list(zip(range(1), batches(rows, len(rows), 1, 0, 0, False), strict=False))
        results.append(_loss_and_grads(model, batch[1]))
    assert len(packed) < len(padded)
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt", "llama", "hf"])
def test_each_document_of_a_packed_row_trains_as_if_alone(arch: str) -> None:
    """A packed row's per-document losses equal each document run alone from position 0,
    and so does the gradient of their sum (the mask is exact forward and backward)."""
    docs = _documents([9, 6, 11], masked=False)
    rows = PackedRows(docs, 24, Packing.BLOCK_CAUSAL)
    x, y, positions = (t[None] for t in rows[0])
    model = _model(arch)
    model.zero_grad()
    logits = model(x, positions=positions)
    per_token = torch.nn.functional.cross_entropy(logits[0], y[0], reduction="none",
                                                  ignore_index=IGNORE)
    per_token.sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    at, alone_total = 0, torch.zeros(())
    for piece in rows.rows[0]:
        doc = int(rows.doc[piece])
        ids = docs.ids(doc)
        alone = torch.nn.functional.cross_entropy(model(ids[None, :-1])[0], ids[1:],
                                                  reduction="none")
        n = len(ids) - 1
        torch.testing.assert_close(per_token[at : at + n], alone.detach(), rtol=1e-5,
                                   atol=1e-5)
        alone_total = alone_total + alone.sum()
        at += n
    alone_total.backward()
    for a, b in zip(packed_grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_mask_is_causal_inside_each_document_only() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1]])
    mask = document_mask(positions)
    for row in range(2):
        document = (positions[row] == 0).cumsum(0)
        for i in range(8):
            for j in range(8):
                assert mask[row, 0, i, j] == (j <= i and document[i] == document[j])


def test_flex_attentions_mask_is_the_dense_one() -> None:
    """The mask_mod the CUDA path gives flex attention marks what the dense mask does
    (torch's own create_mask evaluates it, on the CPU)."""
    from torch.nn.attention.flex_attention import create_mask

    from dtrain.masks import same_document

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3], [*range(7), 0, 1, 2]])
    dense = create_mask(same_document(positions), 2, 1, 10, 10, device="cpu")
    assert torch.equal(dense, document_mask(positions))


def test_prepared_chat_shards_give_the_rows_the_jsonl_gives(tmp_path: Path) -> None:
    file = make_chat_tokenizer(tmp_path / "tok")
    path = write_chat_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 7)
    summary = prepare([str(path)], str(tmp_path / "shards"), str(file), shard_size=50,
                      workers=2, progress=False, format="chat")
    assert summary["documents"] == 21 and summary["shards"] > 3
    assert 0 < summary["targets"] < summary["tokens"]
    for packing in ("block_causal", "pad", "stream"):
        read = open_data(str(path), "chat", str(file), block_size=48, val_fraction=0.2,
                         packing=packing)
        mapped = open_data(str(tmp_path / "shards"), "tokens", block_size=48,
                           val_fraction=0.2, packing=packing)
        assert len(read.train) == len(mapped.train) > 0
        for i in range(len(read.train)):
            for a, b in zip(read.train[i], mapped.train[i], strict=True):
                assert torch.equal(a, b), (packing, i)
        every = list(range(len(read.train)))
        assert read.train.targets_in(every) == mapped.train.targets_in(every)


def test_prepared_text_keeps_its_documents_for_packing(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first document " * 5)
    (tmp_path / "b.txt").write_text("second " * 9)
    prepare([str(tmp_path)], str(tmp_path / "shards"), "bytes", workers=1, progress=False)
    read = open_data(str(tmp_path), "text", block_size=32, val_fraction=0.3,
                     packing="block_causal")
    mapped = open_data(str(tmp_path / "shards"), "tokens", block_size=32, val_fraction=0.3,
                       packing="block_causal")
    for a, b in zip(read.train[0], mapped.train[0], strict=True):
        assert torch.equal(a, b)


def test_a_run_resumed_mid_epoch_reads_the_rows_it_would_have_read() -> None:
    """`batches` from step k of packed rows gives what the uninterrupted stream gives at
    step k, targets' counts included."""
    rows = PackedRows(_documents([7, 12, 5, 9, 15, 3, 11, 8, 6, 14] * 3), 24,
                      Packing.BLOCK_CAUSAL)
    whole = batches(rows, 4, 2, 1, seed=5, shuffle=True)
    seen = [next(whole) for _ in range(12)]
    resumed = batches(rows, 4, 2, 1, seed=5, shuffle=True, start=7)
    for want in seen[7:]:
        got = next(resumed)
        assert got.targets_in_step == want.targets_in_step
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.positions,
                                                                    want.positions)


def test_a_custom_module_is_refused_packed_documents() -> None:
    from dtrain.config import config_from_dict
    from dtrain.data.dataset import Data
    from dtrain.train.check import check_rows

    docs = _documents([7, 12, 5, 9, 15])
    rows = PackedRows(docs, 24, Packing.BLOCK_CAUSAL)
    data = Data(rows, rows, None, VOCAB, Packing.BLOCK_CAUSAL)  # type: ignore[arg-type]
    config = config_from_dict({"model": {"arch": "custom", "factory": "x:y"},
                               "train": {"batch_size": 1}})
    with pytest.raises(ConfigError, match="a custom module trains text"):
        check_rows(data, config)
