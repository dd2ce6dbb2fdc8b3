"""ZeRO's state in and out: full (unsharded) for export, sharded for checkpoints.

Reads and writes a ZeRO wrapper through its public surface only: `units`
(dtrain.data_parallel.zero.units.Unit), `optimizer`, `module`, `layout`, `shapes`,
`alias`, `group`, `rank`.

Every rank holds, per flat unit, one shard of the master weights and of each per-element
optimizer state tensor (Adam's exp_avg and exp_avg_sq, SGD's momentum buffer). A shard
covers pieces of a few parameters, so state is described per parameter as *segments*:
(lo, hi, values) = elements [lo, hi) of the flattened parameter. That description does not
depend on the number of ranks, which is what lets a sharded checkpoint written by N ranks
be loaded by M: each new rank copies, for the elements it owns, whatever segments of the
old shards overlap them.

- full_state / full_optimizer_state: all-gather each unit and cut it into parameters;
  the result has the keys and layout of the unwrapped module's state_dict and of the
  original optimizer's state_dict (collective; every rank gets it).
- load_full_state / load_full_optimizer_state: the reverse (each rank keeps its shard).
- sharded_state / load_sharded_state: this rank's segments, and loading from the
  segments of all ranks of an earlier run (of any size).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dtrain import comm
from dtrain.data_parallel.zero.units import Unit, segment
from dtrain.errors import DtrainError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from dtrain.data_parallel.zero.flat import Span
    from dtrain.data_parallel.zero.wrapper import ZeRO

FORMAT = "dtrain.zero/1"
Segments = dict[str, list[tuple[int, int, torch.Tensor]]]  # name -> (lo, hi, values)
# Segments as they are read: any mapping, its pieces any iterable (dtrain.layouts.parts
# reads them on demand)
SegmentsIn = Mapping[str, Iterable[tuple[int, int, torch.Tensor]]]


def per_element_keys(z: ZeRO) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    """The optimizer's per-element state keys, and its per-group scalar state (e.g. step)."""
    keys: dict[str, None] = {}
    scalars: list[dict[str, torch.Tensor]] = [{} for _ in z.optimizer.param_groups]
    for k, group in enumerate(z.optimizer.param_groups):
        for piece in group["params"]:
            for key, value in z.optimizer.state.get(piece, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.shape != piece.shape:
                        raise DtrainError(f"ZeRO: optimizer state {key!r} is not per element; "
                                          "use an element-wise optimizer (SGD, Adam, AdamW)")
                    keys[key] = None
                elif value is not None:
                    scalars[k][key] = value if isinstance(value, torch.Tensor) \
                        else torch.tensor(value)
    return list(keys), scalars


def _state_shard(unit: Unit, z: ZeRO, key: str) -> torch.Tensor:
    """Optimizer state `key` laid out like the unit's master shard (zeros where none)."""
    out = torch.zeros_like(unit.master, dtype=torch.float32)
    for _, lo, hi, piece in unit.pieces:
        value = z.optimizer.state.get(piece, {}).get(key)
        if value is not None:
            out[lo:hi] = value
    return out


def _gather_unit(z: ZeRO, unit: Unit, shard: torch.Tensor) -> dict[str, torch.Tensor]:
    """The unit's parameters (by name, flattened) from every rank's `shard`."""
    shard = shard.to(unit.full.device)  # offloaded: from the host (NCCL gathers the device's)
    whole = comm.all_gather(shard.contiguous(), group=unit.group,
                            algorithm=z.algorithm).view(-1)
    return {span.name: whole[span.at : span.at + span.hi - span.lo]
            for span in unit.flat.spans(0, unit.flat.numel)}


@torch.no_grad()
def full_state(z: ZeRO) -> dict[str, Any]:
    """The unwrapped module's state_dict, parameters from the master weights."""
    values: dict[str, torch.Tensor] = {}
    for unit in [*z.units, *z.frozen]:
        values.update(_gather_unit(z, unit, unit.master))
    out = {}
    for name, tensor in z.module.state_dict(keep_vars=True).items():
        source = z.alias.get(name, z.frozen_alias.get(name))
        out[name] = (values[source].view(tensor.shape).to(z.param_dtype).clone()
                     if source is not None else tensor.detach().clone())
    return out


@torch.no_grad()
def full_optimizer_state(z: ZeRO) -> dict[str, Any]:
    """The original optimizer's state_dict: parameters numbered in its groups' order."""
    keys, scalars = per_element_keys(z)
    gathered: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for unit in z.units:
        for key in keys:
            for name, value in _gather_unit(z, unit, _state_shard(unit, z, key)).items():
                gathered[name][key] = value
    state, groups, index = {}, [], 0
    for k, names in enumerate(z.layout):
        options = {key: v for key, v in z.optimizer.param_groups[k].items() if key != "params"}
        groups.append({**options, "params": list(range(index, index + len(names)))})
        for name in names:
            if name in gathered:
                shape = z.shapes[name]
                state[index] = {**{key: v.clone() for key, v in scalars[k].items()},
                                **{key: v.view(shape).clone()
                                   for key, v in gathered[name].items()}}
            index += 1
    return {"state": state, "param_groups": groups}


def own_spans(z: ZeRO, frozen: bool = False) -> Iterator[tuple[Unit, Span]]:
    """(unit, span) for every parameter range this rank's shards hold (`frozen`: of the
    frozen parameters sharded at stage 3 instead)."""
    for unit in z.frozen if frozen else z.units:
        for span, _ in unit.shard_spans():
            yield unit, span


def span_ranges(z: ZeRO, frozen: bool = False) -> list[tuple[str, int, int]]:
    """(parameter name, lo, hi): the elements of each flattened parameter this rank holds
    (`frozen`: of the frozen ones sharded at stage 3)."""
    return [(span.name, span.lo, span.hi) for _, span in own_spans(z, frozen)]


def grad_segments(z: ZeRO) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, view of this rank's reduced gradient shard) per range it holds
    (after backward; for global norms over several kinds of parallelism)."""
    for unit, span in own_spans(z):
        yield span.name, segment(unit.shard_grad(), span)


def _cut(shard: torch.Tensor, span: Span) -> tuple[int, int, torch.Tensor]:
    """The part of `shard` that `span` locates, as a segment of its parameter."""
    return span.lo, span.hi, segment(shard, span).clone()


def master_segments(z: ZeRO, frozen: bool = False) -> Segments:
    """This rank's master weights, per parameter (`frozen`: its shards of the frozen
    parameters sharded at stage 3)."""
    params: Segments = defaultdict(list)
    for unit, span in own_spans(z, frozen):
        params[span.name].append(_cut(unit.master, span))
    return dict(params)


def sharded_state(z: ZeRO) -> dict[str, Any]:
    """This rank's shards: master weights and optimizer state as per-parameter segments."""
    keys, scalars = per_element_keys(z)
    state: dict[str, Segments] = {key: defaultdict(list) for key in keys}
    shards = {id(unit): {key: _state_shard(unit, z, key) for key in keys} for unit in z.units}
    for unit, span in own_spans(z):
        for key in keys:
            state[key][span.name].append(_cut(shards[id(unit)][key], span))
    return {
        "format": FORMAT, "rank": z.rank, "world_size": z.size,
        "params": master_segments(z), "state": {key: dict(v) for key, v in state.items()},
        "scalars": scalars,
        "param_groups": [{key: v for key, v in g.items() if key != "params"}
                         for g in z.optimizer.param_groups],
        "buffers": {name: b.clone() for name, b in z.module.named_buffers()},
        "loss_scale": z.loss_scale,
    }


