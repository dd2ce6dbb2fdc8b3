"""Sequence parallelism equals one process: logits, loss, every gradient, training steps;
under recomputation and no_grad, with ZeRO over dp and with the pipeline; its errors."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import dtrain
from dtrain import comm, pipeline
from dtrain import tensor_parallel as tp
from dtrain.comm.threads import ThreadGroup
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.models.llama import Llama, LlamaConfig
from dtrain.models.recompute import recompute_modules
from dtrain.testing import run_ranks, run_threads

ALGORITHM = "native"  # "auto" would first calibrate itself on each group
T, VOCAB, STEPS, CLIP = 16, 256, 3, 0.5
CONFIGS = {
    "gpt": GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_embd=32),
    "llama": LlamaConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=32, ffn_hidden=64),
    "qwen3": LlamaConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=32, ffn_hidden=64, qk_norm=True),
}


def build(arch: str) -> nn.Module:
    torch.manual_seed(0)
    return (GPT if arch == "gpt" else Llama)(CONFIGS[arch])


def tokens(step: int, n: int = 4, length: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(400 + step)
    return (torch.randint(0, VOCAB, (n, length), generator=g),
            torch.randint(0, VOCAB, (n, length), generator=g))


def adamw(params) -> torch.optim.Optimizer:
    """eps well above rounding noise: GPT's key bias has a zero gradient in exact arithmetic,
    and Adam would turn its rounding noise into full steps."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)


def float32(losses: list[float]) -> torch.Tensor:
    """float32 losses kept as Python floats, as float32 again: assert_close then allows
    float32's rounding, where on Python floats it would allow float64's."""
    return torch.tensor(losses, dtype=torch.float32)


def train_serial(model: nn.Module, clip: bool = True) -> tuple[list[float], dict]:
    opt = adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = model(*tokens(step))[1]
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt.state_dict()["state"]


def split(model: nn.Module, group=None) -> nn.Module:
    return tp.split_model(model, group, sequence_parallel=True, algorithm=ALGORITHM)


