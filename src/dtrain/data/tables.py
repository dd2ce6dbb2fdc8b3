"""Datasets as people keep them: Hugging Face `datasets` folders and parquet files, read a
row at a time.

    for row, where, size in table_rows("my-set/", split="train"):   # row: a dict
        ...

A path is a table when it is a folder `datasets.Dataset.save_to_disk` wrote (its
`state.json`, or `dataset_dict.json` for several splits), a `.parquet` file, or a folder
of them (read in sorted order). Parquet is read with pyarrow, a batch of rows at a time
(no cache is written); a saved dataset is memory-mapped by `datasets.load_from_disk`.
Anywhere JSON lines are read (`[data] format` jsonl, chat, prompt_completion, preference,
and `dtrain data prepare`), a table is read the same way, its rows standing for the lines;
`[data] column` names the field a row's text or conversation is in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from dtrain.errors import ConfigError

PARQUET = ".parquet"
SAVED = ("state.json", "dataset_dict.json")
ROWS_PER_BATCH = 1024


def is_table(path: str) -> bool:
    """Whether `path` is a saved dataset, a parquet file, or a folder of parquet files."""
    p = Path(path)
    if not path or not p.exists():
        return False
    if p.is_file():
        return p.suffix == PARQUET
    return any((p / name).is_file() for name in SAVED) or any(p.rglob(f"*{PARQUET}"))


def table_rows(path: str, split: str = "train", key: str = "data.path"
               ) -> Iterator[tuple[dict[str, object], str, int]]:
    """Each row of the table at `path` as a dict, with where it is ("file row N") and its
    share of the files' bytes (for progress).

    Raises:
        ConfigError: a saved dataset without `split`, or a file pyarrow or datasets cannot
            read; the `datasets` package missing for a saved dataset.
    """
    p = Path(path)
    if p.is_file() or not any((p / name).is_file() for name in SAVED):
        files = [p] if p.is_file() else sorted(p.rglob(f"*{PARQUET}"))
        for file in files:
            yield from _parquet_rows(file, key, path)
        return
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{key} {path!r} is a saved Hugging Face dataset, which needs the "
                          "datasets package: pip install datasets") from None
    loaded = datasets.load_from_disk(str(p))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"{key} {path!r} has no split {split!r}: give data.split (or "
                              f"--split) one of {', '.join(sorted(loaded))}")
        loaded = loaded[split]
    size = sum(f.stat().st_size for f in p.rglob("*.arrow"))
    each = size // max(1, len(loaded))
    for number, row in enumerate(loaded):
        yield dict(row), f"{path} row {number}", each


def _parquet_rows(file: Path, key: str, given: str
                  ) -> Iterator[tuple[dict[str, object], str, int]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(file)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid and OSError kinds
        raise ConfigError(f"{key} {given!r}: {file} is not a parquet file pyarrow can read "
                          f"({exc})") from exc
    rows = max(1, table.metadata.num_rows)
    each = file.stat().st_size // rows
    number = 0
    for batch in table.iter_batches(batch_size=ROWS_PER_BATCH):
        for row in batch.to_pylist():
            yield row, f"{file} row {number}", each
            number += 1


def field(row: dict[str, object], column: str, where: str, example: str) -> object:
    """`row[column]`.

    Raises:
        ConfigError: the row has no such field, naming the fields it has.
    """
    if column not in row:
        fields = ", ".join(sorted(row)) or "none"
        raise ConfigError(f'{where}: no "{column}" field (it has {fields}): give data.column '
                          f"(or --column) the field {example} is in")
    return row[column]
