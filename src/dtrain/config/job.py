"""The training job's own sections: `[train]` (the run) and `[logging]` (what it shows).

They are the Trainer's (dtrain.train), defined here, below it, because the layouts that
build a model read `[train]` too (compile, FP8, the loss, the seed, gradient accumulation).

    [train]    steps = 400, batch_size = 32, eval_every = 100, out_dir = "runs/default"
    [logging]  metrics = "metrics.jsonl", log_every = 10
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.models.chunked_loss import DEFAULT_CHUNK, LossKind
from dtrain.models.float8 import Recipe
from dtrain.schema import non_negative, positive


@dataclass
class TrainConfig:
    steps: int = positive(400)
    """Optimizer steps to run."""
    batch_size: int = positive(32)
    """Global batch in sequences, split evenly across data-parallel ranks."""
    grad_accum: int = positive(1)
    """Micro-batches per step on each rank (gradients accumulated without communication)."""
    seed: int = 1337
    """Seed for the model's initialization and the data order."""
    eval_every: int = non_negative(100)
    """Evaluate on the held-out split every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = positive(8)
    """Held-out batches per evaluation."""
    out_dir: str = "runs/default"
    """Where the resolved config, checkpoints and (by default) nothing else are written."""
    compile: bool = False
    """Compile each transformer block with torch.compile (regional compilation: the
    layouts' collectives and hooks stay outside the compiled regions), in every layout;
    compiled code is cached under out_dir/compile_cache, so a restart does not pay again."""
    float8: Literal["none", Recipe] = "none"
    """Train the blocks' Linear layers in FP8 with torchao (tensorwise or rowwise scaling)
    on GPUs that have it (compute capability 8.9 and later); refused elsewhere."""
    loss: LossKind = "auto"
    """How the training loss meets the output head: plain (the logits of every token at
    once), chunked (the head and cross-entropy computed loss_chunk tokens at a time,
    forward and backward, so no rank holds every token's logits), or auto (chunked from a
    vocabulary of 32000 token ids on, where the model can)."""
    loss_chunk: int = positive(DEFAULT_CHUNK)
    """Tokens per chunk of the chunked loss: its largest tensor is loss_chunk x the
    vocabulary (this rank's block of it under tp) in fp32."""


@dataclass
class LoggingConfig:
    metrics: str = ""
    """Path of a JSON-lines file with one record per step (and per evaluation)."""
    log_every: int = positive(10)
    """Print a progress line every this many steps; the metrics are gathered from every
    rank then, once for the steps since the last line."""
    sample_tokens: int = non_negative(200)
    """Tokens of text to generate at the end; 0 skips the sample."""
    sample_prompt: str = "def "
    """Text the sample continues."""
    timeline: str = ""
    """Path of a Chrome-trace JSON timeline of every rank's steps, data loading, forward,
    backward, optimizer and collectives (dtrain.timeline; open it in ui.perfetto.dev)."""
    tensorboard: bool = False
    """Write TensorBoard event files under out_dir/tensorboard (loss, held-out loss, lr,
    gradient norm, tokens/s, MFU, memory, MoE load); needs dtrain[tensorboard]."""
    wandb: Literal["off", "offline", "online"] = "off"
    """Log the same to Weights & Biases: off, offline (a run folder under out_dir/wandb to
    sync later) or online (needs a key; without one the run falls back to offline with one
    line); needs dtrain[wandb]."""
    wandb_project: str = "dtrain"
    """The Weights & Biases project the run is logged to."""
    peak_tflops: float = non_negative(0.0)
    """The peak dense TFLOP/s per rank that MFU divides by; 0: the GPU's datasheet figure,
    or on a CPU a short calibration matmul at start (cached)."""
