"""Context parallelism equals one process: attention alone (each method, cp = 2 and 4,
causal and not, grouped-query), dtrain's GPT and Llama (loss and every gradient), and
`dtrain train` in every layout it composes with (losses per step and final weights),
resumed across cp degrees; its errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from dtrain import comm
from dtrain.checkpoint import universal
from dtrain.context_parallel import ContextParallel, attention, chunks
from dtrain.errors import ConfigError
from dtrain.models import context
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.models.llama import Llama, LlamaConfig
from dtrain.testing import run_threads
from tests.models.test_models_train import BASE
from tests.support import cli

B, T, D = 2, 16, 8
CASES = [(m, n, causal) for m in ("ring", "allgather", "alltoall") for n in (2, 4)
         for causal in (True, False)]


def _chunks_equal_whole(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        want: torch.Tensor, dout: torch.Tensor, **given: object) -> bool:
    """This rank's chunks of q, k and v through `method` (with `given`, as attention takes
    it), backward from its chunks of `dout`: its output and q, k, v gradients equal the
    whole attention's (`want`, backward from `dout` already) on its chunks."""
    cp = ContextParallel(comm.resolve(None), method)
    mine = [chunks.shard(t.detach(), cp.rank, cp.size, dim=2).requires_grad_() for t in (q, k, v)]
    out = cp.attention(*mine, **given)
    out.backward(chunks.shard(dout, cp.rank, cp.size, dim=2))
    torch.testing.assert_close(out, chunks.shard(want.detach(), cp.rank, cp.size, dim=2))
    for got, whole in zip(mine, (q, k, v), strict=True):
        torch.testing.assert_close(got.grad, chunks.shard(whole.grad, cp.rank, cp.size, dim=2))
    return True


def attention_rank(rank: int, method: str, causal: bool, heads: tuple[int, int]) -> bool:
    """One rank: its chunks' output and q, k, v gradients against full SDPA (float64)."""
    gen = torch.Generator().manual_seed(0)  # threads: each its own, all alike
    h, kv = heads
    q, k, v = (torch.randn(B, n, T, D, dtype=torch.float64, generator=gen).requires_grad_()
               for n in (h, kv, kv))
    dout = torch.randn(B, h, T, D, dtype=torch.float64, generator=gen)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1),
                                          v.repeat_interleave(h // kv, 1), is_causal=causal)
    want.backward(dout)
    return _chunks_equal_whole(method, q, k, v, want, dout, causal=causal)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method, n, causal", CASES)
def test_attention_equals_sdpa_forward_and_backward(method: str, n: int, causal: bool) -> None:
    """Each method on 2 and 4 ranks, causal and not, with 8 query heads over 4 key/value
    heads: every rank's output and its q, k and v gradients equal full attention's on its
    chunks, in float64."""
    assert run_threads(attention_rank, n, method, causal, (8, 4)) == [True] * n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("causal", [True, False])
def test_the_ring_without_fused_kernels_equals_sdpa(monkeypatch: pytest.MonkeyPatch,
                                                   causal: bool) -> None:
    """Where torch's fused CPU attention is missing (another device, an older torch) the
    ring's blocks use the plain formulas: the same outputs and gradients."""
    monkeypatch.setattr(attention, "_fused", lambda device, dtype: False)
    assert run_threads(attention_rank, 4, "ring", causal, (8, 4)) == [True] * 4


def documents_rank(rank: int, method: str) -> bool:
    """One rank: packed documents' attention (each row its own document lengths, some
    documents wholly inside one chunk, so that whole ring blocks go unseen) against full
    SDPA under the block-causal mask, output and gradients (float64)."""
    from dtrain.masks import document_mask

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, n, T, D, dtype=torch.float64, generator=gen).requires_grad_()
               for n in (8, 4, 4))
    dout = torch.randn(B, 8, T, D, dtype=torch.float64, generator=gen)
    lengths = ([3, 1, 6, 2, 4], [16])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                          v.repeat_interleave(2, 1),
                                          attn_mask=document_mask(positions))
    want.backward(dout)
    rank, size = comm.resolve(None).rank, comm.resolve(None).size
    return _chunks_equal_whole(method, q, k, v, want, dout,
                               documents=chunks.shard(positions, rank, size))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method, n", [(m, n) for m in ("ring", "allgather", "alltoall")
                                       for n in (1, 2, 4)])
def test_packed_documents_follow_the_chunks(method: str, n: int) -> None:
    """Each method on 1, 2 and 4 ranks: attention stays inside each packed document
    whatever rank holds its tokens, output and gradients equal to one process's."""
    assert run_threads(documents_rank, n, method) == [True] * n


