"""Muon under ZeRO: each matrix orthogonalized whole by one owner rank (Distributed Muon).

ZeRO keeps, on each of N ranks, a flat shard of every unit: pieces of a few matrices laid
end to end. Muon's momentum is elementwise and runs on those pieces as any optimizer's
state does, but its Newton-Schulz orthogonalization needs each matrix whole. So for every
unit holding matrices Muon trains, each step (Liu et al., "Muon is Scalable for LLM
Training", 2025, section 2.3: Distributed Muon):

1. every rank advances the momentum of its pieces and makes their update (elementwise,
   dtrain.optim.muon.momentum_update), in the dtype Newton-Schulz computes in;
2. gather to owners: one all-to-all over the unit's group sends each matrix's pieces to
   the rank that owns it (uneven sizes, known from the layout: no size exchange);
3. each owner puts its matrices together (a tensor-parallel block's whole matrix gathered
   over tp too: every tp rank of the owner orthogonalizes the same whole, tp-redundant)
   and orthogonalizes them;
4. scatter back: the reverse all-to-all returns to every rank the pieces of the results
   its shard holds;
5. every rank applies weight decay and the step to its pieces at the whole matrix's rate.

Owners are assigned once, the same on every rank: the group's matrices, largest
Newton-Schulz cost first (min(A, B)^2 max(A, B) multiply-adds an iteration, of the whole
matrix), each to the rank with the least cost so far (longest-processing-time first), so
that each rank orthogonalizes about 1/N of the work.

Why gather to owners and not the alternatives: all-gathering each unit's update on every
rank and reduce-scattering the owners' results (a sum with zeros, exact) uses the
collectives ZeRO already runs, but every rank then receives every matrix; Moonlight's
own version all-gathers and has every rank orthogonalize every matrix (N times the
Newton-Schulz work). Sending each piece only to its owner and back moves N times fewer
bytes than the first and spreads the work the second repeats.

Extra bytes per step, for M elements of the matrices Muon trains over N ranks, in the
Newton-Schulz dtype (b = 2 bytes in bfloat16, whose rounding the iteration does first
anyway, so sending in it changes nothing; 4 in float32): each element not held by its
owner goes there and back, 2 M b (N - 1) / N bytes over the group, on average
2 M b (N - 1) / N^2 sent and as many received per rank. Beside ZeRO's own per-step traffic
(a reduce-scatter of the gradients and an all-gather of the parameters, about
2 Psi p (N - 1) / N per rank for Psi elements in p bytes) that is about M b / (N Psi p):
1/(2N) more in bfloat16 over fp32 parameters. Memory: an owner holds its matrices of one
unit whole, at once, with Newton-Schulz's temporaries; every rank one unit's shard of
updates. A unit with no such matrix (the embeddings, a root of norms) costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain import comm
from dtrain.data_parallel.zero.units import Unit
from dtrain.errors import ConfigError
from dtrain.optim.muon import Block, Muon, apply_update, momentum_update, orthogonalized


@dataclass(frozen=True)
class Matrix:
    """A matrix Muon trains, where its unit lays it out, and the rank that orthogonalizes it.

    Attributes:
        param: the module's parameter (its shape; its tensor-parallel block, if any).
        group: its optimizer parameter group.
        offset: where it starts in the unit's flat buffer.
        owner: the rank of the unit's group that orthogonalizes it.
    """

    param: nn.Parameter
    group: int
    offset: int
    owner: int

    def held_by(self, rank: int, shard_size: int) -> tuple[int, int]:
        """[lo, hi): its elements (flattened) that `rank`'s shard holds; lo == hi: none."""
        lo = max(self.offset, rank * shard_size)
        hi = min(self.offset + self.param.numel(), (rank + 1) * shard_size)
        return (lo - self.offset, hi - self.offset) if lo < hi else (0, 0)


