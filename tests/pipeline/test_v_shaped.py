"""The V-shaped zero-bubble schedules, ZB-V ("zbv") and DualPipeV ("dualpipev"): their
action lists, and every layout they run in against one process on the same global batch
(plain SGD, no clip: every loss, gradient norm and final weight).

Rank r holds stages r and 2pp-1-r, so rank 0 holds both the embedding and the head a GPT
ties to it: the head gets a twin whose gradient is summed with the embedding's
(dtrain.pipeline.tied_weights), which the GPT runs here check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain import Mesh, pipeline
from dtrain.checkpoint import universal
from dtrain.mesh.dims import V_SHAPED
from dtrain.pipeline.schedules import Placement, check_actions, peak_live, simulate
from dtrain.testing import run_ranks
from tests.models.test_models_train import assert_same_run, run
from tests.pipeline.test_pipeline import float32, gpt, serial, threads_equal_serial, tokens
from tests.pipeline.test_zero_bubble import LLAMA_RUN, _sgd, _trainer_runs
from tests.support.cli import TINY_MODEL, dtrain, exact_run


def _lists(name: str, pp: int, m: int) -> list[list[pipeline.Action]]:
    return [pipeline.build(name, pp, r, m, 2) for r in range(pp)]


@pytest.mark.timeout(60)
def test_v_placement_puts_both_ends_on_the_first_rank() -> None:
    place = Placement.of("zbv", 4, 2)
    assert [[place.stage(r, c) for c in (0, 1)] for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(place.holder(place.stage(r, c)) == (r, c) for r in range(4) for c in (0, 1))
    assert Placement.of("interleaved", 4, 2).stage(1, 1) == 5  # looped: chunk x pp + rank
    pieces = list(range(8))
    assert pipeline.pieces_for(pieces, None, "zbv") == [0, 1, 2, 3, 4, 5, 6, 7]  # one rank


@pytest.mark.timeout(60)
def test_v_action_lists_check_and_hold_1f1b_memory() -> None:
    """Up to (8, 32): the checker passes, one F, B and W per micro-batch and chunk, and
    the live micro-batches (chunk-sized: half a stage) stay within 1F1B's first stage's
    for ZB-V, one chunk more for DualPipeV."""
    for pp in range(1, 9):
        for m in sorted({1, 2, pp, 2 * pp, 2 * pp + 1, 32}):
            first = peak_live(pipeline.build("1f1b", pp, 0, m))
            for name in V_SHAPED:
                if name == "dualpipev" and m < 2 * pp:
                    continue
                lists = _lists(name, pp, m)
                check_actions(lists, Placement.of(name, pp, 2), m)
                for actions in lists:
                    for kind in "FBW":
                        assert sorted((a.micro, a.chunk) for a in actions if a.kind == kind) \
                            == [(j, c) for j in range(m) for c in (0, 1)]
                peak = max(peak_live(actions) for actions in lists)
                assert peak <= 2 * first if name == "zbv" else peak == 2 * pp + 1, (name, pp, m)


@pytest.mark.timeout(60)
def test_v_schedules_idle_only_while_the_first_micro_batch_fills_the_pipe() -> None:
    """With F, B and W of a chunk taking equal time, a step is every rank's work plus the
    p-1 chunk forwards before the last rank can start: an idle share of (p-1)/(6m+p-1),
    against 1F1B's (p-1)/(m+p-1) and ZB-H1's (p-1)/(3m+p-1). Where W is much shorter
    (as on GPUs), ZB-V's order idles the same at every m, no more than ZB-H1."""
    for pp in range(2, 9):
        for m in (2 * pp, 3 * pp, 32):
            bound = (pp - 1) / (6 * m + pp - 1)
            for name in V_SHAPED:
                _, idle = simulate(_lists(name, pp, m), Placement.of(name, pp, 2), (1, 1, 1))
                assert max(idle) == pytest.approx(bound), (name, pp, m)
            _, idle = simulate([pipeline.build("1f1b", pp, r, m) for r in range(pp)],
                               Placement(pp), (2, 2, 2))
            assert max(idle) == pytest.approx((pp - 1) / (m + pp - 1))
    for pp in (4, 8):  # W a quarter of F and B: the fill, then no bubble
        idle = {round(simulate(_lists("zbv", pp, m), Placement.of("zbv", pp, 2),
                               (1, 1, 0.25))[0] - m * 4.5, 9) for m in (2 * pp, 4 * pp, 64)}
        zb1p = simulate([pipeline.build("zb1p", pp, r, 16) for r in range(pp)], Placement(pp),
                        (2, 2, 0.5))[0] - 16 * 4.5
        assert len(idle) == 1 and idle.pop() <= zb1p
    # DualPipeV's steady state: a forward of one chunk overlapped with the other's backward
    steady = [a for a in _lists("dualpipev", 2, 8)[0] if a.with_next]
    assert len(steady) == 2 * (8 - 4 + 1) + 1 and all(a.kind == "F" for a in steady)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, pp, microbatches", [
    ("zbv", 2, 4),
    pytest.param("dualpipev", 4, 8, marks=pytest.mark.slow),
    pytest.param("dualpipev", 2, 4, marks=pytest.mark.slow),
    pytest.param("zbv", 4, 8, marks=pytest.mark.slow),
    pytest.param("zbv", 2, 8, marks=pytest.mark.slow),
    pytest.param("dualpipev", 2, 8, marks=pytest.mark.slow)])