def test_chunks_are_balanced_and_round_trip() -> None:
    """Rank i holds chunks i and 2N-1-i, at their global positions; unshard inverts it."""
    x = torch.arange(16).view(1, 16)
    parts = [chunks.shard(x, r, 4) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(chunks.unshard(parts), x)
    for r in range(4):
        assert torch.equal(chunks.positions(4, r, 4), parts[r][0])
    with pytest.raises(ConfigError, match="does not cut into 2 x cp = 8 equal chunks"):
        chunks.shard(torch.zeros(1, 12), 0, 4)


def odd_heads_rank(rank: int) -> str:
    q = torch.zeros(1, 3, 8, 4)
    try:
        ContextParallel(comm.resolve(None), "alltoall").attention(q, q, q)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_alltoall_refuses_heads_cp_does_not_divide() -> None:
    assert run_threads(odd_heads_rank, 2)[0] == (
        "parallel.cp_method = \"alltoall\" splits the heads over cp = 2, which does not divide "
        "the 3 query heads this rank holds: use cp_method = \"ring\" or \"allgather\"")


def test_an_unknown_method_is_one_line() -> None:
    with pytest.raises(ConfigError, match="parallel.cp_method = 'zigzag' is unknown"):
        ContextParallel(None, "zigzag")


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from dtrain.models.hf import HFCausalLM

    return HFCausalLM(LlamaForCausalLM(HFLlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)), 32)


MODELS = {
    "gpt": lambda: GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)),
    "llama": lambda: Llama(LlamaConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4,
                                       n_kv_head=2, n_embd=32, ffn_hidden=48)),
    "hf-llama": hf_llama,
}


def model_rank(rank: int, base: nn.Module, method: str, x: torch.Tensor, y: torch.Tensor
               ) -> tuple[float, dict[str, torch.Tensor]]:
    model = copy.deepcopy(base)
    cp = ContextParallel(comm.resolve(None), method)
    context.apply(model, cp)
    loss = model(chunks.shard(x, cp.rank, cp.size), chunks.shard(y, cp.rank, cp.size))[1]
    loss.backward()
    grads = {n: comm.all_reduce(p.grad.clone(), op="avg") for n, p in model.named_parameters()}
    return float(comm.all_reduce(loss.detach(), op="avg")), grads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("method", ["ring", "allgather", "alltoall"])
@pytest.mark.parametrize("n", [2, 4])
def test_models_give_one_process_loss_and_gradients(arch: str, method: str, n: int) -> None:
    """dtrain's GPT (learned positions) and Llama (rotary, grouped-query), and transformers'
    Llama (through its attention interface) on 2 and 4 ranks' chunks: the mean of their
    losses and of their gradients equal one process's on whole sequences (global
    positions, attention over every chunk). The Llamas' 2 key/value heads do not split
    over 4 ranks: alltoall refuses them there."""
    torch.manual_seed(0)
    base = MODELS[arch]()
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, 32), generator=gen) for _ in range(2))
    if method == "alltoall" and n == 4 and arch != "gpt":
        with pytest.raises(RuntimeError, match="does not divide the 2 key/value heads"):
            run_threads(model_rank, n, base, method, x, y)
        return
    serial = copy.deepcopy(base)
    loss = serial(x, y)[1]
    loss.backward()
    for got, grads in run_threads(model_rank, n, base, method, x, y):
        torch.testing.assert_close(got, loss.item())
        for name, p in serial.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_apply_refuses_other_models() -> None:
    with pytest.raises(ConfigError, match="context parallelism runs dtrain's GPT and Llama and"):
        context.apply(nn.Linear(2, 2), ContextParallel(None))


# ------------------------------------------------------------------ dtrain train
CP_TOML = """
[model]
arch = "llama"
n_layer = 2
n_embd = 32
n_head = 4
n_kv_head = 2
ffn_hidden = 64
block_size = 32
""" + BASE


def cp_run(folder: Path, args: list[str], steps: int) -> tuple[list[float], Path]:
    """`dtrain train` of CP_TOML (SGD without a clip: tests.support.cli.EXACT_OPTIMIZER):
    each step's loss and gradient norm (before any clip) in one list, and the checkpoints."""
    rows, checkpoints = cli.train_rows(folder, CP_TOML, args, steps)
    return [r["loss"] for r in rows] + [r["grad_norm"] for r in rows], checkpoints


