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
    [ps]        servers = 1, consistency = "ssp", staleness = 2  # with parallel.mode = "ps"
    [checkpoint] every = 0, keep_last = 2, resume = "auto"
    [memory]    activation_checkpointing = "full"    # or "selective", "none"
    [logging]   metrics = "metrics.jsonl", log_every = 10

One section per concern: `[parallel]` says how the model is laid out over the ranks (its
degrees, schedule and who holds it), the others how those ranks talk (`[comm]`), how
often replicas meet (`[sync]`), what happens when one fails (`[fault_tolerance]`) and how
parameter servers behave (`[ps]`). A key that moved between them (MOVED) is refused with
its new place.

The whole schema lives in this one module, every section and key with its docs and its
checks, so that a key is defined, documented and validated in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.context_parallel import METHODS as CP_METHODS
from dtrain.errors import ConfigError
from dtrain.job_layout import Layout, resolve_layout
from dtrain.models import presets as models_presets
from dtrain.models.config import ARCHS, ModelConfig, check_moe, check_shape, with_preset
from dtrain.models.float8 import RECIPES as FLOAT8_RECIPES
from dtrain.models.hf import ROTARY_FAMILY, hf_config_dict, hf_experts
from dtrain.models.llama import moe_config
from dtrain.models.moe.router import ROUTERS
from dtrain.ps.settings import CONSISTENCY


