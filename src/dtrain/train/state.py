"""The trainer's model and optimizer state as logical tensors (dtrain.universal), both ways.

Whatever the layout, a rank holds parameters in one of two ways:

- *whole or tensor-parallel blocks* (DataParallel, a pipeline's DataParallel pieces): the
  parameter is a tensor; a tensor-parallel layer holds block `tp_rank` of it. Its data-
  parallel replicas split the writing: dp rank d writes the d-th share of the elements.
- *ZeRO shards*: the rank holds ranges of the flattened (block of the) parameter, and
  writes exactly those.

Parameters are named as in the plain model (`canonical`): a pipeline piece's names are
already the GPT's, and the head's weight, tied to the embedding, is `wte.weight`; a
tensor appearing under two names is written once, by the lowest pipeline stage holding it.
Reading takes each logical tensor whole from the checkpoint and keeps this rank's part of
it, so the layout that saved and the layout that loads are independent.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from dtrain.parallel import zero_state
from dtrain.train.holding import Holding
from dtrain.universal import MODEL, OPTIM, Checkpoint, Piece


def _scalar(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


@torch.no_grad()
def collect(h: Holding) -> tuple[list[Piece], dict[str, Any]]:
    """This rank's pieces (parameters and per-element optimizer state), and its optimizer
    scalars (e.g. Adam's step) by parameter name."""
    pieces: list[Piece] = []
    scalars: dict[str, dict[str, float]] = {}
    for p in h.params:
        if not h._writes(p):
            continue
        name = h.canonical[id(p)]
        pieces += h._block_pieces(MODEL + name, p, p, h.dp)
        state = h.optimizer.state.get(p, {}) if h.optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
                pieces += h._block_pieces(f"{OPTIM}{name}/{key}", p, value, h.dp)
            elif value is not None:
                scalars.setdefault(name, {})[key] = _scalar(value)
    for z in h.zeros:
        own = {n: p for n, p in z.module.named_parameters()}
        shard = zero_state.sharded_state(z)
        for k, names in enumerate(z.layout):
            for n in names:
                if h._writes(own[n]) and shard["scalars"][k]:
                    scalars[h.canonical[id(own[n])]] = {
                        key: _scalar(v) for key, v in shard["scalars"][k].items()}
        per_key = {"": shard["params"], **{f"/{key}": segs for key, segs in
                                            shard["state"].items()}}
        for suffix, segments in per_key.items():
            for n, segs in segments.items():
                p = own[n]
                if not h._writes(p):
                    continue
                prefix = MODEL if not suffix else OPTIM
                name = f"{prefix}{h.canonical[id(p)]}{suffix}"
                pieces += [Piece.of_block(name, p.shape, values.to(torch.float32), lo,
                                          *h.placement(p)) for lo, _, values in segs]
    return pieces, {"scalars": scalars}


@torch.no_grad()
def restore(h: Holding, ckpt: Checkpoint) -> None:
    """Set this rank's parameters (and optimizer state) from `ckpt`, whatever its layout.

    Raises:
        DtrainError: a tensor is missing or shaped for another model.
    """
    scalars = ckpt.extra.get("scalars", {})
    keys = defaultdict(list)
    for n in ckpt.names(OPTIM):
        param, _, key = n.rpartition("/")
        keys[param].append(key)
    for p in h.params:
        name = h.canonical[id(p)]
        p.copy_(h.local(ckpt, MODEL + name, p))
        if h.optimizer is not None and (keys[name] or name in scalars):
            state = {key: h.local(ckpt, f"{OPTIM}{name}/{key}", p).to(p.dtype).clone()
                     for key in keys[name]}
            for key, value in scalars.get(name, {}).items():
                state[key] = torch.tensor(value, dtype=torch.float32)
            h.optimizer.state[p] = state
    for z in h.zeros:
        own = dict(z.module.named_parameters())
        params: zero_state.Segments = defaultdict(list)
        state: dict[str, zero_state.Segments] = defaultdict(lambda: defaultdict(list))
        for n, lo, hi in zero_state.span_ranges(z):
            p, name = own[n], h.canonical[id(own[n])]
            params[n].append((lo, hi, h.local(ckpt, MODEL + name, p).reshape(-1)[lo:hi]))
            for key in keys[name]:
                block = h.local(ckpt, f"{OPTIM}{name}/{key}", p).reshape(-1)
                state[key][n].append((lo, hi, block[lo:hi]))
        group_scalars = [{key: torch.tensor(v, dtype=torch.float32) for key, v in
                          scalars.get(h.canonical[id(own[names[0]])], {}).items()}
                         if names else {} for names in z.layout]
        zero_state.load_segments(z, params, state, group_scalars, None)
