"""dtrain plan: the planner's arithmetic by hand, its memory against measured peaks of real
runs of every strategy, and the command's output."""

from __future__ import annotations

import json

import pytest
import torch

from dtrain.models import ModelConfig, build, resolve
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.planner import (
    Layout,
    Links,
    bubble,
    estimate,
    layouts,
    plan,
    profile_gpt,
    profile_model,
)
from dtrain.planner.estimate import in_flight, stage_blocks
from dtrain.planner.measure import measured_peak
from tests.cli import dtrain, one_error_line
from tests.distributed import run_ranks

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)
BLOCK = 128 + (64 * 192 + 192) + (64 * 64 + 64) + 128 + (64 * 256 + 256) + (256 * 64 + 64)
EMBED = 256 * 64 + 64 * 64  # wte (the head's weight too) and wpe
PSI = EMBED + 4 * BLOCK + 128  # and ln_f
FREE = Links.given(1e9, 0)  # links that cost nothing
LLAMA = ModelConfig(arch="llama", vocab_size=256, block_size=64, n_layer=4, n_head=4,
                    n_kv_head=2, n_embd=64, ffn_hidden=128, tie_embeddings=False)


@pytest.fixture(scope="module")
def profile():
    return profile_gpt(CFG, 4)


def test_parameters_and_their_tensor_parallel_split(profile):
    assert profile.params.total == PSI == sum(p.numel() for p in GPT(CFG).parameters())
    # tp splits qkv and fc (weights and biases) and both projections' weights; the norms
    # and the row-parallel biases stay whole, as does wpe; wte is split by vocabulary.
    assert profile.params_block.whole == 128 + 128 + 64 + 64
    assert profile.params_block.split == BLOCK - 384
    assert profile.params_embed.split == 256 * 64


@pytest.mark.parametrize("zero, params, grads, state", [
    (0, 4 * PSI, 4 * PSI, 8 * PSI),
    (1, 4 * PSI, 4 * PSI + PSI, 2 * PSI),
    (2, 4 * PSI, PSI, 2 * PSI),
    (3, PSI + 4 * (EMBED + 128) + 2 * 4 * BLOCK, PSI, 2 * PSI),
])
def test_zero_state_per_rank(profile, zero, params, grads, state):
    e = estimate(profile, Layout(dp=4, zero=zero), 1e12, 1e12, FREE)
    assert (e.params, e.grads, e.optimizer) == pytest.approx((params, grads, state))


def test_pipeline_split_bubble_and_in_flight(profile):
    assert stage_blocks(profile, 2) == [[2], [2]]
    busiest = estimate(profile, Layout(dp=1, pp=2, microbatches=4), 1e12, 1e12, FREE)
    # the first stage: two blocks and both embeddings (more than the last stage's two
    # blocks, ln_f and its copy of the tied embedding)
    assert busiest.params == pytest.approx(4 * (2 * BLOCK + EMBED))
    assert bubble(4, 8) == pytest.approx(3 / 11)
    assert bubble(4, 8, chunks=2) == pytest.approx(3 / 19)
    one = [1.0]
    assert in_flight(Layout(1, pp=4, microbatches=8), 0, one) == 4  # 1F1B: p - rank
    assert in_flight(Layout(1, pp=4, microbatches=8), 3, one) == 1
    assert in_flight(Layout(1, pp=4, microbatches=8, schedule="gpipe"), 3, one) == 8


def test_traffic_per_step(profile):
    dp = estimate(profile, Layout(dp=4), 1e12, 1e12, FREE)
    assert dp.traffic == {"dp all_reduce": 4 * PSI}
    tp = estimate(profile, Layout(dp=1, tp=2), 1e12, 1e12, FREE)
    activation = 4 * 64 * 64 * 4  # one micro-batch's (b, s, width) in fp32
    assert tp.traffic == {"tp all_reduce": (4 * 4 + 2) * activation}
    z3 = estimate(profile, Layout(dp=2, zero=3), 1e12, 1e12, FREE)
    assert z3.traffic == {"dp reduce_scatter": 4 * PSI, "dp all_gather": 2 * 4 * PSI}


