"""The planner's check: the peak memory of a real run of dtrain's GPT (or another built-in
model, given its resolved `[model]` section) in a layout.

`measured_peak` builds the model and strategy the way `dtrain train` does (tp splits the
whole model, pp cuts it into pieces and frees the others, DataParallel or ZeRO wraps each
piece over dp), trains a few steps on random tokens with AdamW, and returns this rank's
peak of live tensor bytes (dtrain.planner.tracker; on CUDA `max_memory_allocated` would
read the same). Call it on every rank of an initialized world of `dp * tp * pp` ranks.
"""

from __future__ import annotations

import torch

from dtrain import models, pipeline, tensor_parallel
from dtrain.layout import Layout
from dtrain.mesh import Mesh
from dtrain.models.config import ModelConfig
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.zero import ZeRO
from dtrain.planner.tracker import LiveBytes


def measured_peak(cfg: GPTConfig | ModelConfig, layout: Layout, batch: int, steps: int = 3,
                  bucket_mb: float = 25.0) -> int:
    """Peak live tensor bytes on this rank over steps 2..`steps` of a `batch`-sequence
    global batch: the steady state, with optimizer state. The first step is left out: it
    builds the state, and `algorithm="auto"` times its candidates on probe tensors then."""
    tracker = LiveBytes()
    with tracker:
        mesh = Mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp)
        dp_group = mesh.group("dp")
        torch.manual_seed(0)
        gpt = GPT(cfg) if isinstance(cfg, GPTConfig) else models.build(cfg)
        if layout.tp > 1:
            tensor_parallel.split_model(gpt, mesh.group("tp"))

        def wrap(module: torch.nn.Module):
            if layout.zero:
                return ZeRO(module, lambda params: torch.optim.AdamW(params), stage=layout.zero,
                            group=dp_group, bucket_mb=bucket_mb)
            return DataParallel(module, group=dp_group, bucket_mb=bucket_mb)

        pipe = None
        if layout.pp > 1:
            pp_group = mesh.group("pp")
            mine = pipeline.pieces_for(pipeline.cut(gpt, layout.pp), pp_group)
            pipeline.release_others(gpt, mine)
            model = torch.nn.ModuleList(wrap(p) for p in mine)
            pipe = pipeline.Pipeline(list(model), pp_group, microbatches=layout.microbatches,
                                     schedule=layout.schedule,
                                     loss_fn=pipeline.loss_of(gpt),
                                     tied=pipeline.tied_weights(gpt, mine, pp_group))
        else:
            model = wrap(gpt)
        wrapped = list(model) if pipe else [model]
        optimizers = ([w.optimizer for w in wrapped] if layout.zero
                      else [torch.optim.AdamW(model.parameters())])
        generator = torch.Generator().manual_seed(mesh.coords["dp"])
        per_rank = batch // layout.dp
        for step in range(steps):
            if step == 1:
                tracker.reset_peak()
            x = torch.randint(0, cfg.vocab_size, (per_rank, cfg.block_size), generator=generator)
            if pipe:
                pipe.step(x, x)
            else:
                model(x, x)[1].backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return tracker.peak