def test_v_schedules_equal_one_process(name: str, pp: int, microbatches: int) -> None:
    """dtrain's GPT, its head tied to its embedding (a twin on rank 0): every loss and every
    final weight, the twin's equal to the embedding's."""
    results = threads_equal_serial(pp, name, 2, microbatches, _sgd)
    torch.testing.assert_close(results[0]["state"]["head.weight"],
                               results[0]["state"]["wte.weight"], rtol=0, atol=0)


def _evaluate_and_infer(base: torch.nn.Module, pp: int) -> dict:
    import copy

    group = Mesh(pp=pp).group("pp")
    model = copy.deepcopy(base)
    mine = pipeline.pieces_for(pipeline.cut(model, 2 * pp), group, "zbv")
    pipe = pipeline.Pipeline(mine, group, microbatches=4, schedule="zbv",
                             loss_fn=pipeline.lm_loss,
                             tied=pipeline.tied_weights(model, mine, group))
    x, y = tokens(0)
    return {"loss": pipe.evaluate(x, y), "logits": pipe.infer(x)}


@pytest.mark.slow  # 2 processes: 5-10 s
@pytest.mark.timeout(60)
def test_v_evaluation_and_inference_equal_the_whole_model() -> None:
    base = gpt()
    x, y = tokens(0)
    with torch.no_grad():
        logits, loss = base(x, y)
    results = run_ranks(_evaluate_and_infer, 2, base, 2, timeout=50)
    for r in results:
        torch.testing.assert_close(r["loss"], loss)
    torch.testing.assert_close(results[0]["logits"], logits)  # the head is on rank 0
    assert results[1]["logits"] is None


def _overlapped_rank(base: torch.nn.Module) -> dict:
    """dualpipev on 2 processes, each pair's backward in a second thread on the second
    lane beside its forward; the last step's timeline."""
    import copy

    mesh = Mesh(pp=2)
    mesh.second_lane()
    group = mesh.group("pp")
    model = copy.deepcopy(base)
    mine = pipeline.pieces_for(pipeline.cut(model, 4), group, "dualpipev")
    pipe = pipeline.Pipeline(mine, group, microbatches=4, schedule="dualpipev",
                             loss_fn=pipeline.lm_loss, timeline=True, overlap=True,
                             tied=pipeline.tied_weights(model, mine, group))
    opt = _sgd(torch.nn.ModuleList(mine).parameters())
    losses = []
    for step in range(3):
        losses.append(pipe.step(*tokens(step)).item())
        opt.step()
        opt.zero_grad()
    state = {k: v for piece in mine for k, v in piece.state_dict().items()}
    return {"losses": losses, "state": state, "events": pipe.events}


