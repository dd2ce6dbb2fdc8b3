"""Mixture of experts: the layer against a plain per-token reference, its routers, capacity
and balancing rules exact, the uneven all-to-all, and expert parallelism equal to one
process (losses per step and final weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import dtrain
from dtrain import comm
from dtrain.checkpoint import universal
from dtrain.checkpoint.universal import MODEL
from dtrain.data_parallel.clip import clip_grad_norm_
from dtrain.models import ModelConfig, hf_names, init
from dtrain.models.llama import Llama, LlamaConfig, llama_config
from dtrain.models.moe import MoE, MoEConfig, after_step, expert_parallel, moe_layers
from dtrain.models.moe import experts as experts_mod
from dtrain.testing import run_ranks, run_threads
from tests.models.test_models_train import BASE
from tests.support import cli

DIM, HIDDEN, E, K = 16, 24, 8, 2


def layer(**rules) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(n_experts=E, experts_per_token=K, hidden=HIDDEN, **rules), DIM)
    nn.init.normal_(moe.gate.weight, std=0.5)  # routing far from uniform
    return moe


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer computed one token and one chosen expert at a time, in plain torch."""
    b, t, _ = x.shape
    cfg, out = moe.cfg, torch.zeros_like(x)
    taken = torch.zeros(b, E, dtype=torch.long)
    capacity = math.ceil(cfg.capacity_factor * t * K / E) if cfg.capacity_factor else None
    for i in range(b):
        for j in range(t):
            logits = x[i, j] @ moe.gate.weight.t()
            if cfg.router == "sigmoid_bias":
                scores = torch.sigmoid(logits)
                chosen = torch.topk(scores + moe.gate.expert_bias, K).indices
            else:
                scores = torch.softmax(logits, -1)
                chosen = torch.topk(scores, K).indices
            weights = scores[chosen] / (scores[chosen].sum() if cfg.norm_topk_prob else 1)
            for w, e in zip(weights, chosen.tolist(), strict=True):
                taken[i, e] += 1
                if capacity is not None and taken[i, e] > capacity:
                    continue
                gate_up = moe.experts.gate_up_proj[e] @ x[i, j]
                gate, up = gate_up[:HIDDEN], gate_up[HIDDEN:]
                out[i, j] += w * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
            if moe.shared is not None:
                out[i, j] += moe.shared(x[i, j])
    return out


@pytest.mark.parametrize("rules", [
    {}, {"router": "sigmoid_bias"}, {"capacity_factor": 0.5}, {"n_shared_experts": 1},
    {"norm_topk_prob": False}])
def test_the_layer_equals_one_token_at_a_time(rules: dict) -> None:
    moe = layer(**rules)
    if rules.get("router") == "sigmoid_bias":
        moe.gate.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))  # steers the choice
    x = torch.randn(2, 6, DIM)
    torch.testing.assert_close(moe(x), reference(moe, x))


def test_capacity_drops_the_later_tokens_and_counts_them() -> None:
    moe = layer(capacity_factor=0.25)  # ceil(0.25 * 6 * 2 / 8) = 1 assignment per expert
    moe.train()
    x = torch.randn(2, 6, DIM)
    moe(x)
    kept = moe._within_capacity(moe.gate(x.reshape(-1, DIM))[1].view(2, 6, K))
    assert int((~kept).sum()) == int(moe.dropped) > 0
    assert int(moe.load.sum()) == 2 * 6 * K  # routed, dropped or not


def test_grouped_product_equals_the_loop_over_experts() -> None:
    x = torch.randn(10, DIM, requires_grad=True)
    w = torch.randn(3, HIDDEN, DIM, requires_grad=True)
    counts = [4, 0, 6]
    grouped = experts_mod.grouped_matmul(x, w, counts)
    loop = torch.cat([x[:4] @ w[0].t(), x[4:] @ w[2].t()])
    torch.testing.assert_close(grouped, loop)
    (gx, gw) = torch.autograd.grad(grouped.sum(), (x, w))  # an expanded gradient, too
    (lx, lw) = torch.autograd.grad(loop.sum(), (x, w))
    torch.testing.assert_close((gx, gw), (lx, lw))


