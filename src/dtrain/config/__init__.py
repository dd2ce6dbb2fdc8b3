"""The training config: TOML sections mapped onto dataclasses, checked strictly.

Every key has a default, so an empty file (or none) trains the built-in job. Unknown keys,
wrong types and values out of range are errors that name the key and say what fits;
`--set section.key=value` overrides any key (the value is read as TOML, else as a string).

    [model]     arch = "gpt", n_layer = 4, n_head = 4, n_embd = 128, block_size = 128
                arch = "llama", preset = "llama-tiny"; arch = "hf", hf_config = "dir/"
    [data]      path = "corpus/"        # text file or folder; default: Python's stdlib
                format = "tokens", tokenizer = "tokenizer.json"
    [optimizer] name = "adamw", lr = 3e-3, warmup_steps = 20
    [train]     steps = 400, batch_size = 32, eval_every = 100, out_dir = "runs/default"
    [parallel]  nproc = 2, dp = 0, tp = 1, pp = 1, zero = 0, schedule = "1f1b"
    [comm]      backend = "auto", bucket_mb = 25, grad_dtype = "fp32", compression = "none"
    [sync]      method = "diloco", every = 50, outer_lr = 0.7   # default: every_step
    [fault_tolerance] mode = "live", step_timeout = 5.0     # default: restart
    [ps]        servers = 1, consistency = "ssp", staleness = 2  # with exchange = "ps"
    [checkpoint] every = 0, keep_last = 2, resume = "auto"
    [memory]    recompute = "full"    # or "selective", "none"
    [logging]   metrics = "metrics.jsonl", log_every = 10

One section per concern, each a dataclass defined by the component it configures (its
choices `Literal` types, its bounds and own rules beside it: dtrain.schema), and each
check that spans sections the component's own; this package composes them:

    load        Config, `load_config`, `config_from_dict`, `dims_of`, the keys that MOVED
    overrides   the command line's `--set` and config file arguments
    job         `[train]` and `[logging]`, the training job's
    fault_tolerance  `[fault_tolerance]`, and what live replicas work with

| section | defined in |
|---|---|
| `[model]` | dtrain.models.config |
| `[data]` | dtrain.data.config |
| `[optimizer]` | dtrain.optim.config |
| `[train]`, `[logging]` | dtrain.config.job |
| `[parallel]` | dtrain.mesh.config (the job's Dims are made from it) |
| `[comm]` | dtrain.comm.config |
| `[sync]` | dtrain.sync.config |
| `[fault_tolerance]` | dtrain.config.fault_tolerance |
| `[ps]` | dtrain.ps.config |
| `[checkpoint]` | dtrain.checkpoint.config |
| `[memory]` | dtrain.models.recompute |
"""

from dtrain.checkpoint.config import CheckpointConfig
from dtrain.comm.config import CommConfig
from dtrain.config.fault_tolerance import FaultToleranceConfig
from dtrain.config.job import LoggingConfig, TrainConfig
from dtrain.config.load import MOVED, Config, config_from_dict, dims_of, load_config
from dtrain.config.overrides import add_config_arguments, parse_override
from dtrain.data.config import DataConfig
from dtrain.mesh.config import ParallelConfig
from dtrain.models.config import ModelConfig
from dtrain.models.recompute import MemoryConfig
from dtrain.optim.config import OptimizerConfig
from dtrain.ps.config import PsConfig
from dtrain.sync.config import SyncConfig

__all__ = ["MOVED", "CheckpointConfig", "CommConfig", "Config", "DataConfig",
           "FaultToleranceConfig", "LoggingConfig", "MemoryConfig", "ModelConfig",
           "OptimizerConfig", "ParallelConfig", "PsConfig", "SyncConfig", "TrainConfig",
           "add_config_arguments", "config_from_dict", "dims_of", "load_config",
           "parse_override"]
