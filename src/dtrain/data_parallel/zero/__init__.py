"""Sharded data parallelism (ZeRO stages 1, 2 and 3): each rank keeps 1/N of the state.

Plain data parallelism keeps a full copy of the parameters, gradients and optimizer state
on every rank. ZeRO (Rajbhandari et al., 2020) splits them across the N ranks of the
data-parallel group instead. Parameters are packed into flat *units*
(dtrain.data_parallel.zero.flat) whose shard r belongs to rank r:

- stage 1: each rank keeps optimizer state (and the fp32 master weights) for its shard
  only. Gradients are reduce-scattered, not allreduced, so each rank receives the summed
  gradient of just the shard it updates; after the step the updated shards are
  all-gathered back into every rank's full parameters.
- stage 2: as stage 1, and a unit's full gradient buffer is released as soon as it has
  been reduce-scattered, during backward (units are buckets of about `bucket_mb`).
- stage 3: the parameters themselves are sharded. A unit (a submodule: by default every
  element of an nn.ModuleList, such as transformer blocks, plus the rest of the model as
  the root unit) is all-gathered just before its forward and again before its backward,
  the next unit's gather is started while the current one computes, and its memory is
  released right after. In backward a unit keeps autograd's gradients until its last one,
  then packs them into its flat buffer and frees its parameters; the buffer's
  reduce-scatter runs until the next unit's first gradient (through that unit's forward,
  where blocks are recomputed), which waits for it and then starts the gather of the unit
  after. So a backward holds two whole units besides the gradients under way (the unit and
  the prefetched one, or the unit and the buffer in flight), at the same points in every
  run; three as a unit ends (the prefetched one, its gradients and the buffer packed).

Per-rank memory of model state, for Ψ parameters, N ranks and K bytes of optimizer
state per parameter (Adam: 8; plus 4 for fp32 master weights under mixed precision):
stage 1: 2·p·Ψ + KΨ/N, stage 2: p·Ψ + (p + K)Ψ/N, stage 3: (2p + K)Ψ/N (p: bytes per
parameter in the compute dtype; the paper's formulas with p = 2 and K = 12).

Usage (every rank):

    model = dtrain.ZeRO(net, lambda params: torch.optim.AdamW(params, lr=3e-4), stage=2)
    loss = model(x, y)
    model.backward(loss)          # loss.backward() also works, except with fp16
    model.clip_grad_norm_(1.0)    # the global norm, across shards
    model.step()
    model.zero_grad()

The optimizer factory is called once with the module's parameters; it may build
parameter groups with their own options. dtrain reads the groups and options from it,
then builds the same optimizer class with the same options over this rank's shard pieces
(`model.optimizer`, for learning-rate schedulers). Parameters that no rank used in a step
get a zero gradient (in one process their gradient would stay None and the optimizer
would skip them).

Modules, one concern each (no import cycle: flat <- units <- muon <- optimizer <- wrapper,
units <- state_io <- wrapper, units <- offload <- wrapper):

- flat: the flat units' layout, parameters end to end and their shards.

- units: `Unit`, one flat unit's tensors on this rank (`ZeRO.units`), and their packing.
- optimizer: the factory's optimizer rebuilt over this rank's shard pieces.
- muon: Muon over shards (`ShardedMuon`): each matrix's update sent whole to an owner rank,
  orthogonalized there, and its pieces sent back.
- offload: the optimizer state, master shards and step on the host (`offload_device`).
- wrapper: the `ZeRO` module (hooks, gathers, reduce-scatters, step, clip, grad_parts).
- state_io: state in and out, full and sharded (`from dtrain.data_parallel.zero import
  state_io`).
"""

from dtrain.data_parallel.zero import state_io
from dtrain.data_parallel.zero.units import Unit
from dtrain.data_parallel.zero.wrapper import ZeRO

__all__ = ["Unit", "ZeRO", "state_io"]
