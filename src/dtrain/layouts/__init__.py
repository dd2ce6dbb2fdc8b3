"""Layouts: one builder per way of holding a model, all returning the same `Holding`.

    held = dtrain.layouts.build(model, mesh, config)   # as `[parallel]` says
    loss = held.forward_backward(batches); held.clip_grad_norm_(1.0); held.step()

The composition order is fixed: tp splits every layer of the model first
(dtrain.tensor_parallel), then pp cuts the split model into stages (dtrain.pipeline), then
dp wraps the model or each piece in DataParallel or ZeRO over the remaining axis. With
`mode = "ps"` the ranks are workers of parameter servers instead.

| kind     | module                     | Holding           |
|----------|----------------------------|-------------------|
| dp       | layouts/data_parallel.py   | Replicated        |
| zero     | layouts/zero.py            | Sharded           |
| pp       | layouts/pipeline.py        | Pipelined         |
| ps       | layouts/parameter_server.py| ParameterServer   |
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from dtrain import comm
from dtrain.checkpoint.universal import Checkpoint
from dtrain.config import Config
from dtrain.context_parallel import ContextParallel
from dtrain.data_parallel.averaging import Averaging
from dtrain.layouts.data_parallel import Replicated
from dtrain.layouts.holding import Holding
from dtrain.layouts.parameter_server import ParameterServer
from dtrain.layouts.pipeline import Pipelined
from dtrain.layouts.zero import Sharded
from dtrain.mesh import Dims, Mesh
from dtrain.models import chunked_loss, compiled, context, float8, init, moe, recompute
from dtrain.models.weights import SlicedWeights
from dtrain.sync.diloco import DiLoCo
from dtrain.tensor_parallel.parallelize import sum_headwise_grads
from dtrain.tensor_parallel.plan_of import check_sequence_parallel, split_model
from dtrain.tensor_parallel.sequence import apply_sequence_parallel

# each kind's class, called as (model, mesh, config, notes=, [averaging=])
HOLDINGS: dict[str, Callable[..., Holding]] = {
    "dp": Replicated, "zero": Sharded, "pp": Pipelined, "ps": ParameterServer}

__all__ = ["HOLDINGS", "Holding", "ParameterServer", "Pipelined", "Replicated", "Sharded",
           "build", "kind_of"]


def kind_of(dims: Dims) -> str:
    """Which Holding implements `dims` (a key of HOLDINGS)."""
    if dims.exchange == "ps":
        return "ps"
    return "pp" if dims.pp > 1 else "zero" if dims.zero else "dp"


def build(model: nn.Module, mesh: Mesh, config: Config,
          weights: Checkpoint | SlicedWeights | None = None,
          averaging: Averaging | None = None) -> Holding:
    """This rank's Holding of `model` (the same whole model on every rank) laid out on
    `mesh` by its Dims; `config` gives the options (`[parallel]`, `[comm]`, `[sync]`, `[ps]`,
    `[optimizer]`, `[train]`, `[memory]`).

    tp > 1 splits `model`'s layers in place first, by its family's plan or `[model]
    tp_plan` (dtrain.tensor_parallel.plan_of), with `parallel.sequence_parallel` if set;
    ep > 1 then keeps each rank's share of every MoE layer's experts, ep folded over dp x
    cp x tp (dtrain.mesh.dims: each tp rank sends its share of the tokens), averaged over
    the ranks that hold the same experts (mesh group "edp_cp"), the exchange cut into
    `parallel.ep_overlap_chunks` chunks hidden under compute;
    `train.float8` swaps the blocks' linear layers for FP8 ones (dtrain.models.float8),
    before `train.compile` compiles the blocks;
    `[memory]` chooses the modules recomputed in backward (dtrain.models.recompute). cp > 1
    runs the model on each rank's chunks of every sequence (dtrain.models.context), its
    gradients averaged over dp x cp.

    A `model` built in split form (its parameters on the meta device, dtrain.models.init)
    is never whole anywhere: each rank allocates only what it holds, on the mesh's device,
    and restores it from `weights` (a checkpoint, or Hugging Face weights) or else from the
    initial values for `train.seed`, the same as one process's.

    `averaging` (fault tolerance's live replicas hand one: dtrain.ft.live.LiveAveraging)
    averages gradients over the live replicas it chooses at each step: instead of over the mesh's
    dp group (DataParallel), or after ZeRO's reduction over it, shard by shard.

    A mesh of sync groups (`sync.method` = local_sgd or diloco) gives each its own Holding,
    synchronized with the others' over `mesh.group("sync")` every `sync.every` steps by
    the outer loop it takes (`Holding.sync_with`, dtrain.sync.diloco), and its own
    checkpoints.

    Raises:
        ConfigError: `train.float8` where this rank's device has no FP8 (a CPU, a GPU
            below compute capability 8.9), or without torchao.
    """
    if config.train.float8 != "none":  # refused before anything is split or allocated
        float8.check_float8(mesh.world.device)
    skeleton = init.is_skeleton(model)
    # the training loss over chunks of tokens (`train.loss`), set before tp splits the head
    loss_note = chunked_loss.apply(model, config.train.loss, config.train.loss_chunk)
    if skeleton and weights is None:
        weights = init.Initial(model, config.train.seed)  # the whole model's names and rules
    dims = mesh.dims
    sequence = dims.sequence_parallel
    if sequence:
        check_sequence_parallel(model)
    if dims.cp > 1:  # each rank runs its chunks of every sequence
        context.apply(model, ContextParallel(comm.resolve(mesh.group("cp")), dims.cp_method))
    if dims.tp > 1:
        split_model(model, mesh.group("tp"), config.model.tp_plan)
    if dims.ep > 1:  # each rank keeps its E / ep experts of every MoE layer
        # folded over tp: the tp ranks hold the same tokens (unless sequence parallelism
        # gave each its own part) and send a share of them each
        shares = mesh.group("tp") if dims.tp > 1 and not sequence else None
        moe.expert_parallel(model, mesh.group("ep"), mesh.coords["ep"], dims.ep, shares,
                            config.parallel.ep_overlap_chunks)
    fp8_note = ""
    if config.train.float8 != "none":  # before compiling, as torchao recommends
        converted = float8.convert_to_float8(model, config.train.float8)
        fp8_note = float8.describe(converted, float8.float8_layers(model)[1],
                                   config.train.float8)
    if config.train.compile:  # each block on its own; recomputation then wraps it
        compiled.compile_blocks(model, cache_dir=Path(config.train.out_dir) / "compile_cache")
    recomputed = recompute.apply(model, config.memory)  # split layers, before pp cuts blocks
    kind = kind_of(dims)
    if skeleton and kind in ("dp", "ps"):  # these hold their (tp blocks of the) model whole
        init.allocate(model, mesh.world.device)
    notes = _notes(dims, config, recomputed, fp8_note, loss_note)
    held = HOLDINGS[kind](model, mesh, config, notes=notes,
                          **({"averaging": averaging} if averaging else {}))
    if skeleton:
        assert weights is not None  # given, or the initial weights made above
        held.saved.restore(weights)
        if dims.tp > 1:  # the allocated parameters of per-head norms sum their gradients
            sum_headwise_grads(model)
    if sequence:  # after allocation: its gradient hooks go on the real parameters
        apply_sequence_parallel(model, mesh.group("tp"))
    groups = mesh.size("sync")
    if groups > 1:  # sync groups train alone, synchronized every sync.every steps
        sc = config.sync
        outer = DiLoCo(held.module, mesh.group("sync"), sync_every=sc.every,
                       mode=sc.method, outer_lr=sc.outer_lr, outer_momentum=sc.outer_momentum,
                       streaming=sc.streaming, params=held.synced())
        note = (f"{groups} sync groups synchronized by {sc.method} every {sc.every} steps"
                f"{' (streaming)' if sc.streaming else ''}")
        # each sync group writes checkpoints of its own
        held.sync_with(outer, mesh.group("pp", "dp", "cp", "tp"), note)
    return held


def _notes(dims: Dims, config: Config, recomputed: list[str], fp8: str,
           loss: str) -> tuple[str, ...]:
    """The banner's words for sequence parallelism, FP8 (`fp8`, if on), the chunked loss
    (`loss`, if on) and what is recomputed."""
    notes = ["sequence parallel"] if dims.sequence_parallel else []
    for note in (fp8, loss):
        if note:
            notes.append(note)
    if recomputed:
        mode = config.memory.recompute
        what = "modules" if config.memory.recompute_modules else \
            {"full": "blocks", "selective": "attention cores and activations"}[mode]
        notes.append(f"recomputing {len(recomputed)} {what}")
    return tuple(notes)
