"""Holdings (dtrain.layouts): every way of holding a model, driven the same way by the
training loop. Here: sync groups (local SGD, DiLoCo) around every kind of Holding, against
one process. (Each layout against one process: tests/data_parallel, tests/tensor_parallel,
tests/pipeline, tests/ps; built in split form: tests/layouts/test_split_build.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import dtrain
from dtrain.testing import run_ranks

SYNC_GPT = {"arch": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8}
SYNC_LLAMA = {"arch": "llama", "n_layer": 2, "n_head": 2, "n_kv_head": 2, "n_embd": 16,
              "ffn_hidden": 32, "block_size": 8}
SYNC_MOE = {**SYNC_LLAMA, "preset": "moe-tiny", "moe_inter_size": 16, "moe_layers": "after 1",
            "capacity_factor": 0.0, "router": "sigmoid_bias", "aux_loss_weight": 0.0}
"""Dropless, no balance loss, and biases that nothing moves here: each token's loss is its
own, so the mean over two sync groups' halves is the whole batch's."""
SYNC_VOCAB, SYNC_BATCH, SYNC_STEPS, SYNC_LR = 64, 8, 3, 0.5
SYNC_LAYOUTS = {"dp": (SYNC_GPT, {"dp": 2}), "zero1": (SYNC_GPT, {"dp": 2, "zero": 1}),
                "zero3": (SYNC_GPT, {"dp": 2, "zero": 3}),
                "pp": (SYNC_GPT, {"pp": 2, "microbatches": 2}),
                "cp": (SYNC_LLAMA, {"cp": 2}), "ep": (SYNC_MOE, {"dp": 2, "ep": 2})}
"""Each kind of Holding (layouts.HOLDINGS but the parameter server, which takes no sync
groups), and context and expert parallelism inside it, as one of two sync groups of 2
ranks: (model, parallel)."""


def _sync_model(shape: dict) -> nn.Module:
    from dtrain import models
    from dtrain.models.config import ModelConfig

    torch.manual_seed(0)
    return models.build(models.resolve(ModelConfig(**shape), SYNC_VOCAB))


def _sync_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, SYNC_VOCAB, (SYNC_BATCH, SYNC_GPT["block_size"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _every_holding_in_sync_groups(folder: str) -> dict[str, str]:
    """Each layout of SYNC_LAYOUTS in 2 sync groups, local SGD every step with plain SGD:
    trained SYNC_STEPS steps, each sync group's whole model saved under folder/name/gS."""
    from dtrain import layouts
    from dtrain.checkpoint import universal
    from dtrain.config import config_from_dict, dims_of
    from dtrain.context_parallel import chunks
    from dtrain.mesh import Mesh

    world = dtrain.world.current()
    described = {}
    for name, (shape, parallel) in SYNC_LAYOUTS.items():
        config = config_from_dict({
            "model": shape, "train": {"batch_size": SYNC_BATCH},
            "optimizer": {"name": "sgd", "lr": SYNC_LR, "momentum": 0.0, "weight_decay": 0.0},
            "parallel": {"nproc": world.world_size, **parallel},
            "sync": {"method": "local_sgd", "every": 1}})
        mesh = Mesh(dims_of(config, world.world_size))
        held = layouts.build(_sync_model(shape), mesh, config)
        shards, mine = mesh.dims.batch_shards, mesh.coords["sync"] * mesh.dims.dp + \
            mesh.coords["dp"]
        for step in range(SYNC_STEPS):
            x, y = (chunks.shard(t.chunk(shards)[mine], mesh.coords["cp"], mesh.size("cp"))
                    for t in _sync_batch(step))
            held.forward_backward([(x, y)])
            held.step()
            held.zero_grad()
        pieces, extra = held.saved.state()
        universal.save(Path(folder) / name / f"g{mesh.coords['sync']}", SYNC_STEPS, pieces,
                       extra, {}, keep_last=1, group=held.saved.checkpoint_group)
        described[name] = held.describe()
    return described


@pytest.mark.timeout(120)
def test_every_kind_of_holding_takes_the_outer_loop_and_equals_one_process(
        tmp_path: Path) -> None:
    """Sync groups are no wrapper that could miss a member of Holding: any Holding runs
    the outer loop in its own step. Two sync groups of each kind (DataParallel, ZeRO-1,
    ZeRO-3, a pipeline), averaging parameters after every plain SGD step, equal one process
    on the whole batch (the average of two SGD steps from the same weights is the step on
    the average gradient); without the outer loop the groups would drift apart."""
    from dtrain import layouts
    from dtrain.checkpoint import universal
    from dtrain.models import loss_of_output

    described = run_ranks(_every_holding_in_sync_groups, 4, str(tmp_path), timeout=110)
    for name, (shape, _) in SYNC_LAYOUTS.items():
        model = _sync_model(shape)
        optimizer = torch.optim.SGD(model.parameters(), lr=SYNC_LR)
        for step in range(SYNC_STEPS):
            loss_of_output(model(*_sync_batch(step))).backward()
            optimizer.step()
            optimizer.zero_grad()
        named = {*dict(model.named_parameters()), *dict(model.named_buffers())}  # untied
        want = {k: v for k, v in model.state_dict().items() if k in named}
        assert "2 sync groups synchronized by local_sgd" in described[0][name], described
        for group in ("g0", "g1"):
            got = universal.Checkpoint(tmp_path / name / group).model_state()
            assert set(got) == set(want), (name, group)
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
    for kind, holding in layouts.HOLDINGS.items():  # the outer loop runs in Holding.step
        assert {"step", "finish_rounds", "sync_with"}.isdisjoint(vars(holding)), kind