def test_layouts_and_recommendation(profile):
    found = {str(layout) for layout in layouts(profile, 4, batch=16)}
    assert {"dp4", "dp4 zero3", "tp4", "dp2 x tp2", "pp4 (1f1b, m=4)"} <= found
    assert not any("tp" in s for s in {str(x) for x in layouts(profile_gpt(
        GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=1, n_embd=64), 4), 4, 16)})
    estimates = plan(lambda b: profile_gpt(CFG, b), 4, 4 * 2**20, 16, 1e10, FREE)
    assert all(e.fits == (e.total <= 4 * 2**20) for e in estimates)
    assert estimates[0].fits and not estimates[-1].fits


STRATEGIES = [Layout(2), Layout(2, zero=1), Layout(2, zero=2), Layout(2, zero=3),
              Layout(1, tp=2), Layout(1, pp=2, microbatches=4)]


def _peaks(cfg: GPTConfig | ModelConfig, batch: int) -> list[int]:
    return [measured_peak(cfg, layout, batch, steps=2) for layout in STRATEGIES]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_memory_matches_measured_peaks_within_15_percent(model: str):
    """Planned against measured peaks of real runs, for dtrain's GPT and Llama."""
    cfg, profile_of = (CFG, profile_gpt) if model == "gpt" else (LLAMA, profile_model)
    batch = 8
    measured = run_ranks(_peaks, 2, cfg, batch, timeout=200)
    for i, layout in enumerate(STRATEGIES):
        micro = batch // (layout.dp * layout.microbatches)
        planned = estimate(profile_of(cfg, micro), layout, 1e12, 1e12, FREE).total
        peak = max(rank[i] for rank in measured)
        assert abs(planned / peak - 1) <= 0.15, f"{layout}: planned {planned}, measured {peak}"


@pytest.mark.timeout(120)
def test_plan_command_json_and_table(tmp_path):
    out = tmp_path / "plan.json"
    result = dtrain("plan", "-n", "4", "--layers", "4", "--embd", "64", "--block", "64",
                    "--batch", "16", "--memory", "64MiB", "--tflops", "0.01",
                    "--bandwidth", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["devices"] == 4 and data["parameters"] == PSI
    assert data["recommended"]["fits"] and data["recommended"]["layout"] in result.stdout
    for row in data["layouts"]:
        assert row["memory_bytes"]["total"] == sum(
            v for k, v in row["memory_bytes"].items() if k != "total")
    assert "recommended:" in result.stdout and "tp2" in result.stdout


@pytest.mark.timeout(60)
def test_plan_command_says_when_nothing_fits_and_refuses_bad_sizes():
    result = dtrain("plan", "--memory", "1KB", "--tflops", "1", "--bandwidth", "1",
                    "--layers", "2", "--embd", "32", "--block", "32", "--batch", "4")
    assert result.returncode == 0, result.stderr
    assert "no layout fits" in result.stdout
    bad = dtrain("plan", "--memory", "lots")
    assert bad.returncode != 0 and "--memory" in one_error_line(bad)


def test_tracker_counts_live_bytes_and_in_place_resizes():
    from dtrain.planner import LiveBytes

    with LiveBytes() as live:
        a = torch.zeros(1000)
        b = a * 2
        assert live.live == 8000
        del b
        torch.ones(1)
        assert live.live == 4004 and live.peak == 8000
        a.untyped_storage().resize_(0)
        torch.ones(1)
        assert live.live == 4  # the resized storage counts 0, the unnamed ones are gone



def test_llama_parameters_and_tensor_parallel_degrees():
    """dtrain's Llama traced like the GPT: every parameter counted once (the untied head on
    the last stage), and tp only where it divides the key/value heads."""
    profile = profile_model(LLAMA, 2)
    assert profile.params.total == sum(p.numel() for p in build(LLAMA).parameters())
    assert profile.params_head.total == 64 + 256 * 64 and profile.tied == 0
    assert profile.tp_degrees(8) == [1, 2]
    llama_8b = resolve(ModelConfig(arch="llama", preset="llama-3-8b", block_size=256), 256)
    assert profile_model(llama_8b, 1).params.total == 8_030_261_248
