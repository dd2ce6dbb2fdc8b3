"""Regional compilation (dtrain.models.compiled, `[train] compile`): every layout compiled
gives the losses and weights of the same layout run eagerly, and compiles nothing after its
first step.

The quick tests trace with dynamo's "eager" backend (no code generation: a second at most);
the layout tests compile with inductor, as a run does, and are slow: the first compile of a
block's graph costs seconds (later ones load it from inductor's cache).
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain import layouts, models
from dtrain.checkpoint import universal
from dtrain.config import config_from_dict, dims_of
from dtrain.errors import ConfigError
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.models.compiled import CACHE_ENV, compile_blocks, compile_stats, is_compiled
from dtrain.models.config import ModelConfig
from dtrain.testing import run_ranks
from tests.support import cli

SHAPES = {
    "gpt": {"arch": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
    "llama": {"arch": "llama", "preset": "llama-tiny", "n_layer": 2, "block_size": 32},
}
HF_LLAMA = {"vocab_size": 64, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64}
STEPS, BATCH, VOCAB, BLOCK = 4, 4, 64, 32
LAYOUTS = {
    "dp": ({}, {}),
    "zero3": ({"zero": 3}, {}),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}),
    "tp2": ({"tp": 2}, {}),
    "pp2": ({"pp": 2, "microbatches": 2}, {}),
    "full": ({}, {"recompute": "full"}),
    "cp2": ({"cp": 2}, {}),
}


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return models.build(models.resolve(ModelConfig(**SHAPES["gpt"]), VOCAB))


# ------------------------------------------------------------------ the function
def test_compile_blocks_names_the_blocks_and_keeps_their_names_and_hooks() -> None:
    """Each block's forward is compiled on the instance: the names of the model's modules
    and parameters are unchanged, applying it twice changes nothing, a forward pre-hook on
    a block runs once per call outside the compiled region, and the output is eager's."""
    model = tiny()
    names = [n for n, _ in model.named_parameters()]
    x = torch.randint(0, VOCAB, (2, BLOCK))
    want = model(x)
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    assert compile_blocks(model, backend="eager") == ["blocks.0", "blocks.1"]
    assert compile_blocks(model, backend="eager") == ["blocks.0", "blocks.1"]
    assert all(is_compiled(b) for b in model.blocks) and not is_compiled(model)
    assert [n for n, _ in model.named_parameters()] == names
    before = compile_stats()["frames"]
    torch.testing.assert_close(model(x), want)
    torch.testing.assert_close(model(x), want)
    assert calls == [1, 1]
    assert compile_stats()["frames"] == before + 1  # one graph, shared by both blocks


def test_a_deep_copy_runs_its_own_weights() -> None:
    model = tiny()
    compile_blocks(model, backend="eager")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.mul_(0.5)
    x = torch.randint(0, VOCAB, (2, BLOCK))
    assert not torch.allclose(twin(x), model(x))


def test_a_model_without_blocks_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="train.compile: Linear keeps no blocks"):
        compile_blocks(nn.Linear(4, 4), backend="eager")


