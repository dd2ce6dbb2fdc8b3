"""Multi-head latent attention and multi-token prediction under context parallelism equal
one process: the attention alone on each rank's chunks against the plain per-head
reference of tests/models/test_mla.py (float64, forward and backward, every method); MTP
modules on chunks (their tokens ahead crossing chunk boundaries, packed rows too) against
one process's loss and gradients; and `dtrain train` of deepseek-tiny at cp = 2 (without
MTP on the ring and all-gather, with it on the ring) against one process (losses and
gradient norms per step, final weights).

MLA's keys are qk_nope + qk_rope wide per head and its values v_head_dim: the cp methods
exchange those decompressed per-head keys and values (dtrain.context_parallel.attention),
and the rotary angles are those of each chunk's global positions.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain import comm
from dtrain.context_parallel import ContextParallel, chunks
from dtrain.models import ModelConfig, context
from dtrain.models.llama_parts import rotary
from dtrain.models.mla import LatentAttention
from dtrain.testing import run_threads
from tests.context_parallel.test_context_parallel import exported
from tests.models.test_deepseek import WITHOUT_MTP
from tests.models.test_mla import THETA, WIDTHS, attention, reference
from tests.models.test_mtp import DEEPSEEK, SHAPE, model_of
from tests.support import cli

T = 16


def latent_rank(rank: int, base: LatentAttention, method: str) -> bool:
    """One rank: its chunks of x through latent attention whose core meets the other ranks'
    keys and values through `method`, the rotary angles of the chunks' global positions;
    its output and x's gradient on its chunks, and every parameter's gradient summed over
    the ranks, equal the plain reference's on the whole sequence (float64)."""
    attn = copy.deepcopy(base)  # built once: threads share torch's default generator
    gen = torch.Generator().manual_seed(1)  # threads: each its own, all alike
    x = torch.randn(2, T, attn.o_proj.out_features, dtype=torch.float64, generator=gen,
                    requires_grad=True)
    dout = torch.randn(2, T, attn.o_proj.out_features, dtype=torch.float64, generator=gen)
    want = reference(attn, x)
    want.backward(dout)
    want_params = [p.grad.clone() for p in attn.parameters()]
    attn.zero_grad()
    cp = ContextParallel(comm.resolve(None), method)
    attn.core.context = cp
    mine = chunks.shard(x.detach(), cp.rank, cp.size).requires_grad_()
    rope = rotary(mine.shape[1], WIDTHS["qk_rope_head_dim"], THETA, mine.device, mine.dtype,
                  cp.positions(mine.shape[1]))
    out = attn(mine, rope)
    out.backward(chunks.shard(dout, cp.rank, cp.size))
    torch.testing.assert_close(out, chunks.shard(want.detach(), cp.rank, cp.size))
    assert x.grad is not None and mine.grad is not None
    torch.testing.assert_close(mine.grad, chunks.shard(x.grad, cp.rank, cp.size))
    for p, w in zip(attn.parameters(), want_params, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(comm.all_reduce(p.grad.clone()), w)
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["ring", "allgather", "alltoall"])
@pytest.mark.parametrize("n", [2, 4])
def test_latent_attention_on_chunks_equals_the_reference(method: str, n: int) -> None:
    """Latent attention (query bottleneck, values 10 wide against keys of 6 + 8) on 2 and 4
    ranks' chunks, each method: output and gradients equal the plain reference's on the
    whole sequence. The ring's blocks take the plain formulas (torch's fused CPU kernel
    wants one head size); all-to-all splits the 4 heads."""
    assert run_threads(latent_rank, n, attention(16), method) == [True] * n


def test_latent_attention_with_plain_queries_on_the_ring() -> None:
    """Without the query bottleneck (DeepSeek-V2-Lite's queries), cp = 2 on the ring."""
    assert run_threads(latent_rank, 2, attention(0), "ring") == [True] * 2