def test_the_balance_loss_is_the_sequence_wise_formula() -> None:
    moe = layer(aux_loss_weight=0.1)
    moe.train()
    x = torch.randn(3, 5, DIM)
    moe(x)
    flat = x.reshape(-1, DIM)
    probs = torch.softmax(flat @ moe.gate.weight.t(), -1).view(3, 5, E)
    chosen = torch.topk(probs, K).indices  # (3, 5, K)
    want = 0.0
    for i in range(3):
        counts = torch.bincount(chosen[i].reshape(-1), minlength=E).float()
        f = counts * E / (K * 5)
        want += float((f * probs[i].mean(0)).sum().detach()) / 3
    torch.testing.assert_close(float(moe.aux_loss.detach()), 0.1 * want)


def test_split_form_draws_the_router_and_experts_like_the_linear_layers() -> None:
    """A MoE Llama built on the meta device (dtrain train's way) gets normal(0, 0.02)
    router and expert weights from its initial values, and a zero balancing bias."""
    model = init.skeleton(lambda: moe_llama({}))
    initial = init.Initial(model, seed=0)
    for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
        values = initial.tensor(MODEL + f"blocks.1.mlp.{name}")
        assert abs(values.std().item() - 0.02) < 0.003, name
    assert not initial.tensor(MODEL + "blocks.1.mlp.gate.expert_bias").any()


def test_the_bias_moves_toward_even_load_by_the_rate() -> None:
    moe = layer(router="sigmoid_bias")
    moe.train()
    moe(torch.randn(2, 6, DIM))
    load = moe.load.clone().double()
    after_step(nn.Sequential(moe))
    want = 1e-3 * torch.sign(load.mean() - load)
    torch.testing.assert_close(moe.gate.expert_bias, want.float())
    assert moe.balance[0] == pytest.approx(float(load.max() / load.mean()))
    assert int(moe.load.sum()) == 0  # counted afresh each step


def _uneven(rank: int, algorithm: str) -> torch.Tensor:
    size = 3
    send = [(rank + j) % 3 for j in range(size)]  # some ranks send nothing to some peers
    x = torch.cat([torch.full((n,), 10.0 * rank + j) for j, n in enumerate(send)])
    return comm.all_to_all(x, send_sizes=send, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["native", "pairwise"])
def test_the_uneven_all_to_all(algorithm: str) -> None:
    got = run_threads(_uneven, 3, algorithm)
    for rank in range(3):
        want = torch.cat([torch.full(((r + rank) % 3,), 10.0 * r + rank) for r in range(3)])
        torch.testing.assert_close(got[rank], want)


# ------------------------------------------------------------------ expert parallelism
CFG = dict(vocab_size=64, block_size=12, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
           ffn_hidden=48)
STEPS, BATCH, LR = 3, 8, 0.1
CASES = [(2, {}), (4, {}), (2, {"capacity_factor": 0.5}), (4, {"capacity_factor": 0.5}),
         (2, {"router": "sigmoid_bias", "aux_loss_weight": 0.0}),
         (4, {"aux_loss_weight": 0.05, "n_shared_experts": 1}),
         (2, {"router": "sigmoid_bias", "skew": True})]
"""(ep, MoE rules); "skew" biases every token toward the first half of the experts, so the
ranks holding the second half receive no token at all (their backward must still take
part in every exchange)."""


