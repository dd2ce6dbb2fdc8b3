"""Expert parallelism folded over dp x cp x tp (dtrain.mesh.dims): the MoE layers laid out
over the same ranks as attention but on a mesh of their own, ep taking the innermost
ranks first (tp's, then cp's, then dp's), each tp rank sending its share of the tokens.

Every layout trains a DeepSeek-like MoE Llama (a shared expert beside 8 routed ones,
the sigmoid_bias router, dropless) or, where whole sequences allow it, one with a
softmax router, a capacity that drops and the balance loss, against one process on the
same global batch: every step's loss and gradient norm, and the final weights (SGD
without a clip, so that an expert gradient averaged with a wrong divisor over any axis
shows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dtrain.checkpoint import universal
from tests.models.test_moe import MOE_MODEL
from tests.support.cli import (
    EXACT_OPTIMIZER,
    assert_refused,
    assert_same_steps,
    train_rows_together,
)

MODEL = MOE_MODEL.replace('moe_layers = "after 1"', 'moe_layers = "all"') \
    .replace("capacity_factor = 1.0", "n_shared_experts = 1")
"""moe-tiny shrunk (tests/models/test_moe.py), both blocks MoE, DeepSeek's way: a shared
expert, the sigmoid_bias router, dropless."""
assert "n_shared_experts = 1" in MODEL and 'moe_layers = "all"' in MODEL

REST = EXACT_OPTIMIZER + """
[data]
max_bytes = 100000

[train]
batch_size = 8
eval_every = 0

[checkpoint]
background = false

