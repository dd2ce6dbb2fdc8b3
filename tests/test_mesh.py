"""The Mesh: where each rank sits on the named axes, and the group of any axes by name.

Expectations are written independently of the mesh's arithmetic: by hand, or by reading
each axis of degree 2 as one bit of the rank (tp the lowest bit, then cp, dp_shard, pp,
dp_replicate), so that the group of a rank over some axes is every rank that agrees with
it on the bits of the other axes.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import dtrain
from dtrain.errors import ConfigError, DtrainError
from dtrain.mesh import AXES, fit
from tests.distributed import run_ranks

ORDER = ("dp_replicate", "pp", "dp_shard", "cp", "tp")  # outermost first, as documented
NAMES = (*ORDER, "dp")  # "dp" is dp_shard's other name


EXPERT_ORDER = ("dp_replicate", "pp", "edp", "ep", "cp", "tp")  # dp_shard = (edp, ep)


def _bits(degrees: dict[str, int], order: tuple[str, ...] = ORDER) -> dict[str, int]:
    """The bit of each axis of degree 2 (the innermost the lowest); the others have none."""
    halved = [a for a in reversed(order) if degrees.get(a, 1) == 2]
    assert all(degrees.get(a, 1) in (1, 2) for a in order)
    return {axis: 1 << i for i, axis in enumerate(halved)}


def _expected(degrees: dict[str, int], rank: int, names: tuple[str, ...],
              order: tuple[str, ...] = ORDER) -> list[int]:
    """The ranks of `rank`'s group over `names`, by the bits: agree on every other axis
    (on the expert axes' order, dp_shard is edp and ep together)."""
    axes = {"dp_shard" if n == "dp" else n for n in names} if names else set(order)
    if order == EXPERT_ORDER and "dp_shard" in axes:
        axes |= {"edp", "ep"}
    bits = _bits(degrees, order)
    world = 1 << len(bits)
    others = sum(bit for axis, bit in bits.items() if axis not in axes)
    return [q for q in range(world) if q & others == rank & others]


def _coords(degrees: dict[str, int], rank: int) -> dict[str, int]:
    bits = _bits(degrees)
    return {axis: int(bool(rank & bits[axis])) if axis in bits else 0 for axis in ORDER}


def _subsets() -> list[tuple[str, ...]]:
    return [s for n in range(len(NAMES) + 1) for s in itertools.combinations(NAMES, n)]


def test_axes_are_named_outermost_first() -> None:
    assert AXES == ORDER


def test_every_axis_and_combination_on_a_grid_of_32() -> None:
    """Every axis of degree 2 (32 ranks): each rank's coordinates, and its group over each
    of the 31 combinations of axes, against the bits."""
    degrees = dict.fromkeys(ORDER, 2)
    grid = fit(32, {**degrees, "dp_shard": None})
    assert grid.shape == degrees and grid.world_size == 32
    for rank in range(32):
        assert grid.coords(rank) == _coords(degrees, rank)
        assert grid.rank_of(grid.coords(rank)) == rank
        for axes in (s for s in _subsets() if s and "dp" not in s):
            assert grid.ranks(rank, [a for a in ORDER if a in axes]) == \
                _expected(degrees, rank, axes), (rank, axes)
            assert grid.size(axes) == 2 ** len(axes)


def test_placement_is_tp_innermost_then_dp_then_pp() -> None:
    """Today's (pp, dp, tp) placement, unchanged: rank = pp*(dp*tp) + dp*tp + tp."""
    grid = fit(8, {"dp_replicate": 1, "pp": 2, "dp_shard": 2, "cp": 1, "tp": 2})

    def old(coords: dict[str, int]) -> dict[str, int]:
        return {"tp": coords["tp"], "dp": coords["dp_shard"], "pp": coords["pp"]}

    assert old(grid.coords(0)) == {"tp": 0, "dp": 0, "pp": 0}
    assert old(grid.coords(1)) == {"tp": 1, "dp": 0, "pp": 0}
    assert old(grid.coords(2)) == {"tp": 0, "dp": 1, "pp": 0}
    assert old(grid.coords(5)) == {"tp": 1, "dp": 0, "pp": 1}

    def groups(axis: str) -> list[tuple[int, ...]]:
        return sorted({tuple(grid.ranks(r, [axis])) for r in range(8)})

    assert groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert groups("dp_shard") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    for rank in range(8):
        assert grid.rank_of(grid.coords(rank)) == rank
        c = grid.coords(rank)
        assert rank == c["pp"] * (2 * 2) + c["dp_shard"] * 2 + c["tp"]


def test_replicas_are_outermost_blocks_of_consecutive_ranks() -> None:
    """dp_replicate=2 over dp=2 x tp=2: replica r is ranks 4r..4r+3, each laid out alike."""
    grid = fit(8, {"dp_replicate": 2, "pp": 1, "dp_shard": None, "cp": 1, "tp": 2})
    assert [grid.coords(r)["dp_replicate"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert grid.ranks(6, ["pp", "dp_shard", "cp", "tp"]) == [4, 5, 6, 7]
    assert grid.ranks(6, ["dp_replicate"]) == [2, 6]
    assert grid.ranks(6, ["dp_shard"]) == [4, 6]
    assert grid.ranks(6, ["tp"]) == [6, 7]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dp": 3, "tp": 2}, "dp_shard\\*tp = 3\\*2 = 6 but the world has 8 ranks: make the "
                         "product of the degrees equal 8"),
    ({"tp": 3}, "tp = 3 does not divide the world size 8: choose degrees whose product "
                "divides 8 \\(dp_shard is inferred\\)"),
    ({"dp_replicate": 3}, "dp_replicate = 3 does not divide the world size 8"),
    ({"pp": 2, "cp": 2, "tp": 4}, "pp\\*cp\\*tp = 2\\*2\\*4 = 16 does not divide the world "
                                  "size 8"),
    ({"cp": 0}, "mesh degree cp=0 must be a positive integer"),
    ({"tp": 2.0}, "mesh degree tp=2.0 must be a positive integer"),
    ({"tp": None}, "mesh degrees dp_shard, tp are unset: give all but one"),
    ({"dp": 2, "dp_shard": 4}, "dp is dp_shard's other name; give one of the two"),
    ({"dp": 8, "ep": 3}, r"ep=3 must be a positive integer that divides dp_shard=8"),
])
def test_bad_degrees_are_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        dtrain.Mesh(**kwargs, world=dtrain.World(rank=0, world_size=8))
    assert "\n" not in str(raised.value)


