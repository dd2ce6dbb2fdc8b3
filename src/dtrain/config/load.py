"""The whole config of `dtrain train`: its sections composed, read from TOML and `--set`,
and checked together.

Each section is a dataclass its component defines (dtrain.schema says how); this module
puts them together (`Config`), reads a file and overrides into them, refuses a key that
moved with its new place (MOVED), and runs the checks that span sections: each is the
component's own (`check_config` or the like), called here in turn.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.adapters.config import AdapterConfig, check_adapter_layout
from dtrain.checkpoint.config import CheckpointConfig
from dtrain.checkpoint.config import check_config as check_checkpoint
from dtrain.comm.config import CommConfig
from dtrain.config.fault_tolerance import FaultToleranceConfig, check_live
from dtrain.config.job import LoggingConfig, TrainConfig
from dtrain.config.objective import ObjectiveConfig, check_objective
from dtrain.config.overrides import parse_override
from dtrain.data.config import DataConfig
from dtrain.data_parallel.config import check_config as check_data_parallel
from dtrain.data_parallel.zero.offload import check_config as check_offload
from dtrain.errors import ConfigError
from dtrain.mesh import Dims
from dtrain.mesh.config import ParallelConfig
from dtrain.models import presets
from dtrain.models.config import ModelConfig, with_preset
from dtrain.models.recompute import MemoryConfig
from dtrain.models.rules import check_layout, check_loss
from dtrain.optim.config import OptimizerConfig
from dtrain.pipeline.schedules import check_config as check_pipeline
from dtrain.ps.config import PsConfig
from dtrain.schema import check_fields, coerce
from dtrain.sync.config import SyncConfig
from dtrain.sync.config import check_config as check_slow_links
from dtrain.tensor_parallel.sequence import check_config as check_sequence_parallel


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    ps: PsConfig = field(default_factory=PsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain values, and under EXPLICIT the `[model]` keys the user
        set (which a preset does not override: dtrain.models.config.with_preset)."""
        values = dataclasses.asdict(self)
        if self.model.explicit:
            values[EXPLICIT] = sorted(self.model.explicit)
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


EXPLICIT = "model_explicit"
"""The entry of `Config.to_dict()` listing the `[model]` keys the user set (in the file or
with `--set`), so that the ranks, a resume and `dtrain generate` apply a preset as the
loader did; a dict without it (an older dtrain's) counts only keys off their defaults."""

MOVED = {
    "parallel.backend": "comm.backend",
    "parallel.bucket_mb": "comm.bucket_mb",
    "parallel.grad_dtype": "comm.grad_dtype",
    "parallel.compression": "comm.compression",
    "parallel.compression_rank": "comm.compression_rank",
    "parallel.sync": "sync.method",
    "parallel.replicas": "sync.groups",
    "parallel.sync_every": "sync.every",
    "parallel.outer_lr": "sync.outer_lr",
    "parallel.outer_momentum": "sync.outer_momentum",
    "parallel.streaming": "sync.streaming",
    "parallel.fault_tolerance": "fault_tolerance.mode",
    "parallel.step_timeout": "fault_tolerance.step_timeout",
    "parallel.servers": "ps.servers",
    "parallel.consistency": "ps.consistency",
    "parallel.staleness": "ps.staleness",
    "parallel.snapshot_every": "ps.snapshot_every",
    "parallel.mode": "parallel.exchange",
    "sync.replicas": "sync.groups",
    "ps.replicas": "ps.copies",
    "checkpoint.replicate": "checkpoint.copies",
    "memory.activation_checkpointing": "memory.recompute",
    "memory.checkpoint_modules": "memory.recompute_modules",
}
"""Keys that were renamed, or left [parallel] when it was split by concern, and where each
went: a config file or `--set` that still names one is refused with its new place
(docs/training.md has the table); a config saved by an older dtrain (in a checkpoint) is
read with each moved to its place."""