@pytest.mark.timeout(90)
def test_dualpipev_pairs_overlap_and_equal_one_process() -> None:
    """Each pair's forward and backward run at once (their spans on the timeline
    intersect), and the run still equals one process: every loss and final weight."""
    losses, state = serial(_sgd)
    results = run_ranks(_overlapped_rank, 2, gpt(), timeout=80)
    lists = _lists("dualpipev", 2, 4)
    for rank, r in enumerate(results):
        torch.testing.assert_close(float32(r["losses"]), float32(losses))
        for key, value in r["state"].items():
            torch.testing.assert_close(value, state[key], msg=key)
        spans = {(kind, micro, chunk): (start, end)
                 for kind, micro, chunk, start, end in r["events"]}
        pairs = [(spans[("F", f.micro, f.chunk)], spans[("B", b.micro, b.chunk)])
                 for f, b in zip(lists[rank], lists[rank][1:], strict=False) if f.with_next]
        assert pairs and any(f[0] < b[1] and b[0] < f[1] for f, b in pairs), r["events"]


def _config(folder: Path, name: str, parallel: dict, model: dict = LLAMA_RUN,
            memory: dict | None = None) -> dict:
    return {"model": model, "data": {"max_bytes": 20_000}, "memory": memory or {},
            **exact_run(folder / name, steps=3, batch=8, parallel=parallel)}


MOE_RUN = {"arch": "llama", "preset": "moe-tiny", "n_layer": 4, "block_size": 16,
           "moe_layers": "after 1"}
HF_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "tie_word_embeddings": True}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule, layout, model", [
    ("dualpipev", {"ep": 2, "dp": 2}, "moe"),
    pytest.param("zbv", {"zero": 2}, "llama", marks=pytest.mark.slow),
    pytest.param("zbv", {"ep": 2, "dp": 2}, "moe", marks=pytest.mark.slow),
    pytest.param("zbv", {}, "llama", marks=pytest.mark.slow),
    pytest.param("dualpipev", {}, "llama", marks=pytest.mark.slow),
    pytest.param("dualpipev", {"tp": 2}, "llama", marks=pytest.mark.slow),
    pytest.param("zbv", {}, "hf", marks=pytest.mark.slow),
    pytest.param("zbv", {"zero": 3}, "llama", marks=pytest.mark.slow),
    pytest.param("dualpipev", {"zero": 2}, "llama", marks=pytest.mark.slow),
    pytest.param("zbv", {"tp": 2}, "llama", marks=pytest.mark.slow),
    pytest.param("zbv", {"cp": 2}, "llama", marks=pytest.mark.slow),
    pytest.param("dualpipev", {"recompute": "full"}, "llama", marks=pytest.mark.slow),
    pytest.param("dualpipev", {"zero": 3}, "llama", marks=pytest.mark.slow),
    pytest.param("zb1p", {"ep": 2, "dp": 2}, "moe", marks=pytest.mark.slow),
    pytest.param("zb1p", {}, "hf", marks=pytest.mark.slow),
    pytest.param("zb1p", {"cp": 2}, "llama", marks=pytest.mark.slow),
], ids=["dualpipev-moe-ep2", "zbv-zero2", "zbv-moe-ep2", "zbv", "dualpipev", "dualpipev-tp2",
        "zbv-hf", "zbv-zero3", "dualpipev-zero2", "zbv-tp2", "zbv-cp2",
        "dualpipev-recompute", "dualpipev-zero3", "zb1p-moe-ep2", "zb1p-hf", "zb1p-cp2"])
