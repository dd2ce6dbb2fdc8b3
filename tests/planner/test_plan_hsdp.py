"""Both planners weigh hybrid sharding (HSDP, `[parallel] dp_replicate`): the degrees they
search, the bytes that cross the replicas, when it wins (a slow network and a model whose
ZeRO state fits a machine) and when it does not (a fast network, a model that does not
fit), and the config an HSDP plan writes.

Arithmetic and one small trace (a 4-block GPT on fake tensors): seconds.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from dtrain.cli import main
from dtrain.config import dims_of, load_config
from dtrain.errors import ConfigError
from dtrain.mesh import Dims
from dtrain.models.gpt import GPTConfig
from dtrain.planner import Links, plan, profile_gpt, recommend
from dtrain.planner.analytic.cluster import (
    GRAD,
    evaluate,
    planned_layout,
    replica_seconds,
    replica_traffic,
)
from dtrain.planner.analytic.hardware import Cluster, hardware
from dtrain.planner.analytic.search import best_layout, check_layout, rank
from dtrain.planner.costs import replica_degrees
from dtrain.planner.planned import PlannedLayout
from dtrain.planner.shape import parse_shape
from dtrain.planner.traced.measure import run_config

pytestmark = pytest.mark.timeout(120)

# Llama 3 8B's shape (8.03B parameters): its ZeRO-3 state, 18 bytes a parameter, is 18 GiB
# a GPU over one node of 8, and it trains on 40 GiB A100s in replicas of one node
LLAMA_8B = parse_shape("arch=llama,layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,"
                       "seq=4096,vocab=128256")
# Llama 3 70B's: 18 bytes a parameter over 8 GPUs is 148 GiB, more than a GPU holds
LLAMA_70B = parse_shape("arch=llama,layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,"
                        "seq=4096,vocab=128256")
SLOW, FAST = "3", "25"  # GB/s per GPU between nodes: 25 Gbit/s Ethernet, HDR InfiniBand


def cluster(network: str, nodes: int = 2, gpu: str = "a100-40gb") -> Cluster:
    return Cluster(hardware(gpu, {"inter_gbps": network}), nodes, 8)


def is_hybrid(planned: PlannedLayout) -> bool:
    return planned.dims.dp_replicate > 1


def test_replica_degrees_are_parts_of_a_machine_or_whole_machines() -> None:
    # dp 16 on machines of 8: replicas of 8 (a machine), 4 and 2 (parts of one)
    assert replica_degrees(16, 1, 8) == [2, 4, 8]
    # dp 32: replicas of 16 (two machines) too
    assert replica_degrees(32, 1, 8) == [2, 4, 8, 16]
    # dp 12: replicas of 6 or 3 ranks would straddle a machine's boundary
    assert replica_degrees(12, 1, 8) == [3, 6]
    # tp x cp beside each rank: a replica of 4 dp ranks x tp 2 is a machine
    assert replica_degrees(8, 2, 8) == [2, 4]
    # experts split over ep inside a replica: S a multiple of ep
    assert replica_degrees(16, 1, 8, ep=4) == [2, 4]
    # never S = 1 (DataParallel) nor R = 1 (plain ZeRO)
    assert replica_degrees(2, 1, 8) == [] and replica_degrees(4, 1, 8) == [2]


def test_cross_node_bytes_are_an_all_reduce_of_one_shard() -> None:
    """Replicas of whole nodes send 2(R-1)/R x Ψ/S x 4 bytes (fp32 gradients) per GPU per
    step across the network, nothing of it on NVLink, and that is what it costs."""
    psi = LLAMA_8B.parameters()
    for nodes, replicas in ((2, 2), (4, 4), (4, 2)):
        grid = cluster(SLOW, nodes)
        dims = planned_layout(256, 1, 1, 8 * nodes, zero=3, replicas=replicas).dims
        shard = 8 * nodes // replicas
        nvlink, network = replica_traffic(GRAD, psi, 0, dims, grid)
        expected = 2 * (replicas - 1) / replicas * psi / shard * 4
        assert network == pytest.approx(expected) and nvlink == 0
        hw = grid.hardware
        seconds = hw.inter_latency_us * 1e-6 * 2 + expected / (hw.inter_gbps * 1e9 *
                                                                hw.link_efficiency)
        assert replica_seconds(GRAD, psi, 0, dims, grid) == pytest.approx(seconds)
    # tp splits Ψ first: tp 2 x 4 dp ranks a node, 4 replicas on 4 nodes
    dims = planned_layout(256, 2, 1, 16, zero=1, replicas=4).dims
    _, network = replica_traffic(GRAD, psi / 2, 0, dims, cluster(SLOW, 4))
    assert network == pytest.approx(2 * 3 / 4 * psi / 2 / 4 * 4)
    # without replicas nothing crosses them
    plain = planned_layout(256, 1, 1, 16, zero=3).dims
    assert replica_traffic(GRAD, psi, 0, plain, cluster(SLOW)) == (0.0, 0.0)


def test_memory_is_zeros_over_a_replica() -> None:
    grid = cluster(SLOW)
    whole = evaluate(LLAMA_8B, grid, 256, planned_layout(256, 1, 1, 16, 3, 1, recompute="none"))
    hybrid = evaluate(LLAMA_8B, grid, 256, planned_layout(256, 1, 1, 16, 3, 1,
                                                          recompute="none", replicas=2))
    for part in ("grads", "optimizer"):
        assert hybrid.memory[part] == pytest.approx(2 * whole.memory[part])
    assert hybrid.memory["activations"] == whole.memory["activations"]


def test_cluster_planner_picks_hsdp_over_a_slow_network() -> None:
    """Two nodes of 8 A100s joined at 3 GB/s a GPU: ZeRO-3 over all 16 GPUs sends 4 GB a
    GPU across the network for each micro-batch, HSDP in replicas of one node 4 GB a step;
    HSDP wins, and over ZeRO-3 (and every stage) across both nodes."""
    grid = cluster(SLOW)
    best = rank(LLAMA_8B, grid, 256)[0]
    assert best.fits and best.planned.dims.dp_replicate == 2, best.label
    assert best.planned.dims.dp_shard * best.planned.dims.cp * best.planned.dims.tp == 8
    assert "dp2x" in best.label
    across = best_layout(LLAMA_8B, grid, 256, 1, 1, 16)
    assert across is not None and best.step_s < across.step_s
    hybrid = best_layout(LLAMA_8B, grid, 256, 1, 1, 16, zeros=(3,), replicas=(2,))
    whole = best_layout(LLAMA_8B, grid, 256, 1, 1, 16, zeros=(3,))
    assert hybrid is not None and whole is not None and hybrid.step_s < whole.step_s


def test_cluster_planner_picks_otherwise_on_a_fast_network_or_a_model_too_big() -> None:
    best = rank(LLAMA_8B, cluster(FAST), 256)[0]
    assert best.fits and not is_hybrid(best.planned), best.label
    # 70B's state over one node's 8 GPUs does not fit 80 GiB: no HSDP layout is weighed
    estimates = rank(LLAMA_70B, cluster(SLOW, gpu="a100-80gb"), 64)
    assert estimates[0].fits and not is_hybrid(estimates[0].planned), estimates[0].label
    assert not any(is_hybrid(e.planned) for e in estimates)
    one = evaluate(LLAMA_70B, cluster(SLOW, gpu="a100-80gb"), 64,
                   planned_layout(64, 1, 1, 16, 3, 1, recompute="full", replicas=2))
    assert not one.fits


def test_bad_hybrid_layouts_are_one_line() -> None:
    with pytest.raises(ConfigError, match="does not divide dp=16"):
        planned_layout(256, 1, 1, 16, zero=3, replicas=3)
    with pytest.raises(ConfigError, match="give a ZeRO stage"):
        check_layout(LLAMA_8B, cluster(SLOW), 256, planned_layout(256, 1, 1, 16, 0,
                                                                   replicas=2))


def _config_of(overrides: dict[str, object], world: int, batch: int) -> Dims:
    """The Dims `dtrain train` makes of a plan's `--set` keys on `world` ranks, for Llama 3
    8B (the shape planned)."""
    sets = [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    config = load_config(None, ['model.arch="llama"', 'model.preset="llama-3-8b"', *sets,
                                f"parallel.nproc={world}", f"train.batch_size={batch}"])
    return dims_of(config, world)


def test_an_hsdp_plan_is_a_config_dtrain_accepts(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    main(["plan", "--hardware", "a100-40gb", "--nodes", "2", "--set",
          f"hardware.inter_gbps={SLOW}", "--model-shape",
          "arch=llama,layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=4096,"
          "vocab=128256", "--batch", "256", "--json", str(out)])
    info = json.loads(out.read_text())
    chosen = info["recommended"]
    assert chosen["dp_replicate"] == 2 and chosen["config"]["parallel.dp_replicate"] == 2
    assert chosen["config"]["parallel.dp"] == chosen["dp"] and chosen["zero"] >= 1
    dims = _config_of(chosen["config"], 16, 256)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.cp, dims.pp, dims.zero) == \
        (2, chosen["dp"] // 2, chosen["tp"], chosen["cp"], chosen["pp"], chosen["zero"])
    # every layout's config reproduces its degrees, HSDP or not
    for layout in info["layouts"][:40]:
        got = _config_of(layout["config"], 16, 256)
        assert (got.dp, got.dp_replicate, got.zero) == \
            (layout["dp"], layout["dp_replicate"], layout["zero"])
    # the planner's own runs (dtrain.planner.traced.measure) write dp_replicate too
    layout = Dims(4, zero=3, dp_replicate=2)
    config = run_config(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2,
                                  n_embd=32), layout, 8)
    assert config.parallel.dp_replicate == 2 and dims_of(config, 8) == layout


# -------------------------------------------------------------- the traced planner
CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)
INSIDE = Links.given(100, 5)  # a machine's links
BATCH, DEVICES, FLOPS = 64, 16, 1e12


@functools.cache
def traced(micro_batch: int):
    return profile_gpt(CFG, micro_batch, ("none",))


def traced_plan(links: Links, memory: float = 80e9):
    return plan(traced, DEVICES, memory, BATCH, FLOPS, links, recompute=("none",))


def test_links_cost_what_spans_machines_on_the_network() -> None:
    links = INSIDE.across_machines(8, 1, 20)
    hybrid = Dims(8, zero=3, dp_replicate=2)
    assert not links.crosses("dp", hybrid) and links.crosses("dp_replicate", hybrid)
    assert links.crosses("dp", Dims(16, zero=3)) and not INSIDE.crosses("dp", Dims(16))
    shard = 1e6
    key = "dp_replicate all_reduce"
    assert links.seconds({key: shard}, {key: 1}, hybrid) == \
        pytest.approx(20e-6 + 2 * (2 - 1) / 2 * shard / 1e9)
    with pytest.raises(ConfigError, match="positive number of ranks"):
        INSIDE.across_machines(0, 1, 20)


def test_traced_plan_counts_one_shard_across_replicas() -> None:
    estimates = traced_plan(INSIDE.across_machines(8, 1, 20))
    hybrid = next(e for e in estimates if e.label == "dp2x8 zero2")
    whole = next(e for e in estimates if e.label == "dp16 zero2")
    shard = hybrid.traffic["dp_replicate all_reduce"]
    assert shard == pytest.approx(hybrid.traffic["dp reduce_scatter"] / 8)
    assert hybrid.traffic["dp reduce_scatter"] == whole.traffic["dp reduce_scatter"]
    assert hybrid.optimizer == pytest.approx(2 * whole.optimizer)
    assert hybrid.to_dict()["config"]["parallel.dp_replicate"] == 2


def test_traced_planner_picks_hsdp_where_the_network_says_so() -> None:
    # two machines of 8 joined at 1 GB/s a rank: one shard's all-reduce beats ZeRO's and
    # DataParallel's traffic across them
    best, why = recommend(traced_plan(INSIDE.across_machines(8, 1, 20)))
    assert best is not None and best.dims.dp_replicate == 2 and best.dims.dp_shard == 8, why
    # as fast between machines as inside one: the extra all-reduce buys nothing
    best, why = recommend(traced_plan(INSIDE.across_machines(8, 100, 5)))
    assert best is not None and best.dims.dp_replicate == 1, why
    # memory below every HSDP layout's: none fits, another is picked
    estimates = traced_plan(INSIDE.across_machines(8, 1, 20))
    least = min(e.total for e in estimates if e.dims.dp_replicate > 1)
    estimates = traced_plan(INSIDE.across_machines(8, 1, 20), memory=least * 0.99)
    best, why = recommend(estimates)
    assert best is not None and best.dims.dp_replicate == 1, why
    assert not any(e.fits for e in estimates if e.dims.dp_replicate > 1)


def test_dtrain_plan_takes_machines_and_an_hsdp_layout(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """`dtrain plan --ranks-per-machine 8 --network 1` (the traced planner told of two
    machines of 8 joined at 1 GB/s) recommends HSDP across them; the two flags alone are
    one line; `--hardware --layout ...,dp_replicate=2` evaluates that hybrid layout."""
    out = tmp_path / "plan.json"
    model = ["--layers", "4", "--heads", "4", "--embd", "256", "--vocab", "256", "--block",
             "64"]
    assert main(["plan", "-n", "16", "--batch", "64", "--memory", "80GB", "--tflops", "1",
                 "--bandwidth", "100", "--latency", "5", "--recompute", "none", *model,
                 "--ranks-per-machine", "8", "--network", "1", "--network-latency", "20",
                 "--json", str(out)]) == 0
    chosen = json.loads(out.read_text())["recommended"]
    assert chosen["config"]["parallel.dp_replicate"] == 2, chosen
    assert main(["plan", "-n", "16", *model, "--ranks-per-machine", "8"]) == 2
    assert "--ranks-per-machine and --network go together" in capsys.readouterr().err
    assert main(["plan", "--hardware", "a100-40gb", "--nodes", "2", "--set",
                 f"hardware.inter_gbps={SLOW}", "--model-shape",
                 "arch=llama,layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=4096,"
                 "vocab=128256", "--batch", "256", "--layout",
                 "tp=1,pp=1,dp=16,dp_replicate=2", "--json", str(out)]) == 0
    layouts = json.loads(out.read_text())["layouts"]
    assert [(x["dp"], x["dp_replicate"]) for x in layouts] == [(16, 2)]