def in_grid(rank: int, outer: str, fn: Callable[[comm.Group, comm.Group], dict]) -> dict:
    """`fn(tp group, outer group)` on a 2 x 2 thread world: tp over consecutive ranks,
    `outer` (dp or pp) across them."""
    fabric = comm.resolve(None).fabric
    tp_group = ThreadGroup(fabric, rank % 2, [rank - rank % 2, rank - rank % 2 + 1],
                           name=f"tp{rank // 2}")
    other = ThreadGroup(fabric, rank // 2, [rank % 2, rank % 2 + 2], name=f"{outer}{rank % 2}")
    try:
        return fn(tp_group, other)
    finally:
        tp_group.executor.close()
        other.executor.close()


@pytest.mark.timeout(60)
def test_sequence_collectives_and_their_gradients() -> None:
    whole = torch.arange(24.0).view(2, 4, 3)  # [batch, time, width]

    def body(rank: int) -> list[torch.Tensor]:
        g = comm.resolve(None)
        part = whole[:, 2 * rank : 2 * rank + 2].clone().requires_grad_()
        gathered = tp.gather_sequence(part, g, ALGORITHM)
        (gathered * (rank + 1)).sum().backward()  # summed over ranks, this rank's part kept
        full = (whole * (rank + 1)).requires_grad_()
        summed = tp.reduce_scatter_sequence(full, g, ALGORITHM)
        (summed * torch.arange(2.0).view(1, 2, 1)).sum().backward()
        leaf = whole.clone().requires_grad_()
        tp.scatter_sequence(leaf, g, ALGORITHM).sum().backward()
        return [gathered.detach(), part.grad, summed.detach(), full.grad, leaf.grad]

    for rank, (gathered, grad, summed, full_grad, leaf_grad) in enumerate(run_threads(body, 2)):
        assert torch.equal(gathered, whole)
        assert torch.equal(grad, torch.full((2, 2, 3), 3.0))
        assert torch.equal(summed, 3 * whole[:, 2 * rank : 2 * rank + 2])
        assert torch.equal(full_grad, torch.arange(2.0).repeat(2).view(1, 4, 1).expand(2, 4, 3))
        assert torch.equal(leaf_grad, torch.ones(2, 4, 3))  # every rank's part, gathered


def equal_then_train(rank: int, base: nn.Module) -> dict:
    g = comm.resolve(None)
    model = split(copy.deepcopy(base))
    x, y = tokens(0)
    traffic = comm.traffic(g, reset=True)
    part, loss = model(x, y)
    traffic = comm.traffic(g, reset=True)
    loss.backward()
    out = {"logits": tp.gather_last(part, g, ALGORITHM).detach(), "loss": loss.detach(),
           "grads": tp.full_grads(model), "forward": traffic}
    plain = tp.split_model(copy.deepcopy(base), g, algorithm=ALGORITHM)
    comm.traffic(g, reset=True)
    plain(x, y)
    out["plain forward"] = comm.traffic(g, reset=True)
    model.zero_grad()
    optimizer, losses = adamw(model.parameters()), []
    for step in range(STEPS):
        loss = model(*tokens(step))[1]
        loss.backward()
        tp.clip_grad_norm_(model, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {**out, "losses": losses, "state": tp.full_state_dict(model),
            "optim": tp.full_optimizer_state(model, optimizer)["state"]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ["gpt", "llama", "qwen3"])
def test_equals_one_process(arch: str) -> None:
    """tp=2 with sequence parallelism: logits, loss and every gradient of a step, then
    training steps (clipped AdamW), equal the unsplit model's (Qwen3's per-head norms,
    which see the whole sequence and this rank's heads, summed over the heads only). The
    forward sends what plain tensor parallelism sends, plus the head's gather: q, k, v
    share one gather."""
    base = build(arch)
    serial = copy.deepcopy(base)
    logits, loss = serial(*tokens(0))
    loss.backward()
    grads = {n: p.grad for n, p in serial.named_parameters()}
    serial.zero_grad()
    losses, optim = train_serial(serial)
    head_gather = 4 * T * CONFIGS[arch].n_embd * 4 // 2  # bytes of [4, T, width] x (n-1)/n
    for r in run_threads(equal_then_train, 2, base):
        torch.testing.assert_close(r["logits"], logits.detach())
        torch.testing.assert_close(r["loss"], loss.detach())
        for name, grad in grads.items():
            torch.testing.assert_close(r["grads"][name], grad, msg=name)
        torch.testing.assert_close(float32(r["losses"]), float32(losses))
        torch.testing.assert_close(r["state"], serial.state_dict())
        torch.testing.assert_close(r["optim"], optim)
        assert sum(r["forward"].values()) == sum(r["plain forward"].values()) + head_gather


RECOMPUTED = {"blocks": ["blocks.*"], "attn-and-mlp": ["blocks.*.attn", "blocks.*.mlp"],
              "attention core": ["blocks.*.attn.core"]}  # the column layers keep parts


def recompute_and_no_grad(rank: int, base: nn.Module) -> dict:
    g, out = comm.resolve(None), {}
    for case, names in RECOMPUTED.items():
        model = split(copy.deepcopy(base))
        recompute_modules(model, names)
        model(*tokens(0))[1].backward()
        out[case] = tp.full_grads(model)
    gather = model.blocks[0].attn.q_proj.sequence_gather
    with torch.no_grad():
        logits = model(tokens(0)[0])
    out["held"] = gather._last is not None  # the head's input is gone, and its gather too
    with torch.inference_mode():
        inferred = model(tokens(0)[0]).clone()
    out["logits"] = tp.gather_last(logits, g, ALGORITHM)
    out["inferred"] = tp.gather_last(inferred, g, ALGORITHM)
    return out


@pytest.mark.timeout(60)
def test_recomputation_and_no_grad() -> None:
    """Recomputed blocks gather again in backward (recomputed attention and MLP even from
    the same input tensor as in forward), their column-parallel layers keeping their
    whole input; with only attention's core recomputed they keep their part; a forward
    without autograd equals the unsplit model's and keeps no gathered tensor after it."""
    base = build("llama")
    serial = copy.deepcopy(base)
    x, y = tokens(0)
    serial(x, y)[1].backward()
    with torch.no_grad():
        logits = serial(x)
    for r in run_threads(recompute_and_no_grad, 2, base):
        for case in RECOMPUTED:
            for name, p in serial.named_parameters():
                torch.testing.assert_close(r[case][name], p.grad, msg=f"{case}: {name}")
        torch.testing.assert_close(r["logits"], logits)
        torch.testing.assert_close(r["inferred"], logits)
        assert not r["held"]


def over_dp(rank: int, base: nn.Module, wrap: str) -> dict:
    """dp=2 x tp=2: `wrap` is "dp" (DataParallel, two micro-batches a step: the first
    under no_sync) or "zero1".."zero3"."""
    def body(tp_group: comm.Group, dp_group: comm.Group) -> dict:
        model = split(copy.deepcopy(base), tp_group)
        if wrap == "dp":
            outer = dtrain.DataParallel(model, group=dp_group, algorithm=ALGORITHM)
            opt = adamw(model.parameters())
        else:
            outer = opt = dtrain.ZeRO(model, adamw, stage=int(wrap[-1]), group=dp_group,
                                      algorithm=ALGORITHM)
        half = slice(dp_group.rank * 2, dp_group.rank * 2 + 2)
        for step in range(STEPS):
            x, y = tokens(step)
            if wrap == "dp":  # two micro-batches of one row each, each loss halved
                with outer.no_sync():
                    (outer(x[half][:1], y[half][:1])[1] / 2).backward()
                (outer(x[half][1:], y[half][1:])[1] / 2).backward()
            else:
                outer(x[half], y[half])[1].backward()
            opt.step()
            opt.zero_grad()
        return tp.full_state_dict(model)

    return in_grid(rank, "dp", body)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("wrap", ["dp", "zero1", "zero2"])  # zero3 x tp crashes on threads
def test_over_dp_equals_one_process(wrap: str) -> None:
    """dp=2 x tp=2 (threads): sequence-parallel Llama under DataParallel (with gradient
    accumulation) or ZeRO over dp; the norms' gradients, summed over tp at the end of
    backward, reach dp's reduction whole."""
    base = build("llama")
    serial = copy.deepcopy(base)
    train_serial(serial, clip=False)
    for state in run_threads(functools.partial(over_dp, base=base, wrap=wrap), 4):
        torch.testing.assert_close(state, serial.state_dict())


def pipelined(base: nn.Module, tp_group: comm.Group, pp_group: comm.Group) -> dict:
    """pp=2 x tp=2: the sequence-parallel model cut into two stages; the first holds the
    cut into sequence parts, the activations sent between stages are those parts."""
    model = split(copy.deepcopy(base), tp_group)
    mine = pipeline.pieces_for(pipeline.cut(model, 2), pp_group)
    pipe = pipeline.Pipeline(mine, pp_group, microbatches=2, schedule="1f1b",
                             loss_fn=pipeline.loss_of(model),
                             tied=pipeline.tied_weights(model, mine, pp_group))
    opt = adamw(nn.ModuleList(mine).parameters())
    losses = []
    for step in range(STEPS):
        losses.append(pipe.step(*tokens(step)).item())
        opt.step()
        opt.zero_grad()
    state = {k: v for piece in mine for k, v in tp.full_state_dict(piece).items()}
    return {"losses": losses, "state": state}


def pipelined_rank(base: nn.Module) -> dict:
    mesh = dtrain.Mesh(pp=2, tp=2)
    return pipelined(base, mesh.group("tp"), mesh.group("pp"))


def check_pipelined(arch: str, run: Callable[[nn.Module], list[dict]]) -> None:
    base = build(arch)
    serial = copy.deepcopy(base)
    losses, _ = train_serial(serial, clip=False)
    results = run(base)
    for r in results:
        torch.testing.assert_close(float32(r["losses"]), float32(losses))
        for name, value in r["state"].items():
            torch.testing.assert_close(value, serial.state_dict()[name], msg=name)
    assert set().union(*(r["state"] for r in results)) == set(serial.state_dict())


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["gpt", "llama"])  # gpt: its head is tied across stages
def test_pp2_tp2_on_threads_equals_one_process(arch: str) -> None:
    check_pipelined(arch, lambda base: run_threads(
        lambda rank: in_grid(rank, "pp", functools.partial(pipelined, base)), 4))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_pp2_tp2_on_four_processes_equals_one_process() -> None:
    check_pipelined("llama", lambda base: run_ranks(pipelined_rank, 4, base, timeout=180))


def gloo_rank(base: nn.Module) -> dict:
    model = split(copy.deepcopy(base))
    loss = model(*tokens(0))[1]
    loss.backward()
    return {"loss": loss.detach(), "grads": tp.full_grads(model)}


@pytest.mark.slow  # the thread tests above cover the same in the quick suite
@pytest.mark.timeout(120)
def test_two_processes_on_gloo_equal_one_process() -> None:
    """The same collectives on gloo (real processes) as on threads above."""
    base = build("llama")
    serial = copy.deepcopy(base)
    loss = serial(*tokens(0))[1]
    loss.backward()
    for r in run_ranks(gloo_rank, 2, base, timeout=100):
        torch.testing.assert_close(r["loss"], loss.detach())
        for name, p in serial.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, msg=name)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