def test_dtrain_train_with_zero_bubble_schedules_equals_one_process(
        tmp_path: Path, schedule: str, layout: dict, model: str) -> None:
    """By the Trainer, pp = 2 with 4 micro-batches (two chunks a rank in a V for zbv and
    dualpipev, one for zb1p): every step's loss and gradient norm. dtrain's Llama (its head
    tied), moe-tiny with its experts over ep, a transformers Llama built from a config;
    with ZeRO, tp, cp and recomputation."""
    layout = dict(layout)
    memory = {"recompute": layout.pop("recompute")} if "recompute" in layout else None
    values = {"llama": LLAMA_RUN, "moe": MOE_RUN}.get(model)
    if model == "hf":
        (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
        values = {"arch": "hf", "hf_config": str(tmp_path / "config.json"), "block_size": 32}
    if schedule == "dualpipev":  # each pair's backward beside its forward, as on GPUs
        layout["overlap_pairs"] = "on"
    nproc = 2 * layout.get("tp", 1) * layout.get("cp", 1) * (
        2 if layout.get("zero") or layout.get("dp") else 1)
    one = run_ranks(_trainer_runs, 1, [("one", _config(tmp_path, "one", {"nproc": 1},
                                                       values))], timeout=100)
    got = run_ranks(_trainer_runs, nproc, [("v", _config(tmp_path, "v", {
        "nproc": nproc, "pp": 2, "virtual_stages": 1 if schedule == "zb1p" else 2,
        "microbatches": 4,
        "schedule": schedule, **layout}, values, memory))], timeout=250)
    torch.testing.assert_close(got[0]["v"], one[0]["one"], rtol=1e-5, atol=1e-6)


ZBV = ["--set", "parallel.pp=2", "--set", "parallel.virtual_stages=2",
       "--set", "parallel.microbatches=4"]
FOUR_BLOCKS = ["--set", "model.n_layer=4", "--set", "optimizer.name='sgd'"]


@pytest.mark.slow  # four `dtrain train` runs: about a minute on 2 cores
@pytest.mark.timeout(400)
def test_zbv_run_resumes_as_1f1b_and_as_one_process(tmp_path: Path) -> None:
    """Two steps under zbv, two more resumed as 1f1b, the last two as one process: every
    loss and the final weights equal six steps of one process."""
    six = ["--set", "train.steps=6"]
    one = run(tmp_path, "one", TINY_MODEL, ["-n", "1", *FOUR_BLOCKS, *six])
    zbv = run(tmp_path, "zbv", TINY_MODEL, ["-n", "2", *ZBV, "--set", "parallel.schedule='zbv'",
                                             *FOUR_BLOCKS, "--set", "train.steps=2"])
    assert "pipeline of 2 stages (zbv" in zbv[3]
    assert universal.Checkpoint(zbv[2]).meta["layout"]["schedule"] == "zbv"
    then = run(tmp_path, "then", TINY_MODEL, [
        "-n", "2", "--set", "parallel.pp=2", "--set", "parallel.microbatches=4",
        *FOUR_BLOCKS, "--set", "train.steps=4", "--resume", str(zbv[2])])
    last = run(tmp_path, "last", TINY_MODEL, ["-n", "1", *FOUR_BLOCKS, *six,
                                              "--resume", str(then[2])])
    resumed = (zbv[0] + then[0] + last[0], last[1], last[2], last[3], zbv[4] + then[4] + last[4])
    assert_same_run(resumed, one)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--set", "parallel.schedule='zbv'", "--set", "parallel.virtual_stages=1"],
     "parallel.schedule = 'zbv': schedule 'zbv' runs two chunks per rank in a V, not 1: "
     "set virtual_stages = 2"),
    (["--set", "parallel.schedule='dualpipev'", "--set", "parallel.virtual_stages=2",
      "--set", "parallel.microbatches=3"],
     "schedule 'dualpipev' needs at least 2 x pp = 4 micro-batches, not 3: raise "
     "microbatches"),
    (["--set", "parallel.schedule='zbv'", "--set", "parallel.virtual_stages=2",
      "--set", "parallel.stage_layers='1,1,1'"],
     "parallel.stage_layers = '1,1,1': give 4 positive sizes"),
], ids=["one-chunk", "too-few-micro-batches", "stage-sizes"])
def test_v_schedule_mistakes_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_MODEL)
    result = dtrain("train", str(config), "-n", "2", "--set", "parallel.pp=2",
                    "--set", "model.n_layer=4", *args,
                    "--set", f"train.out_dir='{tmp_path / 'run'}'")
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr
    assert not (tmp_path / "run").exists()
