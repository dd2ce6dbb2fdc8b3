"""A replica's training state as it travels to a replacement: tensors plus a JSON manifest.

What a live peer sends a joining replica (dtrain.ft.live): the model state its strategy
carries (a module's parameters and buffers; ZeRO's master shards, which at stage 3 and
under mixed precision are what the parameters are made from, and its loss scaler: a
dtrain.data_parallel.averaging.Carried), the optimizer's state, the step number and the
caller's small "extra" dict (e.g. the data position). Tensors go by broadcast over the
quorum's group, in an order both sides derive from the same model and from the
manifest; everything else (step,
extra, optimizer hyper-parameters, the names, shapes and dtypes of the optimizer's
tensors) is JSON that the sender writes to the job's store. Nothing is pickled, so a
replica never runs code that came over the network.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtrain import comm
from dtrain.data_parallel.averaging import Carried
from dtrain.errors import DtrainError

SaveExtra = Callable[[], dict[str, Any]]
LoadExtra = Callable[[dict[str, Any]], None]


@dataclass
class Tracked:
    """What a replica sends a joiner: its model state, its optimizer, and `save_extra()`, a
    small JSON dict that `load_extra(dict)` restores on the joiner (e.g. the data
    position)."""

    carried: Carried | None = None
    optimizer: torch.optim.Optimizer | None = None
    save_extra: SaveExtra | None = None
    load_extra: LoadExtra | None = None

    def update(self, carried: Carried | None, optimizer: torch.optim.Optimizer | None,
               save_extra: SaveExtra | None, load_extra: LoadExtra | None) -> None:
        """Keep each of these that is not None."""
        self.carried = carried or self.carried
        self.optimizer = optimizer or self.optimizer
        self.save_extra = save_extra or self.save_extra
        self.load_extra = load_extra or self.load_extra


def transfer(tracked: Tracked, group: comm.Group, src: int, post: Callable[[str], None],
             fetch: Callable[[], str], load: bool) -> None:
    """Send group rank `src`'s tracked state to every member (a collective call): `src`
    posts the manifest (JSON) with `post`, the others `fetch` it; then the tensors are
    broadcast. The model state's tensors are written in place everywhere (they are equal
    on healthy members); the optimizer state and extra are applied, and the model state
    taken in (`Carried.loaded`), where `load`.

    Raises:
        DtrainError: no module is tracked, or the models differ.
    """
    if tracked.carried is None:
        raise DtrainError("live recovery has no module: wrap it with "
                          "DataParallel(module, live=...) before begin_step")
    tensors = tracked.carried.tensors()
    if group.rank == src:
        described, received = optimizer_manifest(tracked.optimizer)
        post(json.dumps({"model": signature(tensors), "optimizer": described,
                         "extra": tracked.save_extra() if tracked.save_extra else {}}))
        broadcast_tensors(tensors + received, src, group)
        return
    manifest = json.loads(fetch())
    if manifest["model"] != signature(tensors):
        raise DtrainError(
            f"replica {group.global_rank(group.rank)} has a different model than replica "
            f"{group.global_rank(src)} ({signature(tensors)} vs {manifest['model']} as "
            "tensors/elements/checksum): build the same model on every replica")
    received = optimizer_buffers(manifest["optimizer"], tracked.optimizer)
    broadcast_tensors(tensors + received, src, group)
    if load:
        tracked.carried.loaded()
        load_optimizer(tracked.optimizer, manifest["optimizer"], received)
        if tracked.load_extra is not None:
            tracked.load_extra(manifest["extra"])


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements widened to int64 at a time


@torch.no_grad()
def digest(trained: list[torch.Tensor]) -> str:
    """A fingerprint of the trained tensors (a module's parameters that take gradients;
    ZeRO's master shards: `Carried.trained`), bit for bit: equal tensors give equal
    digests on any device and in any process; a changed element, or elements moved within
    a tensor, change it (but for a collision of two weighted 64-bit sums per tensor).

    Each tensor's bits, as integers, are summed plain and weighted by position (integer
    sums: exact, whatever the order of a reduction), chunk by chunk so that the widened
    copy stays small; one transfer to the host at the end. Buffers and parameters that
    take no gradient are left out: a live replica's may be its own (a router's balancing
    bias moves by its own replica's load)."""
    sums = []
    for p in trained:
        bits = p.detach().reshape(-1).view(_BITS[p.element_size()])
        weights = torch.arange(1, min(bits.numel(), _CHUNK) + 1, device=bits.device)
        plain = torch.zeros((), dtype=torch.int64, device=bits.device)
        weighted = torch.zeros((), dtype=torch.int64, device=bits.device)
        for lo in range(0, bits.numel(), _CHUNK):
            part = bits[lo:lo + _CHUNK].long()
            plain += part.sum()
            weighted += (part * (weights[:part.numel()] + lo)).sum()
        sums += [plain, weighted]
    if not sums:
        return "empty"
    values = torch.stack(sums).cpu().tolist()
    return f"{hashlib.blake2b(repr(values).encode(), digest_size=8).hexdigest()}/{len(values) // 2}"


