"""A Hugging Face folder of safetensors weights, read the way a checkpoint is.

`init_from` starts a run from such a folder in any layout: the layouts restore their
parameters from it exactly as from a dtrain checkpoint (dtrain.layouts.parts), through the
few calls a checkpoint answers (`tensor`, `names`, `extra`, `path`) and two a checkpoint
does not (`block`, `rows`), all served by `SlicedWeights` from one slice reader (which
dtrain.models.init's initial values share). Names are dtrain's (`model/` + the model's
parameter name), mapped to the folder's by a table of (Hugging Face name, transposed). A
rank reads only what it holds: a tensor-parallel rank its block of each split tensor, a
ZeRO rank the rows that hold its shard's elements, each a slice of the file. There is no
optimizer state. `Overlaid` puts one source over another: adapters (from a checkpoint,
a PEFT folder or the seed) over a frozen base (a folder or the seed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors import safe_open

from dtrain.checkpoint.universal import MODEL, OPTIM, Checkpoint
from dtrain.errors import ConfigError
from dtrain.models.hf_places import HFName, Stacked, Zeros
from dtrain.split import Split

if TYPE_CHECKING:
    from dtrain.models.config import ModelConfig

class TensorSlice(Protocol):
    """A tensor in a safetensors file, read a slice at a time (safe_open's get_slice)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor: ...


ROWS_AT_ONCE = 1 << 20
"""Elements `copy_into` reads at a time (at least one row)."""


def _files(folder: Path, file: str = "model.safetensors") -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it: `file`, or the files
    of its index (`file`.index.json)."""
    index = folder / f"{file}.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"model.init_from: {index} is not a safetensors index: "
                              f"{exc}") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / file
    if not single.exists():
        raise ConfigError(f"model.init_from = {str(folder)!r} holds no {file} (or "
                          f"{file}.index.json): give a Hugging Face model folder")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class SlicedWeights:
    """Model weights read the way a checkpoint is (names `model/` + the parameter's), from
    a source that can read any rectangular slice of a tensor (`_read`): whole tensors, a
    tensor-parallel block, or the rows holding a ZeRO shard's elements. No optimizer
    state. Subclasses define `_names`, `shape` and `_read`."""

    extra: dict[str, Any] = {}
    path: Any

    def _names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the tensor dtrain calls `name`."""
        raise NotImplementedError

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The slice `index` (one slice per dimension, in dtrain's orientation) of `name`."""
        raise NotImplementedError

    @staticmethod
    def plain(name: str) -> str:
        """The model's parameter name of a checkpoint name (`model/` dropped)."""
        return name.removeprefix(MODEL)

    def names(self, prefix: str = MODEL) -> list[str]:
        return self._names() if prefix == MODEL else []

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor dtrain calls `name` (model/...)."""
        return self._read(name, tuple(slice(None) for _ in self.shape(name))).contiguous()

    def _rows_per_read(self, name: str) -> int:
        """Rows of `name` one read takes at most (one group of rows: `_read_into` writes
        them as they come); the reads of `copy_into` and the cuts of `row_cuts` fall on
        multiples of it."""
        return max(1, ROWS_AT_ONCE // max(1, math.prod(self.shape(name)[1:])))

    def _read_into(self, out: torch.Tensor, name: str, index: tuple[slice, ...]) -> None:
        """Write the slice `index` of `name` into `out` (its shape). A source that makes
        its values in groups of rows (dtrain.models.init) writes each group's share as it
        comes, so a read costs one group beyond `out`."""
        out.copy_(self._read(name, index))

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements lo..hi of the tensor `name` flattened, reading only the rows (of dtrain's
        orientation) that hold them."""
        shape = self.shape(name)
        if hi <= lo:
            return torch.empty(0)
        if not shape:
            return self.tensor(name).reshape(-1)[lo:hi]
        row = math.prod(shape[1:])
        first, last = lo // row, (hi - 1) // row + 1
        index = (slice(first, last), *(slice(None) for _ in shape[1:]))
        return self._read(name, index).reshape(-1)[lo - first * row : hi - first * row]

    def row_cuts(self, name: str, lo: int, hi: int) -> list[tuple[int, int]]:
        """lo..hi (elements of `name` flattened) cut where this source's groups of rows
        begin: `rows` of each piece reads one group."""
        shape = self.shape(name)
        if not shape:
            return [(lo, hi)] if hi > lo else []
        unit = self._rows_per_read(name) * math.prod(shape[1:])
        cuts, a = [], lo
        while a < hi:
            b = min(hi, (a // unit + 1) * unit)
            cuts.append((a, b))
            a = b
        return cuts

    def block(self, name: str, split: Split, part: int, parts: int) -> torch.Tensor:
        """Block `part` of `parts` of the tensor `name` cut as `split` (Split.shard's
        result), read as slices."""
        out = torch.empty(split.block_shape(self.shape(name), parts),
                          dtype=self._dtype(name))
        self.copy_into(out, name, split, part, parts)
        return out

    def _dtype(self, name: str) -> torch.dtype:
        """The dtype `_read` gives `name` in (a one-element read, for sources that do not
        say)."""
        return self._read(name, tuple(slice(0, 1) for _ in self.shape(name))).dtype

    def copy_into(self, out: torch.Tensor, name: str, split: Split | None = None,
                  part: int = 0, parts: int = 1) -> None:
        """Write block `part` of `parts` of `name` cut as `split` (None: the whole tensor)
        into `out`, one group of rows at a time: what it costs beyond `out` is one group."""
        shape = self.shape(name)
        if not shape or out.dim() == 0:
            out.copy_(self.tensor(name).reshape(out.shape))
            return
        per = self._rows_per_read(name)
        for a in range(0, out.shape[0], per):
            b = min(a + per, out.shape[0])
            self._block_rows_into(out[a:b], name, shape, split, part, parts, a, b)

    def _block_rows_into(self, out: torch.Tensor, name: str, shape: tuple[int, ...],
                         split: Split | None, part: int, parts: int, a: int, b: int) -> None:
        """Rows a..b of the block into `out` (Split.shard's layout: each fused chunk's part
        in turn)."""
        whole = [slice(None)] * len(shape)
        if split is None:
            self._read_into(out, name, (slice(a, b), *whole[1:]))
            return
        size = shape[split.dim] // split.chunks
        step = size // parts
        if split.dim == 0:  # block row r is chunk r // step's row r % step of this part
            r = a
            while r < b:
                end = min(b, (r // step + 1) * step)
                lo = (r // step) * size + part * step + r % step
                self._read_into(out[r - a : end - a], name,
                                (slice(lo, lo + end - r), *whole[1:]))
                r = end
            return
        for k in range(split.chunks):
            index = [slice(a, b), *whole[1:]]
            index[split.dim] = slice(k * size + part * step, k * size + (part + 1) * step)
            into = [slice(None)] * len(shape)
            into[split.dim] = slice(k * step, (k + 1) * step)
            self._read_into(out[tuple(into)], name, tuple(index))


class HFWeights(SlicedWeights):
    """The weights in `folder`, named by `names`: dtrain name -> (its Hugging Face name,
    whether the tensor is stored transposed there); `file`: the safetensors file (or
    index) holding them (a PEFT folder's adapter_model.safetensors).

    Raises:
        ConfigError: the folder holds no safetensors weights, or lacks a tensor the model
            needs.
    """

    def __init__(self, folder: str | Path, names: dict[str, tuple[HFName, bool]],
                 file: str = "model.safetensors") -> None:
        self.path = Path(folder)
        if not self.path.is_dir():
            raise ConfigError(f"model.init_from = {str(folder)!r} is not a folder: give a "
                              "Hugging Face model folder")
        self.names_map = names
        self.files = _files(self.path, file)
        self._open: dict[Path, Any] = {}
        for name, (where, _) in names.items():
            needed = where.names() if isinstance(where, Stacked) else \
                [] if isinstance(where, Zeros) else [where]
            for hf_name in needed:
                if self._stored(hf_name) is None:
                    raise ConfigError(f"model.init_from = {str(folder)!r} has no tensor "
                                      f"{hf_name!r} (dtrain's {name}): is it the same model "
                                      "as [model]?")

    def _stored(self, hf_name: str) -> str | None:
        """The name `hf_name` has in the files (a base model's are saved without the
        prefix its causal-LM class adds, e.g. `transformer.`)."""
        if hf_name in self.files:
            return hf_name
        short = hf_name.partition(".")[2]
        return short if short in self.files else None

    def _names(self) -> list[str]:
        return list(self.names_map)

    def _file_slice(self, hf_name: str) -> TensorSlice:
        stored = self._stored(hf_name)
        assert stored is not None  # asked only of the names the files hold
        file = self.files[stored]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_slice(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        where, transposed = self.names_map[self.plain(name)]
        if isinstance(where, Zeros):
            return where.shape
        if isinstance(where, Stacked):
            shapes = [tuple(self._file_slice(p.format(e=0)).get_shape()) for p in where.parts]
            return (where.count, sum(rows for rows, _ in shapes), shapes[0][1])
        shape = tuple(self._file_slice(where).get_shape())
        return shape[::-1] if transposed else shape

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        where, transposed = self.names_map[self.plain(name)]
        if isinstance(where, Zeros):
            return torch.zeros(where.shape)[index]
        if isinstance(where, Stacked):  # each expert's parts, then the rows and columns asked
            experts = range(where.count)[index[0]]
            return torch.stack([torch.cat([self._file_slice(p.format(e=e))[:, index[2]]
                                           for p in where.parts])[index[1]]
                                for e in experts])
        piece = self._file_slice(where)
        if not index:
            return piece[:]
        return piece[index[::-1]].t() if transposed else piece[index]


def weights_of(cfg: ModelConfig, model: torch.nn.Module,
               without: Collection[str] = ()) -> HFWeights:
    """The weights `cfg.init_from` names, mapped to `model` (built from `cfg`, a resolved
    ModelConfig); `without`: parameters the folder does not hold (adapters, read from
    elsewhere: `Overlaid`).

    Raises:
        ConfigError: the arch cannot start from Hugging Face weights, or the folder does
            not hold the model's tensors.
    """
    from dtrain.models import hf_names

    if cfg.arch == "custom":
        raise ConfigError("model.init_from reads Hugging Face weights into arch gpt, llama "
                          "or hf: a custom model loads its own weights in its factory")
    names = {n: where for n, where in hf_names(cfg, model).items() if n not in without}
    return HFWeights(cfg.init_from, names)


class Overlaid(SlicedWeights):
    """A model's tensors from two sources: those `over` holds (`names`, plain parameter
    names; default: every model tensor of `over`) from it, the others from `base`; the
    optimizer state and scalars are `over`'s. A frozen base beneath its adapters: the
    base's folder or initial values under an adapter checkpoint, a PEFT folder's adapters,
    or the seed's initial adapters (dtrain.adapters.checkpoints).

    Args:
        base: the base model's weights (Hugging Face weights, or `Initial`).
        over: a checkpoint, or weights read in slices.
        names: the parameters `over` gives.
    """

    def __init__(self, base: SlicedWeights, over: Checkpoint | SlicedWeights,
                 names: Iterable[str] | None = None) -> None:
        self.base, self.over = base, over
        self.over_names = set(over.names(MODEL) if names is None else names)
        self.path = over.path
        self.extra = over.extra

    def _from_over(self, name: str) -> bool:
        return name.startswith(OPTIM) or self.plain(name) in self.over_names

    def _names(self) -> list[str]:
        return [*(n for n in self.base.names() if n not in self.over_names),
                *sorted(self.over_names)]

    def names(self, prefix: str = MODEL) -> list[str]:
        if prefix == MODEL:
            return self._names()
        return self.over.names(prefix)

    def shape(self, name: str) -> tuple[int, ...]:
        if not self._from_over(name):
            return self.base.shape(name)
        if isinstance(self.over, Checkpoint):
            return tuple(self.over.tensors[name]["shape"])
        return self.over.shape(name)

    def tensor(self, name: str) -> torch.Tensor:
        return (self.over if self._from_over(name) else self.base).tensor(name)

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if not self._from_over(name):
            return self.base._read(name, index)
        if isinstance(self.over, Checkpoint):
            return self.over.tensor(name)[index]
        return self.over._read(name, index)

    def _read_into(self, out: torch.Tensor, name: str, index: tuple[slice, ...]) -> None:
        if self._from_over(name):
            out.copy_(self._read(name, index))
        else:  # the base's way: the seed's values a group of rows at a time
            self.base._read_into(out, name, index)

    def _rows_per_read(self, name: str) -> int:
        if self._from_over(name):
            return super()._rows_per_read(name)
        return self.base._rows_per_read(name)

    def _dtype(self, name: str) -> torch.dtype:
        if self._from_over(name):
            return self._read(name, tuple(slice(0, 1) for _ in self.shape(name))).dtype
        return self.base._dtype(name)
