"""Zero-bubble pipelines: each backward split into B (the input's gradient) and W (the
weights'), equal to one backward for every kind of block; the ZB-H1 schedule's action
lists, checked and within 1F1B's memory; its runs equal one process (plain SGD, no clip:
a lost or doubled weight gradient shows)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from dtrain import comm, pipeline
from dtrain import tensor_parallel as tp
from dtrain.adapters import AdapterConfig, apply
from dtrain.errors import DtrainError
from dtrain.models import ModelConfig, build, resolve
from dtrain.pipeline import Action
from dtrain.pipeline.schedules import Placement, check_actions, peak_live
from dtrain.pipeline.split_backward import WeightGrads
from dtrain.testing import run_ranks
from tests.pipeline.test_pipeline import dp_pp_rank, gpt, serial, threads_equal_serial

SMALL = {"block_size": 16, "n_layer": 2, "n_embd": 32, "n_head": 4}
BLOCKS = {
    "gpt": ModelConfig(arch="gpt", **SMALL),
    "llama": ModelConfig(arch="llama", **SMALL, n_kv_head=2, ffn_hidden=64),
    "moe": ModelConfig(arch="llama", **SMALL, n_kv_head=2, ffn_hidden=64, n_experts=4,
                       experts_per_token=2),
}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _split_equals_plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """B then W on a copy of `model` give the gradients one backward gives."""
    split = copy.deepcopy(model)
    model(x, y)[1].backward()
    keeper = WeightGrads.install(split)
    assert keeper.installed
    with keeper.deferring(0):
        split(x, y)[1].backward()
    held = _grads(split)
    assert len(held) < len(_grads(model))  # B left the products' weights to W
    keeper.run(0)
    assert keeper.pending() == 0
    got, want = _grads(split), _grads(model)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [*BLOCKS, "lora", "hf"])
def test_b_then_w_equals_one_backward(kind: str, tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
    torch.manual_seed(0)
    if kind == "hf":
        import json

        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}))
        model = build(resolve(ModelConfig(arch="hf", hf_config=str(tmp_path / "config.json"),
                                          block_size=16), 256))
    else:
        model = build(resolve(BLOCKS["llama" if kind == "lora" else kind], 256))
    if kind == "lora":
        apply(model, AdapterConfig(kind="lora", rank=4), "llama")
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.data.normal_(0, 0.1)
    _split_equals_plain(model, x, y)


def _tp_rank(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    plain = copy.deepcopy(model)
    for m in (plain, model):
        tp.split_model(m, comm.resolve(None), algorithm="native")
    plain(x, y)[1].backward()
    keeper = WeightGrads.install(model)
    with keeper.deferring(0):
        model(x, y)[1].backward()
    keeper.run(0)
    return {"plain": tp.full_grads(plain), "split": tp.full_grads(model)}


@pytest.mark.timeout(60)
def test_b_then_w_under_tensor_parallelism_keeps_the_collectives_in_b() -> None:
    """Column- and row-parallel layers: W moves only the local products' weight gradients."""
    torch.manual_seed(0)
    model = build(resolve(BLOCKS["llama"], 256))
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
    for result in run_ranks(_tp_rank, 2, model, x, y, timeout=50):
        for name, grad in result["plain"].items():
            if grad is not None:
                torch.testing.assert_close(result["split"][name], grad, rtol=1e-6, atol=1e-7,
                                           msg=name)


@pytest.mark.timeout(60)
def test_zb1p_action_lists_check_and_hold_1f1b_memory() -> None:
    for pp in range(1, 9):
        for m in (1, 2, pp, 2 * pp + 1, 32):
            lists = [pipeline.build("zb1p", pp, r, m) for r in range(pp)]
            check_actions(lists, Placement(pp), m)
            first = peak_live(pipeline.build("1f1b", pp, 0, m))
            assert first == min(pp, m)  # 1F1B's peak: its first stage's
            for actions in lists:
                for kind in "FBW":
                    assert sorted(a.micro for a in actions if a.kind == kind) == list(range(m))
                assert peak_live(actions) <= first  # a micro-batch lives from F to W
    for name, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        check_actions([pipeline.build(name, 4, r, 8, chunks) for r in range(4)],
                      Placement(4, chunks), 8)
    # ZB-H1's steady state on stage i: F of x, B of x - (p-1-i), W of x - (p-1)
    assert pipeline.build("zb1p", 4, 1, 8)[4:10] == [Action("F", 3), Action("B", 1),
                                                    Action("W", 0), Action("F", 4),
                                                    Action("B", 2), Action("W", 1)]


@pytest.mark.timeout(60)
def test_the_checker_names_a_rank_that_would_wait_forever() -> None:
    lists = [pipeline.build("1f1b", 2, r, 2) for r in range(2)]
    lists[1] = [Action("B", 0), *[a for a in lists[1] if a != Action("B", 0)]]
    with pytest.raises(DtrainError, match=r"rank 1 at B0"):
        check_actions(lists, Placement(2), 2)
    with pytest.raises(DtrainError, match="not one F/B per micro-batch"):
        check_actions([lists[0][:-1], lists[1]], Placement(2), 2)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp, microbatches", [
    (2, 4), pytest.param(2, 8, marks=pytest.mark.slow), pytest.param(4, 4, marks=pytest.mark.slow),
    (4, 8)])