def test_one_process_mesh_names_its_axes_and_lets_go_at_shutdown() -> None:
    dtrain.init()
    try:
        mesh = dtrain.Mesh()
        assert mesh.size() == mesh.size("dp") == mesh.size("dp", "cp", "tp") == 1
        assert mesh.coords == {**dict.fromkeys(ORDER, 0), "dp": 0, "ep": 0, "edp": 0}
        assert mesh.group("dp_shard", "cp") is mesh.group("tp")  # the same ranks: one group
        for call in (mesh.group, mesh.size, mesh.ranks):
            with pytest.raises(ConfigError, match="unknown mesh axis 'xp': use one of "
                                                  "dp_replicate, pp, dp_shard, cp, tp, edp, "
                                                  "ep") as e:
                call("dp", "xp")
            assert "\n" not in str(e.value)
    finally:
        dtrain.shutdown()
    with pytest.raises(DtrainError, match="destroyed by dtrain.shutdown"):
        mesh.group("dp")


def _every_group(degrees: dict[str, int]) -> dict:
    """Each combination of names: this rank's ranks(), size(), and the sum of the ranks
    over group() (so the group holds exactly those members)."""
    mesh = dtrain.Mesh(**degrees)
    out = {"coords": dict(mesh.coords), "groups": {}}
    experts = [("ep",), ("edp",), ("ep", "tp"), ("edp", "pp")] if "ep" in degrees else []
    for names in [*_subsets(), *experts]:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.group(*names))
        out["groups"][names] = (mesh.ranks(*names), mesh.size(*names), t.item(),
                                mesh.ranks(*reversed(names)))
    return out


