"""Optimizer offload (ZeRO-Offload, Ren et al., 2021): the optimizer state, the master
shards and the optimizer step kept in host memory.

Without offload each rank keeps, on its compute device, its shard of the optimizer state
(Adam: 8 bytes per element) and, under mixed precision, an fp32 master shard (4 more).
With offload these are host tensors, and what the device keeps of a unit is what its
forward and backward need: the parameters in the compute dtype (stages 1-2: the full
unit; stage 3: this rank's shard of it, `Unit.resident`, which the gathers read) and the
reduced gradient shard. Each step then moves, per unit, in order:

1. the gradient shard to the host (after clipping and fp16 unscaling, which work on the
   device's shards), into a host buffer the optimizer's pieces take as their .grad;
2. the optimizer's step over that unit's pieces only, on the host (the other pieces'
   .grad are None, which torch's optimizers skip; their per-parameter state, Adam's step
   count included, is the same as after one step over all);
3. the updated master shard back to the device, cast to the compute dtype on the host
   first (half the bytes under bf16).

Copies go through `Copies`: on a CUDA device a side stream with pinned host buffers and
non-blocking copies, so unit k+1's gradient travels while the host steps unit k and
unit k's parameters travel back while it steps k+1; the compute stream waits for the
last copy (without blocking the host) before anything reads the parameters. On a CPU the
"device" is the host too: the same buffers, copies and steps in the same order, each copy
done at once, which is how the CPU tests exercise this path.

Cost per step and rank, for Ψ parameters over N ranks: the gradient shard down (Ψ/N
elements in the parameters' dtype) and the parameter shard back (in the compute dtype),
and the optimizer's arithmetic on host cores instead of the device.
"""

from __future__ import annotations

import torch

from dtrain.data_parallel.zero.units import Unit
from dtrain.errors import ConfigError, DtrainError
from dtrain.mesh.config import ParallelConfig
from dtrain.models.recompute import MemoryConfig


def check_config(memory: MemoryConfig, parallel: ParallelConfig, sync_method: str,
                 live: bool) -> None:
    """Optimizer offload moves ZeRO's optimizer shards to the host: it needs ZeRO, and what
    reaches into the optimizer state across sync groups and live replicas does not follow
    it there yet.

    Raises:
        ConfigError: `memory.offload` without ZeRO, with local SGD or DiLoCo, or with live
            replicas.
    """
    if memory.offload == "none":
        return
    if not parallel.zero:
        raise ConfigError(f"memory.offload = {memory.offload!r} needs parallel.zero = "
                          "1, 2 or 3 (it moves ZeRO's optimizer shards to the host)")
    if sync_method != "every_step":
        raise ConfigError(f"memory.offload with sync.method = {sync_method!r} is not "
                          "supported yet: use memory.offload = \"none\"")
    if live:
        raise ConfigError("memory.offload with fault_tolerance.mode = \"live\" is not "
                          "supported yet: use fault_tolerance.mode = \"restart\"")