def moe_llama(rules: dict) -> Llama:
    torch.manual_seed(0)
    rules = dict(rules)
    skew = rules.pop("skew", False)
    moe = MoEConfig(n_experts=E, experts_per_token=K, hidden=24, **rules)
    model = Llama(LlamaConfig(**CFG, moe=moe, moe_layers=(1,)))
    if skew:
        with torch.no_grad():
            model.blocks[1].mlp.gate.expert_bias.copy_(torch.tensor([10.0] * 4 + [-10.0] * 4))
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randint(0, 64, (BATCH, 12), generator=g)
    return x, torch.roll(x, -1, 1)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Plain SGD with momentum, no clip: its update is proportional to the gradient, so an
    expert gradient averaged with a wrong divisor (1/ep forgotten, edp for dp) shows in the
    weights, and in the gradient norm each step records (Adam would hide a scale)."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def serial_run(rules: dict) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process on the whole batch: each step's loss and gradient norm, the weights."""
    model = moe_llama(rules)
    opt = sgd(trainable(model))
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*batch(step))[1]
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable(model), math.inf)))
        opt.step()
        opt.zero_grad()
        after_step(model)
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def ep_rank(cases: list) -> list:
    """Each case (ep, rules[, ZeRO stage]) trained on this rank: DataParallel, or ZeRO."""
    out = []
    for ep, rules, *zero in cases:
        mesh = dtrain.Mesh(dp=4, ep=ep)
        model = moe_llama(rules)
        expert_parallel(model, mesh.group("ep"), mesh.coords["ep"], ep)
        if zero:
            wrapped = opt = dtrain.ZeRO(
                model, sgd, stage=zero[0], group=mesh.group("dp"), algorithm="native",
                expert_group=mesh.group("edp"))
        else:
            wrapped = dtrain.DataParallel(model, group=mesh.group("dp"), algorithm="native",
                                          expert_group=mesh.group("edp"))
            opt = sgd(trainable(model))
        mine = slice(2 * mesh.coords["dp"], 2 * mesh.coords["dp"] + 2)
        losses, norms = [], []
        for step in range(STEPS):
            x, y = batch(step)
            loss = wrapped(x[mine], y[mine])[1]
            loss.backward()
            if zero:  # the global norm (before a clip of none)
                norms.append(float(wrapped.clip_grad_norm_(math.inf)))
            else:
                norms.append(clip_grad_norm_(wrapped.grad_parts(), math.inf,
                                             {"ep": mesh.group("ep")}))
            opt.step()
            opt.zero_grad()
            after_step(model, mesh.group("dp"))
            losses.append(float(comm.all_reduce(loss.detach(), op="avg")))
        out.append({"losses": losses, "norms": norms, "state": wrapped.state_dict(),
                    "ep": mesh.coords["ep"],
                    "balance": [m.balance for m in moe_layers(model)]})
    return out


ZERO_CASES = [(2, {}, 1), (4, {}, 1), (2, {"capacity_factor": 0.5}, 2),
              (4, {"aux_loss_weight": 0.05}, 2), (2, {"router": "sigmoid_bias", "skew": True}, 3),
              (4, {"router": "sigmoid_bias"}, 3)]
"""(ep, MoE rules, ZeRO stage): each stage at ep = 2 and 4, the experts sharded over the
ranks that hold the same ones (two, or one at ep = 4), the rest over all four."""


@pytest.mark.timeout(180)  # room past the ranks' 110 s for them to be named on a hang
@pytest.mark.parametrize("cases", [CASES, ZERO_CASES], ids=["data-parallel", "zero"])
def test_expert_parallel_ranks_equal_one_process(cases: list) -> None:
    """ep = 2 and 4 over four ranks (dropless and with a capacity that drops, both routers,
    the balance loss and shared experts), under DataParallel and under ZeRO 1-3: every
    step's loss and every final weight equal one process on the same global batch (a
    rank's experts, those of its global indices)."""
    ranks = run_ranks(ep_rank, 4, cases, timeout=110)
    for c, (ep, rules, *_) in enumerate(cases):
        losses, norms, state = serial_run(rules)
        results = [r[c] for r in ranks]
        balance = results[0]["balance"][0]  # (max / mean load, dropped share) of the last step
        assert balance[0] > 1.0 and (balance[1] > 0) == ("capacity_factor" in rules)
        if rules.get("skew"):  # the second half of the experts got no token
            assert balance[0] >= 2.0
        if rules.get("router") == "sigmoid_bias":
            assert state["blocks.1.mlp.gate.expert_bias"].abs().min() > 0  # it moved
        for r in results:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses))
            torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(norms),
                                       msg=lambda m, e=ep, k=rules: f"norms, ep={e}, {k}: {m}")
            assert set(r["state"]) == set(state)
            for name, value in state.items():
                got = r["state"][name]
                if "experts." in name:  # this rank's E / ep experts: global index ep * E / ep on
                    value = value.chunk(ep)[r["ep"]]
                label = f"{name}, ep={ep}, {rules}"
                torch.testing.assert_close(got, value, msg=lambda m, at=label: f"{at}: {m}")


