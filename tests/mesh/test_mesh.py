"""The Mesh: where each rank sits on the named axes, and the group of any axes by name.

Expectations are written independently of the mesh's arithmetic: by hand, or by reading
each axis of degree 2 as one bit of the rank (tp the lowest bit, then cp, dp_shard,
dp_replicate, pp, sync), so that the group of a rank over some axes is every rank that agrees with
it on the bits of the other axes. The expert axes read the same way on their own order,
ep's bits the lowest of dp_shard x cp x tp's (ep folded over them, innermost first).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import dtrain
from dtrain.errors import ConfigError, DtrainError
from dtrain.mesh import AXES, Dims
from dtrain.mesh.config import ParallelConfig
from dtrain.testing import run_ranks

ORDER = ("sync", "pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first, as documented
FLAT = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
        "edp_cp": ("dp_replicate", "edp")}  # the flattened names, as documented
NAMES = (*ORDER, "dp", "dp_cp")


EXPERT_ORDER = ("sync", "pp", "dp_replicate", "edp", "ep")  # dp_shard x cp x tp = (edp, ep)
FOLDED = ("dp_shard", "cp", "tp")


def _bits(degrees: dict[str, int], order: tuple[str, ...] = ORDER) -> dict[str, int]:
    """The bit of each axis of degree 2 (the innermost the lowest); the others have none."""
    halved = [a for a in reversed(order) if degrees.get(a, 1) == 2]
    assert all(degrees.get(a, 1) in (1, 2) for a in order)
    return {axis: 1 << i for i, axis in enumerate(halved)}


def _expected(degrees: dict[str, int], rank: int, names: tuple[str, ...],
              order: tuple[str, ...] = ORDER) -> list[int]:
    """The ranks of `rank`'s group over `names`, by the bits: agree on every other axis
    (a flattened name stands for its axes; on the expert axes' order, dp_shard is edp and
    ep together)."""
    axes = {a for n in names for a in FLAT.get(n, (n,))} if names else set(order)
    if order == EXPERT_ORDER and axes & set(FOLDED):  # all of them asked, of degree 2
        axes |= {"edp", "ep"}
    if order == ORDER and "edp" in axes:  # without ep, edp is all of dp_shard
        axes = (axes - {"edp"}) | {"dp_shard"}
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


def test_every_axis_and_combination_on_a_grid_of_64() -> None:
    """Every axis of degree 2 (64 ranks): each rank's coordinates, and its group over each
    combination of axes and flattened names, against the bits."""
    degrees = dict.fromkeys(ORDER, 2)
    dims = Dims.fit(64, **{**degrees, "dp_shard": None})
    grid = dims.grid
    assert grid.shape == degrees and grid.world_size == 64 == dims.world_size
    for rank in range(64):
        assert grid.coords(rank) == _coords(degrees, rank)
        assert grid.rank_of(grid.coords(rank)) == rank
        for axes in (s for s in _subsets() if s):
            assert dims.ranks(rank, *axes) == _expected(degrees, rank, axes), (rank, axes)
            assert dims.size(*axes) == len(_expected(degrees, rank, axes))


def test_placement_is_tp_innermost_then_dp_then_pp() -> None:
    """The (pp, dp, tp) placement dtrain has always had: rank = pp*(dp*tp) + dp*tp + tp."""
    grid = Dims(2, tp=2, pp=2).grid

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


def test_sync_groups_are_outermost_blocks_of_consecutive_ranks() -> None:
    """sync=2 over dp=2 x tp=2: sync group s is ranks 4s..4s+3, each laid out alike."""
    dims = Dims.fit(8, sync=2, tp=2)
    assert [dims.coords(r)["sync"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.ranks(6, "pp", "dp", "cp", "tp") == [4, 5, 6, 7]
    assert dims.ranks(6, "sync") == [2, 6]
    assert dims.ranks(6, "dp_shard") == dims.ranks(6, "dp") == [4, 6]
    assert dims.ranks(6, "tp") == [6, 7]


def test_dp_replicate_and_dp_shard_make_the_data_parallel_world() -> None:
    """dp_replicate x dp_shard is the data-parallel world (torchtitan's meaning): "dp" spans
    both, every step; "dp_cp" adds cp; the sync groups stay outside both."""
    dims = Dims.fit(16, dp_replicate=2, dp_shard=2, cp=2, sync=2)
    assert dims.dp == 4 and dims.batch_shards == 8
    assert dims.ranks(5, "dp") == [1, 3, 5, 7]
    assert dims.ranks(5, "dp_cp") == [0, 1, 2, 3, 4, 5, 6, 7]
    assert dims.coords(5)["dp"] == 2 and dims.coords(5)["dp_cp"] == 5


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dp": 3, "tp": 2}, "dp_shard\\*tp = 3\\*2 = 6 but the world has 8 ranks: make the "
                         "product equal 8 \\(or leave one unset to infer it\\)"),
    ({"tp": 3}, "tp = 3 does not divide the world size 8: choose degrees whose product "
                "divides 8 \\(dp_shard is inferred\\)"),
    ({"dp_replicate": 3}, "dp_replicate = 3 does not divide the world size 8"),
    ({"sync": 3}, "sync = 3 does not divide the world size 8"),
    ({"pp": 2, "cp": 2, "tp": 4}, "pp\\*cp\\*tp = 2\\*2\\*4 = 16 does not divide the world "
                                  "size 8"),
    ({"cp": 0}, "mesh degree cp=0 must be a positive integer"),
    ({"tp": 2.0}, "mesh degree tp=2.0 must be a positive integer"),
    ({"tp": None}, "mesh degrees dp_shard, tp are unset: give all but one"),
    ({"dp": 2, "dp_shard": 4}, "dp is dp_shard's other name; give one of the two"),
    ({"dp": 8, "ep": 3}, "ep = 3 does not divide the ranks it is folded over \\(dp_shard x "
                         "cp x tp = 8 x 1 x 1 = 8\\): choose an ep that divides 8"),
    ({"dp": 4, "tp": 2, "ep": 16}, "ep = 16 does not divide the ranks it is folded over "
                                  "\\(dp_shard x cp x tp = 4 x 1 x 2 = 8\\)"),
    ({"dp": 8, "ep": 0}, "mesh degree ep=0 must be a positive integer"),
])
def test_bad_degrees_are_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        dtrain.Mesh(**kwargs, world=dtrain.World(rank=0, world_size=8))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(("dims", "message"), [
    ({"zero": 4}, "zero=4: use one of 0, 1, 2, 3"),
    ({"schedule": "zb"}, "schedule='zb': use one of gpipe, 1f1b, interleaved"),
    ({"cp_method": "x"}, "cp_method='x': use one of ring, allgather, alltoall"),
    ({"exchange": "p2p"}, "exchange='p2p': use one of collective, ps"),
    ({"microbatches": 0}, "mesh degree microbatches=0 must be a positive integer"),
    ({"sequence_parallel": True}, "sequence_parallel needs tp > 1"),
    ({"exchange": "ps", "tp": 2}, "exchange = \"ps\" trains whole copies of the model .* "
                                  "set tp = 2 back to the default"),
    ({"exchange": "ps", "zero": 1}, "set zero = 1 back to the default"),
])
def test_every_bad_option_is_refused_by_the_dims_in_one_line(dims: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        Dims(**dims)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(("parallel", "world", "sync", "message"), [
    ({"pp": 3}, 2, None, "tp\\*pp = 1\\*3 = 3 does not divide the world size 2"),
    ({"dp": 3, "tp": 2}, 8, None, "dp\\*tp\\*pp = 3\\*2\\*1 = 6 but the world has 8 ranks"),
    ({"cp": 3}, 8, None, "cp\\*tp\\*pp = 3\\*1\\*1 = 3 does not divide the world size 8"),
    ({"ep": 4, "dp": 2}, 2, None, "parallel.ep = 4 does not divide the ranks it is folded "
                                  "over \\(dp x cp x tp = 2 x 1 x 1 = 2\\)"),
    ({"ep": 3, "tp": 2, "dp_replicate": 2, "zero": 1}, 8, None,
     "parallel.ep = 3 does not divide the ranks it is folded over \\(dp x cp x tp = 2 x 1 x "
     "2 = 4 in each of parallel.dp_replicate = 2 replicas\\): choose an ep that divides 4"),
    ({"sequence_parallel": True}, 2, None, "parallel.sequence_parallel needs parallel.tp > 1"),
    ({"exchange": "ps", "tp": 2}, 2, None,
     "parallel.exchange = \"ps\" .* set parallel.tp = 2 back"),
    ({}, 4, 3, "sync.groups = 3 does not divide 4 ranks into sync groups"),
])
def test_a_configs_degrees_are_refused_in_its_keys_words(parallel: dict, world: int,
                                                         sync: int | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        Dims.of(ParallelConfig(**parallel), world, sync)
    assert "\n" not in str(raised.value)


def test_a_configs_sync_groups_count_context_parallel_ranks() -> None:
    """`[sync] groups = 0` leaves each sync group dp x cp x tp x pp ranks: cp counts (with
    cp=2 on 4 ranks, 2 groups of 2, not 4 groups of one rank each)."""
    dims = Dims.of(ParallelConfig(cp=2), 4, 0)
    assert (dims.sync, dims.cp, dims.dp) == (2, 2, 1)
    assert Dims.of(ParallelConfig(tp=2, dp=2), 8, 0).sync == 2


def test_dims_survive_plain_values_and_read_older_checkpoints() -> None:
    dims = Dims(2, tp=2, zero=1, cp=2, cp_method="alltoall", sync=2)
    assert Dims.from_dict(dims.to_dict()) == dims
    assert Dims.from_dict({"dp": 4, "tp": 2, "mode": "collective"}) == Dims(4, 2)
    with pytest.raises(ValueError, match="world_size"):
        Dims.from_dict({**dims.to_dict(), "world_size": 3})


def test_one_process_mesh_names_its_axes_and_lets_go_at_shutdown() -> None:
    dtrain.init()
    try:
        mesh = dtrain.Mesh()
        assert mesh.size() == mesh.size("dp") == mesh.size("dp", "cp", "tp") == 1
        assert mesh.coords == {**dict.fromkeys(ORDER, 0), "dp": 0, "ep": 0, "edp": 0,
                               "dp_cp": 0, "edp_cp": 0}
        assert mesh.place("dp_cp") == (0, 1)
        assert mesh.group("dp_shard", "cp") is mesh.group("tp")  # the same ranks: one group
        for call in (mesh.group, mesh.size, mesh.ranks):
            with pytest.raises(ConfigError, match="unknown mesh axis 'xp': use one of "
                                                  "sync, pp, dp_replicate, dp_shard, cp, tp, "
                                                  "edp, ep, dp, dp_cp, edp_cp") as e:
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
    experts = [("ep",), ("edp",), ("ep", "pp"), ("edp", "pp"), ("edp_cp",),
               ("ep", "dp", "cp", "tp")] if "ep" in degrees else []
    for names in [*_subsets(), *experts]:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.group(*names))
        out["groups"][names] = (mesh.ranks(*names), mesh.size(*names), t.item(),
                                mesh.ranks(*reversed(names)))
    return out


@pytest.mark.parametrize("degrees", [
    {"pp": 2, "dp": 2, "tp": 2},  # today's layouts
    {"sync": 2, "dp_replicate": 2, "cp": 2},  # sync groups, each data and context parallel
    {"pp": 2, "dp_replicate": 2, "dp": 2, "ep": 2},  # experts over dp_shard, two replicas
    {"sync": 2, "dp": 2, "cp": 2, "ep": 2},  # ep folded over cp
    {"pp": 2, "dp": 2, "tp": 2, "ep": 2},  # ep folded over tp
], ids=["pp-dp-tp", "sync-dp-cp", "pp-hsdp-ep", "dp-cp-ep", "dp-tp-ep"])
def test_group_of_every_combination_holds_its_ranks(degrees: dict[str, int]) -> None:
    results = run_ranks(_every_group, 8, degrees)
    full = {"dp_shard" if a == "dp" else a: n for a, n in degrees.items()}
    ep = full.pop("ep", 1)
    folded = full.get("dp_shard", 1) * full.get("cp", 1) * full.get("tp", 1)
    replicas = full.get("dp_replicate", 1)
    experts = {**{a: full.get(a, 1) for a in EXPERT_ORDER[:3]}, "edp": folded // ep, "ep": ep}
    for rank, result in enumerate(results):
        # ep the innermost of the folded block's ranks, edp the rest; edp_cp adds replicas
        inner = rank % folded
        want = {**_coords(full, rank), "ep": inner % ep, "edp": inner // ep,
                "edp_cp": (rank // folded) % replicas * (folded // ep) + inner // ep}
        for name in ("dp", "dp_cp"):  # a rank's place in its group
            want[name] = _expected(full, rank, (name,)).index(rank)
        assert result["coords"] == want
        for names, (ranks, size, total, reversed_ranks) in result["groups"].items():
            if {"ep", "edp", "edp_cp"} & set(names):
                expected = _expected(experts, rank, names, EXPERT_ORDER)
            else:
                expected = _expected(full, rank, names)
            assert (ranks, size, total) == (expected, len(expected), float(sum(expected))), \
                (rank, names)
            assert reversed_ranks == expected


def test_ep_is_folded_over_the_innermost_ranks_first() -> None:
    """ep over dp_shard x cp x tp (2 x 2 x 2): ep consecutive ranks, tp's first, then cp's,
    then dp's; edp the ranks at the same place in the other ep groups; the expert axes with
    some but not all of the axes they are folded over have no one grid and are refused."""
    for ep, groups, same in (
            (2, [[0, 1], [2, 3], [4, 5], [6, 7]], [0, 2, 4, 6]),  # ep = tp
            (4, [[0, 1, 2, 3], [4, 5, 6, 7]], [0, 4]),  # ep = tp x cp
            (8, [list(range(8))], [0])):  # ep over every rank
        dims = Dims.fit(8, dp_shard=2, cp=2, tp=2, ep=ep)
        assert dims.edp == 8 // ep
        assert sorted({tuple(dims.ranks(r, "ep")) for r in range(8)}) == \
            [tuple(g) for g in groups]
        assert dims.ranks(0, "edp") == dims.ranks(0, "edp_cp") == same
        assert [dims.coords(r)["ep"] for r in range(8)] == [r % ep for r in range(8)]
    dims = Dims.fit(16, dp_shard=2, tp=2, ep=2, dp_replicate=2, pp=2)
    assert dims.ranks(5, "edp") == [5, 7] and dims.ranks(5, "edp_cp") == [1, 3, 5, 7]
    assert dims.ranks(5, "ep", "dp_shard", "cp", "tp") == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match="mesh axes ep, tp: ep and edp are laid over "
                                          "dp_shard x cp x tp together; ask for them with all "
                                          "of dp_shard, tp or none") as raised:
        dims.ranks(0, "ep", "tp")
    assert "\n" not in str(raised.value)


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


def _sync_group_sums() -> dict:
    mesh = dtrain.Mesh(tp=2, sync=2)
    out = {"group": mesh.coords["sync"],
           "ranks": {a: mesh.ranks(a) for a in ("dp", "tp", "pp")}}
    for name, group in (("tp", mesh.group("tp")), ("dp", mesh.group("dp")),
                        ("block", mesh.group("pp", "dp", "cp", "tp")),
                        ("across", mesh.group("sync"))):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=group)
        out[name] = t.item()
    return out


@pytest.mark.slow
def test_mesh_of_sync_groups_lays_out_each_alike() -> None:
    """Two sync groups of tp=2 (ranks 0-1, 2-3): the other axes stay inside a group,
    `group("sync")` joins the same places of both."""
    results = run_ranks(_sync_group_sums, 4)
    assert [r["group"] for r in results] == [0, 0, 1, 1]
    assert [r["tp"] for r in results] == [1, 1, 5, 5]
    assert [r["dp"] for r in results] == [0, 1, 2, 3]
    assert [r["block"] for r in results] == [1, 1, 5, 5]
    assert [r["across"] for r in results] == [2, 4, 2, 4]
    assert results[3]["ranks"]["tp"] == [2, 3]
    with pytest.raises(ConfigError, match="sync = 3 does not divide the world size 1"):
        dtrain.Mesh(sync=3, world=dtrain.World(rank=0, world_size=1))
