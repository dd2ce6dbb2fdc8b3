"""Tensor parallelism equals the unsplit model: outputs, loss, every gradient, training steps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain import comm
from dtrain import tensor_parallel as tp
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.testing import run_ranks, run_threads

ALGORITHM = "native"  # "auto" would first calibrate itself on each group
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)
STEPS, CLIP = 3, 0.5


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def tokens(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, CFG.vocab_size, (n, CFG.block_size), generator=g),
            torch.randint(0, CFG.vocab_size, (n, CFG.block_size), generator=g))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """eps well above rounding noise: the key bias's gradient is zero in exact arithmetic
    (softmax ignores a shift), and Adam would turn its rounding noise into full steps."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)


def float32(losses: list[float]) -> torch.Tensor:
    """float32 losses kept as Python floats, as float32 again: assert_close then allows
    float32's rounding, where on Python floats it would allow float64's."""
    return torch.tensor(losses, dtype=torch.float32)


def train_serial(model: nn.Module, batch: int) -> tuple[list[float], torch.optim.Optimizer]:
    opt = adamw(model)
    losses = []
    for step in range(STEPS):
        loss = model(*tokens(step, batch))[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.timeout(60)
def test_conjugate_operators_and_their_gradients() -> None:
    x = torch.arange(12.0).view(3, 4)

    def body(rank: int) -> list[torch.Tensor]:
        g = comm.resolve(None)
        mine = (x + rank).requires_grad_()
        copied = tp.copy_to_group(mine, g, ALGORITHM)
        (copied * (rank + 1)).sum().backward()  # f: gradient summed over ranks = 1 + 2
        reduced = tp.reduce_from_group(mine.detach().requires_grad_(), g, ALGORITHM)
        leaf = x.clone().requires_grad_()
        gathered = tp.gather_last(tp.scatter_last(leaf, g, ALGORITHM), g, ALGORITHM)
        (gathered * torch.arange(4.0)).sum().backward()  # each rank's slice, gathered back
        return [copied.detach(), mine.grad, reduced.detach(), gathered.detach(), leaf.grad]

    for rank, (copied, grad, reduced, gathered, leaf_grad) in enumerate(run_threads(body, 2)):
        assert torch.equal(copied, x + rank)  # f is the identity forward
        assert torch.equal(grad, torch.full((3, 4), 3.0))
        assert torch.equal(reduced, 2 * x + 1)
        assert torch.equal(gathered, x)
        assert torch.equal(leaf_grad, torch.arange(4.0).expand(3, 4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunks", [1, 3])
def test_gathered_column_and_whole_input_row_layers(chunks: int) -> None:
    """gather_output puts fused parts back in the original order; a row-parallel layer
    given the whole input splits it itself."""
    torch.manual_seed(0)
    lin, row = nn.Linear(6, 12), nn.Linear(12, 5)
    x = torch.randn(4, 6)

    def body(rank: int) -> torch.Tensor:
        model = tp.parallelize(nn.Sequential(copy.deepcopy(lin), copy.deepcopy(row)),
                               {"0": tp.Colwise(gather_output=True, chunks=chunks),
                                "1": tp.Rowwise(input_is_parallel=False)}, algorithm=ALGORITHM)
        return model(x).detach()

    for out in run_threads(body, 2):
        torch.testing.assert_close(out, row(lin(x)).detach())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 4])
def test_gpt_outputs_loss_and_gradients_equal_unsplit(size: int) -> None:
    base = gpt()
    x, y = tokens(0, 3)
    logits, loss = base(x, y)
    loss.backward()
    grads = {n: p.grad for n, p in base.named_parameters()}

    def body(rank: int) -> tuple:
        model = tp.parallelize(copy.deepcopy(base), tp.gpt_plan(CFG), algorithm=ALGORITHM)
        model.zero_grad()
        part, part_loss = model(x, y)
        part_loss.backward()
        whole = tp.gather_last(part, comm.resolve(None), ALGORITHM)
        assert part.shape[-1] == CFG.vocab_size // size  # logits stay split
        return whole.detach(), part_loss.detach(), tp.full_grads(model), tp.full_state_dict(model)

    for whole, part_loss, full_grads, state in run_threads(body, size):
        torch.testing.assert_close(whole, logits.detach())
        torch.testing.assert_close(part_loss, loss.detach())
        assert full_grads.keys() == grads.keys() | {"head.weight"}
        for name, grad in grads.items():
            torch.testing.assert_close(full_grads[name], grad, msg=name)
        torch.testing.assert_close(state, base.state_dict())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_training_steps_equal_one_process(size: int) -> None:
    base = gpt()
    serial = copy.deepcopy(base)
    losses, opt = train_serial(serial, 4)

    def body(rank: int) -> tuple:
        model = tp.parallelize(copy.deepcopy(base), tp.gpt_plan(CFG), algorithm=ALGORITHM)
        optimizer = adamw(model)
        mine = []
        for step in range(STEPS):
            loss = model(*tokens(step, 4))[1]
            loss.backward()
            tp.clip_grad_norm_(model, CLIP)
            optimizer.step()
            optimizer.zero_grad()
            mine.append(loss.item())
        return mine, tp.full_state_dict(model), tp.full_optimizer_state(model, optimizer)

    for mine, state, optim in run_threads(body, size):
        torch.testing.assert_close(float32(mine), float32(losses))
        torch.testing.assert_close(state, serial.state_dict())
        torch.testing.assert_close(optim["state"], opt.state_dict()["state"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(reduction: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 7, 12) * 4
    target = torch.randint(0, 12, (5, 7))
    target[0, :3] = -100  # ignored, as F.cross_entropy does
    whole = logits.clone().requires_grad_()
    expected = F.cross_entropy(whole.view(-1, 12), target.view(-1), reduction=reduction)
    expected.backward(torch.ones_like(expected))

    def body(rank: int) -> tuple:
        part = logits[..., rank * 4 : (rank + 1) * 4].clone().requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(part.view(-1, 4), target.view(-1),
                                               reduction=reduction, algorithm=ALGORITHM)
        loss.backward(torch.ones_like(loss))
        return loss.detach(), part.grad

    results = run_threads(body, 3)
    for loss, _ in results:
        torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(torch.cat([g for _, g in results], dim=-1), whole.grad)


@pytest.mark.timeout(60)
def test_vocab_parallel_cross_entropy_backward_runs_once() -> None:
    """Backward turns the saved softmax into the gradient in place (one block of logits
    alive, as Megatron-LM): a second backward through the same graph is refused in words,
    not answered with a wrong gradient."""
    def body(rank: int) -> str:
        part = torch.randn(6, 4, requires_grad=True)
        loss = tp.vocab_parallel_cross_entropy(part, torch.arange(6), algorithm=ALGORITHM)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward runs once per forward") as caught:
            loss.backward()
        return str(caught.value)

    assert all("in place" in message for message in run_threads(body, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 4])
def test_block_parameters_are_one_tp_th(size: int) -> None:
    """A parallelized block holds 1/tp of its split weights; LayerNorms and the biases of
    row-parallel layers stay whole on every rank."""
    block = gpt().blocks[0]
    whole = sum(p.numel() * 4 for p in block.parameters())
    replicated = 4 * (4 * CFG.n_embd + 2 * CFG.n_embd)  # two LayerNorms, two row biases
    plan = {k.removeprefix("blocks.*."): v for k, v in tp.gpt_plan(CFG).items()
            if k.startswith("blocks.")}

    def body(rank: int) -> dict[str, int]:
        return tp.parameter_bytes(tp.parallelize(copy.deepcopy(block), plan,
                                                 algorithm=ALGORITHM))

    for counted in run_threads(body, size):
        assert counted["replicated"] == replicated
        assert counted["split"] * size == whole - replicated


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size, cfg, plan, message", [
    (3, CFG, {"blocks.*.attn.qkv": tp.Colwise(chunks=3, heads=4)},
     "tp=3 does not divide the 4 attention heads of blocks.0.attn.qkv"),
    (3, CFG, {"blocks.*.mlp.proj": "rowwise"},
     "blocks.0.mlp.proj: tp=3 does not divide the 128 input features"),
    (2, GPTConfig(vocab_size=257, n_layer=1, n_head=2, n_embd=8), None,
     "wte: tp=2 does not divide the 257 vocabulary entries"),
    (2, CFG, {"blocks.*.mlp.fcc": "colwise"}, "'blocks.*.mlp.fcc' matches no module"),
    (2, CFG, {"blocks.*.ln1": "colwise"}, "blocks.0.ln1 is LayerNorm, but 'colwise'"),
    (2, CFG, {"wte": "vocab"}, "head.weight is tied to wte.weight, which the plan splits"),
    (2, CFG, {"head": "diagonal"}, "unknown style 'diagonal'"),
])
def test_bad_plans_name_what_to_fix(size: int, cfg: GPTConfig, plan: dict | None,
                                    message: str) -> None:
    def body(rank: int) -> None:
        tp.parallelize(GPT(cfg), plan or tp.gpt_plan(cfg), algorithm=ALGORITHM)

    with pytest.raises(RuntimeError) as info:
        run_threads(body, size)
    assert isinstance(info.value.__cause__, ConfigError)
    assert message in str(info.value.__cause__)


@pytest.mark.timeout(120)
def test_hugging_face_bert_plan() -> None:
    """The seeds' running example, from a config (no download): outputs and gradients."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    base = transformers.BertModel(config).eval()
    ids = torch.randint(0, 128, (2, 10))
    out = base(ids).last_hidden_state
    out.pow(2).mean().backward()
    grads = {n: p.grad for n, p in base.named_parameters()}

    def body(rank: int) -> tuple:
        model = tp.parallelize(copy.deepcopy(base), tp.bert_plan(4), algorithm=ALGORITHM)
        model.zero_grad()
        mine = model(ids).last_hidden_state
        mine.pow(2).mean().backward()
        assert model.encoder.layer[0].attention.self.query.weight.shape == (16, 32)
        return mine.detach(), tp.full_grads(model)

    for mine, full in run_threads(body, 2):
        torch.testing.assert_close(mine, out.detach())
        for name, grad in grads.items():
            torch.testing.assert_close(full[name], grad, msg=name)


def dp_tp_rank(base: GPT, per_rank: int) -> dict:
    """One rank of dp=2 x tp=2: its data-parallel replica's half of every global batch."""
    mesh = dtrain.Mesh(dp=2, tp=2)
    model = tp.parallelize(base, tp.gpt_plan(CFG), mesh.group("tp"), algorithm=ALGORITHM)
    wrapped = dtrain.DataParallel(model, group=mesh.group("dp"), algorithm=ALGORITHM)
    optimizer = adamw(model)
    mine = slice(mesh.coords["dp"] * per_rank, (mesh.coords["dp"] + 1) * per_rank)
    for step in range(STEPS):
        x, y = tokens(step, 2 * per_rank)
        wrapped(x[mine], y[mine])[1].backward()
        tp.clip_grad_norm_(model, CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {"model": tp.full_state_dict(model), "coords": mesh.coords}


# `make test` checks the same layout end to end (tests/train/test_train.py: dtrain train with
# tp=2 on 4 processes equals one process); this library-level twin runs with test-slow.
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_dp2_tp2_on_four_processes_equals_one_process() -> None:
    base = gpt()
    serial = copy.deepcopy(base)
    train_serial(serial, 4)
    results = run_ranks(dp_tp_rank, 4, base, 2, timeout=120)
    assert [r["coords"]["tp"] for r in results] == [0, 1, 0, 1]
    for r in results:
        torch.testing.assert_close(r["model"], serial.state_dict())
