"""What DataParallel and ZeRO take from the config, checked before any rank starts."""

from __future__ import annotations

from dtrain.comm.config import CommConfig
from dtrain.errors import ConfigError
from dtrain.mesh.config import ParallelConfig


def check_config(parallel: ParallelConfig, comm: CommConfig) -> None:
    """ZeRO's mixed precision and DataParallel's gradient dtype, each with its own; ZeRO's
    wire dtypes with ZeRO only (fp8's device is checked where the device is known:
    `dtrain.comm.check_wire_dtype`).

    Raises:
        ConfigError: in one line naming what to change.
    """
    p = parallel
    if p.mixed_precision == "fp16" and (p.tp > 1 or p.pp > 1):
        raise ConfigError("parallel.mixed_precision = \"fp16\" with parallel.tp or pp > 1 is "
                          "not supported (its loss scaling is per ZeRO group): use \"bf16\"")
    if p.zero and comm.grad_dtype != "fp32":
        raise ConfigError("comm.grad_dtype is for DataParallel; with parallel.zero set "
                          "parallel.mixed_precision instead")
    for key in ("gather_dtype", "reduce_dtype"):
        if getattr(comm, key) != "auto" and not p.zero:
            raise ConfigError(f"comm.{key} = {getattr(comm, key)!r} is the dtype ZeRO's "
                              f"{key.split('_')[0]}s travel in: set parallel.zero = 1, 2 or 3 "
                              f"(or comm.{key} = \"auto\")")
