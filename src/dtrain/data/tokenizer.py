"""Tokenizers: text to token ids and back.

Two kinds, chosen by `load_tokenizer(spec)`: "bytes" (one token per UTF-8 byte, 256 ids,
the built-in job's default) or the path of a Hugging Face `tokenizer.json`, loaded with the
`tokenizers` library from the local file (never from the network). Documents are joined
by the tokenizer's `separator`: its end-of-text token when it has one, else the encoding
of a newline, which for bytes is exactly the b"\\n" that joins the files of a text corpus.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from dtrain.errors import ConfigError

END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
"""End-of-text tokens looked for, in this order, to separate documents."""

BYTES = "bytes"


class Tokenizer(ABC):
    """Text to token ids and back; `vocab_size` ids, documents joined by `separator`.

    Attributes:
        vocab_size: the number of ids (every id is below it).
        separator: the ids put between two documents.
        path: the tokenizer.json file, None for bytes.
        name: "bytes" or the path.
        dtype: the numpy dtype `encode_document` returns (uint8 for bytes, else int32).
        end_of_text: the id of its end-of-text token (the separator, where it has one);
            None for bytes and for a tokenizer without one.
    """

    vocab_size: int
    separator: list[int]
    end_of_text: int | None
    path: str | None
    name: str
    dtype: np.dtype

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, with no special tokens added."""
        ids: list[int] = self.encode_document(text).tolist()
        return ids

    @abstractmethod
    def encode_document(self, document: str | bytes) -> np.ndarray:
        """The ids of one document (a str, or the bytes of a text file) as a 1-D array."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """The text of `ids` (special tokens such as the separator are kept)."""

    def encode_spans(self, text: str, spans: list[tuple[int, int]]
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The ids of `text` (special tokens in it recognised, none added) and, for each,
        whether any of its characters lies in one of `spans` ([start, end) character
        offsets): a conversation's ids and loss mask (dtrain.data.chat)."""
        return self.encode_spans_batch([text], [spans])[0]

    def encode_spans_batch(self, texts: list[str], spans: list[list[tuple[int, int]]]
                           ) -> list[tuple[np.ndarray, np.ndarray]]:
        """`encode_spans` of each text, tokenized as one batch."""
        out = []
        for (ids, starts, ends), marks in zip(self.offsets_batch(texts), spans, strict=True):
            marked = np.zeros(len(ids), dtype=bool)
            for start, end in marks:
                marked |= (starts < end) & (ends > start)
            out.append((ids, marked))
        return out

    def offsets_batch(self, texts: list[str]
                      ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """`offsets` of each text."""
        return [self.offsets(text) for text in texts]

    @abstractmethod
    def offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ids of `text` and each one's [start, end) character offsets in it."""


class ByteTokenizer(Tokenizer):
    """One token per byte of UTF-8: ids 0..255, documents joined by b"\\n"."""

    def __init__(self) -> None:
        self.vocab_size = 256
        self.separator = [ord("\n")]
        self.end_of_text = None
        self.path = None
        self.name = BYTES
        self.dtype = np.dtype(np.uint8)

    def encode_document(self, document: str | bytes) -> np.ndarray:
        data = document.encode("utf-8") if isinstance(document, str) else document
        return np.frombuffer(data, dtype=np.uint8)

    def offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = self.encode_document(text)
        # the character each byte belongs to: a character of k bytes covers k ids
        widths = np.fromiter((len(c.encode("utf-8")) for c in text), dtype=np.int64,
                             count=len(text))
        chars = np.repeat(np.arange(len(text)), widths)
        return ids, chars, chars + 1

    def decode(self, ids: list[int]) -> str:
        # A model may have more ids than bytes (vocab_size above 256): those decode to nothing.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class FileTokenizer(Tokenizer):
    """A Hugging Face tokenizer from a local tokenizer.json.

    The bytes of a text file are decoded as UTF-8 first (an invalid byte becomes U+FFFD).
    """

    def __init__(self, path: str, key: str = "data.tokenizer") -> None:
        from tokenizers import Tokenizer as HFTokenizer

        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"{key} {path!r} does not exist: give \"bytes\" or the path of a "
                              "Hugging Face tokenizer.json")
        try:
            self._tokenizer = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{key} {path!r} is not a Hugging Face tokenizer.json ({reason}): "
                              "give a file saved by the tokenizers library (tokenizer.save)"
                              ) from exc
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.path = str(file)
        self.name = str(file)
        self.dtype = np.dtype(np.int32)
        found = [self._tokenizer.token_to_id(token) for token in END_OF_TEXT]
        ends = [i for i in found if i is not None]
        self.end_of_text = ends[0] if ends else None
        self.separator = ends[:1] or self.encode("\n")

    def encode_document(self, document: str | bytes) -> np.ndarray:
        text = document
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=self.dtype)

    def offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.offsets_batch([text])[0]

    def offsets_batch(self, texts: list[str]
                      ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        out = []
        for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False):
            spans = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            out.append((np.asarray(encoding.ids, dtype=self.dtype), spans[:, 0], spans[:, 1]))
        return out

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer `spec` names: "bytes", or the path of a Hugging Face tokenizer.json.

    Args:
        spec: "bytes" or a local file.
        key: the config key or flag that gave `spec`, for messages.

    Raises:
        ConfigError: the file does not exist or is not a tokenizer.json.
    """
    if spec == BYTES:
        return ByteTokenizer()
    if not spec:
        raise ConfigError(f"{key} is empty: give \"bytes\" or the path of a Hugging Face "
                          "tokenizer.json")
    return FileTokenizer(spec, key)