def signature(tensors: list[torch.Tensor]) -> str:
    """Count, elements and a checksum of shapes and dtypes: equal iff the models match."""
    shapes = ";".join(f"{tuple(t.shape)}{t.dtype}" for t in tensors)
    return f"{len(tensors)}/{sum(t.numel() for t in tensors)}/{zlib.crc32(shapes.encode())}"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DtrainError(f"live recovery: unknown dtype {name!r} in a peer's manifest")
    return dtype


def _json_value(value: Any, where: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise DtrainError(f"live recovery cannot send {where} = {value!r}: only tensors and "
                          "JSON values travel between replicas") from exc
    return value


def optimizer_manifest(optimizer: torch.optim.Optimizer | None
                       ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The optimizer's state dict split into JSON (values, shapes) and its tensors, in a
    deterministic order (parameter index, then state name)."""
    if optimizer is None:
        return {"state": {}, "param_groups": None}, []
    full = optimizer.state_dict()
    state: dict[str, dict[str, Any]] = {}
    tensors = []
    for index in sorted(full["state"]):
        entry: dict[str, Any] = {}
        for name in sorted(full["state"][index]):
            value = full["state"][index][name]
            if isinstance(value, torch.Tensor):
                entry[name] = {"shape": list(value.shape),
                               "dtype": str(value.dtype).removeprefix("torch.")}
                tensors.append(value.contiguous())
            else:
                entry[name] = {"value": _json_value(value, f"optimizer state {name!r}")}
        state[str(index)] = entry
    groups = [{key: _json_value(value, f"optimizer option {key!r}")
               for key, value in group.items()} for group in full["param_groups"]]
    return {"state": state, "param_groups": groups}, tensors


def optimizer_buffers(manifest: dict[str, Any], optimizer: torch.optim.Optimizer | None
                      ) -> list[torch.Tensor]:
    """Empty tensors to receive the optimizer tensors `manifest` describes, in wire order."""
    if not manifest["state"]:
        return []
    if optimizer is None:
        raise DtrainError("a live peer sends optimizer state but this replica registered no "
                          "optimizer: call live.track(optimizer=...) before begin_step")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    buffers = []
    for index in sorted(manifest["state"], key=int):
        device = params[int(index)].device if int(index) < len(params) else "cpu"
        for name in sorted(manifest["state"][index]):
            spec = manifest["state"][index][name]
            if "shape" in spec:
                buffers.append(torch.empty(spec["shape"], dtype=_dtype(spec["dtype"]),
                                           device=device))
    return buffers


def load_optimizer(optimizer: torch.optim.Optimizer | None, manifest: dict[str, Any],
                   tensors: list[torch.Tensor]) -> None:
    """Load the state `manifest` and the received `tensors` describe into `optimizer`."""
    if optimizer is None or manifest["param_groups"] is None:
        return
    received = iter(tensors)
    state: dict[int, dict[str, Any]] = {}
    for index in sorted(manifest["state"], key=int):
        state[int(index)] = {
            name: next(received) if "shape" in spec else spec["value"]
            for name, spec in sorted(manifest["state"][index].items())
        }
    own = optimizer.state_dict()["param_groups"]
    if len(own) != len(manifest["param_groups"]):
        raise DtrainError(f"live recovery: the peer's optimizer has "
                          f"{len(manifest['param_groups'])} parameter groups, this one "
                          f"{len(own)}: build the same optimizer on every replica")
    groups = []
    for mine, theirs in zip(own, manifest["param_groups"], strict=True):
        # JSON turned tuples (Adam's betas) into lists: give them their own type back.
        groups.append({key: tuple(value) if isinstance(mine.get(key), tuple) else value
                       for key, value in theirs.items()})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], src: int, group: comm.Group) -> None:
    """Broadcast `tensors` (in place) from group rank `src`, all launched before any wait."""
    staged = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    handles = [comm.broadcast(t, src=src, group=group, async_op=True, algorithm="native")
               for t in staged]
    for handle in handles:
        handle.wait()
    for tensor, stage in zip(tensors, staged, strict=True):
        if stage is not tensor:
            tensor.copy_(stage)
