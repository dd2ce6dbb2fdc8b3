"""dtrain plan: the planner's arithmetic by hand, its memory against measured peaks of real
runs of every strategy, of each activation-recomputation mode, of sequence parallelism and
of split-form construction, and the command's output."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from dtrain.cli import main
from dtrain.config import Config
from dtrain.models import ModelConfig, build, init, resolve
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.planner import (
    RECOMPUTE,
    Dims,
    Links,
    bubble,
    estimate,
    layouts,
    plan,
    profile_gpt,
    profile_model,
)
from dtrain.planner.traced.construction import whole_model
from dtrain.planner.traced.estimate import in_flight, stage_blocks
from dtrain.planner.traced.measure import measured_peaks
from dtrain.testing import run_ranks
from dtrain.tools.plan import plan_choices
from tests.support.cli import dtrain, one_error_line

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)
BLOCK = 128 + (64 * 192 + 192) + (64 * 64 + 64) + 128 + (64 * 256 + 256) + (256 * 64 + 64)
EMBED = 256 * 64 + 64 * 64  # wte (the head's weight too) and wpe
PSI = EMBED + 4 * BLOCK + 128  # and ln_f
FREE = Links.given(1e9, 0)  # links that cost nothing
LLAMA = ModelConfig(arch="llama", vocab_size=256, block_size=64, n_layer=4, n_head=4,
                    n_kv_head=2, n_embd=64, ffn_hidden=128, tie_embeddings=False)


_PROFILES: dict = {}


def traced(cfg: GPTConfig | ModelConfig, micro_batch: int, modes: tuple[str, ...] = RECOMPUTE,
           cp: int = 1, method: str = "ring"):
    """The profile of `cfg` with (at least) the recomputation `modes` traced, each traced
    once for the whole module: it takes a while. With `cp` > 1, a context-parallel rank's,
    attending by `method`."""
    key = (repr(cfg), micro_batch, cp, method)
    have = _PROFILES.get(key)
    if have is None or not set(modes) <= set(have.modes):
        profile_of = profile_gpt if isinstance(cfg, GPTConfig) else profile_model
        wanted = set(modes) | set(have.modes if have else ())
        _PROFILES[key] = profile_of(cfg, micro_batch, tuple(m for m in RECOMPUTE if m in wanted),
                                    cp, method)
    return _PROFILES[key]


@pytest.fixture(scope="module")
def profile():
    return traced(CFG, 4)


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
    e = estimate(profile, Dims(dp_shard=4, zero=zero), 1e12, 1e12, FREE)
    assert (e.params, e.grads, e.optimizer) == pytest.approx((params, grads, state))


def test_zero3_peak_in_the_heads_backward_gathers_no_block():
    """With a large vocabulary the peak is the logits' gradients, before backward reaches
    a block: ZeRO-3 then holds its shard and the root unit only."""
    cfg = GPTConfig(vocab_size=4096, block_size=64, n_layer=4, n_head=4, n_embd=64)
    profile = profile_gpt(cfg, 4, modes=("none",))
    e = estimate(profile, Dims(4, zero=3), 1e12, 1e12, FREE)
    root = (profile.params_embed + profile.params_head).total
    assert e.params == pytest.approx(profile.params.total + 4 * root)


def test_pipeline_split_bubble_and_in_flight(profile):
    assert stage_blocks(profile, 2) == [[2], [2]]
    busiest = estimate(profile, Dims(dp_shard=1, pp=2, microbatches=4), 1e12, 1e12, FREE)
    # the first stage: two blocks and both embeddings (more than the last stage's two
    # blocks, ln_f and its copy of the tied embedding)
    assert busiest.params == pytest.approx(4 * (2 * BLOCK + EMBED))
    assert bubble(4, 8) == pytest.approx(3 / 11)
    assert bubble(4, 8, chunks=2) == pytest.approx(3 / 19)
    one = [1.0]
    assert in_flight(Dims(1, pp=4, microbatches=8), 0, one) == 4  # 1F1B: p - rank
    assert in_flight(Dims(1, pp=4, microbatches=8), 3, one) == 1
    assert in_flight(Dims(1, pp=4, microbatches=8, schedule="gpipe"), 3, one) == 8


def test_traffic_per_step(profile):
    dp = estimate(profile, Dims(dp_shard=4), 1e12, 1e12, FREE)
    assert dp.traffic == {"dp all_reduce": 4 * PSI}
    tp = estimate(profile, Dims(dp_shard=1, tp=2), 1e12, 1e12, FREE)
    activation = 4 * 64 * 64 * 4  # one micro-batch's (b, s, width) in fp32
    assert tp.traffic == {"tp all_reduce": (4 * 4 + 2) * activation}
    z3 = estimate(profile, Dims(dp_shard=2, zero=3), 1e12, 1e12, FREE)
    assert z3.traffic == {"dp reduce_scatter": 4 * PSI, "dp all_gather": 2 * 4 * PSI}


def test_layouts_and_recommendation(profile):
    found = {str(layout) for layout in layouts(profile, 4, batch=16)}
    assert {"dp4", "dp4 zero3", "tp4", "dp2 x tp2", "pp4 (1f1b, m=4)"} <= found
    assert not any("tp" in s for s in {str(x) for x in layouts(profile_gpt(
        GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=1, n_embd=64), 4,
        modes=("none",)), 4, 16)})
    estimates = plan(lambda b: traced(CFG, b, ("none",)), 4, 4 * 2**20, 16, 1e10, FREE)
    assert all(e.fits == (e.total <= 4 * 2**20) for e in estimates)
    assert estimates[0].fits and not estimates[-1].fits


STRATEGIES = [Dims(2), Dims(2, zero=1), Dims(2, zero=2), Dims(2, zero=3),
              Dims(1, tp=2), Dims(1, pp=2, microbatches=4)]
Case = tuple  # (model config, layout, global batch, recompute mode, sequence parallel)


def _measure(cases: list[Case], steps: int = 2, chunk: int = 0) -> list:
    """Each case's peaks on this rank (steps=0: building only), generator groups of
    `chunk` elements if given."""
    if chunk:
        init.CHUNK = chunk
    return [measured_peaks(cfg, layout, batch, steps, recompute=mode, sequence_parallel=sp)
            for cfg, layout, batch, mode, sp in cases]


def _planned(cfg: GPTConfig | ModelConfig, case: Case):
    _, layout, batch, mode, sp = case
    micro = batch // (layout.dp * layout.microbatches)
    return estimate(traced(cfg, micro, (mode,)), layout, 1e12, 1e12, FREE, recompute=mode,
                    sequence_parallel=sp)


def _check(cases: list[Case], measured: list[list], what: str = "train") -> list[int]:
    """Planned against measured (the busiest rank) within 15%; returns the measured."""
    peaks = []
    for i, case in enumerate(cases):
        peak = max(getattr(rank[i], what) for rank in measured)
        e = _planned(case[0], case)
        planned = e.total if what == "train" else e.construction
        assert abs(planned / peak - 1) <= 0.15, \
            f"{what} {case[1:]}: planned {planned:.0f}, measured {peak}"
        peaks.append(peak)
    return peaks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_memory_matches_measured_peaks_within_15_percent(model: str, native: dict):
    """Planned against measured peaks of real runs, for dtrain's GPT and Llama."""
    cfg = CFG if model == "gpt" else LLAMA
    cases = [(cfg, layout, 8, "none", False) for layout in STRATEGIES]
    _check(cases, run_ranks(_measure, 2, cases, timeout=200, env=native))