def two_moe_llama() -> Llama:
    """Both blocks MoE with the balance loss, so each of two pipeline stages has one."""
    torch.manual_seed(0)
    moe = MoEConfig(n_experts=E, experts_per_token=K, hidden=24, aux_loss_weight=0.1)
    return Llama(LlamaConfig(**CFG, moe=moe, moe_layers=(0, 1)))


def pipeline_rank() -> dict:
    from dtrain import pipeline

    model = two_moe_llama()
    mine = pipeline.pieces_for(pipeline.cut(model, 2))
    pipe = pipeline.Pipeline(mine, microbatches=2, loss_fn=pipeline.loss_of(model),
                             extra_loss=pipeline.extra_loss_of(model, mine))
    opt = sgd(list(nn.ModuleList(mine).parameters()))
    losses = []
    for step in range(STEPS):
        losses.append(pipe.step(*batch(step)).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": {k: v for piece in mine
                                        for k, v in piece.state_dict().items()}}


@pytest.mark.timeout(60)
def test_a_pipeline_adds_every_stage_s_balance_loss() -> None:
    """A pipeline of two stages (two micro-batches), each with a MoE block whose balance loss
    is on: each stage backpropagates its share with the gradient from the stage after it,
    and the returned loss counts both, so losses and weights equal one process."""
    model = two_moe_llama()
    opt = sgd(list(model.parameters()))
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = model.state_dict()
    ranks = run_ranks(pipeline_rank, 2, timeout=50)
    held = [name for r in ranks for name in r["state"]]
    assert sorted(held) == sorted(state), "every parameter held by exactly one stage"
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses))
        for name, value in r["state"].items():
            torch.testing.assert_close(value, state[name], msg=name)


# ------------------------------------------------------------------ dtrain train
MOE_MODEL = """
[model]
arch = "llama"
preset = "moe-tiny"
n_layer = 2
n_embd = 32
n_head = 2
n_kv_head = 2
moe_inter_size = 32
ffn_hidden = 64
block_size = 32
moe_layers = "after 1"
capacity_factor = 1.0
router = "sigmoid_bias"
"""
"""A small Llama whose second block is a mixture of experts (the `[model]` section)."""
MOE_TOML = MOE_MODEL + BASE