def _suggest(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _apply(config: Config, values: dict[str, Any], origin: str,
           migrate: bool = False) -> list[str]:
    """Set `values` (section -> key -> value) into `config`, each checked for its type;
    `migrate`: a moved key goes to its new place (a config an older dtrain saved) instead
    of being refused. Returns the keys set, as `section.key` at their places."""
    sections = {f.name: f for f in dataclasses.fields(Config)}
    written: list[str] = []
    for section, body in values.items():
        if not isinstance(body, dict) and section in sections:
            raise ConfigError(f"{origin}: '{section}' is a section: write its keys under "
                              f"[{section}]")
        if not isinstance(body, dict):
            types = typing.get_type_hints(Config)
            homes = [s for s in sections if section in typing.get_type_hints(types[s])]
            where = f": put it under [{homes[0]}]" if homes else ""
            raise ConfigError(f"{origin}: key '{section}' is outside any [section]{where}")
        if section not in sections:
            raise ConfigError(f"{origin}: unknown section [{section}]{_suggest(section, sections)}")
        for key, value in body.items():
            dotted = f"{section}.{key}"
            if dotted in MOVED and not migrate:
                raise ConfigError(f"{origin}: {dotted} moved to {MOVED[dotted]}")
            if dotted in MOVED:
                dotted = MOVED[dotted]
            home, name = dotted.split(".")
            target = getattr(config, home)
            hints = typing.get_type_hints(type(target))
            if name not in hints:
                known = [f"{home}.{k}" for k in hints]
                raise ConfigError(f"{origin}: unknown key '{dotted}'{_suggest(dotted, known)}")
            setattr(target, name, coerce(dotted, value, hints[name]))
            written.append(dotted)
    return written


def _model_keys(written: typing.Iterable[str]) -> frozenset[str]:
    """The `[model]` keys among `written` (`section.key`)."""
    return frozenset(key.removeprefix("model.") for key in written
                     if key.startswith("model."))


def _validate(config: Config) -> None:
    """Every section's own checks, then those across sections, each its component's."""
    for section in dataclasses.fields(Config):
        check_fields(getattr(config, section.name), section.name)
    p, live = config.parallel, config.fault_tolerance.live
    model = with_preset(config.model, presets())
    check_layout(model, p)
    check_loss(model, config.train.loss)
    check_checkpoint(config.checkpoint, {f"sync.method = {config.sync.method!r}":
                                         config.sync.method != "every_step"})
    check_data_parallel(p, config.comm)
    if p.pp > 1:
        check_pipeline(p, model, config.train.grad_accum)
    check_offload(config.memory, p, config.sync.method, live)
    check_sequence_parallel(model, p)
    check_adapter_layout(config.adapter, p.tp)
    check_objective(config.objective, config.data, config.adapter, p)
    if live:
        check_live(p)
    check_slow_links(config.sync, config.comm, p, live)


def dims_of(config: Config, world_size: int) -> Dims:
    """The job's Dims on `world_size` ranks (dtrain.mesh.Dims.of: the degrees of `[parallel]`,
    and the sync groups of `[sync]`), checked against them: the degrees multiply to the
    world size and the global batch splits into ranks and micro-batches. The launcher
    calls it before starting ranks, and each rank once as it starts.

    Raises:
        ConfigError: the degrees or the batch do not fit `world_size`.
    """
    dims = Dims.of(config.parallel, world_size, config.sync.groups_asked)
    dims.per_rank_batch(config.train.batch_size, config.train.grad_accum)
    return dims


def load_config(path: str | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a TOML file (or the defaults) and apply `--set` overrides, then validate.

    Raises:
        ConfigError: the file is missing or malformed, or a key or value is invalid.
    """
    config = Config()
    written: list[str] = []
    if path:
        try:
            values = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config {path!r}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        written += _apply(config, values, path)
    for text in overrides:
        section, name, value = parse_override(text)
        written += _apply(config, {section: {name: value}}, "--set")
    config.model.explicit = _model_keys(written)  # they win over a preset, even at defaults
    _validate(config)
    return config


def config_from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (how ranks receive it, and what a
    checkpoint keeps: one an older dtrain saved has its moved keys moved), the `[model]`
    keys the user set (EXPLICIT) recorded again.

    Raises:
        ConfigError: a key or value is invalid.
    """
    config = Config()
    sections = {k: v for k, v in values.items() if k != EXPLICIT}
    _apply(config, sections, "config", migrate=True)
    explicit = coerce(EXPLICIT, values.get(EXPLICIT, []), list[str])
    config.model.explicit = frozenset(typing.cast(list[str], explicit))
    _validate(config)
    return config
