"""`[optimizer] name = "muon"`: Muon on the hidden matrices, AdamW on the rest, on one
process (equal to torch.optim.Muon + torch.optim.AdamW) and in every layout (equal to one
process on the same global batch), resumed, and its bad input refused in one line."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dtrain
from dtrain import comm, layouts, models
from dtrain.checkpoint import universal
from dtrain.config import config_from_dict, dims_of
from dtrain.data_parallel.zero.muon import ShardedMuon
from dtrain.errors import ConfigError, DtrainError
from dtrain.mesh import Mesh
from dtrain.models import loss_of_output
from dtrain.models.config import ModelConfig
from dtrain.optim import Muon, OptimizerConfig, build_optimizer, muon_split
from dtrain.testing import run_ranks, run_threads
from tests.support.cli import dtrain as run_dtrain
from tests.support.cli import one_error_line

TINY_GPT = {"arch": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8}
TINY_LLAMA = {"arch": "llama", "n_layer": 2, "n_head": 2, "n_kv_head": 1, "n_embd": 16,
              "block_size": 8, "tie_embeddings": False}
VOCAB, SEQUENCES, STEPS, CLIP = 64, 4, 4, 1.0
MUON = {"name": "muon", "lr": 0.01, "weight_decay": 0.1, "warmup_steps": 0,
        "muon_ns_dtype": "float32"}
"""Muon as the layouts run it. Newton-Schulz in float32: in bfloat16 a gradient averaged
over two ranks rounds its last bit differently from one process's, which bfloat16's first
rounding turns into a 2**-8 difference now and then; float32 keeps the comparison at
float32's tolerance."""
LAYOUT_MODEL = {**TINY_LLAMA, "n_kv_head": 2, "tie_embeddings": True}
"""Llama, its head tied to the embedding (the pipeline's stages each hold one end): no
biases, whose elements of no gradient (attention's key bias) AdamW would step by the
rounding noise of their gradient, which differs between layouts."""
BUCKET_MB = 0.002
"""ZeRO's units at stages 1-2: about 500 elements, so the tiny model's matrices fall in
several units and across the shards' boundaries."""


def tiny(model: dict[str, Any] = TINY_GPT) -> nn.Module:
    torch.manual_seed(0)
    return models.build(models.resolve(ModelConfig(**model), VOCAB))


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randint(0, VOCAB, (SEQUENCES, TINY_GPT["block_size"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def names_of(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    named = {id(p): n for n, p in model.named_parameters()}
    return [named[id(p)] for p in params]


# ---------------------------------------------------------------- one process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("adjust, nesterov", [("match_rms_adamw", True), ("original", False)])
def test_one_process_equals_torch_muon_and_adamw(adjust: str, nesterov: bool) -> None:
    """dtrain's Muon steps the matrices as torch.optim.Muon and the rest as
    torch.optim.AdamW (decay on 2-D, none on 1-D) in a plain loop, bit for bit, with the
    same parameter split; its state is theirs."""
    model = tiny(TINY_LLAMA)
    reference = copy.deepcopy(model)
    cfg = OptimizerConfig(name="muon", lr=0.02, weight_decay=0.1, muon_adjust_lr=adjust,
                          muon_nesterov=nesterov, muon_lr=0.03)
    ours = build_optimizer(model, cfg)
    assert isinstance(ours, Muon)
    matrices, rest = muon_split(reference)
    theirs = [torch.optim.Muon(matrices, lr=0.03, weight_decay=0.1, momentum=0.95,
                               nesterov=nesterov, adjust_lr_fn=adjust),
              torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2],
                                  "weight_decay": 0.1},
                                 {"params": [p for p in rest if p.dim() < 2],
                                  "weight_decay": 0.0}], lr=0.02, betas=(0.9, 0.95))]
    for step in range(STEPS):
        x, y = tokens(step)
        for net, optimizers in ((model, [ours]), (reference, theirs)):
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss_of_output(net(x, y)).backward()
            for optimizer in optimizers:
                optimizer.step()
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=0, atol=0)
    mine = dict(zip(reference.parameters(), model.parameters(), strict=True))
    for optimizer in theirs:
        for p, state in optimizer.state.items():
            torch.testing.assert_close(ours.state[mine[p]], state, rtol=0, atol=0)
    assert len(matrices) == 14  # q, k, v, o, gate, up, down of each block