def moe_run(folder: Path, args: list[str], steps: int) -> tuple[list[dict], Path]:
    return cli.train_rows(folder, MOE_TOML, args, steps)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_runs_in_expert_parallel_layouts_equal_one_process(tmp_path: Path) -> None:
    """`dtrain train` of moe-tiny (sigmoid_bias router, a capacity that drops), against one
    process: two steps at ep = 4 on four ranks, resumed for one at ep = 2 on two, then for
    one on one process (the checkpoints hold experts by global index, and the routers'
    biases); tp = 2 x ep = 2 on four ranks (ep folded over tp: each tp rank computing the
    experts of its share of the tokens); ep = 2
    with every block recomputed in backward; pp = 2 x ep = 2 (two micro-batches); ZeRO-2 x
    ep = 2 on four ranks (the experts sharded over the two ranks holding the same ones; the
    routers' biases, which no optimizer steps, held whole beside the shards) resumed as
    ZeRO-3 x ep = 2 on two; DiLoCo over 2 sync groups of ep = 2, which hold the same weights after a
    synchronization (their routers' biases are each sync group's own). Every
    step's loss and the final weights equal the one-process run's; the metrics carry each
    MoE layer's balance, and the timeline each MoE forward's dispatch, expert compute and
    combine."""
    resume, ep2 = "checkpoint.resume='auto'", "parallel.ep=2"
    # Forked once per world size (dtrain.testing.run_ranks), not a launch per run.
    (first, _), piped, diloco, (sharded, _) = cli.train_rows_together([
        (tmp_path / "chain", MOE_TOML, ["parallel.ep=4"], 2),
        (tmp_path / "pp", MOE_TOML, ["parallel.pp=2", "parallel.microbatches=2", ep2], 4),
        (tmp_path / "diloco", MOE_TOML, [ep2, "sync.method='diloco'", "sync.groups=2",
                                         "sync.every=2"], 4),
        (tmp_path / "zero", MOE_TOML, ["parallel.zero=2", ep2], 2)], 4)
    (second, _), recomputed, (resumed, zero_chain) = cli.train_rows_together([
        (tmp_path / "chain", MOE_TOML, [ep2, resume], 3),
        (tmp_path / "recompute", MOE_TOML, [ep2, "memory.recompute='full'"], 4),
        (tmp_path / "zero", MOE_TOML, ["parallel.zero=3", ep2, resume], 4)], 2)
    (one, one_ckpt), (third, chain) = cli.train_rows_together([
        (tmp_path / "one", MOE_TOML, [], 4), (tmp_path / "chain", MOE_TOML, [resume], 4)], 1)
    trace = tmp_path / "tp.json"
    tp_ep = moe_run(tmp_path / "tp", ["-n", "4", "--set", "parallel.tp=2", "--set",
                                      "parallel.ep=2", "--timeline", str(trace)], 4)
    groups = [load_file(universal.export(c, c.parent / "model.safetensors")) for c in (
        diloco[1], tmp_path / "diloco/run/sync-group-1/checkpoints")]
    for name, value in groups[0].items():  # synchronized at step 4, experts by index too
        if not name.endswith("expert_bias"):  # each sync group's own, from its own load
            torch.testing.assert_close(groups[1][name], value, rtol=0, atol=0, msg=name)
    exported = load_file(universal.export(one_ckpt, one_ckpt.parent / "model.safetensors"))
    for rows, ckpt in ((first + second + third, chain), tp_ep, recomputed, piped,
                       (sharded + resumed, zero_chain)):
        cli.assert_same_steps(rows, one)
        got = load_file(universal.export(ckpt, ckpt.parent / "model.safetensors"))
        # the rounding of a gradient summed in another order (the pipeline's micro-batches)
        torch.testing.assert_close(got, exported, rtol=1e-4, atol=5e-5)
    assert exported["blocks.1.mlp.gate.expert_bias"].abs().max() > 0  # it moved
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    for rank in range(4):  # each MoE forward's exchanges and expert compute, as spans
        names = {e["name"] for e in events if e.get("pid") == rank and e.get("cat") == "moe"}
        assert names == {"moe dispatch", "moe experts", "moe combine"}, (rank, names)
    assert all(len(r["moe_imbalance"]) == 1 and 0 < r["moe_dropped"][0] < 1 for r in one)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_live_replicas_with_expert_parallelism_equal_them_without(tmp_path: Path) -> None:
    """`dtrain train` of moe-tiny with two live replicas of ZeRO-2 over two ranks: with
    ep = 2 inside each replica (its experts sharded over their own ranks, each shard then
    averaged with the other replica's same shard) every step's loss and the final weights
    equal the same replicas' without expert parallelism."""
    live = ["-n", "4", "--set", "fault_tolerance.mode='live'", "--set", "parallel.zero=2",
            "--set", "parallel.dp=2"]
    plain, plain_ckpt = moe_run(tmp_path / "plain", live, 4)
    split, split_ckpt = moe_run(tmp_path / "ep", [*live, "--set", "parallel.ep=2"], 4)
    cli.assert_same_steps(split, plain)
    want = load_file(universal.export(plain_ckpt, plain_ckpt.parent / "model.safetensors"))
    got = load_file(universal.export(split_ckpt, split_ckpt.parent / "model.safetensors"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_expert_parallelism_with_context_parallelism_equals_one_process(tmp_path: Path
                                                                        ) -> None:
    """moe-tiny, dropless, balanced by the sigmoid_bias router, at cp = 2 x ep = 2 with
    ZeRO-2 on four ranks: ep folded over cp (a rank's tokens, its two chunks of each
    sequence, go to the experts of its cp pair), the experts average over the dp ranks
    holding the same ones, and the routers' biases move by the load summed over dp x cp:
    every step's loss and the final weights (biases too) equal one process's."""
    dropless = ["--set", "model.capacity_factor=0.0"]
    one, one_ckpt = moe_run(tmp_path / "one", ["-n", "1", *dropless], 4)
    split, split_ckpt = moe_run(tmp_path / "cp", ["-n", "4", *dropless, "--set",
                                                  "parallel.cp=2", "--set", "parallel.ep=2",
                                                  "--set", "parallel.zero=2"], 4)
    cli.assert_same_steps(split, one)
    want = load_file(universal.export(one_ckpt, one_ckpt.parent / "model.safetensors"))
    got = load_file(universal.export(split_ckpt, split_ckpt.parent / "model.safetensors"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
    assert want["blocks.1.mlp.gate.expert_bias"].abs().max() > 0  # it moved


# ------------------------------------------------------------------ Hugging Face
def hf_mixtral() -> tuple[nn.Module, ModelConfig]:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(1)
    hf = MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=16, rope_theta=10000.0,
        tie_word_embeddings=False))
    ours = ModelConfig(arch="llama", vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                       n_kv_head=2, ffn_hidden=24, block_size=16, tie_embeddings=False,
                       rope_theta=10000.0, n_experts=4, experts_per_token=2)
    return hf, ours


def hf_qwen3_moe() -> tuple[nn.Module, ModelConfig]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
        max_position_embeddings=16, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False))
    ours = ModelConfig(arch="llama", vocab_size=64, n_embd=32, n_layer=3, n_head=4,
                       n_kv_head=2, head_dim=16, qk_norm=True, ffn_hidden=40, block_size=16,
                       tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-6, n_experts=8,
                       experts_per_token=2, moe_inter_size=16, moe_layers="after 1")
    return hf, ours