@pytest.mark.timeout(60)
def test_only_dtrain_gpt_and_llama() -> None:
    with pytest.raises(ConfigError, match=r'model.arch = "gpt" or "llama" only, not Tiny'):
        tp.split_model(Tiny(), None, {"fc": "colwise"}, sequence_parallel=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plan, length, message", [
    (None, 15, "a sequence of 15 tokens does not divide into tp=2 parts"),
    ({"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}, T,
     "blocks.0.attn would attend within this rank's part of the sequence only"),
    ({"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": tp.Rowwise(input_is_parallel=False),
      "blocks.*.attn.qkv": tp.Colwise(chunks=3, heads=4), "blocks.*.attn.proj": "rowwise"}, T,
     "blocks.0.mlp.proj splits its own input"),
])
def test_errors_name_what_to_fix(plan: dict | None, length: int, message: str) -> None:
    base = build("gpt")

    def body(rank: int) -> None:
        model = tp.split_model(copy.deepcopy(base), None, plan, sequence_parallel=True,
                               algorithm=ALGORITHM)
        model(*tokens(0, length=length))

    with pytest.raises(RuntimeError) as info:
        run_threads(body, 2)
    assert isinstance(info.value.__cause__, ConfigError)
    assert message in str(info.value.__cause__)


def kept_for_backward(rank: int, base: nn.Module) -> dict:
    model = split(copy.deepcopy(base))
    outputs = {}
    for name in ("q_proj", "k_proj"):
        getattr(model.blocks[0].attn, name).register_forward_hook(
            lambda m, args, out, name=name: outputs.__setitem__(name, out))
    model(*tokens(0))[1]
    saved = {name: [tuple(t.shape) for t in out.grad_fn.saved_tensors]
             for name, out in outputs.items()}
    return {"saved": saved, "held": model.blocks[0].attn.q_proj.sequence_gather._last}


