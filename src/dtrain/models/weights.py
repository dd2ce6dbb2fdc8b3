"""A Hugging Face folder of safetensors weights, read the way a checkpoint is.

`init_from` starts a run from such a folder in any layout: the layouts restore their
parameters from it exactly as from a dtrain checkpoint (dtrain.layouts.state), through the
few calls a checkpoint answers (`tensor`, `names`, `extra`, `path`) and two a checkpoint
does not (`block`, `rows`). Names are dtrain's (`model/` + the model's parameter name),
mapped to the folder's by a table of (Hugging Face name, transposed). A rank reads only
what it holds: a tensor-parallel rank its block of each split tensor, a ZeRO rank the
rows that hold its shard's elements, each a slice of the file. There is no optimizer
state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dtrain.checkpoint.universal import MODEL
from dtrain.errors import ConfigError
from dtrain.layout import Split


def _files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"model.init_from: {index} is not a safetensors index: "
                              f"{exc}") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise ConfigError(f"model.init_from = {str(folder)!r} holds no model.safetensors "
                          "(or model.safetensors.index.json): give a Hugging Face model folder")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class HFWeights:
    """The weights in `folder`, named by `names`: dtrain name -> (Hugging Face name,
    whether the tensor is stored transposed there).

    Raises:
        ConfigError: the folder holds no safetensors weights, or lacks a tensor the model
            needs.
    """

    extra: dict[str, Any] = {}

    def __init__(self, folder: str | Path, names: dict[str, tuple[str, bool]]) -> None:
        self.path = Path(folder)
        if not self.path.is_dir():
            raise ConfigError(f"model.init_from = {str(folder)!r} is not a folder: give a "
                              "Hugging Face model folder")
        self.names_map = names
        self.files = _files(self.path)
        self._open: dict[Path, Any] = {}
        for name, (hf_name, _) in names.items():
            if self._stored(hf_name) is None:
                raise ConfigError(f"model.init_from = {str(folder)!r} has no tensor {hf_name!r} "
                                  f"(dtrain's {name}): is it the same model as [model]?")

    def _stored(self, hf_name: str) -> str | None:
        """The name `hf_name` has in the files (a base model's are saved without the
        prefix its causal-LM class adds, e.g. `transformer.`)."""
        if hf_name in self.files:
            return hf_name
        short = hf_name.partition(".")[2]
        return short if short in self.files else None

    def names(self, prefix: str = MODEL) -> list[str]:
        return list(self.names_map) if prefix == MODEL else []

    def _slice(self, name: str) -> tuple[Any, bool]:
        hf_name, transposed = self.names_map[name.removeprefix(MODEL)]
        stored = self._stored(hf_name)
        file = self.files[stored]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_slice(stored), transposed

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor dtrain calls `name` (model/...)."""
        piece, transposed = self._slice(name)
        whole = piece[:]
        return whole.t().contiguous() if transposed else whole

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the tensor dtrain calls `name`."""
        piece, transposed = self._slice(name)
        shape = tuple(piece.get_shape())
        return shape[::-1] if transposed else shape

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements lo..hi of the tensor `name` flattened, reading only the rows (of dtrain's
        orientation) that hold them."""
        piece, transposed = self._slice(name)
        shape = self.shape(name)
        if hi <= lo:
            return torch.empty(0)
        row = 1
        for n in shape[1:]:
            row *= n
        first, last = lo // row, (hi - 1) // row + 1
        if transposed:
            block = piece[:, first:last].t()
        else:
            block = piece[first:last]
        return block.reshape(-1)[lo - first * row : hi - first * row]

    def block(self, name: str, split: Split, part: int, parts: int) -> torch.Tensor:
        """Block `part` of `parts` of the tensor `name` cut as `split` (Split.shard's
        result), read as slices of the file."""
        piece, transposed = self._slice(name)
        shape = piece.get_shape()
        if transposed:
            shape = shape[::-1]
        size = shape[split.dim] // split.chunks
        step = size // parts
        blocks = []
        for chunk in range(split.chunks):
            lo = chunk * size + part * step
            index = [slice(None)] * len(shape)
            index[split.dim] = slice(lo, lo + step)
            if transposed:
                blocks.append(piece[tuple(index[::-1])].t())
            else:
                blocks.append(piece[tuple(index)])
        return torch.cat(blocks, dim=split.dim).contiguous()


def weights_of(cfg: Any, model: torch.nn.Module) -> HFWeights:
    """The weights `cfg.init_from` names, mapped to `model` (built from `cfg`, a resolved
    ModelConfig).

    Raises:
        ConfigError: the arch cannot start from Hugging Face weights, or the folder does
            not hold the model's tensors.
    """
    from dtrain.models import hf_names

    if cfg.arch == "custom":
        raise ConfigError("model.init_from reads Hugging Face weights into arch gpt, llama "
                          "or hf: a custom model loads its own weights in its factory")
    return HFWeights(cfg.init_from, hf_names(cfg, model))