@pytest.mark.parametrize("make", [hf_mixtral, hf_qwen3_moe], ids=["mixtral", "qwen3-moe"])
def test_hugging_face_moe_models_in_and_out_give_their_logits(make, tmp_path: Path) -> None:
    """A Mixtral and a Qwen3-MoE built by transformers from their configs, saved as
    transformers saves them (a tensor per expert): dtrain's Llama of the same shape reads
    the folder (`init_from`'s reader) and gives transformers' logits; written back
    (`dtrain export --format hf`'s state and config), transformers loads it and gives them
    again."""
    from transformers import AutoModelForCausalLM

    from dtrain.models.convert import hf_config_of
    from dtrain.models.weights import HFWeights
    from dtrain.tools.export_hf import hf_state

    hf, cfg = make()
    hf.eval()
    hf.save_pretrained(tmp_path / "in")
    names = hf_names(cfg)
    weights = HFWeights(tmp_path / "in", names)
    model = Llama(llama_config(cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.tensor(MODEL + name))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-5)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_of(cfg)))
    state = model.state_dict()
    save_file(hf_state(names, lambda n: state[n]), str(out / "model.safetensors"))
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [hf_mixtral, hf_qwen3_moe], ids=["mixtral", "qwen3-moe"])
def test_arch_hf_swaps_the_sparse_blocks_and_keeps_the_logits(make, tmp_path: Path) -> None:
    """`arch = "hf"` of a Mixtral or Qwen3-MoE folder: each sparse block is dtrain's MoE
    layer holding the same parameters under the same names (Qwen3-MoE's dense first
    block stays transformers' MLP); `init_from`'s reader fills it from the folder's
    tensor-per-expert files, and it gives transformers' logits."""
    from dtrain.models.hf import HFCausalLM
    from dtrain.models.weights import HFWeights

    hf, _ = make()
    hf.eval()
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig(arch="hf", init_from=str(tmp_path), vocab_size=64, block_size=16)
    model = dtrain.models.build(cfg).eval()
    assert isinstance(model, HFCausalLM)
    layers = model.hf.model.layers
    assert all(isinstance(layer.mlp, MoE) for layer in layers[1:])
    assert isinstance(layers[0].mlp, MoE) == (hf.config.model_type == "mixtral")
    assert dict(model.named_parameters()).keys() == {
        f"hf.{n}" for n, _ in hf.named_parameters()} | {
        f"hf.model.layers.{i}.mlp.gate.expert_bias" for i in range(len(layers))
        if isinstance(layers[i].mlp, MoE)}
    weights = HFWeights(tmp_path, hf_names(cfg, model))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.tensor(MODEL + name))
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-4, atol=1e-5)