@pytest.mark.parametrize("degrees", [
    {"pp": 2, "dp": 2, "tp": 2},  # today's layouts
    {"dp_replicate": 2, "dp_shard": 2, "cp": 2},  # replicas, each data and context parallel
    {"pp": 2, "dp": 4, "ep": 2},  # experts split over pairs of data-parallel ranks
    {"dp": 2, "cp": 2, "ep": 2, "tp": 2},  # ep at each cp coordinate
], ids=["pp-dp-tp", "replicas-dp-cp", "pp-dp-ep", "dp-cp-ep-tp"])
def test_group_of_every_combination_holds_its_ranks(degrees: dict[str, int]) -> None:
    results = run_ranks(_every_group, 8, degrees)
    full = {"dp_shard" if a == "dp" else a: n for a, n in degrees.items()}
    order = ORDER
    if "ep" in full:  # the ranks on the expert axes: dp_shard factored into (edp, ep)
        ep = full.pop("ep")
        full = {**full, "edp": full.pop("dp_shard") // ep, "ep": ep}
        order = EXPERT_ORDER
    for rank, result in enumerate(results):
        coords = {a: int(bool(rank & bit)) for a, bit in _bits(full, order).items()}
        if order == EXPERT_ORDER:
            d = coords.get("edp", 0) * full["ep"] + coords.get("ep", 0)
            want = {**{a: coords.get(a, 0) for a in ORDER if a != "dp_shard"},
                    "dp_shard": d, "dp": d, "ep": coords.get("ep", 0),
                    "edp": coords.get("edp", 0)}
        else:
            want = {**_coords(full, rank), "dp": _coords(full, rank)["dp_shard"], "ep": 0,
                    "edp": _coords(full, rank)["dp_shard"]}
        assert result["coords"] == want
        for names, (ranks, size, total, reversed_ranks) in result["groups"].items():
            expected = _expected(full, rank, names, order)
            assert (ranks, size, total) == (expected, len(expected), float(sum(expected))), \
                (rank, names)
            assert reversed_ranks == expected


def _mesh_sums() -> dict:
    mesh = dtrain.Mesh(tp=2)
    out = {"coords": mesh.coords, "ranks": {a: mesh.ranks(a) for a in ("dp", "tp", "pp")}}
    for axis in ("dp", "tp", "pp"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.group(axis))
        out[axis] = t.item()
    return out


def test_mesh_groups_reduce_only_within_themselves() -> None:
    results = run_ranks(_mesh_sums, 4)
    # tp groups {0,1},{2,3}; dp groups {0,2},{1,3}; pp groups are single ranks.
    assert [r["tp"] for r in results] == [1, 1, 5, 5]
    assert [r["dp"] for r in results] == [2, 4, 2, 4]
    assert [r["pp"] for r in results] == [0, 1, 2, 3]
    assert {a: results[3]["coords"][a] for a in ("tp", "dp", "pp")} == \
        {"tp": 1, "dp": 1, "pp": 0}
    assert results[2]["ranks"]["dp"] == [0, 2]


def _replica_sums() -> dict:
    mesh = dtrain.Mesh(tp=2, dp_replicate=2)
    out = {"replica": mesh.coords["dp_replicate"],
           "ranks": {a: mesh.ranks(a) for a in ("dp", "tp", "pp")}}
    for name, group in (("tp", mesh.group("tp")), ("dp", mesh.group("dp")),
                        ("block", mesh.group("pp", "dp", "cp", "tp")),
                        ("across", mesh.group("dp_replicate"))):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=group)
        out[name] = t.item()
    return out


@pytest.mark.slow
def test_mesh_of_replicas_lays_out_each_alike() -> None:
    """Two replicas of tp=2 (ranks 0-1, 2-3): the other axes stay inside a replica,
    `group("dp_replicate")` joins the same places of both."""
    results = run_ranks(_replica_sums, 4)
    assert [r["replica"] for r in results] == [0, 0, 1, 1]
    assert [r["tp"] for r in results] == [1, 1, 5, 5]
    assert [r["dp"] for r in results] == [0, 1, 2, 3]
    assert [r["block"] for r in results] == [1, 1, 5, 5]
    assert [r["across"] for r in results] == [2, 4, 2, 4]
    assert results[3]["ranks"]["tp"] == [2, 3]
    with pytest.raises(ConfigError, match="dp_replicate = 3 does not divide the world size 1"):
        dtrain.Mesh(dp_replicate=3, world=dtrain.World(rank=0, world_size=1))