# ---------------------------------------------------------------- which parameters
def _split_names(model: nn.Module, **overrides: list[str]) -> tuple[list[str], list[str]]:
    matrices, rest = muon_split(model, **overrides)
    return names_of(model, matrices), names_of(model, rest)


@pytest.mark.timeout(60)
def test_the_split_is_the_blocks_matrices_in_every_form(tmp_path: Path) -> None:
    """Muon gets the 2-D weights of the repeated blocks; the embeddings, the head (tied or
    not), norms and biases go to AdamW: in dtrain's GPT and Llama, in Hugging Face models
    built from configs, and in each pipeline piece (which holds the stem without its
    model's methods) as in the whole model."""
    for model_config, head in ((TINY_GPT, "wte.weight"), (TINY_LLAMA, "head.weight")):
        model = tiny(model_config)
        matrices, rest = _split_names(model)
        assert matrices and all(n.startswith("blocks.") and n.endswith(".weight")
                                for n in matrices)
        assert head in rest and not any("norm" in n or "ln" in n for n in matrices)
        assert {n for n, p in model.named_parameters() if p.dim() == 2} - set(matrices) \
            == {n for n in rest if dict(model.named_parameters())[n].dim() == 2}
        pieces = dtrain.pipeline.cut(model, 2)
        per_piece = [n for piece in pieces for n in _split_names(piece)[0]]
        assert sorted(per_piece) == sorted(matrices)
        listed = muon_split(nn.ModuleList(pieces), include=["head.weight"])[0]
        assert sorted(names_of(model, listed)) == sorted(
            [*matrices, *([head] if head == "head.weight" else [])])
    transformers = pytest.importorskip("transformers")
    tiny_hf = {"vocab_size": 64, "bos_token_id": None, "eos_token_id": None,
               "pad_token_id": None}
    for name, config in {
        "llama": transformers.LlamaConfig(**tiny_hf, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1),
        "gpt2": transformers.GPT2Config(**tiny_hf, n_embd=16, n_layer=2, n_head=2,
                                        n_positions=16),
    }.items():
        config.save_pretrained(tmp_path / name)
        model = tiny({"arch": "hf", "hf_config": str(tmp_path / name), "block_size": 8})
        matrices, rest = _split_names(model)
        assert len(matrices) == {"llama": 14, "gpt2": 8}[name], matrices
        assert all(".layers." in n or ".h." in n for n in matrices), matrices
        assert any("lm_head" in n or "wte" in n for n in rest), rest


@pytest.mark.timeout(60)
def test_overrides_move_parameters_and_a_vector_is_refused_in_one_line() -> None:
    model = tiny(TINY_LLAMA)
    matrices, _ = _split_names(model)
    fewer, _ = _split_names(model, exclude=["blocks.0.*"])
    assert fewer == [n for n in matrices if not n.startswith("blocks.0.")]
    more, rest = _split_names(model, include=["head.weight"])
    assert sorted(more) == sorted([*matrices, "head.weight"]) and "head.weight" not in rest
    with pytest.raises(ConfigError) as refused:
        muon_split(model, include=["*norm*"])
    assert "\n" not in str(refused.value)
    assert "matches blocks.0.attn_norm.weight of shape (16,): Muon trains matrices" in \
        str(refused.value)
    with pytest.raises(DtrainError, match="needs the module"):
        build_optimizer(model.parameters(), OptimizerConfig(name="muon"))
    with pytest.raises(DtrainError, match="shape"):
        Muon([{"params": [model.get_parameter("norm.weight")]}])
    muon = OptimizerConfig(name="muon")
    with pytest.raises(ConfigError, match="memory.offload"):
        dtrain.ZeRO(model, lambda _: build_optimizer(model, muon), offload_device="cpu")