@dataclass
class Exchange:
    """One unit's matrices and what each rank sends and receives to orthogonalize them."""

    unit: Unit
    matrices: list[Matrix]

    @property
    def size(self) -> int:
        """The ranks the unit is sharded over."""
        return self.unit.group.size

    def owned_by(self, rank: int) -> list[Matrix]:
        """The matrices `rank` orthogonalizes, in the unit's order."""
        return [m for m in self.matrices if m.owner == rank]

    def pieces(self, sender: int, receiver: int) -> Iterator[tuple[Matrix, int, int]]:
        """(matrix, lo, hi): what of each of `receiver`'s matrices `sender`'s shard holds, in
        the order the messages carry them."""
        for m in self.owned_by(receiver):
            lo, hi = m.held_by(sender, self.unit.flat.shard_size)
            yield m, lo, hi

    def send_sizes(self, rank: int) -> list[int]:
        """Elements `rank` sends each rank (what its shard holds of that rank's matrices)."""
        return [sum(hi - lo for _, lo, hi in self.pieces(rank, r)) for r in range(self.size)]

    def recv_sizes(self, rank: int) -> list[int]:
        """Elements `rank` receives from each rank (what that rank's shard holds of its
        matrices)."""
        return [sum(hi - lo for _, lo, hi in self.pieces(r, rank)) for r in range(self.size)]


def plan(units: list[Unit], matrix_groups: set[int]) -> list[Exchange]:
    """The units holding matrices of the groups `matrix_groups`, each with its matrices and
    their owners: within each sharding group, largest Newton-Schulz cost first, to the rank
    with the least so far (ties: the lower rank)."""
    found: list[tuple[Unit, int, nn.Parameter, int]] = []
    for unit in units:
        for p, group, offset in zip(unit.flat.params, unit.flat.groups, unit.flat.offsets,
                                    strict=True):
            if group in matrix_groups and p.numel():
                found.append((unit, group, p, offset))
    load: dict[int, list[float]] = {}
    owner: dict[int, int] = {}
    for k in sorted(range(len(found)), key=lambda k: -_cost(found[k][2])):
        ranks = found[k][0].group
        costs = load.setdefault(id(ranks), [0.0] * ranks.size)
        owner[k] = min(range(ranks.size), key=lambda r: costs[r])
        costs[owner[k]] += _cost(found[k][2])
    exchanges: dict[int, Exchange] = {}
    for k, (unit, group_index, p, offset) in enumerate(found):
        exchange = exchanges.setdefault(id(unit), Exchange(unit, []))
        exchange.matrices.append(Matrix(p, group_index, offset, owner[k]))
    return list(exchanges.values())


def _cost(p: nn.Parameter) -> float:
    """Newton-Schulz's multiply-adds per iteration on `p`, up to a constant: the smaller
    side squared times the larger (of a tensor-parallel block, whose whole every tp rank of
    its owner orthogonalizes: the block's sides order the matrices alike on every tp rank)."""
    small, large = sorted(p.shape)
    return float(small) * small * large


