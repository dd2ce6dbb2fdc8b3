"""Multi-head latent attention under tensor parallelism equals one process: the attention
alone split by heads over 2 ranks against the plain per-head reference of
tests/models/test_mla.py (float64, forward and backward: the replicated down-projections'
gradients whole on every rank without a sum of their own), and `dtrain train` of
deepseek-tiny at tp = 2 (with its MTP module), tp = 2 with sequence parallelism (without
it: MTP under sequence parallelism is refused, tests/models/test_deepseek.py), and tp = 2
x dp = 2 against one process (losses and gradient norms per step, final weights);
`dtrain plan` lists a tp layout for it.

The plan (dtrain.tensor_parallel.latent_attention_plan): q_b_proj and kv_b_proj
column-parallel by heads, o_proj row-parallel, the latent projections and norms whole on
every rank, the rotary key part every head reads through `share_rope`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain import comm
from dtrain.tensor_parallel import latent_attention_plan, parallelize
from dtrain.testing import run_threads
from tests.context_parallel.test_context_parallel import exported
from tests.models.test_deepseek import TINY, WITHOUT_MTP
from tests.models.test_mla import HEADS, reference_case
from tests.support import cli

T = 12
DROPLESS_WITHOUT_MTP = WITHOUT_MTP.replace("aux_loss_weight = 0.01\n", "")
"""deepseek-tiny's test shape without its MTP module (refused with sequence parallelism:
tests/models/test_deepseek.py) and the balance loss (sequence parallelism wants a dropless
MoE balanced by its router's bias)."""


def split_rank(rank: int, q_lora_rank: int) -> bool:
    """One rank of 2: latent attention split by `latent_attention_plan` (through a model
    holding it where the plan looks, blocks.0.attn); its output, x's gradient and every
    parameter's gradient (this rank's block of a split one, the whole of a replicated one)
    equal the plain reference's on the whole input (float64)."""
    attn, x, dout, want = reference_case(q_lora_rank, T)
    whole = {name: p.grad.clone() for name, p in attn.named_parameters() if p.grad is not None}
    attn.zero_grad()
    holder = nn.Module()
    holder.blocks = nn.ModuleList([nn.Module()])
    holder.blocks[0].attn = attn
    group = comm.resolve(None)
    parallelize(holder, latent_attention_plan(HEADS, attn.cfg), group)
    mine = x.detach().clone().requires_grad_()
    out = attn(mine)
    out.backward(dout)
    torch.testing.assert_close(out, want)
    assert x.grad is not None
    torch.testing.assert_close(mine.grad, x.grad)
    for name, p in attn.named_parameters():
        assert p.grad is not None, name
        grad = whole[name]
        if p.shape != grad.shape:  # split by heads: this rank's rows (o_proj: columns)
            dim = 0 if p.shape[0] != grad.shape[0] else 1
            grad = grad.chunk(group.size, dim)[group.rank]
        torch.testing.assert_close(p.grad, grad, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("q_lora_rank", [16, 0])
def test_latent_attention_split_by_heads_equals_the_reference(q_lora_rank: int) -> None:
    """Latent attention with and without the query bottleneck split over 2 ranks by heads:
    output and every gradient equal the plain reference's, the replicated down-projections'
    and norms' whole on each rank (the up-projections sum the latents' gradients, share_rope
    the rotary key part's)."""
    assert run_threads(split_rank, 2, q_lora_rank) == [True] * 2


@pytest.mark.timeout(300)
def test_deepseek_tiny_at_tp_2_equals_one_process(tmp_path: Path) -> None:
    """`dtrain train` of deepseek-tiny (with its MTP module, whole on each tp rank) at
    tp = 2 on two ranks: every step's loss and gradient norm, and the final weights, equal
    one process's on the same global batch (SGD, no clip: a gradient summed once too often
    or not at all shows)."""
    ((want, one),) = cli.train_rows_together([(tmp_path / "one", TINY, [], 3)], 1)
    ((got, ckpt),) = cli.train_rows_together([(tmp_path / "tp2", TINY, ["parallel.tp=2"], 3)],
                                             2)
    cli.assert_same_steps(got, want)
    torch.testing.assert_close(exported(ckpt), exported(one), rtol=1e-4, atol=5e-5)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_deepseek_tiny_with_sequence_parallelism_equals_one_process(tmp_path: Path) -> None:
    """deepseek-tiny without MTP at tp = 2 with sequence parallelism (the latent
    projections on each rank's part of the sequence, the latents and the rotary key part
    gathered) on two ranks equals one process, steps and final weights."""
    text = DROPLESS_WITHOUT_MTP
    ((want, one),) = cli.train_rows_together([(tmp_path / "one", text, [], 3)], 1)
    ((got, ckpt),) = cli.train_rows_together([
        (tmp_path / "sp", text, ["parallel.tp=2", "parallel.sequence_parallel=true"], 3)], 2)
    cli.assert_same_steps(got, want)
    torch.testing.assert_close(exported(ckpt), exported(one), rtol=1e-4, atol=5e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepseek_tiny_at_tp_2_by_dp_2_equals_one_process(tmp_path: Path) -> None:
    """deepseek-tiny at tp = 2 x dp = 2 on four ranks (with MTP; and without it under
    sequence parallelism) equals one process on the same global batch."""
    text = TINY.replace("batch_size = 4", "batch_size = 8")
    plain = DROPLESS_WITHOUT_MTP.replace("batch_size = 4", "batch_size = 8")
    (want, one), (want_plain, one_plain) = cli.train_rows_together(
        [(tmp_path / "one", text, [], 3), (tmp_path / "one-plain", plain, [], 3)], 1)
    runs = cli.train_rows_together([
        (tmp_path / "tp2dp2", text, ["parallel.tp=2"], 3),
        (tmp_path / "sp-dp2", plain, ["parallel.tp=2", "parallel.sequence_parallel=true"], 3)],
        4)
    for (got, ckpt), rows, base in zip(runs, [want, want_plain], [one, one_plain],
                                       strict=True):
        cli.assert_same_steps(got, rows)
        torch.testing.assert_close(exported(ckpt), exported(base), rtol=1e-4, atol=5e-5)


@pytest.mark.timeout(120)
def test_the_planner_lists_tp_layouts_for_deepseek_tiny(tmp_path: Path) -> None:
    """`dtrain plan` of deepseek-tiny on two ranks traces its tp layouts as well (the tp
    plan knows latent attention)."""
    out = tmp_path / "plan.json"
    result = cli.dtrain("plan", "--set", "model.arch='llama'", "--set",
                        "model.preset='deepseek-tiny'", "-n", "2", "--json", str(out),
                        timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
    layouts = [row["layout"] for row in json.loads(out.read_text())["layouts"]]
    assert "tp2" in layouts, layouts