@pytest.mark.timeout(60)
def test_column_layers_keep_their_part() -> None:
    """A column-parallel layer keeps this rank's part of its input (and its weight) for
    backward, not the gathered whole; none is held after forward."""
    base = build("llama")
    for r in run_threads(kept_for_backward, 2, base):
        width = CONFIGS["llama"].n_embd
        assert r["saved"]["q_proj"][0] == (4, T // 2, width)
        assert r["saved"]["k_proj"][0] == (4, T // 2, width)
        assert r["held"] is None


DROPOUT = dict(CONFIGS["gpt"].__dict__, dropout=0.5)


def dropout_rank(base: nn.Module) -> dict:
    out = {}
    for case in ("first", "again", "recomputed"):
        model = split(copy.deepcopy(base))
        if case == "recomputed":
            recompute_modules(model, ["blocks.*"])
        masks = {}
        for name in ("drop", "blocks.0.mlp.drop"):
            model.get_submodule(name).register_forward_hook(
                lambda m, args, y, name=name, masks=masks: masks.__setitem__(name, y == 0),
                prepend=True)  # before the cut into parts: the input part's whole output
        torch.manual_seed(7)
        loss = model(*tokens(0))[1]
        loss.backward()
        out[case] = {"loss": loss.detach(), "grads": tp.full_grads(model), "masks": masks}
    return out


@pytest.mark.timeout(150)
def test_dropout_draws_each_ranks_own_masks() -> None:
    """With dropout, the input part (before the cut, the same tokens on every rank) draws
    the same mask on every tp rank; the blocks' dropouts, on each rank's own part of the
    sequence, draw different ones (dtrain.tensor_parallel.rng). A run is reproducible from
    its seed, and recomputed blocks replay the same masks. On processes: threads (the
    in-process backend) share one generator."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(**DROPOUT))
    results = run_ranks(dropout_rank, 2, base, timeout=120)
    first = [r["first"]["masks"] for r in results]
    assert torch.equal(first[0]["drop"], first[1]["drop"])
    assert first[0]["blocks.0.mlp.drop"].shape == (4, T // 2, DROPOUT["n_embd"])
    assert not torch.equal(first[0]["blocks.0.mlp.drop"], first[1]["blocks.0.mlp.drop"])
    for r in results:
        for case in ("again", "recomputed"):
            torch.testing.assert_close(r[case]["loss"], r["first"]["loss"], msg=case)
            torch.testing.assert_close(r[case]["grads"], r["first"]["grads"], msg=case)
