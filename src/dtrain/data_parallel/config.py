"""What DataParallel and ZeRO take from the config, checked before any rank starts."""

from __future__ import annotations

from dtrain.comm.config import CommConfig
from dtrain.errors import ConfigError
from dtrain.mesh.config import ParallelConfig


def check_config(parallel: ParallelConfig, comm: CommConfig) -> None:
    """ZeRO's mixed precision and DataParallel's gradient dtype, each with its own.

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
