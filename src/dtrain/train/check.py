"""What every rank of `dtrain train` would find wrong with its data and model, found once
before any rank starts: one line and exit 2, nothing written."""

from __future__ import annotations

from dtrain import adapters, models
from dtrain.config import Config
from dtrain.data import vocab_of
from dtrain.data.dataset import Data, data_of
from dtrain.data.packing import Packing
from dtrain.errors import ConfigError
from dtrain.models import init, recompute
from dtrain.tensor_parallel.parallelize import matches
from dtrain.tensor_parallel.plan_of import check_sequence_parallel, plan_of
from dtrain.train.sinks import check_dependencies


def check_job(config: Config) -> None:
    """Read the data's vocabulary (and the corpus, when one is named), resolve the model
    against it and build it on the meta device (no memory).

    Raises:
        ConfigError: the data, the tokenizer, the model's arch, preset, Hugging Face
            config or factory, their vocabularies, the tensor-parallel plan, sequence
            parallelism or the modules to recompute do not fit; TensorBoard or W&B asked
            for and not installed.
    """
    check_dependencies(config.logging)
    dc = config.data
    if dc.path:  # the stdlib default is known good; a user's corpus is read once here
        data = data_of(dc, config.model.block_size)
        check_rows(data, config)
        vocab = data.vocab_size
    else:
        vocab = vocab_of(dc.path, dc.format, dc.tokenizer)
    shape = models.resolve(config.model, vocab)
    model = init.on_meta(lambda: adapters.built(shape, config.adapter))
    if config.parallel.tp > 1:  # a plan that names nothing, or none at all
        matches(model, plan_of(model, config.model.tp_plan))
    if config.parallel.sequence_parallel:
        check_sequence_parallel(model)
    recompute.apply(model, config.memory)  # modules that do not exist, a mode it lacks


def check_rows(data: Data, config: Config) -> None:
    """Whether the layout and the model can train on the data's rows: enough held-out rows
    for an evaluation batch; packed documents and loss masks need a model that takes
    their positions and weighs its loss.

    Raises:
        ConfigError: the combination is not supported yet, naming what to change.
    """
    packed = data.packing is Packing.BLOCK_CAUSAL
    masked = data.train.targets_in([0]) is not None
    evaluated = config.train.batch_size // config.train.grad_accum
    if len(data.val) < evaluated:
        raise ConfigError(f"the data's held-out part holds {len(data.val)} rows, fewer than "
                          f"one evaluation batch of {evaluated}: raise data.val_fraction or "
                          "give more data")
    dpo = config.objective.kind == "dpo"
    if data.pairs and not dpo:  # token shards of pairs (data.format "preference": the config)
        raise ConfigError(f"{config.data.path} holds preference pairs, not text to learn: set "
                          'objective.kind = "dpo"')
    if dpo and not data.pairs:
        raise ConfigError(f'objective.kind = "dpo" needs preference pairs: {config.data.path} '
                          "holds none (prepare them with dtrain data prepare --format "
                          "preference)")
    if (packed or masked) and config.model.arch == "custom":
        raise ConfigError("packed documents and loss masks need a model that takes "
                          "positions= and weight= (dtrain's GPT and Llama, arch = \"hf\"): "
                          'a custom module trains text with data.packing = "stream"')