HF_MOE_TOML = """
[model]
arch = "hf"
init_from = "{folder}"
block_size = 16
""" + BASE


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_arch_hf_moe_trains_in_expert_parallel_layouts(tmp_path: Path) -> None:
    """`dtrain train` of a Qwen3-MoE folder (`arch = "hf"`, `init_from`; a dense first block
    and two MoE blocks of 8 experts) on one process, at tp = 2 x ep = 2 on four ranks (the
    Qwen3 plan: attention split by heads; ep folded over tp) and at ZeRO-2 x ep = 4 on four:
    every step's loss and the final weights equal; `dtrain export --format hf` writes a
    folder transformers loads with the logits of dtrain's trained model."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from dtrain.models.hf import HFCausalLM

    torch.manual_seed(3)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=16,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)).save_pretrained(
            tmp_path / "qwen3")
    config = tmp_path / "hf.toml"
    config.write_text(HF_MOE_TOML.format(folder=tmp_path / "qwen3"))

    def trained(rows: list[dict], ckpt: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
        return ([r["loss"] for r in rows],
                load_file(universal.export(ckpt, ckpt.parent / "model.safetensors")))

    text = config.read_text()  # forked once per world size, not a launch per run
    ((rows, ckpt),) = cli.train_rows_together([(tmp_path / "one", text, [], 3)], 1)
    want, weights = trained(rows, ckpt)
    for rows, ckpt in cli.train_rows_together([
            (tmp_path / "tp-ep", text, ["parallel.tp=2", "parallel.ep=2"], 3),
            (tmp_path / "zero-ep", text, ["parallel.zero=2", "parallel.ep=4"], 3)], 4):
        losses, got = trained(rows, ckpt)
        torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, weights, rtol=1e-4, atol=5e-5)
    exported = tmp_path / "export"
    result = cli.dtrain("export", str(tmp_path / "one" / "run" / "checkpoints"), str(exported),
                        "--format", "hf")
    assert result.returncode == 0, result.stdout + result.stderr
    model = dtrain.models.build(ModelConfig(arch="hf", init_from=str(tmp_path / "qwen3"),
                                            vocab_size=256, block_size=16)).eval()
    assert isinstance(model, HFCausalLM)
    model.load_state_dict(weights)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(exported).eval()(
            x).logits, model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("keys", [{"router": "sigmoid_bias"}, {"n_shared_experts": 1}],
                         ids=["sigmoid_bias", "shared-experts"])
def test_no_hugging_face_format_for_routing_transformers_lacks(keys: dict) -> None:
    """`dtrain export --format hf` of a MoE that Mixtral and Qwen3-MoE cannot compute (a
    sigmoid_bias router, shared experts) is refused in one line naming the keys (the
    export's config comes from here, before any file is written)."""
    from dtrain.errors import ConfigError
    from dtrain.models import presets
    from dtrain.models.config import ModelConfig, with_preset
    from dtrain.models.convert import hf_config_of

    cfg = with_preset(ModelConfig(arch="llama", preset="moe-tiny", **keys), presets())
    with pytest.raises(ConfigError, match=r"\(model.router, model.n_shared_experts\) has no "
                                          "Hugging Face format in dtrain") as raised:
        hf_config_of(cfg)
    assert "\n" not in str(raised.value)