class Copies:
    """Copies between the compute device and the host, in order, in the background where
    the device has streams (CUDA); on a CPU each is done when asked.

    Args:
        device: the compute device (where the units' `full` is).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer, pinned when copies to and from it run in the background."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.stream is not None)

    def after_compute(self) -> None:
        """Copies asked for from now on start after the compute stream's work so far (the
        reduce-scatters, the clip)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Start copying `src` into `dst`; returns what `wait` takes to know it is done."""
        if self.stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    @staticmethod
    def wait(done: torch.cuda.Event | None) -> None:
        """Block the host until the copy that returned `done` has finished."""
        if done is not None:
            done.synchronize()

    def before_compute(self) -> None:
        """The compute stream's next work waits for every copy asked for so far (the host
        goes on)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class Offload:
    """The units' optimizer-side tensors on the host, and the step that runs there.

    Built after the units and before the optimizer: each unit's `master` becomes a host
    copy (the optimizer's pieces will view it) and the device keeps only what computes.

    Args:
        units: the ZeRO wrapper's units.
        stage: the ZeRO stage (3: a resident shard in the compute dtype feeds the gathers).
        host: where the state goes; a CPU device.

    Raises:
        DtrainError: `host` is not a CPU device.
    """

    def __init__(self, units: list[Unit], stage: int, host: torch.device) -> None:
        if host.type != "cpu":
            raise DtrainError(f"ZeRO offload_device={str(host)!r}: the optimizer state is "
                              "offloaded to host memory; use \"cpu\"")
        self.units = units
        self.copies = Copies(units[0].full.device)
        self.host_grads: list[torch.Tensor] = []
        self.staging: list[torch.Tensor | None] = []
        self.device_shards: list[torch.Tensor] = []
        with torch.no_grad():
            for unit in units:
                self._move(unit, stage)

    def _move(self, unit: Unit, stage: int) -> None:
        """Put `unit`'s master on the host; keep on the device the shard forward reads."""
        master, compute_dtype = unit.master, unit.full.dtype
        if stage == 3:
            # the shard the gathers read: the old master itself when no cast is needed
            unit.resident = master if master.dtype == compute_dtype \
                else master.to(compute_dtype)
            self.device_shards.append(unit.resident)
        else:
            self.device_shards.append(unit.full[slice(*unit.flat.shard(unit.rank))])
        host = self.copies.host_empty(master.numel(), master.dtype)
        host.copy_(master)
        unit.master = host
        unit.offloaded = True
        self.host_grads.append(self.copies.host_empty(master.numel(), master.dtype))
        self.staging.append(None if master.dtype == compute_dtype
                            else self.copies.host_empty(master.numel(), compute_dtype))

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step on the host, unit by unit, the copies in the background
        (the module docstring's steps 1-3); the compute stream waits for the last copy."""
        pieces = [[piece for *_, piece in unit.pieces] for unit in self.units]
        placeholders = [p for group in optimizer.param_groups for p in group["params"]
                        if p.numel() == 0]  # groups meeting no shard here: step them once
        for piece in placeholders:
            piece.grad = None
        self.copies.after_compute()
        arrived = [self.copies.copy(host, unit.shard_grad())
                   for unit, host in zip(self.units, self.host_grads, strict=True)]
        last = len(self.units) - 1
        for k, unit in enumerate(self.units):
            self.copies.wait(arrived[k])
            for _, lo, hi, piece in unit.pieces:
                piece.grad = self.host_grads[k][lo:hi]
            if k == last:
                for piece in placeholders:
                    piece.grad = piece.new_zeros(0)
            if pieces[k] or (k == last and placeholders):
                optimizer.step()
            for piece in pieces[k]:
                piece.grad = None
            self.upload(k)
        self.copies.before_compute()

    def upload(self, k: int) -> None:
        """Start copying unit k's master shard into the device's parameters."""
        source, staging = self.units[k].master, self.staging[k]
        if staging is not None:  # cast on the host: the compute dtype's bytes travel
            staging.copy_(source)
            source = staging
        self.copies.copy(self.device_shards[k], source)

    @torch.no_grad()
    def publish(self) -> None:
        """Copy every master shard (set from outside: a checkpoint, a state_dict) to the
        device, and wait."""
        self.copies.after_compute()
        for k in range(len(self.units)):
            self.upload(k)
        self.copies.before_compute()

    def host_bytes(self, optimizer: int) -> dict[str, int]:
        """Bytes kept on the host: master shards, gradient buffers (with the cast staging)
        and the optimizer state (`optimizer`: its bytes, counted by the caller)."""
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        return {"host_master": sum(size(u.master) for u in self.units),
                "host_grads": sum(size(t) for t in self.host_grads)
                + sum(size(t) for t in self.staging if t is not None),
                "host_optimizer": optimizer}

    def device_bytes(self) -> int:
        """Bytes of the stage-3 resident shards on the device (not views of `full`)."""
        return sum(t.numel() * t.element_size() for u, t in
                   zip(self.units, self.device_shards, strict=True) if u.resident is t)