class ShardedMuon(Muon):
    """`Muon` over ZeRO's shard pieces: AdamW's groups step their pieces as they are; the
    Muon groups' matrices are orthogonalized by their owners (the module docstring).

    Built by dtrain.data_parallel.zero.optimizer.shard_optimizer from the factory's Muon
    (`template`), with `groups` over the pieces of `units`.

    Raises:
        ConfigError: units whose optimizer state is offloaded to the host (its step runs
            unit by unit there, and the exchange spans ranks).
    """

    def __init__(self, groups: list[dict[str, Any]], template: Muon, units: list[Unit]
                 ) -> None:
        if any(unit.offloaded for unit in units):
            raise ConfigError("optimizer.name = \"muon\" with memory.offload = \"optimizer\" "
                              "is not supported yet: use memory.offload = \"none\"")
        options = {k: v for k, v in template.defaults.items() if k != "muon"}
        super().__init__(groups, **options, blocks=template.blocks)
        matrix_groups = {k for k, g in enumerate(template.param_groups) if g["muon"]}
        self.exchanges = plan(units, matrix_groups)

    def check_matrices(self) -> None:
        """Nothing: the pieces are flat, and the template checked the matrices."""

    def step_matrices(self, groups: list[dict[str, Any]]) -> None:
        """Muon on every unit's matrices (`groups`, the Muon ones, are read through the
        units' pieces). A unit with no gradient shard (no backward since zero_grad, on
        every rank alike) is left as it is, as torch leaves a parameter without .grad."""
        for exchange in self.exchanges:
            if exchange.unit.grad_shard is not None:
                self._step_unit(exchange)

    def _step_unit(self, exchange: Exchange) -> None:
        """The module docstring's steps 1-5 for one unit."""
        unit, rank = exchange.unit, exchange.unit.rank
        wire = self._wire_dtype(exchange)
        update = self._updates(exchange, wire)
        start = unit.flat.shard(rank)[0]
        outgoing = [update[m.offset + lo - start : m.offset + hi - start]
                    for r in range(exchange.size) for m, lo, hi in exchange.pieces(rank, r)]
        device = unit.master.device
        arrived = comm.all_to_all(_cat(outgoing, wire, device), group=unit.group,
                                  send_sizes=exchange.send_sizes(rank),
                                  recv_sizes=exchange.recv_sizes(rank))
        results = self._orthogonalize(exchange, arrived)
        back = [results[id(m)][lo:hi] for r in range(exchange.size)
                for m, lo, hi in exchange.pieces(r, rank)]
        returned = comm.all_to_all(_cat(back, wire, device), group=unit.group,
                                   send_sizes=exchange.recv_sizes(rank),
                                   recv_sizes=exchange.send_sizes(rank))
        self._apply(exchange, returned)

    def _wire_dtype(self, exchange: Exchange) -> torch.dtype:
        """The dtype the unit's updates travel in: Newton-Schulz's (float32 if its groups
        differ)."""
        dtypes = {self.param_groups[m.group]["ns_dtype"] for m in exchange.matrices}
        return dtypes.pop() if len(dtypes) == 1 else torch.float32

    @staticmethod
    def _group_pieces(unit: Unit) -> Mapping[int, tuple[int, nn.Parameter]]:
        """Optimizer group -> (where its piece starts in the unit's shard, the piece)."""
        return {group: (lo, piece) for group, lo, _, piece in unit.pieces}

    def _updates(self, exchange: Exchange, wire: torch.dtype) -> torch.Tensor:
        """This rank's shard of the unit's Muon updates (zeros elsewhere), in `wire`."""
        unit = exchange.unit
        update = torch.zeros(unit.flat.shard_size, dtype=wire, device=unit.master.device)
        pieces = self._group_pieces(unit)
        for group_index in sorted({m.group for m in exchange.matrices} & set(pieces)):
            lo, piece = pieces[group_index]  # a group this rank's shard meets
            if piece.grad is not None:
                update[lo : lo + piece.numel()] = momentum_update(
                    self.state[piece], piece.grad, self.param_groups[group_index])
        return update

    def _orthogonalize(self, exchange: Exchange, arrived: torch.Tensor
                       ) -> dict[int, torch.Tensor]:
        """id(matrix) -> its orthogonalized update (flattened), for this rank's matrices,
        put together from every rank's pieces in `arrived` (sender by sender)."""
        rank = exchange.unit.rank
        parts: dict[int, list[torch.Tensor]] = {id(m): [] for m in exchange.owned_by(rank)}
        at = 0
        for sender in range(exchange.size):
            for m, lo, hi in exchange.pieces(sender, rank):
                parts[id(m)].append(arrived[at : at + hi - lo])
                at += hi - lo
        out = {}
        for m in exchange.owned_by(rank):
            update = torch.cat(parts[id(m)]).view(m.param.shape)
            group = self.param_groups[m.group]
            block = self.blocks.get(id(m.param))
            if block is None or block.group.size == 1:
                out[id(m)] = orthogonalized(update, group).reshape(-1)
            else:
                whole = block.whole(update)
                out[id(m)] = block.mine(orthogonalized(whole, group)).reshape(-1)
        return out

    def _apply(self, exchange: Exchange, returned: torch.Tensor) -> None:
        """Weight decay and the step on this rank's pieces of each matrix, from `returned`
        (owner by owner), at the rate of the whole matrix's shape."""
        unit = exchange.unit
        rank, start = unit.rank, unit.flat.shard(unit.rank)[0]
        pieces = self._group_pieces(unit)
        at = 0
        for owner in range(exchange.size):
            for m, lo, hi in exchange.pieces(rank, owner):
                if hi == lo:
                    continue
                first, piece = pieces[m.group]
                begin = m.offset + lo - start - first
                segment = piece[begin : begin + hi - lo]
                block: Block | None = self.blocks.get(id(m.param))
                shape = m.param.shape if block is None else block.whole_shape(m.param.shape)
                apply_update(segment, returned[at : at + hi - lo], self.param_groups[m.group],
                             shape)
                at += hi - lo


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device
         ) -> torch.Tensor:
    """`tensors` end to end (an empty message when there are none)."""
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype, device=device)