# ------------------------------------------------------------------ every layout
@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One out_dir for the layout tests. Their graphs and kernels go to the session's
    inductor cache (tests/conftest.py's `hermetic` chooses it, so compile_blocks leaves
    out_dir/compile_cache unused): what they share (the same block in several layouts, the
    same shapes in several tests) is compiled once and loaded from there after."""
    return tmp_path_factory.mktemp("compiled")


def _run(shape: dict, parallel: dict, memory: dict, compiled: bool, out: str) -> dict:
    """STEPS steps of `parallel` on this rank, eager or compiled: the mean loss of each
    step, this rank's pieces of the final state, and dynamo's counts after step 2 and at
    the end."""
    import dtrain
    from dtrain import comm
    from dtrain.context_parallel import chunks

    world = dtrain.world.current()
    config = config_from_dict({
        "model": shape, "train": {"batch_size": BATCH, "seed": 3, "compile": compiled,
                                  "out_dir": out},
        "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0},
        "parallel": {"nproc": world.world_size, **parallel}, "memory": memory})
    mesh = Mesh(dims_of(config, world.world_size))
    layout = mesh.dims
    skeleton = init.skeleton(lambda: models.build(models.resolve(ModelConfig(**shape), VOCAB)))
    held = layouts.build(skeleton, mesh, config)
    g = torch.Generator().manual_seed(0)
    rows = slice(mesh.coords["dp"] * BATCH // layout.dp,
                 (mesh.coords["dp"] + 1) * BATCH // layout.dp)
    losses, counts = [], []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g)
        x, y = (chunks.shard(t[rows], mesh.coords["cp"], mesh.size("cp"))
                for t in (x, x.roll(-1, 1)))
        loss = held.forward_backward([(x, y)]).float().reshape(1)
        held.step()
        held.zero_grad()
        if held.loss_group is not None:
            loss = comm.all_reduce(loss, op="avg", group=held.loss_group)
        losses.append(float(loss))
        counts.append(compile_stats()["frames"])
    pieces, _ = held.saved.state()
    return {"losses": losses, "counts": counts,
            "state": {(p.name, p.part, p.lo): p.values.clone() for p in pieces}}


def _compare(shape: dict, layout: str, out: Path) -> None:
    """`layout` compiled against eager, on 2 ranks (out: the compiled run's out_dir, where
    its kernels are cached)."""
    parallel, memory = LAYOUTS[layout]
    eager = run_ranks(_run, 2, shape, parallel, memory, False, str(out), timeout=120)
    with_compile = run_ranks(_run, 2, shape, parallel, memory, True, str(out), timeout=400)
    for rank, (want, got) in enumerate(zip(eager, with_compile, strict=True)):
        assert got["counts"][0] > 0, "nothing was compiled"
        assert got["counts"][-1] == got["counts"][1], \
            f"rank {rank} compiled again after step 2: {got['counts']}"
        # inductor fuses and reorders sums: float rounding apart (plain SGD: Adam would
        # blow a rounding difference in a near-zero gradient up to a whole step)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=1e-5, atol=0)
        assert want["state"], f"rank {rank} holds no state to compare"
        assert got["state"].keys() == want["state"].keys()
        for key, value in want["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("layout", ["dp", "zero3", "tp2-sp", "pp2", "full"])
def test_compiled_layouts_equal_eager(arch: str, layout: str, shared: Path) -> None:
    _compare(SHAPES[arch], layout, shared)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["dp", "zero3", "tp2", "pp2", "full"])
def test_a_hugging_face_model_compiled_equals_eager(layout: str, tmp_path: Path,
                                                    shared: Path) -> None:
    """transformers' Llama: its decoder layers compiled (tp without sequence parallelism,
    which Hugging Face models do not take)."""
    import transformers

    transformers.LlamaConfig(**HF_LLAMA).save_pretrained(tmp_path)
    _compare({"arch": "hf", "hf_config": str(tmp_path), "block_size": BLOCK}, layout, shared)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_context_parallel_and_experts_compiled_equal_eager(shared: Path) -> None:
    """cp's attention and the MoE layer are graph breaks; the rest of the block compiles."""
    _compare(SHAPES["llama"], "cp2", shared)
    # moe-tiny's dense block is llama-tiny's (the same width, heads and feed-forward):
    # its graph on each rank is the one test_compiled_layouts_equal_eager[dp-llama]
    # compiled, loaded from the cache instead of built again
    moe = {"arch": "llama", "preset": "moe-tiny", "n_layer": 2, "moe_inter_size": 32,
           "block_size": BLOCK, "moe_layers": "after 1", "capacity_factor": 0.0,
           "router": "sigmoid_bias", "aux_loss_weight": 0.0}
    LAYOUTS["ep2"] = ({"ep": 2}, {})
    _compare(moe, "ep2", shared)


# ------------------------------------------------------------------ dtrain train
GRAPH_CACHES = ("fxgraph", "aotautograd", "locks")
"""The folders of an inductor cache that hold compiled graphs (and its file locks); the
others hold built kernels, each found by the hash of its source and build command."""


def _seed_kernels(session: Path, cache: Path) -> None:
    """Copy the built kernels of the session's inductor cache into `cache`, not its graphs.

    The block of dtrain train's tiny GPT is the one the layout tests compiled (the same
    shapes on each rank), so its C++ kernels load instead of being built again (g++, most
    of a cold compile's time); every graph is still traced, lowered and written into
    `cache` by the run itself, whose restart then loads them from there."""
    if not session.is_dir():
        return  # this test alone: the run builds every kernel itself
    for folder in session.iterdir():
        if folder.is_dir() and folder.name not in GRAPH_CACHES:
            shutil.copytree(folder, cache / folder.name, dirs_exist_ok=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dtrain_train_compiled_reports_compile_time_and_a_restart_uses_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dtrain train` with compile = true on 2 ranks: the losses of the eager run, one
    line with the compile time, and a second run in the same out_dir loads every graph
    from out_dir/compile_cache."""
    text = cli.TINY_MODEL + "[train]\nbatch_size = 4\neval_every = 0\n[logging]\n" \
                            "sample_tokens = 0\n"
    session = Path(os.environ[CACHE_ENV])
    monkeypatch.delenv(CACHE_ENV, raising=False)  # the run's own cache
    eager, eager_saved = cli.train_rows(tmp_path / "eager", text, ["-n", "2"], 3)
    args = ["-n", "2", "--set", "train.compile=true"]
    cache = tmp_path / "compiled" / "run" / "compile_cache"
    _seed_kernels(session, cache)
    first, first_saved = cli.train_rows(tmp_path / "compiled", text, args, 3)
    assert list((cache / "fxgraph").iterdir()), "the first run cached no graph in its out_dir"
    torch.testing.assert_close(torch.tensor([r["loss"] for r in first]),
                               torch.tensor([r["loss"] for r in eager]), rtol=1e-5, atol=0)
    want = universal.Checkpoint(eager_saved).model_state()
    got = universal.Checkpoint(first_saved).model_state()
    assert want and got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    again = cli.dtrain("train", str(tmp_path / "compiled" / "config.toml"), *args,
                       "--set", "train.steps=5", "--set", "checkpoint.resume='auto'", "--set",
                       f"train.out_dir='{tmp_path / 'compiled' / 'run'}'", timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout, again.stdout
    lines = [x for x in again.stdout.splitlines() if x.startswith("compile:")]
    assert len(lines) == 1 and "from the cache" in lines[0], again.stdout