def _merge(shards: list[dict[str, Any]]) -> tuple[Segments, dict[str, Segments]]:
    params: Segments = defaultdict(list)
    state: dict[str, Segments] = defaultdict(lambda: defaultdict(list))
    for shard in shards:
        if shard.get("format") != FORMAT:
            raise DtrainError("not a ZeRO sharded state (format missing or unknown)")
        for name, segments in shard["params"].items():
            params[name].extend(segments)
        for key, per_name in shard["state"].items():
            for name, segments in per_name.items():
                state[key][name].extend(segments)
    return params, state


def _fill(unit: Unit, segments: SegmentsIn, out: torch.Tensor, absent_ok: bool = False
          ) -> set[str]:
    """Copy into `out` (laid out like the unit's shard) the elements `segments` hold; the
    names of the parameters they hold nothing of (`absent_ok`: an optimizer state key some
    parameters do not have, such as Muon's momentum beside AdamW's moments).

    Raises:
        DtrainError: a parameter is covered in part only (or not at all, unless
            `absent_ok`).
    """
    lo, hi = unit.flat.shard(unit.rank)
    absent = set()
    for span in unit.flat.spans(lo, hi):
        covered = 0
        for s_lo, s_hi, values in segments.get(span.name, ()):
            a, b = max(span.lo, s_lo), min(span.hi, s_hi)
            if a < b:
                out[span.at + a - span.lo : span.at + b - span.lo] = values[a - s_lo : b - s_lo]
                covered += b - a
            del values  # segments read on demand (dtrain.layouts.parts) go before the next
        if covered == 0 and absent_ok:
            absent.add(span.name)
        elif covered < span.hi - span.lo:
            raise DtrainError(f"ZeRO state is missing elements of parameter {span.name!r}: "
                              "pass the shards of every rank of the run that saved it")
    return absent