def test_zb1p_equals_one_process(pp: int, microbatches: int) -> None:
    """dtrain's GPT (tied embedding and head on the first and last ranks): every loss and
    every final weight."""
    threads_equal_serial(pp, "zb1p", 1, microbatches, _sgd)


@pytest.mark.timeout(150)
def test_zb1p_with_data_parallel_equals_one_process() -> None:
    """The weights' gradients reach DataParallel's buckets in W: reduced once, after the
    last W of the step."""
    _, state = serial(_sgd)
    for got in run_ranks(dp_pp_rank, 4, gpt(), "zb1p", 4, _sgd, timeout=120):
        for name, value in got["state"].items():
            torch.testing.assert_close(value, state[name], msg=name)



def _trainer_runs(runs: list[tuple[str, dict]]) -> dict[str, list[float]]:
    """Each run by the Trainer: rank 0's loss and gradient norm per step."""
    import json
    from pathlib import Path

    from dtrain.config import config_from_dict
    from dtrain.train.trainer import Trainer

    out = {}
    for name, values in runs:
        Trainer(config_from_dict(values)).run()
        rows = [json.loads(line) for line in
                Path(values["logging"]["metrics"]).read_text().splitlines() if "loss" in line]
        out[name] = [r[k] for r in rows if "loss" in r for k in ("loss", "grad_norm")]
    return out


LLAMA_RUN = {"arch": "llama", "block_size": 32, "n_layer": 4, "n_embd": 32, "n_head": 4,
             "n_kv_head": 2, "ffn_hidden": 64}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [
    {"pp": 2, "microbatches": 4}, {"pp": 2, "microbatches": 2, "zero": 2},
    {"pp": 2, "microbatches": 2, "zero": 3}, {"pp": 2, "microbatches": 2, "tp": 2},
    {"pp": 2, "microbatches": 4, "stage_layers": "1,3"},
], ids=["pp2", "pp2-zero2", "pp2-zero3", "pp2-tp2", "pp2-uneven"])
def test_dtrain_train_with_zb1p_equals_one_process(tmp_path, layout: dict) -> None:
    """dtrain's Llama by the Trainer: every step's loss and gradient norm (SGD, no clip)."""
    from tests.support.cli import exact_run

    def config(name: str, parallel: dict) -> dict:
        return {"model": LLAMA_RUN, "data": {"max_bytes": 20_000},
                **exact_run(tmp_path / name, steps=3, batch=8, parallel=parallel)}

    nproc = layout["pp"] * layout.get("tp", 1) * (2 if layout.get("zero") else 1)
    one = run_ranks(_trainer_runs, 1, [("one", config("one", {"nproc": 1}))], timeout=100)
    got = run_ranks(_trainer_runs, nproc, [("zb", config("zb", {
        "nproc": nproc, "schedule": "zb1p", **layout}))], timeout=200)
    torch.testing.assert_close(got[0]["zb"], one[0]["one"], rtol=1e-5, atol=1e-6)


def test_the_planner_knows_zb1ps_bubble_and_memory() -> None:
    """The traced planner: ZB-H1's bubble (p-1)/(3m+p-1), a third of 1F1B's idle time;
    its live activations: p micro-batches on every stage (1F1B's first stage's), so the
    last stage, with its logits, can peak above 1F1B's busiest."""
    from dtrain.planner import Dims, Links, estimate
    from dtrain.planner.costs import bubble
    from dtrain.planner.traced.profile import profile_model

    assert bubble(4, 8, schedule="zb1p") == pytest.approx(3 / 27)
    assert bubble(4, 8) == pytest.approx(3 / 11)
    profile = profile_model(resolve(BLOCKS["llama"], 256), 1, ("none",))
    free = Links.given(1e9, 0)
    one, zb = (estimate(profile, Dims(1, pp=2, microbatches=4, schedule=s), 1e12, 1e12, free)
               for s in ("1f1b", "zb1p"))
    assert zb.bubble < one.bubble and zb.compute_s < one.compute_s
    assert one.activations <= zb.activations < 2 * one.activations


def test_uneven_stages_weigh_the_embedding_and_the_head() -> None:
    """`stage_layers = "auto"`: a vocabulary-sized embedding and head count on the first
    and last stages, which take fewer blocks; explicit sizes are taken as given, and sizes
    that do not fit are one line naming the key."""
    from dtrain.errors import ConfigError
    from dtrain.pipeline.schedules import stage_balance

    model = build(resolve(dataclasses.replace(BLOCKS["llama"], n_layer=8), 4096))
    even = [len(p.held_blocks) for p in pipeline.cut(model, 4)]
    auto = [len(p.held_blocks) for p in pipeline.cut(model, 4, "auto")]
    assert even == [2, 2, 2, 2] and sum(auto) == 8
    assert auto[0] < 2 and auto[-1] < 2 and max(auto[1:-1]) > 2
    assert [len(p.held_blocks) for p in pipeline.cut(model, 2, [3, 5])] == [3, 5]
    assert stage_balance("", 2) == "params" and stage_balance("1,3", 2, 4) == [1, 3]
    for bad in ("1,2", "4", "a,b", "0,4"):
        with pytest.raises(ConfigError, match="parallel.stage_layers"):
            stage_balance(bad, 2, 4)