# ---------------------------------------------------------------- ZeRO's shards
class _Lopsided(nn.Module):
    """A 4 x 4 matrix, then a vector four times its size: one ZeRO unit (a block at stage
    3) whose matrix lies in the first shard of two; the second rank holds none of it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x).repeat(1, 16) * self.gain).square().mean()


class _OneBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Lopsided()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_rank_that_holds_no_matrix_of_a_unit_still_steps_with_the_others(stage: int
                                                                           ) -> None:
    """dtrain.ZeRO over Muon (the factory's optimizer, from build_optimizer) on two
    thread ranks: a unit whose matrix lies in one rank's shard only, the other rank's
    shard a vector AdamW steps; as one process."""
    cfg = OptimizerConfig(name="muon", lr=0.05, muon_ns_dtype="float32", weight_decay=0.1)
    xs = [torch.randn(8, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    torch.manual_seed(0)
    base = _OneBlock()
    one = copy.deepcopy(base)
    opt = build_optimizer(one, cfg)
    for x in xs:
        opt.zero_grad()
        one(x).backward()
        opt.step()

    def rank(r: int) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(base)
        z = dtrain.ZeRO(model, lambda _: build_optimizer(model, cfg), stage=stage,
                        algorithm="native")
        assert isinstance(z.optimizer, ShardedMuon)
        for x in xs:
            z.backward(z(x[r * 4:(r + 1) * 4]))
            z.step()
            z.zero_grad()
        return z.state_dict()

    for state in run_threads(rank, 2, timeout=30):
        torch.testing.assert_close(state, one.state_dict(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- every layout
@dataclass(frozen=True)
class Run:
    """A layout trained on the ranks: its `[parallel]`, its `[optimizer]` keys beside
    MUON's, whether it is also run again resumed from a checkpoint halfway, its clip."""

    parallel: dict[str, Any]
    optimizer: dict[str, Any] = field(default_factory=dict)
    resumed: bool = False
    clip: float = CLIP
    restore: str = ""
    """Another run's, to start from its checkpoint halfway (a resumed one, run before)."""


TWO_RANKS = {
    "dp2": Run({}, resumed=True),
    "zero1": Run({"zero": 1}),
    "zero2": Run({"zero": 2}, resumed=True),
    "zero3": Run({"zero": 3}),
    "tp2": Run({"tp": 2}),
    "pp2": Run({"pp": 2, "microbatches": 2}),
    "pp2-zero1": Run({"pp": 2, "microbatches": 2, "zero": 1}),
    # bfloat16's Newton-Schulz (its matrices sent in it), unclipped: beside DataParallel's
    "dp2-bf16": Run({}, {"muon_ns_dtype": "bfloat16"}, clip=math.inf),
    "zero2-bf16": Run({"zero": 2}, {"muon_ns_dtype": "bfloat16"}, clip=math.inf),
    "zero3-bf16": Run({"zero": 3}, {"muon_ns_dtype": "bfloat16"}, clip=math.inf),
    "zero2-from-dp2": Run({"zero": 2}, restore="dp2"),
    "dp2-from-zero2": Run({}, restore="zero2"),
}
"""The layouts of two ranks (ZeRO over 2, tp 2, pp 2)."""
FOUR_RANKS = {
    "tp2-zero2": Run({"tp": 2, "zero": 2}),
    "zero3-dp4": Run({"zero": 3}),
    "pp2-tp2": Run({"pp": 2, "microbatches": 2, "tp": 2}),
}
"""The layouts of four ranks: ZeRO over tensor-parallel blocks, owners over four ranks."""


def layout_config(world: int, parallel: dict[str, Any], **optimizer: Any) -> Any:
    return config_from_dict({
        "model": LAYOUT_MODEL, "train": {"batch_size": SEQUENCES},
        "optimizer": {**MUON, **optimizer}, "comm": {"bucket_mb": BUCKET_MB},
        "parallel": {"nproc": world, **parallel}})


def train_steps(held: layouts.Holding, mesh: Mesh, steps: range, clip: float
                ) -> dict[str, list[float]]:
    """`steps` steps of the global batches, this rank taking its data-parallel share: the
    global batch's loss and the gradient norm before clipping, every step."""
    dp, coord = mesh.size("dp"), mesh.coords["dp"]
    losses, norms = [], []
    for step in steps:
        x, y = tokens(step)
        mine = slice(coord * SEQUENCES // dp, (coord + 1) * SEQUENCES // dp)
        loss = held.forward_backward([(x[mine], y[mine])]).reshape(1).float()
        if held.loss_group is not None:
            comm.all_reduce(loss, op="avg", group=held.loss_group)
        losses.append(loss.item())
        norms.append(float(held.clip_grad_norm_(clip)))
        held.step()
        held.zero_grad()
    return {"losses": losses, "norms": norms}


def save(held: layouts.Holding, folder: Path, step: int) -> None:
    pieces, extra = held.saved.state()
    universal.save(folder, step, pieces, extra, {}, keep_last=1,
                   group=held.saved.checkpoint_group)


def owners(held: layouts.Holding) -> dict[str, Any]:
    """How many tensor-parallel blocks Muon gathers whole; ZeRO's Muon: how many matrices
    each rank of the group orthogonalizes, and how many lie across two shards or more."""
    found: dict[str, Any] = {"owned": {}, "across": 0, "blocks": 0}
    for optimizer in held.optimizers:
        assert isinstance(optimizer, Muon)
        found["blocks"] += sum(b.group.size > 1 for b in optimizer.blocks.values())
        if isinstance(optimizer, ShardedMuon):
            for exchange in optimizer.exchanges:
                for m in exchange.matrices:
                    found["owned"][m.owner] = found["owned"].get(m.owner, 0) + 1
                    held_by = [r for r in range(exchange.size)
                               if m.held_by(r, exchange.unit.flat.shard_size)[1]]
                    found["across"] += len(held_by) > 1
    return found


def _layouts(runs: dict[str, Run], folder: str) -> dict[str, dict]:
    """Each of `runs` trained STEPS steps, its whole model saved under `folder`/name; a
    resumed one also trained half the steps, saved, built anew, restored and trained the
    rest (saved under `folder`/name-resumed)."""
    world = dtrain.world.current()
    out = {}
    for name, run in runs.items():
        config = layout_config(world.world_size, run.parallel, **run.optimizer)
        mesh = Mesh(dims_of(config, world.world_size))
        held = layouts.build(tiny(LAYOUT_MODEL), mesh, config)
        if run.restore:
            out[name] = _restored(held, mesh, Path(folder) / name, run)
            continue
        out[name] = {**train_steps(held, mesh, range(STEPS), run.clip),
                     "layout": held.describe(), **owners(held)}
        save(held, Path(folder) / name, STEPS)
        if not run.resumed:
            continue
        half = STEPS // 2
        held = layouts.build(tiny(LAYOUT_MODEL), mesh, config)
        first = train_steps(held, mesh, range(half), run.clip)
        save(held, Path(folder) / f"{name}-half", half)
        held = layouts.build(tiny(LAYOUT_MODEL), mesh, config)
        held.saved.restore(universal.Checkpoint(Path(folder) / f"{name}-half"))
        rest = train_steps(held, mesh, range(half, STEPS), run.clip)
        out[f"{name}-resumed"] = {key: first[key] + rest[key] for key in first}
        save(held, Path(folder) / f"{name}-resumed", STEPS)
    return out


def _restored(held: layouts.Holding, mesh: Mesh, out: Path, run: Run) -> dict[str, Any]:
    """The second half of `run.restore`'s steps from its checkpoint halfway, in this
    layout, saved in `out`; what it raised, if it did."""
    try:
        held.saved.restore(universal.Checkpoint(out.parent / f"{run.restore}-half"))
    except DtrainError as exc:
        return {"error": str(exc)}
    done = train_steps(held, mesh, range(STEPS // 2, STEPS), run.clip)
    save(held, out, STEPS)
    return done


def serial() -> dict[str, Any]:
    """One process on the global batches: dtrain's Muon in a plain loop."""
    model = tiny(LAYOUT_MODEL)
    opt = build_optimizer(model, layout_config(1, {}).optimizer)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = tokens(step)
        opt.zero_grad()
        loss = loss_of_output(model(x, y))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    state = model.state_dict()
    del state["head.weight"]  # tied: embed.weight itself
    return {"losses": losses, "norms": norms, "model": state}


class _Ranks:
    """Runs on one set of gloo processes (a set's start costs more than the runs): each
    test reads its own part. Called: the results by rank, run at the first call."""

    def __init__(self, folder: Path, runs: dict[str, Run], world: int) -> None:
        self.folder, self.runs, self.world = folder, runs, world
        self.results: list[dict] | None = None

    def __call__(self) -> list[dict]:
        if self.results is None:
            self.results = run_ranks(_layouts, self.world, self.runs, str(self.folder),
                                     timeout=170)
        return self.results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> _Ranks:
    return _Ranks(tmp_path_factory.mktemp("muon-two"), TWO_RANKS, 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> _Ranks:
    return _Ranks(tmp_path_factory.mktemp("muon-four"), FOUR_RANKS, 4)


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return serial()


def same_as_one_process(ranks: _Ranks, name: str, want: dict[str, Any]) -> None:
    """The losses and gradient norms of every rank, and the saved model, as `want`'s."""
    for r in ranks():
        torch.testing.assert_close(r[name]["losses"], want["losses"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r[name]["norms"], want["norms"], rtol=1e-5, atol=1e-5)
    got = universal.Checkpoint(ranks.folder / name).model_state()
    torch.testing.assert_close(got, want["model"], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", [n for n, run in TWO_RANKS.items()
                                  if "bf16" not in n and not run.restore]
                         + [f"{n}-resumed" for n, run in TWO_RANKS.items() if run.resumed])
def test_layout_equals_one_process(name: str, two_ranks: _Ranks,
                                   one_process: dict[str, Any]) -> None:
    """DataParallel, ZeRO 1-3 (each matrix orthogonalized by its owner), tp 2 (each
    matrix gathered whole), pp 2 (each stage its own, with ZeRO too), and runs resumed
    from a checkpoint halfway: the global batch's losses, gradient norms and final weights
    as one process's, within float32's tolerance."""
    same_as_one_process(two_ranks, name, one_process)
    found = two_ranks()[0][name]
    if name.startswith("zero") and not name.endswith("resumed"):
        assert set(found["owned"]) == {0, 1} and found["across"] > 0, found
    assert (found.get("blocks", 0) > 0) == (name == "tp2")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["zero2-bf16", "zero3-bf16"])
def test_zero_in_bfloat16_equals_data_parallel(name: str, two_ranks: _Ranks) -> None:
    """Newton-Schulz in bfloat16 (torch's), the matrices sent to their owners and back in
    it: ZeRO's weights and losses are DataParallel's on the same ranks, whose averaged
    gradients are ZeRO's (unclipped: a norm summed over shards rounds differently, and
    bfloat16 would turn a last float32 bit of the scaled gradient into a 2**-8 one now
    and then). Against one process (a gradient averaged in another order) bfloat16's
    rounding shows; see MUON."""
    dp = universal.Checkpoint(two_ranks.folder / "dp2-bf16").model_state()
    torch.testing.assert_close(universal.Checkpoint(two_ranks.folder / name).model_state(),
                               dp)
    for r in two_ranks():
        torch.testing.assert_close(r[name]["losses"], r["dp2-bf16"]["losses"])


@pytest.mark.timeout(180)
def test_a_zero_checkpoint_resumes_in_data_parallel(two_ranks: _Ranks,
                                                   one_process: dict[str, Any]) -> None:
    """ZeRO-2's checkpoint halfway, resumed under DataParallel: the last steps' losses as
    one process's (the checkpoint's Muon and AdamW state are per parameter, whatever
    layout reads them)."""
    for r in two_ranks():
        got = r["dp2-from-zero2"]
        assert "error" not in got, got
        torch.testing.assert_close(got["losses"], one_process["losses"][STEPS // 2:],
                                   rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        universal.Checkpoint(two_ranks.folder / "dp2-from-zero2").model_state(),
        one_process["model"], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(180)
def test_a_data_parallel_checkpoint_resumes_under_zero(two_ranks: _Ranks,
                                                      one_process: dict[str, Any]) -> None:
    """DataParallel's checkpoint halfway, resumed under ZeRO-2: each shard piece takes the
    state keys its parameters have (Muon's momentum, AdamW's moments), and the last steps
    are one process's."""
    for r in two_ranks():
        got = r["zero2-from-dp2"]
        assert "error" not in got, got["error"]
        torch.testing.assert_close(got["losses"], one_process["losses"][STEPS // 2:],
                                   rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        universal.Checkpoint(two_ranks.folder / "zero2-from-dp2").model_state(),
        one_process["model"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_rank_layout_equals_one_process(name: str, four_ranks: _Ranks,
                                             one_process: dict[str, Any]) -> None:
    """ZeRO-2 over tp 2 x dp 2 (each owner's tp ranks gather its matrix's blocks), ZeRO-3
    over 4 (owners spread over four ranks), pp 2 x tp 2: as one process."""
    same_as_one_process(four_ranks, name, one_process)
    found = four_ranks()[0][name]
    if "zero" in name:
        ranks = 4 if name == "zero3-dp4" else 2
        assert set(found["owned"]) == set(range(ranks)) and found["across"] > 0, found
    assert (found["blocks"] > 0) == ("tp2" in name)


@pytest.mark.timeout(120)
def test_a_vector_forced_into_muon_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_dtrain("train", "-n", "1", "--set", "optimizer.name='muon'",
                        "--set", "optimizer.muon_include=['*ln*']", "--set", "train.steps=1",
                        "--set", f"train.out_dir='{tmp_path}'", timeout=100)
    assert result.returncode == 2
    assert "optimizer.muon_include = ['*ln*'] matches blocks.0.ln1.weight of shape (128,): " \
        "Muon trains matrices" in one_error_line(result)
