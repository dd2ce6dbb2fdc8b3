"""What a parameter-server job agrees on: the consistency model and the servers' optimizer.

Worker 0 sends these settings with its initial parameters, so servers need no user code;
they travel as JSON (never pickle) and are validated on both ends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.errors import ConfigError

CONSISTENCY = ("sync", "async", "ssp")
ON_WORKER_LOSS = ("continue", "fail")
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


@dataclass(frozen=True)
class Settings:
    """A parameter-server job's rules.

    Attributes:
        consistency: "sync" (every worker's gradient for step t is averaged and applied
            before anyone gets step t+1's parameters), "async" (each push is applied when
            it arrives), or "ssp" (async, but no worker runs more than `staleness` clocks
            ahead of the slowest live one).
        staleness: ssp's bound s; 0 is lock-step.
        optimizer: the servers' optimizer: "sgd", "adam" or "adamw" (its state lives on
            the servers, each holding that of its own shard).
        lr, momentum, betas, weight_decay: the optimizer's options (momentum for sgd,
            betas for adam/adamw).
        worker_timeout: seconds a worker may stay silent while others wait on it (or
            while it is the last one the servers wait for) before it counts as dead.
        start_timeout: the same for a worker that has pushed no step yet: starting one
            (importing torch, building its model) and its first step (the first
            forward and backward, compiling) can take far longer than a silence between
            steps on a loaded machine. The larger of the two applies to it.
        on_worker_loss: "continue" drops a dead worker from the clocks with a warning and
            trains on with the live ones; "fail" stops the job with an error instead.
        copies: copies of each shard, each on a server of its own (dtrain.ps.chain):
            with 2 or more, a push is acknowledged once every live copy applied it, and
            when a server dies the next copy of its shard takes over; 1 keeps no backup.
    """

    consistency: str = "sync"
    staleness: int = 0
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    worker_timeout: float = 120.0
    start_timeout: float = 60.0
    on_worker_loss: str = "continue"
    copies: int = 1

    def __post_init__(self) -> None:
        if self.consistency not in CONSISTENCY:
            raise ConfigError(f"consistency={self.consistency!r}: use one of "
                              f"{', '.join(CONSISTENCY)}")
        if self.staleness < 0:
            raise ConfigError(f"staleness={self.staleness} must not be negative")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}: the servers run one of "
                              f"{', '.join(OPTIMIZERS)}")
        if self.on_worker_loss not in ON_WORKER_LOSS:
            raise ConfigError(f"on_worker_loss={self.on_worker_loss!r}: use one of "
                              f"{', '.join(ON_WORKER_LOSS)}")
        if not self.worker_timeout > 0 or not self.start_timeout > 0 or not self.lr > 0:
            raise ConfigError("worker_timeout, start_timeout and lr must be positive")
        if not self.momentum >= 0 or not self.weight_decay >= 0:
            raise ConfigError(f"momentum={self.momentum} and weight_decay={self.weight_decay} "
                              "must not be negative")
        if isinstance(self.copies, bool) or not isinstance(self.copies, int) \
                or self.copies < 1:
            raise ConfigError(f"copies={self.copies!r}: give a whole number of copies, 1 or "
                              "more")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas={self.betas}: give two numbers in [0, 1)")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: object) -> Settings:
        """Settings from a decoded JSON object.

        Raises:
            ConfigError: unknown keys, wrong types or values out of range.
        """
        if not isinstance(data, dict):
            raise ConfigError("settings must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown settings {sorted(unknown)}")
        try:
            values = {**data, "betas": tuple(float(b) for b in data.get("betas", (0.9, 0.999)))}
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"malformed settings: {exc}") from None

    def build_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer these settings describe, over `params`."""
        options: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.optimizer == "sgd":
            options["momentum"] = self.momentum
        else:
            options["betas"] = self.betas
        return OPTIMIZERS[self.optimizer](params, **options)