[logging]
sample_tokens = 0
"""
DEEPSEEKISH = MODEL + REST
CAPACITY = MODEL.replace('router = "sigmoid_bias"', 'router = "softmax_topk"') \
    .replace("n_shared_experts = 1", "capacity_factor = 1.0\naux_loss_weight = 0.01") + REST
"""Mixtral's router with a capacity that drops and the balance loss: rules per whole
sequence, which tp (without sequence parallelism) keeps on every rank."""
FOUR_BLOCKS = DEEPSEEKISH.replace("n_layer = 2", "n_layer = 4")


def exported(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(universal.export(ckpt, ckpt.parent / "model.safetensors"))


def assert_equal_runs(got: tuple[list[dict], Path], want: tuple[list[dict], Path]) -> None:
    """Every step's loss and gradient norm, and the final weights (experts by global
    index, the routers' balancing biases too), of `got` equal `want`'s."""
    assert_same_steps(got[0], want[0])
    torch.testing.assert_close(exported(got[1]), exported(want[1]), rtol=1e-4, atol=5e-5)


@pytest.mark.timeout(120)
def test_ep_folded_over_tp_on_two_ranks_equals_one_process(tmp_path: Path) -> None:
    """tp = 2 x ep = 2 on two ranks: ep is tp, each rank holding 4 of the 8 experts and
    sending its half of the tokens' assignments to them (the router, the shared expert and
    the dense parts computed alike on both), the results all-gathered; the exchange cut
    into 2 chunks under the experts' compute. Equal to one process."""
    ((one, one_ckpt),) = train_rows_together([(tmp_path / "one", DEEPSEEKISH, [], 3)], 1)
    ((rows, ckpt),) = train_rows_together([
        (tmp_path / "tp-ep", DEEPSEEKISH, ["parallel.tp=2", "parallel.ep=2",
                                           "parallel.ep_overlap_chunks=2"], 3)], 2)
    assert_equal_runs((rows, ckpt), (one, one_ckpt))
    assert exported(one_ckpt)["blocks.1.mlp.gate.expert_bias"].abs().max() > 0  # it moved


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ep_folded_over_every_axis_equals_one_process(tmp_path: Path) -> None:
    """ep folded over cp (cp = 2 x ep = 2 on 4 ranks, dp 2), over dp x cp (ep = 4, ZeRO-2),
    over tp with dp (dp 2 x tp 2 x ep 2; and with the balance loss and a capacity that
    drops, which tp keeps per whole sequence), over tp with sequence parallelism (each tp
    rank routing its own part of the sequence: dp 2 x tp 2 x ep 4, the exchange in 2
    chunks; and at ep = 1, every tp rank's experts whole and their gradients summed over
    tp), ZeRO-3 sharding the experts over the ranks holding the same ones (tp 2 x ep 2 x
    ZeRO-3), and pipeline stages each folding ep over its tp ranks (pp 2 x tp 2 x ep 2):
    every step and the final weights equal one process's."""
    ((one, one_ckpt), (capped, capped_ckpt)) = train_rows_together([
        (tmp_path / "one", DEEPSEEKISH, [], 4), (tmp_path / "capped", CAPACITY, [], 4)], 1)
    runs = {
        "cp-ep": (DEEPSEEKISH, ["parallel.cp=2", "parallel.ep=2"]),
        "dp-cp-ep4-zero2": (DEEPSEEKISH, ["parallel.cp=2", "parallel.ep=4", "parallel.zero=2"]),
        "dp-tp-ep": (DEEPSEEKISH, ["parallel.tp=2", "parallel.ep=2"]),
        "dp-tp-ep-capacity": (CAPACITY, ["parallel.tp=2", "parallel.ep=2"]),
        "sp-ep4": (DEEPSEEKISH, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                 "parallel.ep=4", "parallel.ep_overlap_chunks=2"]),
        "sp-whole-experts": (DEEPSEEKISH, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        "tp-ep-zero3": (DEEPSEEKISH, ["parallel.tp=2", "parallel.ep=2", "parallel.zero=3"]),
        "pp-tp-ep": (DEEPSEEKISH, ["parallel.pp=2", "parallel.tp=2", "parallel.ep=2",
                                   "parallel.microbatches=2"]),
    }
    results = train_rows_together([(tmp_path / name, text, overrides, 4)
                                   for name, (text, overrides) in runs.items()], 4)
    for name, got in zip(runs, results, strict=True):
        want = (capped, capped_ckpt) if runs[name][0] is CAPACITY else (one, one_ckpt)
        try:
            assert_equal_runs(got, want)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    assert all(0 < r["moe_dropped"][0] < 1 for r in capped)  # the capacity dropped some


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_resumes_across_ep_degrees(tmp_path: Path) -> None:
    """Two steps at tp = 2 x ep = 2 on two ranks, the third at dp 2 x tp 2 x ep = 4 on four
    (each rank now holding 2 experts of 8), the fourth on one process (all 8): the
    checkpoints hold the experts, their optimizer state and the routers' biases by global
    index, so the chain equals the unbroken run, step for step."""
    chain = tmp_path / "chain"
    resume = "checkpoint.resume='auto'"
    ((one, one_ckpt),) = train_rows_together([(tmp_path / "one", DEEPSEEKISH, [], 4)], 1)
    ((first, _),) = train_rows_together([
        (chain, DEEPSEEKISH, ["parallel.tp=2", "parallel.ep=2"], 2)], 2)
    ((second, _),) = train_rows_together([
        (chain, DEEPSEEKISH, ["parallel.tp=2", "parallel.ep=4", resume], 3)], 4)
    ((third, ckpt),) = train_rows_together([(chain, DEEPSEEKISH, [resume], 4)], 1)
    assert_equal_runs((first + second + third, ckpt), (one, one_ckpt))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dualpipev_with_ep_folded_over_tp_equals_one_process(tmp_path: Path) -> None:
    """The DualPipeV schedule on 2 stages of 2 virtual stages each (4 MoE blocks, 4
    micro-batches), each stage's ep folded over its 2 tp ranks: the schedule interleaves
    micro-batches' forwards and backwards, and every rank of an ep group runs them in the
    same order, so their exchanges meet; with its pairs overlapped too (each pair's
    backward in a second thread beside its forward, the backward's exchanges, in 2 chunks,
    on the groups' twins). Equal to one process."""
    ((one, one_ckpt),) = train_rows_together([(tmp_path / "one", FOUR_BLOCKS, [], 3)], 1)
    dualpipev = ["parallel.pp=2", "parallel.tp=2", "parallel.ep=2",
                 "parallel.schedule='dualpipev'", "parallel.virtual_stages=2",
                 "parallel.microbatches=4"]
    for got in train_rows_together([
            (tmp_path / "dualpipev", FOUR_BLOCKS, dualpipev, 3),
            (tmp_path / "pairs", FOUR_BLOCKS, [*dualpipev, "parallel.overlap_pairs='on'",
                                               "parallel.ep_overlap_chunks=2"], 3)], 4):
        assert_equal_runs(got, (one, one_ckpt))


@pytest.mark.parametrize(("overrides", "nproc", "message"), [
    (["parallel.tp=2", "parallel.ep=8", "parallel.dp=2"], 4,
     "parallel.ep = 8 does not divide the ranks it is folded over (dp x cp x tp = 2 x 1 x 2 "
     "= 4): choose an ep that divides 4"),
    (["parallel.cp=2", "parallel.ep=4"], 2,
     "parallel.ep = 4 does not divide the ranks it is folded over (dp x cp x tp = 1 x 2 x 1 "
     "= 2): choose an ep that divides 2"),
], ids=["ep-above-dp-tp", "ep-above-cp"])
def test_an_ep_that_does_not_divide_the_folded_ranks_is_one_line(
        tmp_path: Path, overrides: list[str], nproc: int, message: str) -> None:
    assert_refused(tmp_path, DEEPSEEKISH, overrides, message, nproc=nproc)
