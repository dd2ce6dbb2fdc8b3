"""Both planners know what trains: a LoRA run's frozen base has no gradient and no
optimizer state (ZeRO-3 still shards it), backward computes no weight gradient of it,
and DPO adds a reference forward. The adapters the shape counts are those dtrain builds."""

from __future__ import annotations

import dataclasses

import pytest

from dtrain.adapters import AdapterConfig, built
from dtrain.models import resolve
from dtrain.models.config import ModelConfig
from dtrain.planner.analytic.cluster import evaluate, planned_layout
from dtrain.planner.analytic.hardware import Cluster, hardware
from dtrain.planner.shape import ModelShape, parse_shape

LLAMA = ModelConfig(arch="llama", block_size=64, n_layer=2, n_embd=64, n_head=4,
                    n_kv_head=2, ffn_hidden=128)
LORA = AdapterConfig(kind="lora", rank=8)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_the_shape_counts_the_adapters_dtrain_builds(arch: str) -> None:
    cfg = resolve(dataclasses.replace(LLAMA, arch=arch, n_kv_head=0 if arch == "gpt" else 2,
                                      ffn_hidden=0 if arch == "gpt" else 128), 256)
    model = built(cfg, LORA)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = dataclasses.replace(ModelShape.of(cfg), lora=LORA.rank)
    assert shape.trained_parameters() == trained
    assert "LoRA rank 8" in shape.describe()


def test_traced_plan_holds_gradients_and_state_for_the_adapters_alone() -> None:
    from dtrain.planner import Dims, Links, estimate
    from dtrain.planner.traced.profile import profile_model

    cfg = resolve(LLAMA, 256)
    full, lora = profile_model(cfg, 2, ("none",)), profile_model(cfg, 2, ("none",),
                                                                 adapter=LORA)
    dpo = profile_model(cfg, 2, ("none",), adapter=LORA, reference=True)
    adapters = sum(p.numel() for p in built(cfg, LORA).parameters() if p.requires_grad)
    free = Links.given(1e9, 0)
    for zero in (0, 2, 3):
        a = estimate(full, Dims(2, zero=zero), 1e12, 1e12, free)
        b = estimate(lora, Dims(2, zero=zero), 1e12, 1e12, free)
        shards = 2 if zero else 1
        assert b.optimizer == pytest.approx(8 * adapters / shards)  # AdamW: two moments
        assert b.grads == pytest.approx(4 * adapters / (2 if zero >= 2 else 1))
        assert b.grads < a.grads / 4
        if zero == 3:  # the frozen base sharded as the rest (the adapters beside it)
            assert a.params <= b.params <= a.params + 8 * adapters
    half = profile_model(cfg, 2, ("none",), adapter=dataclasses.replace(
        LORA, base_dtype="bfloat16"))
    base = sum(p.numel() for p in built(cfg, LORA).parameters() if not p.requires_grad)
    for zero in (0, 2, 3):  # a bfloat16 base: 2 bytes a parameter less (ZeRO-3: sharded)
        a, b = (estimate(p, Dims(2, zero=zero), 1e12, 1e12, free) for p in (lora, half))
        if zero < 3:
            assert a.params - b.params == pytest.approx(2 * base)
        else:  # which peak is the rank's (a block's or the logits') may change with it
            assert b.params < a.params
    plain, adapted, preferred = (estimate(p, Dims(2), 1e12, 1e12, free)
                                 for p in (full, lora, dpo))
    # per element: 6 flops a step trained whole, 4 with a frozen base, 6 with DPO's forward
    assert adapted.compute_s < plain.compute_s < preferred.compute_s


def test_cluster_plan_of_a_lora_run() -> None:
    base = parse_shape("arch=llama,layers=32,hidden=4096,heads=32,kv_heads=8,seq=4096,"
                       "vocab=128256,ffn=14336")
    lora = dataclasses.replace(base, lora=16)
    cluster = Cluster(hardware("h100"), 1, 8)
    layout = planned_layout(8, 1, 1, 8, 3, 1, 1, "full")
    whole, adapted = (evaluate(s, cluster, 8, layout) for s in (base, lora))
    assert adapted.memory["optimizer"] < whole.memory["optimizer"] / 100
    assert adapted.memory["grads"] < whole.memory["grads"] / 100
    assert adapted.memory["weights"] == pytest.approx(whole.memory["weights"])
    assert adapted.parts["compute"] < whole.parts["compute"]
    dpo = evaluate(dataclasses.replace(lora, dpo=True), cluster, 8, layout)
    assert dpo.parts["compute"] > adapted.parts["compute"]
    assert parse_shape("layers=2,hidden=64,heads=4,seq=8,vocab=10,lora=4,dpo=true").dpo


def _fine_tune(cfg: ModelConfig, adapter: AdapterConfig, cap: int) -> int:
    """Build and train 2 AdamW steps of 4 sequences under a cap on live tensor bytes;
    the peak (MemoryError past the cap)."""
    import torch

    from dtrain.planner import LiveBytes

    with LiveBytes(limit=cap) as live:
        torch.manual_seed(0)
        model = built(cfg, adapter)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = (torch.randint(0, 256, (4, cfg.block_size), generator=g) for _ in range(2))
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    return live.peak


def test_a_lora_run_planned_to_fit_where_full_fine_tuning_does_not_then_runs() -> None:
    """The traced plan of one process: full fine-tuning over a cap, LoRA under it; then
    both run under that cap on live tensor bytes: full fine-tuning runs out, LoRA trains."""
    from dtrain.planner import Dims, Links, estimate
    from dtrain.planner.traced.profile import profile_model

    cfg = resolve(dataclasses.replace(LLAMA, n_layer=4, n_embd=128, block_size=64), 256)
    free = Links.given(1e9, 0)
    full, lora = (estimate(profile_model(cfg, 4, ("none",), adapter=a), Dims(1), 1e12, 1e12,
                           free) for a in (None, LORA))
    cap = int((full.total + lora.total) / 2)
    assert lora.total < cap < full.total
    with pytest.raises(MemoryError):
        _fine_tune(cfg, AdapterConfig(), cap)
    assert _fine_tune(cfg, LORA, cap) <= cap