def mtp_rank(rank: int, base: nn.Module, method: str, x: torch.Tensor, y: torch.Tensor,
             positions: torch.Tensor | None) -> tuple[float, dict[str, torch.Tensor]]:
    """One rank: the model on its chunks (its MTP modules reading the tokens ahead from
    the other ranks' chunks); the cp group's mean loss and mean gradients."""
    model = copy.deepcopy(base).train()
    cp = ContextParallel(comm.resolve(None), method)
    context.apply(model, cp)
    given = {} if positions is None else {"positions": chunks.shard(positions, cp.rank,
                                                                    cp.size)}
    loss = model(chunks.shard(x, cp.rank, cp.size), chunks.shard(y, cp.rank, cp.size),
                 **given)[1]
    loss.backward()
    grads = {n: comm.all_reduce(torch.zeros_like(p) if p.grad is None else p.grad.clone(),
                                op="avg") for n, p in model.named_parameters()}
    return float(comm.all_reduce(loss.detach(), op="avg")), grads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg, n, packed", [(SHAPE, 2, False), (SHAPE, 4, True),
                                            (DEEPSEEK, 2, True)],
                         ids=["gqa-dense-cp2", "gqa-dense-cp4-packed", "deepseek-tiny-cp2"])
def test_multi_token_prediction_on_chunks_equals_one_process(cfg: ModelConfig, n: int,
                                                             packed: bool) -> None:
    """Two MTP depths on cp ranks' chunks (ring): the tokens k ahead and their targets
    cross chunk boundaries, the last k of a row (all on rank 0) have none, nor, in packed
    rows, those whose token ahead is in the next document: the cp group's loss (next-token
    + MTP, float64) and every gradient equal one process's on whole rows."""
    base = model_of(cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2, 16), generator=gen)
    y = torch.roll(x, -1, 1)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
                              list(range(7)) + list(range(9))]) if packed else None
    serial = copy.deepcopy(base).train()
    loss = serial(x, y, **({} if positions is None else {"positions": positions}))[1]
    loss.backward()
    for got, grads in run_threads(mtp_rank, n, base, "ring", x, y, positions):
        torch.testing.assert_close(got, loss.item())
        for name, p in serial.named_parameters():
            want = torch.zeros_like(p) if p.grad is None else p.grad
            torch.testing.assert_close(grads[name], want, msg=name)


TINY_CP = WITHOUT_MTP.replace("aux_loss_weight = 0.01\n", "")
"""deepseek-tiny's shape (latent attention, a dense block then grouped sigmoid routing with
a shared expert) without its MTP module and without the balance loss (context
parallelism wants a dropless MoE balanced by its router's bias)."""
TINY_CP_MTP = TINY_CP.replace("routed_scaling_factor = 2.5", """routed_scaling_factor = 2.5
mtp_depth = 1
mtp_loss_weight = 0.3""")
"""The same with deepseek-tiny's MTP module."""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_deepseek_tiny_at_cp_2_equals_one_process(tmp_path: Path) -> None:
    """`dtrain train` of deepseek-tiny at cp = 2 on two ranks: without MTP on the ring
    and all-gather, and with its MTP module on the ring: every step's loss and gradient
    norm, and the final weights, equal one process's on the same global batch (SGD, no
    clip: a wrong divisor or a wrong position shows)."""
    (plain, plain_ckpt), (mtp, mtp_ckpt) = cli.train_rows_together(
        [(tmp_path / "one", TINY_CP, [], 3), (tmp_path / "one-mtp", TINY_CP_MTP, [], 3)], 1)
    runs = cli.train_rows_together([
        (tmp_path / method, TINY_CP, ["parallel.cp=2", f"parallel.cp_method='{method}'"], 3)
        for method in ("ring", "allgather")] + [
        (tmp_path / "ring-mtp", TINY_CP_MTP, ["parallel.cp=2"], 3)], 2)
    for (got, ckpt), (want, one) in zip(runs, [(plain, plain_ckpt)] * 2 + [(mtp, mtp_ckpt)],
                                        strict=True):
        cli.assert_same_steps(got, want)
        torch.testing.assert_close(exported(ckpt), exported(one), rtol=1e-4, atol=5e-5)