DROPPED = ModelConfig(arch="gpt", vocab_size=256, block_size=64, n_layer=2, n_head=4,
                      n_embd=64, dropout=0.1)
"""Attention dropout: the CPU's attention is the math kernel, whose probabilities
selective recomputation drops (the fused kernel keeps little else to drop)."""
MODES = ("none", "selective", "full")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_recomputation_sequence_parallelism_and_construction_match_measured(native: dict):
    """Each recomputation mode with and without sequence parallelism at tp=2, and the
    construction peaks of tp=2 and ZeRO-3 over 2 ranks, against real runs."""
    cases = [(DROPPED, Dims(1, tp=2), 8, mode, sp) for sp in (False, True) for mode in MODES]
    built = [(DROPPED, Dims(2, zero=3), 8, "none", False)]
    measured = run_ranks(_measure, 2, cases + built, timeout=100, env=native)
    peaks = _check(cases, measured)
    assert peaks[0] > peaks[1] > peaks[2] and peaks[3] > peaks[4] > peaks[5]
    assert peaks[3] < peaks[0] and peaks[4] < peaks[1]  # (full's differ by less than noise)
    _check(cases[:1] + built, [rank[:1] + rank[-1:] for rank in measured], "build")


WIDE = ModelConfig(arch="gpt", vocab_size=512, block_size=32, n_layer=2, n_head=4,
                  n_embd=128)