@torch.no_grad()
def load_segments(z: ZeRO, params: SegmentsIn, state: dict[str, Segments] | None,
                  scalars: list[dict[str, torch.Tensor]] | None,
                  param_groups: list[dict[str, Any]] | None) -> None:
    """Set master weights (and optimizer state) from per-parameter segments."""
    scalars = scalars or [{} for _ in z.optimizer.param_groups]
    for unit in z.units:
        _fill(unit, params, unit.master)
        if state is None:
            continue
        shards, absent = {}, {}
        for key, segments in state.items():
            shards[key] = torch.zeros_like(unit.master, dtype=torch.float32)
            absent[key] = _fill(unit, segments, shards[key], absent_ok=True)
        spans = list(unit.flat.spans(*unit.flat.shard(unit.rank)))
        for group, lo, hi, piece in unit.pieces:
            # a piece takes the keys its parameters have (a checkpoint of another layout
            # holds each parameter's own: Muon's matrices a momentum, the rest AdamW's)
            names = {span.name for span in spans if lo <= span.at < hi}
            z.optimizer.state[piece] = {
                **{key: v.clone() for key, v in scalars[group].items()},
                **{key: shards[key][lo:hi].to(piece.dtype).clone() for key in shards
                   if not absent[key] & names},
            }
    if state is not None:  # empty placeholder pieces carry the group's scalars too
        for k, param_group in enumerate(z.optimizer.param_groups):
            for piece in param_group["params"]:
                # a group with no parameter saved (LoRA's adapters are all matrices: the
                # no-decay group is empty) has no scalars: the optimizer starts it itself
                if piece.numel() == 0 and scalars[k]:
                    z.optimizer.state[piece] = {
                        **{key: v.clone() for key, v in scalars[k].items()},
                        **{key: piece.detach().clone() for key in state}}
    if param_groups is not None:
        for param_group, options in zip(z.optimizer.param_groups, param_groups, strict=True):
            param_group.update(options)
    z.publish_masters()


def load_sharded_state(z: ZeRO, shards: list[dict[str, Any]]) -> None:
    """Load the sharded states of all ranks of a run (any number of ranks).

    Raises:
        DtrainError: the model's experts are split (expert parallelism): the ranks' states
            name each rank's own experts alike; dtrain.checkpoint places them by global
            index instead.
    """
    if any(unit.group is not z.group for unit in z.units):
        raise DtrainError("ZeRO.load_sharded_state with split experts: the ranks' experts "
                          "share names; save and restore through dtrain.checkpoint "
                          "(dtrain.layouts), which places them by global index")
    params, state = _merge(shards)
    first = shards[0]
    load_segments(z, params, state, first["scalars"], first["param_groups"])
    for name, buffer in z.module.named_buffers():
        if name in first["buffers"]:
            buffer.copy_(first["buffers"][name])
    z.loss_scale = first["loss_scale"]


def whole(tensors: dict[str, torch.Tensor], names: list[str]) -> Segments:
    """Full tensors as segments covering each parameter entirely."""
    return {name: [(0, tensors[name].numel(), tensors[name].reshape(-1))] for name in names
            if name in tensors}


@torch.no_grad()
def load_full_state(z: ZeRO, state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Load a full state_dict (the unwrapped module's keys); each rank keeps its shard.

    Raises:
        DtrainError: `strict` and a key of the module is missing.
    """
    trainable = {z.alias[k]: v for k, v in state_dict.items() if k in z.alias}
    missing = sorted(set(z.alias.values()) - set(trainable))
    if strict and missing:
        raise DtrainError(f"ZeRO.load_state_dict: missing {', '.join(missing[:3])}")
    rest = {k: v for k, v in state_dict.items() if k not in z.alias}
    own = {k for k in z.module.state_dict() if k not in z.alias}
    if strict and own - set(rest):
        raise DtrainError(f"ZeRO.load_state_dict: missing {', '.join(sorted(own - set(rest)))}")
    module_state = z.module.state_dict(keep_vars=True)
    for key, value in rest.items():
        if key in module_state and key not in z.frozen_alias:
            module_state[key].copy_(value)
    load_frozen(z, whole({z.frozen_alias[k]: v for k, v in rest.items() if k in z.frozen_alias},
                         [n for unit in z.frozen for n in unit.flat.names]))
    load_segments(z, whole(trainable, list(z.shapes)), None, None, None)


@torch.no_grad()
def load_frozen(z: ZeRO, params: SegmentsIn) -> None:
    """Set this rank's shards of the frozen parameters sharded at stage 3 from
    per-parameter segments (the next forward gathers them)."""
    for unit in z.frozen:
        _fill(unit, params, unit.master)


def load_full_optimizer_state(z: ZeRO, state_dict: dict[str, Any]) -> None:
    """Load a full optimizer state_dict (as `full_optimizer_state` returns); the master
    weights are kept as they are."""
    names = [n for group in z.layout for n in group]
    per_key: dict[str, dict[str, torch.Tensor]] = {}
    scalars: list[dict[str, torch.Tensor]] = [{} for _ in z.layout]
    for k, group in enumerate(state_dict["param_groups"]):
        for index in group["params"]:
            for key, value in state_dict["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    per_key.setdefault(key, {})[names[index]] = value
                else:
                    scalars[k].setdefault(key, torch.as_tensor(value))
    state = {key: whole(values, names) for key, values in per_key.items()}
    options = [{key: v for key, v in g.items() if key != "params"}
               for g in state_dict["param_groups"]]
    load_segments(z, master_segments(z), state, scalars, options)