def exported(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(universal.export(ckpt, ckpt.parent / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_runs_in_context_parallel_layouts_equal_one_process(tmp_path: Path) -> None:
    """`dtrain train` of a small Llama against one process (the layouts that are not
    resumed trained by its Trainer on ranks forked once): two steps at cp = 4 (ring, its
    steps' compute and messages on the timeline) on four ranks resumed for one at cp = 2
    (allgather) on two, then for one on one process; cp = 2 x tp = 2 with sequence
    parallelism; cp = 2 x pp = 2; cp = 2 x DataParallel, ZeRO-1 and ZeRO-3 over dp = 2
    (gradients averaged over dp x cp); cp = 2 (alltoall) with every block recomputed; cp =
    4 (allgather). Every step's loss and gradient norm and the final weights equal the
    one-process run's (SGD: a divisor of dp instead of dp x cp shows); DiLoCo over two sync
    groups of cp = 2 equals DiLoCo over two sync groups of one rank."""
    ((rows, one),) = cli.train_rows_together([(tmp_path / "one", CP_TOML, [], 4)], 1)
    want = [r["loss"] for r in rows] + [r["grad_norm"] for r in rows]
    trace = tmp_path / "ring.json"
    first, _ = cp_run(tmp_path / "chain", ["-n", "4", "--set", "parallel.cp=4",
                                           "--timeline", str(trace)], 2)
    second, _ = cp_run(tmp_path / "chain", ["-n", "2", "--set", "parallel.cp=2", "--set",
                                            "parallel.cp_method='allgather'", "--resume"], 3)
    third, chain = cp_run(tmp_path / "chain", ["-n", "1", "--resume"], 4)
    losses, norms = (first[:2] + second[:1] + third[:1], first[2:] + second[1:] + third[1:])
    runs = [(losses + norms, chain)]
    together = {4: [("sp", ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
                    ("pp", ["parallel.cp=2", "parallel.pp=2", "parallel.microbatches=2"]),
                    ("dp", ["parallel.cp=2"]),
                    ("zero1", ["parallel.cp=2", "parallel.zero=1"]),
                    ("zero", ["parallel.cp=2", "parallel.zero=3"]),
                    ("allgather", ["parallel.cp=4", "parallel.cp_method='allgather'"])],
                2: [("recompute", ["parallel.cp=2", "parallel.cp_method='alltoall'",
                                   "memory.recompute='full'"])]}
    for nproc, named in together.items():  # on ranks forked once: no launch per layout
        trained = cli.train_rows_together(
            [(tmp_path / name, CP_TOML, overrides, 4) for name, overrides in named], nproc)
        runs += [([r["loss"] for r in rows] + [r["grad_norm"] for r in rows], ckpt)
                 for rows, ckpt in trained]
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    for rank in range(4):  # each ring step's compute, and the blocks sent and received
        names = [e["name"] for e in events if e.get("pid") == rank]
        # 2 training steps x 2 layers x (4 forward + 4 backward ring steps; 3 blocks sent
        # forward, 3 blocks and 4 gradients backward), and the final evaluation's 2 batches
        # x 2 layers x (4 ring steps, 3 blocks sent)
        assert names.count("cp ring step") == 2 * 2 * 8 + 2 * 2 * 4
        assert names.count("send") == names.count("recv") == 2 * 2 * 10 + 2 * 2 * 3
    diloco = ["--set", "sync.method='diloco'", "--set", "sync.groups=2", "--set",
              "sync.every=2"]
    plain, plain_ckpt = cp_run(tmp_path / "diloco", ["-n", "2", *diloco], 4)
    split, split_ckpt = cp_run(tmp_path / "diloco-cp", ["-n", "4", "--set", "parallel.cp=2",
                                                        *diloco], 4)
    torch.testing.assert_close(split, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(exported(split_ckpt), exported(plain_ckpt), rtol=1e-4,
                               atol=5e-5)
    weights = exported(one)
    for losses, ckpt in runs:
        torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(exported(ckpt), weights, rtol=1e-4, atol=5e-5)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_hugging_face_llama_at_cp_2_equals_one_process(tmp_path: Path) -> None:
    """`dtrain train` of transformers' Llama (`arch = "hf"`) at cp = 2, its attention layers
    calling dtrain's ring through transformers' attention interface: every step's loss and
    the final weights equal one process's."""
    from transformers import LlamaConfig as HFLlamaConfig

    HFLlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  bos_token_id=None, eos_token_id=None).save_pretrained(tmp_path / "llama")
    text = f'[model]\narch = "hf"\nhf_config = "{tmp_path / "llama"}"\nblock_size = 32\n' + BASE
    one, one_ckpt = cli.train_rows(tmp_path / "one", text, ["-n", "1"], 3)
    split, split_ckpt = cli.train_rows(tmp_path / "cp", text, ["-n", "2", "--set",
                                                               "parallel.cp=2"], 3)
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in split], [r[key] for r in one],
                                   rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    torch.testing.assert_close(exported(split_ckpt), exported(one_ckpt), rtol=1e-4, atol=5e-5)