CHUNK = 3000
"""Elements per generator group in the construction checks: most tensors take several, as
a big model's do with dtrain.models.init.CHUNK."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 4])
def test_everywhere_matches_measured(ranks: int, native: dict, monkeypatch):
    """Llama's modes at tp=2, recomputation in pipelines and under ZeRO, sequence
    parallelism with dp, ZeRO and pp; the construction peak of every kind of layout, with
    generator groups smaller than the tensors."""
    monkeypatch.setattr(init, "CHUNK", CHUNK)
    if ranks == 2:
        llama = dataclasses.replace(LLAMA, dropout=0.1, n_layer=2)
        trained = [(llama, Dims(1, tp=2), 8, mode, sp) for sp in (False, True)
                   for mode in MODES]
        trained += [(DROPPED, Dims(1, pp=2, microbatches=4), 8, mode, False)
                    for mode in MODES[1:]]
        trained += [(DROPPED, Dims(2, zero=2), 8, "full", False)]
        built = [(WIDE, layout, 4, "none", False) for layout in
                 (Dims(2), Dims(1, tp=2), Dims(2, zero=1), Dims(2, zero=3),
                  Dims(1, pp=2, microbatches=2))]
    else:
        trained = [(DROPPED, Dims(2, tp=2, zero=1), 8, "full", True),
                   (DROPPED, Dims(2, tp=2), 8, "selective", True),
                   (CFG, Dims(1, tp=2, pp=2, microbatches=4), 8, "none", True)]
        built = [(WIDE, layout, 4, "none", False) for layout in
                 (Dims(4, zero=3), Dims(2, tp=2, zero=3), Dims(2, tp=2))]
    measured = run_ranks(_measure, ranks, trained + built, 2, CHUNK, timeout=250, env=native)
    _check(trained, measured)
    peaks = _check(built, [rank[len(trained):] for rank in measured], "build")
    if ranks == 4:  # every rank used to build the whole model first
        assert max(peaks[:2]) < whole_model(traced(WIDE, 1).params)


def test_recomputation_and_sequence_parallelism_by_hand():
    """Each mode keeps less and costs a forward of more; sequence parallelism divides the
    norms' and residuals' share and moves the same bus bytes in twice the calls."""
    profile = traced(DROPPED, 8)
    tp2 = {(mode, sp): estimate(profile, Dims(1, tp=2), 1e12, 1e12, FREE,
                                recompute=mode, sequence_parallel=sp)
           for mode in MODES for sp in (False, True)}
    acts = [tp2[mode, False].activations for mode in MODES]
    assert acts[0] > acts[1] > acts[2]
    assert all(tp2[mode, True].activations < tp2[mode, False].activations for mode in MODES)
    again = [tp2[mode, False].recompute_s for mode in MODES]
    assert again[0] == 0 < again[1] < again[2] < tp2["none", False].compute_s / 3
    on = tp2["none", True].traffic
    assert on["tp all_gather"] == on["tp reduce_scatter"] + 8 * 64 * 64 * 4  # the cut's
    bandwidth = Links.given(1, 0)  # no latency: bus bytes alone
    off_s, on_s = (estimate(profile, Dims(1, tp=2), 1e12, 1e12, bandwidth,
                            sequence_parallel=sp).comm_s for sp in (False, True))
    assert off_s < on_s < 1.1 * off_s
    # a tp=1 layout has no sequence to divide: the same figures either way
    dp = [estimate(profile, Dims(2), 1e12, 1e12, FREE, sequence_parallel=sp) for sp in
          (False, True)]
    assert dp[0].total == dp[1].total and not dp[1].dims.sequence_parallel


def test_plan_falls_back_to_recomputation_only_where_a_layout_does_not_fit():
    def trace(b: int):
        return traced(DROPPED, b)

    roomy = plan(trace, 2, 1e12, 8, 1e10, FREE, recompute=MODES, sequence_parallel=(False, True))
    assert all(e.recompute == "none" and not e.dims.sequence_parallel for e in roomy)
    tp2 = next(e for e in roomy if str(e.dims) == "tp2")
    budget = (tp2.total + estimate(trace(8), Dims(1, tp=2), 1e12, 1e10, FREE,
                                   recompute="full", sequence_parallel=True).total) / 2
    tight = {str(e.dims): e for e in plan(trace, 2, budget, 8, 1e10, FREE, recompute=MODES,
                                            sequence_parallel=(False, True))}
    chosen = tight["tp2"]
    assert chosen.fits and (chosen.recompute, chosen.dims.sequence_parallel) != ("none", False)
    assert chosen.recompute == "none" or chosen.recompute_s > 0
    assert chosen.step_s >= tp2.step_s
    fixed = plan(trace, 2, budget, 8, 1e10, FREE, recompute="none")
    assert not next(e for e in fixed if str(e.dims) == "tp2").fits


def test_choices_follow_the_config_and_the_flags():
    config = Config()
    flags = argparse.Namespace(recompute="auto", sequence_parallel="auto")
    assert plan_choices(flags, config) == (MODES, (False, True))
    config.memory.recompute = "selective"
    config.parallel.sequence_parallel = True
    assert plan_choices(flags, config) == (("selective", "full"), (True,))
    fixed = argparse.Namespace(recompute="none", sequence_parallel="off")
    assert plan_choices(fixed, config) == (("none",), (False,))


def test_construction_by_hand(profile):
    """DataParallel holds the parameters (its buckets come at the first backward), then
    draws one generator group at a time; ZeRO-3 its shards; before split form every rank held the
    whole model."""
    whole = whole_model(profile.params)
    assert whole == 4 * PSI
    dp = estimate(profile, Dims(2), 1e12, 1e12, FREE).construction
    fc = 256 * 64  # the largest tensors (fc, the embedding): one generator group each,
    assert dp == 4 * (PSI + fc)  # its rows copied straight into place
    z3 = estimate(profile, Dims(4, zero=3), 1e12, 1e12, FREE).construction
    assert z3 < whole / 2


@pytest.mark.slow  # about 9 s on 2 cores: make test-slow
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
        m = row["memory_bytes"]
        assert m["total"] == m["params"] + m["optimizer"] + max(
            m["grads_in_backward"] + m["activations"], m["grads"])
        assert row["recompute"] in ("none", "selective", "full")
    built = {row["layout"]: row["construction_bytes"] for row in data["layouts"]}
    assert built["dp4 zero3"] < data["whole_model_bytes"] < built["dp4"]
    assert "recommended:" in result.stdout and "tp2" in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gbps, latency_us, chosen", [
    pytest.param(10.0, 20, "every step", marks=pytest.mark.slow),
    (0.0125, 20_000, "local_sgd H=50")])
def test_plan_lists_and_chooses_how_data_parallelism_synchronizes(
        gbps: float, latency_us: int, chosen: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """On a fast link the gradients' every-step all-reduce hides behind backward; on a
    100 Mbit/s, 20 ms one the plan sends every H steps. Bytes per rank: PowerSGD and int8
    below fp32's 2(n-1)/n x 4 bytes per parameter (int8 about a quarter), H steps H times
    fewer. (`dtrain plan --json -` runs here, as the command's main: what it prints is the
    JSON alone, and a process of its own would import torch's tracing again for it. The
    default job fits every layout without recomputation or sequence parallelism, which
    only tp layouts take: fixing them off traces each micro-batch once, not thrice.)"""
    for name in ("TORCH_CPP_LOG_LEVEL", "DTRAIN_USER_CPP_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)  # main sets them; restored afterwards
    code = main(["plan", "-n", "4", "--tflops", "0.05", "--bandwidth", str(gbps),
                 "--latency", str(latency_us), "--recompute", "none", "--sequence-parallel",
                 "off", "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    sync = json.loads(out)["sync"]
    options = {o["name"]: o for o in sync["options"]}
    assert sync["recommended"]["name"] == chosen, sync["why"]
    every = options["every step"]["bytes_per_step"]
    assert options["powersgd r=4"]["bytes_per_step"] < every / 4
    assert 0.24 < options["int8"]["bytes_per_step"] / every < 0.26
    assert options["diloco H=50"]["bytes_per_step"] == pytest.approx(every / 50, rel=1e-3)
    assert all(o["step_s"] > 0 and o["progress"] >= 1 for o in sync["options"])


@pytest.mark.slow
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
    profile = profile_model(LLAMA, 2, modes=("none",))
    assert profile.params.total == sum(p.numel() for p in build(LLAMA).parameters())
    assert profile.params_head.total == 64 + 256 * 64 and profile.tied == 0
    assert profile.tp_degrees(8) == [1, 2]
    llama_8b = resolve(ModelConfig(arch="llama", preset="llama-3-8b", block_size=256), 256)
    assert profile_model(llama_8b, 1, modes=("none",)).params.total == 8_030_261_248