@dataclass
class DataConfig:
    path: str = ""
    """A text file or a folder of them, a JSON-lines file or folder (format = "jsonl"), or
    a folder of token shards (format = "tokens"); empty means the Python standard
    library's .py files."""
    format: str = "text"
    """text (files read whole), jsonl (a "text" field per line) or tokens (shards written
    by `dtrain data prepare`: memory-mapped, read lazily)."""
    tokenizer: str = "bytes"
    """bytes (one token per byte, 256 ids) or the path of a Hugging Face tokenizer.json;
    with format = "tokens" the shards' own index names it."""
    max_bytes: int = 4_000_000
    """Read at most this many bytes of the corpus."""
    val_fraction: float = 0.05
    """Share of the corpus held out for evaluation (its end)."""


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """One of adamw, adam, sgd."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay (adamw) or L2 penalty (adam, sgd)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam's beta1 and beta2."""
    momentum: float = 0.9
    """SGD momentum."""
    warmup_steps: int = 20
    """Linear warm-up from 0 to lr over this many steps."""
    schedule: str = "cosine"
    """After warm-up: cosine (decay to min_lr_ratio * lr) or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr, for cosine."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""


@dataclass
class TrainConfig:
    steps: int = 400
    """Optimizer steps to run."""
    batch_size: int = 32
    """Global batch in sequences, split evenly across data-parallel ranks."""
    grad_accum: int = 1
    """Micro-batches per step on each rank (gradients accumulated without communication)."""
    seed: int = 1337
    """Seed for the model's initialization and the data order."""
    eval_every: int = 100
    """Evaluate on the held-out split every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    out_dir: str = "runs/default"
    """Where the resolved config, checkpoints and (by default) nothing else are written."""
    compile: bool = False
    """Compile each transformer block with torch.compile (regional compilation: the
    layouts' collectives and hooks stay outside the compiled regions), in every layout;
    compiled code is cached under out_dir/compile_cache, so a restart does not pay again."""
    float8: str = "none"
    """Train the blocks' Linear layers in FP8 with torchao (tensorwise or rowwise scaling)
    on GPUs that have it (compute capability 8.9 and later); refused elsewhere."""


@dataclass
class ParallelConfig:
    """How the model is laid out over the ranks: its degrees, the pipeline's schedule, and
    who holds it (the ranks themselves, or parameter servers)."""

    nproc: int = 2
    """Ranks started on this machine by `dtrain train` (ignored under another launcher)."""
    dp: int = 0
    """Data-parallel degree; 0 means all ranks left after tp."""
    tp: int = 1
    """Tensor-parallel degree: each layer's weights split across this many consecutive
    ranks (dtrain.tensor_parallel); data parallelism runs over the rest."""
    pp: int = 1
    """Pipeline stages: the blocks cut into pp groups of consecutive layers on pp ranks,
    micro-batches flowing through them (dtrain.pipeline); the outermost axis."""
    microbatches: int = 4
    """With pp > 1: micro-batches each data-parallel rank's batch is cut into."""
    schedule: str = "1f1b"
    """With pp > 1: gpipe, 1f1b, or interleaved (needs virtual_stages >= 2)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (the interleaved schedule's v)."""
    zero: int = 0
    """Shard model state across the data-parallel ranks (dtrain.ZeRO): 1 optimizer state,
    2 and gradients, 3 and parameters; 0 replicates it (DataParallel)."""
    mixed_precision: str = "fp32"
    """With zero > 0: compute and communicate in bf16 or fp16 over fp32 master weights
    (ZeRO's own option; DataParallel's is comm.grad_dtype)."""
    mode: str = "collective"
    """collective (the ranks exchange gradients among themselves: DataParallel, ZeRO, tp,
    pp) or ps (parameter servers hold the model and its optimizer; nproc workers push
    gradients and pull parameters: dtrain.ps, tuned in [ps])."""
    ep: int = 1
    """Expert-parallel degree: each mixture-of-experts layer's experts split over this many
    of the data-parallel ranks (carved from dp, which it must divide), tokens sent to their
    experts' ranks and back by all-to-all; the other layers stay data parallel over dp."""
    cp: int = 1
    """Context-parallel degree: every sequence cut into 2 x cp chunks, each of cp ranks
    holding two (chunk i and its mirror 2cp-1-i, balanced for causal attention) through the
    whole model; attention meets the other chunks by `cp_method`. The model is replicated
    over cp, as over dp. dtrain's GPT and Llama, and Hugging Face models of the Llama
    family; model.block_size must divide by 2 x cp."""
    cp_method: str = "ring"
    """How attention meets the other ranks' chunks: ring (key/value blocks passed around
    while the local block computes), allgather (keys and values gathered once per layer:
    small with grouped-query attention) or alltoall (DeepSpeed-Ulysses: heads split over
    cp, which must divide each rank's query and key/value heads)."""
    sequence_parallel: bool = False
    """With tp > 1: run the norms, dropouts and residuals between the tensor-parallel
    layers on 1/tp of the sequence each (all-gather in, reduce-scatter out instead of an
    all-reduce; Korthikanti et al., 2022); dtrain's GPT and Llama. model.block_size must
    divide by tp."""


@dataclass
class CommConfig:
    """How the ranks exchange gradients: the transport, DataParallel's buckets, and what
    is sent."""

    backend: str = "auto"
    """Collective backend: auto (NCCL with CUDA, else gloo), gloo, nccl, or shm (shared
    memory between the ranks of a host, hierarchical across hosts)."""
    bucket_mb: float = 25.0
    """Gradient bucket size for data parallelism, in MB."""
    grad_dtype: str = "fp32"
    """Dtype DataParallel communicates gradients in: fp32, bf16 or fp16 (ZeRO takes
    parallel.mixed_precision)."""
    compression: str = "none"
    """Gradients DataParallel sends: none (fp32 or grad_dtype), powersgd (rank
    compression_rank approximations with error feedback) or int8 (per-chunk scales, error
    feedback): fewer bytes per step over slow links (dtrain.parallel.sync.compression)."""
    compression_rank: int = 4
    """With compression = "powersgd": the rank of each gradient matrix's approximation."""


@dataclass
class SyncConfig:
    """How often replicas of the model meet: every step, or every few steps over slow
    links (local SGD, DiLoCo)."""

    method: str = "every_step"
    """every_step (gradients averaged each step), local_sgd (replicas train alone and
    average their parameters every `every` steps) or diloco (the replicas' mean change
    drives an outer Nesterov step every `every` steps; Douillard et al., 2023)."""
    replicas: int = 0
    """With method = local_sgd or diloco: replicas of dp x tp x pp consecutive ranks each
    (dp: data parallelism or ZeRO inside a replica, every step); 0: ranks / (tp x pp), so
    that each replica is one tp x pp group (dp = 1)."""
    every: int = 50
    """With method = local_sgd or diloco: inner steps between synchronizations (H)."""
    outer_lr: float = 0.7
    """With method = diloco: the outer optimizer's learning rate."""
    outer_momentum: float = 0.9
    """With method = diloco: the outer optimizer's Nesterov momentum, in [0, 1)."""
    streaming: bool = False
    """With method = local_sgd or diloco: the synchronization's all-reduce overlaps the
    next inner step, its result applied one step late."""


@dataclass
class FaultToleranceConfig:
    """What the job does when a rank dies or stalls."""

    mode: str = "restart"
    """restart (every rank restarts from the newest checkpoint, up to --max-restarts
    times) or live (data-parallel replicas of dp x tp x pp ranks each, dp being ZeRO's
    inside a replica: one that loses a rank or stalls is dropped at the next step and the
    others go on without restarting; with --max-restarts K its ranks are restarted in
    place up to K times and recover their state from a live peer)."""
    step_timeout: float = 5.0
    """With mode = "live": seconds a step waits for a late replica before it is dropped
    (also each collective's timeout)."""
    rdzv_backend: str = "c10d"
    """Where the job's store lives: c10d (node 0's launcher, at --master: the job cannot
    lose node 0) or etcd (a cluster at rdzv_endpoints that survives losing any one of its
    members; with mode = "live" the job then survives losing any machine). The command
    line's --rdzv-backend wins."""
    rdzv_endpoints: str = ""
    """With rdzv_backend = "etcd": the cluster's members, HOST:PORT,... (--rdzv-endpoints)."""
    rdzv_id: str = ""
    """With rdzv_backend = "etcd": the job's id, the same on every machine and new for each
    job (--rdzv-id)."""


@dataclass
class PsConfig:
    """The parameter servers of parallel.mode = "ps"."""

    servers: int = 1
    """Server processes per machine; the parameters are split across them."""
    consistency: str = "sync"
    """sync, async, or ssp (bounded staleness)."""
    staleness: int = 2
    """With consistency = "ssp": how many steps a worker may run ahead of the slowest."""
    snapshot_every: int = 0
    """Servers snapshot their shards to out_dir/ps-snapshots every this many updates (0:
    never); restarted servers resume from them."""
    replicas: int = 1
    """Copies of each shard, each on its own server: with 2, a push is acknowledged once the
    backup has it too, and a server's death loses nothing (its backup takes over its shard).
    At most ps.servers."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every this many steps; 0 saves only at the end."""
    keep_last: int = 2
    """Keep this many most recent checkpoints."""
    resume: str = ""
    """Resume from a checkpoint: "auto" (the newest in train.out_dir/checkpoints, if any),
    or the path of a checkpoints folder or of one checkpoint in it, saved in any layout.
    Empty: start afresh (an elastic restart resumes as "auto")."""
    background: bool = True
    """Write the checkpoints saved every `every` steps from a background thread: the step's
    state is copied to CPU memory and training goes on while it is written, published
    atomically as a blocking save is. The last save of a run always blocks. false: every
    save blocks."""
    replicate: int = 0
    """Hosts without a shared filesystem: each host writes its ranks' files into its own
    `train.out_dir` and sends a copy to this many other hosts (at most the hosts minus
    one); resume and `dtrain export` then work with any `replicate` hosts' folders lost.
    0: every host sees one shared `train.out_dir`."""


@dataclass
class MemoryConfig:
    activation_checkpointing: str = "none"
    """Recompute activations in backward instead of keeping them: none; full (each
    transformer block's, keeping only its input); selective (the attention core's and
    SwiGLU's: large activations, cheap to recompute)."""
    checkpoint_modules: list[str] = field(default_factory=list)
    """Instead of activation_checkpointing's choice, recompute exactly these modules:
    dotted names, `*` standing for one name component (e.g. "blocks.*.mlp")."""
    offload: str = "none"
    """none; optimizer: keep ZeRO's optimizer state and fp32 master shards in host memory
    and step the optimizer there, each step's gradient shards copied to the host and the
    parameters back in the background (ZeRO-Offload; needs parallel.zero >= 1)."""


@dataclass
class LoggingConfig:
    metrics: str = ""
    """Path of a JSON-lines file with one record per step (and per evaluation)."""
    log_every: int = 10
    """Print a progress line every this many steps."""
    sample_tokens: int = 200
    """Tokens of text to generate at the end; 0 skips the sample."""
    sample_prompt: str = "def "
    """Text the sample continues."""
    timeline: str = ""
    """Path of a Chrome-trace JSON timeline of every rank's steps, data loading, forward,
    backward, optimizer and collectives (dtrain.timeline; open it in ui.perfetto.dev)."""
    tensorboard: bool = False
    """Write TensorBoard event files under out_dir/tensorboard (loss, held-out loss, lr,
    gradient norm, tokens/s, MFU, memory, MoE load); needs dtrain[tensorboard]."""
    wandb: str = "off"
    """Log the same to Weights & Biases: off, offline (a run folder under out_dir/wandb to
    sync later) or online (needs a key; without one the run falls back to offline with one
    line); needs dtrain[wandb]."""
    wandb_project: str = "dtrain"
    """The Weights & Biases project the run is logged to."""
    peak_tflops: float = 0.0
    """The peak dense TFLOP/s per rank that MFU divides by; 0: the GPU's datasheet figure,
    or on a CPU a short calibration matmul at start (cached)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
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
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


CHOICES = {
    "optimizer.name": ("adamw", "adam", "sgd"),
    "data.format": ("text", "jsonl", "tokens"),
    "model.arch": ARCHS,
    "optimizer.schedule": ("cosine", "constant"),
    "parallel.zero": (0, 1, 2, 3),
    "parallel.schedule": ("gpipe", "1f1b", "interleaved"),
    "parallel.mixed_precision": ("fp32", "bf16", "fp16"),
    "parallel.mode": ("collective", "ps"),
    "comm.backend": ("auto", "gloo", "nccl", "shm"),
    "comm.grad_dtype": ("fp32", "bf16", "fp16"),
    "comm.compression": ("none", "powersgd", "int8"),
    "sync.method": ("every_step", "local_sgd", "diloco"),
    "fault_tolerance.mode": ("restart", "live"),
    "fault_tolerance.rdzv_backend": ("c10d", "etcd"),
    "ps.consistency": CONSISTENCY,
    "memory.activation_checkpointing": ("none", "full", "selective"),
    "memory.offload": ("none", "optimizer"),
    "model.router": ROUTERS,
    "parallel.cp_method": CP_METHODS,
    "train.float8": ("none", *FLOAT8_RECIPES),
    "logging.wandb": ("off", "offline", "online"),
}
POSITIVE = {"model.n_layer", "model.n_head", "model.n_embd", "model.block_size",
            "data.max_bytes", "train.steps", "train.batch_size", "train.grad_accum",
            "train.eval_batches", "parallel.nproc", "parallel.tp", "parallel.pp",
            "parallel.microbatches", "parallel.virtual_stages", "comm.bucket_mb",
            "comm.compression_rank", "sync.every", "sync.outer_lr",
            "fault_tolerance.step_timeout", "ps.servers", "ps.replicas", "checkpoint.keep_last",
            "optimizer.lr", "logging.log_every", "model.experts_per_token", "parallel.ep",
            "parallel.cp"}
NON_NEGATIVE = {"model.dropout", "model.vocab_size", "model.n_kv_head", "model.ffn_hidden",
                "model.rope_theta", "model.norm_eps", "optimizer.weight_decay",
                "optimizer.momentum",
                "optimizer.warmup_steps", "optimizer.min_lr_ratio", "optimizer.grad_clip",
                "train.eval_every", "parallel.dp", "checkpoint.every", "checkpoint.replicate",
                "logging.sample_tokens",
                "ps.staleness", "ps.snapshot_every", "sync.replicas", "model.head_dim",
                "model.n_experts", "model.n_shared_experts", "model.moe_inter_size",
                "model.aux_loss_weight", "model.capacity_factor", "logging.peak_tflops"}
MOVED = {
    "parallel.backend": "comm.backend",
    "parallel.bucket_mb": "comm.bucket_mb",
    "parallel.grad_dtype": "comm.grad_dtype",
    "parallel.compression": "comm.compression",
    "parallel.compression_rank": "comm.compression_rank",
    "parallel.sync": "sync.method",
    "parallel.replicas": "sync.replicas",
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
}
"""Keys that left [parallel] when it was split by concern, and where each went: a config
that still names one is refused with its new place (docs/training.md has the table)."""


def _suggest(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_type(key: str, value: object, kind: object) -> object:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r} must be a finite number")
    origin = typing.get_origin(kind)
    if origin is dict:
        key_kind, value_kind = typing.get_args(kind)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r} must be a table, e.g. {{\"pattern\" = "
                              "\"colwise\"}")
        return {_check_type(f"{key}.{k}", k, key_kind): _check_type(f"{key}.{k}", v, value_kind)
                for k, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r} must be a list")
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{key} = {value!r} must be {kind.__name__}, not {type(value).__name__}")
    return value


def _apply(config: Config, values: dict[str, Any], origin: str) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
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
        target = getattr(config, section)
        hints = typing.get_type_hints(type(target))
        for key, value in body.items():
            dotted = f"{section}.{key}"
            if dotted in MOVED:
                raise ConfigError(f"{origin}: {dotted} moved to {MOVED[dotted]}")
            if key not in hints:
                known = [f"{section}.{k}" for k in hints]
                raise ConfigError(f"{origin}: unknown key '{dotted}'{_suggest(dotted, known)}")
            setattr(target, key, _check_type(dotted, value, hints[key]))


def _validate(config: Config) -> None:
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(config, section.name)):
            key, value = f"{section.name}.{f.name}", getattr(getattr(config, section.name), f.name)
            if key in CHOICES and value not in CHOICES[key]:
                options = ", ".join(map(str, CHOICES[key]))
                raise ConfigError(f"{key} = {value!r} must be one of {options}")
            if key in POSITIVE and value <= 0:
                raise ConfigError(f"{key} = {value!r} must be positive")
            if key in NON_NEGATIVE and value < 0:
                raise ConfigError(f"{key} = {value!r} must not be negative")
    m = config.model
    check_shape(m, config.parallel.tp)
    _validate_moe(config)
    _validate_context(config)
    _validate_replicate(config)
    if len(config.optimizer.betas) != 2 or not all(0 <= b < 1 for b in config.optimizer.betas):
        raise ConfigError(f"optimizer.betas = {config.optimizer.betas} must be two numbers in "
                          "[0, 1), e.g. [0.9, 0.95]")
    if m.dropout >= 1:
        raise ConfigError(f"model.dropout = {m.dropout} must be below 1 (a probability)")
    if not 0 < config.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction = {config.data.val_fraction} must be between 0 "
                          "and 1 (the held-out share of the corpus)")
    p = config.parallel
    if p.mixed_precision != "fp32" and not p.zero:
        raise ConfigError(f"parallel.mixed_precision = {p.mixed_precision!r} needs parallel.zero "
                          "= 1, 2 or 3 (DataParallel takes comm.grad_dtype)")
    if p.mixed_precision == "fp16" and (p.tp > 1 or p.pp > 1):
        raise ConfigError("parallel.mixed_precision = \"fp16\" with parallel.tp or pp > 1 is "
                          "not supported (its loss scaling is per ZeRO group): use \"bf16\"")
    if p.pp > 1:
        _validate_pipeline(config)
    if p.mode == "ps" and (p.tp > 1 or p.pp > 1 or p.zero or p.dp):
        raise ConfigError("parallel.mode = \"ps\" trains whole replicas on the workers: "
                          "leave parallel.tp, pp, zero and dp at their defaults")
    if config.ps.replicas > config.ps.servers:
        raise ConfigError(f"ps.replicas = {config.ps.replicas} is more than ps.servers = "
                          f"{config.ps.servers}: each copy of a shard needs a server of its own")
    if config.memory.offload != "none":
        _validate_offload(config)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1 (it splits the "
                          "sequence across the tensor-parallel ranks): set parallel.tp")
    if p.sequence_parallel and m.block_size % p.tp:
        raise ConfigError(f"parallel.sequence_parallel: model.block_size = {m.block_size} does "
                          f"not divide by parallel.tp = {p.tp}: make it a multiple of {p.tp}")
    if config.fault_tolerance.mode == "live":
        _validate_live(config)
    if p.zero and config.comm.grad_dtype != "fp32":
        raise ConfigError("comm.grad_dtype is for DataParallel; with parallel.zero set "
                          "parallel.mixed_precision instead")
    _validate_slow_links(config)


def _validate_replicate(config: Config) -> None:
    """checkpoint.replicate copies the checkpoints that the whole job writes together."""
    k = config.checkpoint.replicate
    if not k:
        return
    for what, used in (("parallel.mode = \"ps\"", config.parallel.mode == "ps"),
                       ("fault_tolerance.mode = \"live\"",
                        config.fault_tolerance.mode == "live"),
                       (f"sync.method = {config.sync.method!r}",
                        config.sync.method != "every_step")):
        if used:
            raise ConfigError(f"checkpoint.replicate = {k} with {what} is not supported yet: "
                              "set checkpoint.replicate = 0 and give the hosts a shared "
                              "train.out_dir")


def _validate_offload(config: Config) -> None:
    """Optimizer offload moves ZeRO's optimizer shards to the host: it needs ZeRO, and what
    reaches into the optimizer state across replicas does not follow it there yet."""
    if not config.parallel.zero:
        raise ConfigError(f"memory.offload = {config.memory.offload!r} needs parallel.zero = "
                          "1, 2 or 3 (it moves ZeRO's optimizer shards to the host)")
    if config.sync.method != "every_step":
        raise ConfigError(f"memory.offload with sync.method = {config.sync.method!r} is not "
                          "supported yet: use memory.offload = \"none\"")
    if config.fault_tolerance.mode == "live":
        raise ConfigError("memory.offload with fault_tolerance.mode = \"live\" is not "
                          "supported yet: use fault_tolerance.mode = \"restart\"")


def _validate_moe(config: Config) -> None:
    """Mixture of experts and expert parallelism: what they need and what they work with
    (so far)."""
    p = config.parallel
    m = with_preset(config.model, models_presets())
    check_moe(m)
    experts = m.n_experts if m.arch == "llama" else 0
    if m.arch == "hf" and p.ep > 1:  # its config.json says (read only when it matters)
        experts = hf_experts(m)
    if experts and m.arch == "llama":
        moe_config(m)  # its rules: top-k within the experts, a known router, ...
    if experts and p.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel with a mixture-of-experts model is not "
                          "supported yet: leave sequence_parallel off")
    if p.ep == 1:
        return
    if not experts:
        raise ConfigError(f"parallel.ep = {p.ep} splits experts, and this model has none: set "
                          "model.n_experts (dtrain's Llama, model.arch = \"llama\"), or "
                          "name a Mixtral or Qwen3-MoE config (model.arch = \"hf\")")
    if experts % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep} does not divide model.n_experts = {experts}: "
                          "choose an expert-parallel degree that divides it")
    if p.mode == "ps":
        raise ConfigError("parallel.ep with parallel.mode = \"ps\": parameter servers hold "
                          "whole replicas; use parallel.mode = \"collective\"")
    if config.comm.compression != "none":
        raise ConfigError("parallel.ep > 1 with comm.compression is not supported yet: leave "
                          "parallel.ep = 1, or comm.compression = \"none\"")


def _validate_context(config: Config) -> None:
    """Context parallelism: the models, sequence lengths and options it works with."""
    p, m = config.parallel, with_preset(config.model, models_presets())
    if p.cp == 1:
        return
    what = f"parallel.cp = {p.cp}"
    if m.arch not in ("gpt", "llama", "hf") or (
            m.arch == "hf" and hf_config_dict(m).get("model_type") not in ROTARY_FAMILY):
        raise ConfigError(f"{what} runs dtrain's GPT and Llama and Hugging Face models of the "
                          f"Llama family ({', '.join(ROTARY_FAMILY)}), not this model: use "
                          "parallel.cp = 1")
    if p.mode == "ps":
        raise ConfigError(f"{what} with parallel.mode = \"ps\": parameter servers train "
                          "whole sequences on each worker; use parallel.mode = \"collective\"")
    if m.block_size % (2 * p.cp):
        raise ConfigError(f"{what} cuts each sequence into 2 x cp = {2 * p.cp} chunks, and "
                          f"model.block_size = {m.block_size} does not divide by "
                          f"{2 * p.cp}: make it a multiple of {2 * p.cp}")
    if p.sequence_parallel and (m.block_size // p.cp) % p.tp:
        raise ConfigError(f"{what} with parallel.sequence_parallel: each rank's "
                          f"{m.block_size // p.cp} tokens do not divide by parallel.tp = "
                          f"{p.tp}: make model.block_size a multiple of cp x tp")
    if m.dropout:
        raise ConfigError(f"{what} with model.dropout = {m.dropout}: attention dropout is not "
                          "split over the chunks; set model.dropout = 0")
    if m.arch == "llama" and m.n_experts and (m.capacity_factor or m.aux_loss_weight):
        raise ConfigError(f"{what} with model.capacity_factor or model.aux_loss_weight: both "
                          "are per whole sequence, and a cp rank holds two chunks of each; "
                          "use a dropless MoE (capacity_factor = 0) balanced by model.router = "
                          "\"sigmoid_bias\" (aux_loss_weight = 0)")
    if config.fault_tolerance.mode == "live":
        raise ConfigError(f"{what} with fault_tolerance.mode = \"live\" is not supported yet: "
                          "use fault_tolerance.mode = \"restart\"")
    if p.cp_method == "alltoall":
        heads = m.n_head // p.tp
        kv = (m.n_kv_head or m.n_head) // p.tp if m.arch == "llama" else heads
        if heads % p.cp or kv % p.cp:
            raise ConfigError(f"parallel.cp_method = \"alltoall\" splits each rank's {heads} "
                              f"query and {kv} key/value heads over cp = {p.cp}, which does not "
                              "divide them: use cp_method = \"ring\" or \"allgather\"")


def _validate_slow_links(config: Config) -> None:
    """Compression and infrequent synchronization: what they work with."""
    p, c, s = config.parallel, config.comm, config.sync
    live = config.fault_tolerance.mode == "live"
    if c.compression != "none":
        what = f"comm.compression = {c.compression!r}"
        if p.mode == "ps":
            raise ConfigError(f"{what} compresses DataParallel's all-reduce; parameter servers "
                              "send whole gradients: use comm.compression = \"none\" with "
                              "parallel.mode = \"ps\"")
        if p.zero:
            raise ConfigError(f"{what} compresses DataParallel's all-reduce, not ZeRO's "
                              "reduce-scatter: use parallel.zero = 0, or comm.compression = "
                              "\"none\"")
        if c.grad_dtype != "fp32":
            raise ConfigError(f"{what} replaces comm.grad_dtype = {c.grad_dtype!r}: leave "
                              "comm.grad_dtype = \"fp32\"")
        if live:
            raise ConfigError(f"{what} with fault_tolerance.mode = \"live\": a replica's error "
                              "feedback cannot be sent to its replacement; use one of them")
    if not 0 <= s.outer_momentum < 1:
        raise ConfigError(f"sync.outer_momentum = {s.outer_momentum} must be in [0, 1)")
    if s.method != "every_step":
        what = f"sync.method = {s.method!r}"
        if p.mode == "ps" or live:
            raise ConfigError(f"{what} synchronizes replicas of a collective job: use "
                              "parallel.mode = \"collective\" and fault_tolerance.mode = "
                              "\"restart\"")
        if c.compression != "none":
            raise ConfigError(f"{what} already sends parameters every sync.every steps only: "
                              "leave comm.compression = \"none\"")


def _validate_live(config: Config) -> None:
    """What a live replica's replacement can be sent, and what keeps replicas apart."""
    p, live = config.parallel, "fault_tolerance.mode = \"live\""
    if p.mode != "collective":
        raise ConfigError(f"{live} keeps collective replicas alive, not parallel.mode = "
                          f"{p.mode!r}: use parallel.mode = \"collective\" or "
                          "fault_tolerance.mode = \"restart\"")
    if p.zero == 3 or (p.zero and p.mixed_precision != "fp32"):
        raise ConfigError(f"{live} works with ZeRO stages 1 and 2 in fp32 (a replacement is "
                          "sent the parameters and its shard's optimizer state; stage 3 and "
                          "mixed precision keep more): use parallel.zero = 1 or 2 with "
                          "parallel.mixed_precision = \"fp32\", or fault_tolerance.mode = "
                          "\"restart\"")
    if p.dp > 1 and not p.zero:
        raise ConfigError(f"{live}: parallel.dp = {p.dp} is data parallelism inside a "
                          "replica, which only ZeRO does (the replicas are the data "
                          "parallelism): set parallel.zero = 1 or 2, or parallel.dp = 0")
    if p.pp > 1 and p.virtual_stages > 1:
        raise ConfigError(f"{live} reduces one pipeline piece per rank: use "
                          "parallel.virtual_stages = 1, or fault_tolerance.mode = \"restart\"")


def _validate_pipeline(config: Config) -> None:
    from dtrain.pipeline.schedules import check

    p = config.parallel
    if config.model.arch == "gpt" and p.pp * p.virtual_stages > config.model.n_layer:
        raise ConfigError(f"parallel.pp x parallel.virtual_stages = {p.pp * p.virtual_stages} "
                          f"stages but the model has {config.model.n_layer} layers: use at most "
                          f"{config.model.n_layer} stages")
    if config.train.grad_accum != 1:
        raise ConfigError("train.grad_accum with parallel.pp > 1: the pipeline accumulates "
                          "over parallel.microbatches instead; set train.grad_accum = 1")
    try:
        check(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    except ConfigError as exc:
        raise ConfigError(f"parallel.schedule = {p.schedule!r}: {exc}") from None


def per_rank_batch(config: Config, dp_size: int) -> int:
    """Sequences each data-parallel rank feeds per forward (a pipeline cuts them further
    into `parallel.microbatches`).

    Raises:
        ConfigError: the global batch does not split evenly into ranks and micro-batches.
    """
    micro = config.train.grad_accum * (config.parallel.microbatches
                                       if config.parallel.pp > 1 else 1)
    parts = dp_size * micro
    if config.train.batch_size % parts:
        raise ConfigError(
            f"train.batch_size = {config.train.batch_size} does not split into {dp_size} "
            f"data-parallel rank{'s' if dp_size > 1 else ''} x "
            f"{micro} micro-batches: make it a multiple of {parts}"
        )
    return config.train.batch_size // (dp_size * config.train.grad_accum)


def layout_of(config: Config, world_size: int) -> Layout:
    """The job's Layout on `world_size` ranks, checked against them: the degrees multiply
    to the world size (to each replica's ranks, with sync.method = local_sgd or diloco)
    and the global batch splits into ranks and micro-batches. The launcher calls it
    before starting ranks, and every rank calls it again.

    Raises:
        ConfigError: the degrees or the batch do not fit `world_size`.
    """
    p = config.parallel
    replicas = replicas_of(config, world_size)  # each laid out alike
    layout = resolve_layout(world_size // replicas, p.dp or None, p.tp, p.pp, zero=p.zero,
                            microbatches=p.microbatches, schedule=p.schedule,
                            virtual_stages=p.virtual_stages, mode=p.mode, ep=p.ep, cp=p.cp)
    if layout.dp % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep} does not divide the data-parallel ranks (dp = "
                          f"{layout.dp}): experts split over data-parallel ranks; choose an ep "
                          f"that divides {layout.dp}")
    per_rank_batch(config, layout.dp * replicas)
    return layout


def replicas_of(config: Config, world_size: int) -> int:
    """How many replicas synchronize every sync.every steps (1 when every step does).

    Raises:
        ConfigError: the replicas do not divide the ranks.
    """
    p = config.parallel
    if config.sync.method == "every_step":
        return 1
    count = config.sync.replicas or world_size // (max(p.dp, 1) * p.tp * p.pp)
    if count < 1 or world_size % count:
        raise ConfigError(f"sync.replicas = {count} does not divide {world_size} ranks "
                          f"into replicas of dp x tp x pp: choose a divisor of {world_size}")
    return count


def add_config_arguments(parser, config_help: str, example: str = "train.steps=50") -> None:
    """The options of every command that reads a training config: an optional TOML file
    and repeatable `--set section.key=value` overrides (into `overrides`)."""
    parser.add_argument("config", nargs="?", help=config_help)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help=f"override a config key, e.g. {example}")


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split `section.key=value`; the value is read as TOML, falling back to a string."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise ConfigError(f"--set {text!r} is not section.key=value (e.g. train.steps=50)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, name, value


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (or the defaults) and apply `--set` overrides, then validate.

    Raises:
        ConfigError: the file is missing or malformed, or a key or value is invalid.
    """
    config = Config()
    if path:
        try:
            values = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config {path!r}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        _apply(config, values, path)
    for text in overrides:
        section, name, value = parse_override(text)
        _apply(config, {section: {name: value}}, "--set")
    _validate(config)
    return config


def config_from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (how ranks receive it)."""
    config = Config()
    _apply(config, values, "config")
    _validate(config)
    return config
