"""Generation from a model in split form: every rank holds what it trained with, and no
rank ever holds the whole model (`dtrain generate`, and `dtrain train`'s final sample).

    holding = dtrain.layouts.build(model, mesh, config, weights=Checkpoint(path))
    ids = generate_split(holding, model, mesh, prompt_ids, tokens=200, seed=0,
                        temperature=0.8, vocab_size=shape.vocab_size)

Each step runs one forward of the tokens the KV caches have not seen
(dtrain.models.kv_cache: under tp each rank caches its own heads, under pp each stage its
own blocks, under ZeRO-3 each unit is gathered for its forward and freed after, as in
training) and draws the next token from the last position's logits:

- tp: the vocab-parallel head's logits are gathered whole on every tp rank, and every tp
  rank draws from them with the same seeded generator: the same token everywhere, so the
  ranks keep running the same collectives, step after step;
- pp: the token ids enter the first stage and flow through the stages
  (Holding.infer); the last stage draws the token and broadcasts it over the pp group,
  so every stage feeds the same sequence next;
- dp (and ZeRO over it): every data-parallel rank computes the same logits and draws the same token.

The draw is dtrain.models.generate.pick_token with one torch.Generator seeded `seed`, the
one the whole model's path makes: the same seed gives the same text in any layout (the
logits of a split model differ from one process's by float rounding only, which moves a
draw only when it falls within that rounding of a boundary between two tokens).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import torch
from torch import nn

from dtrain import adapters, comm, layouts
from dtrain import world as world_mod
from dtrain.adapters import checkpoints
from dtrain.checkpoint.universal import Checkpoint
from dtrain.config import Config, config_from_dict, dims_of
from dtrain.data import Tokenizer, load_tokenizer
from dtrain.data.chat import ChatTemplate, chat_prompt
from dtrain.data.tokenizer import BYTES
from dtrain.errors import ConfigError, DtrainError, exit_code_of
from dtrain.layouts import Holding
from dtrain.mesh import Dims, Mesh
from dtrain.models import init
from dtrain.models.config import ModelConfig
from dtrain.models.generate import attach, detach, pick_token, window
from dtrain.tensor_parallel.functions import gather_last


def splits_model(config: Config, dims: Dims) -> bool:
    """Whether the trainer's final sample generates in split form (no rank builds the
    whole model): a layout that splits it (tp > 1, pp > 1 or ZeRO-3), run on whole
    sequences (cp = 1, no sequence parallelism) by collective ranks with uncompiled
    blocks. Otherwise rank 0 builds the model whole from the checkpoint."""
    split = dims.tp > 1 or dims.pp > 1 or dims.zero == 3
    whole_sequences = dims.cp == 1 and not dims.sequence_parallel
    return (split and whole_sequences and dims.exchange != "ps" and not config.train.compile
            and config.train.float8 == "none")


@torch.no_grad()
def generate_split(holding: Holding, model: nn.Module, mesh: Mesh, prompt_ids: list[int],
                  tokens: int, seed: int, temperature: float, vocab_size: int,
                  stop: int | None = None) -> list[int]:
    """`prompt_ids` followed by `tokens` sampled tokens (fewer if `stop` is drawn, which
    ends them), from this rank's `holding` of `model` (the model handed to
    dtrain.layouts.build) over `mesh`, at most `model.block_size` tokens seen at once.
    Collective: every rank of the mesh calls it with the same arguments, and every rank
    returns the same ids.

    Raises:
        ConfigError: the model runs under context or sequence parallelism.
    """
    device = mesh.world.device
    tp, pp = comm.resolve(mesh.group("tp")), mesh.group("pp")
    cache = attach(model, staged=mesh.size("pp") > 1)
    generator = torch.Generator(device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    was_training = holding.module.training
    holding.module.eval()
    try:
        for _ in range(tokens):
            # every dtrain model has block_size (StagedLM, HFCausalLM, a custom one's own)
            fed = window(ids, model.block_size, cache)  # type: ignore[arg-type]
            logits = holding.infer(fed)
            if cache is not None:
                cache.advance(fed.shape[1])
            token = torch.zeros((1, 1), dtype=torch.long, device=device)
            if logits is not None:  # every tp rank of the last stage: the same draw
                last = logits[:, -1, :].contiguous()
                if tp.size > 1 and last.shape[-1] != vocab_size:
                    last = gather_last(last, tp)
                token = pick_token(last, generator, temperature)
            comm.broadcast(token, src=mesh.size("pp") - 1, group=pp)
            ids = torch.cat([ids, token], dim=1)
            if stop is not None and int(token) == stop:  # every rank drew the same
                break
    finally:
        detach(model)
        holding.module.train(was_training)
    return ids[0].tolist()


def model_of(ckpt: Checkpoint) -> ModelConfig:
    """The resolved model a checkpoint records (its shape, vocabulary included).

    Raises:
        ConfigError: the checkpoint records none (saved by an older dtrain).
    """
    saved = ckpt.meta.get("model")
    if saved is None or "config" not in ckpt.meta:
        raise ConfigError(f"checkpoint {ckpt.path} does not record its config and model "
                          "(saved by an older dtrain): it cannot be generated from")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in fields})


def tokenizer_of(ckpt: Checkpoint) -> Tokenizer:
    """The tokenizer the checkpoint's run used (its tokenizer.json, or bytes).

    Raises:
        ConfigError: the run's tokenizer file is gone.
    """
    path = ckpt.meta.get("tokenizer")
    return load_tokenizer(path, "the run's tokenizer") if path else load_tokenizer("bytes")


GENERATION_SETTINGS = {"parallel": {"dp": 0, "tp": 1, "pp": 1, "zero": 0, "cp": 1, "ep": 1,
                                    "mode": "collective", "microbatches": 1,
                                    "virtual_stages": 1, "sequence_parallel": False},
                       "sync": {"method": "every_step"}, "fault_tolerance": {"mode": "restart"},
                       "train": {"compile": False, "float8": "none", "grad_accum": 1},
                       "checkpoint": {"resume": ""}}
"""What `dtrain generate` sets in the checkpoint's config before the user's --set: one
layout over the ranks given (every one of them data parallel unless tp, pp or ZeRO is set),
on whole sequences, uncompiled, without fault tolerance."""


def generation_config(ckpt: Checkpoint, overrides: list[tuple[str, str, object]],
                      nproc: int) -> Config:
    """The config `dtrain generate` builds the checkpoint's model with on `nproc` ranks:
    the run's, with GENERATION_SETTINGS, then `overrides` ((section, key, value) of
    --set), its global batch one sequence per data-parallel rank.

    Raises:
        ConfigError: a bad key or value, or a layout that does not fit `nproc` ranks or
            the model.
    """
    values = json.loads(json.dumps(ckpt.meta.get("config", {})))
    for section, keys in GENERATION_SETTINGS.items():
        values.setdefault(section, {}).update(keys)
    for section, name, value in overrides:
        values.setdefault(section, {})[name] = value
    values["parallel"]["nproc"] = nproc
    values["train"]["batch_size"] = nproc  # a multiple of any dp the ranks make
    config = config_from_dict(values)
    if config.parallel.exchange == "ps":
        raise ConfigError("dtrain generate runs collective ranks: drop parallel.exchange = "
                          "\"ps\"")
    dims_of(config, nproc)
    return config


def generate_text(config: Config, checkpoint: str, prompt: str, tokens: int, seed: int,
                  temperature: float, chat: bool = False) -> str:
    """This rank's part of `dtrain generate`: build the checkpoint's model in split form
    in the config's layout over this process's world, restore its weights, generate, and
    return the text (every rank the same). With `chat`, the prompt is a user's message
    rendered by the run's chat template (dtrain.data.chat.chat_prompt), generation stops
    at the template's end of turn, and the text is the answer alone.

    Raises:
        ConfigError: a damaged checkpoint, a layout that does not fit, a model it cannot
            split so; with `chat`, a run whose tokenizer has no chat template.
    """
    backend = None if config.comm.backend == "auto" else config.comm.backend
    world = world_mod.init(backend=backend)
    try:
        ckpt = Checkpoint(checkpoint)
    except DtrainError as exc:
        raise ConfigError(str(exc)) from None
    shape, tokenizer = model_of(ckpt), tokenizer_of(ckpt)
    config.train.batch_size = world.world_size  # one sequence per rank (under a launcher)
    mesh = Mesh(dims_of(config, world.world_size))
    torch.manual_seed(config.train.seed)
    model = init.skeleton(lambda: adapters.built(shape, config.adapter))
    holding = layouts.build(model, mesh, config,  # an adapter checkpoint over its base
                            weights=checkpoints.checkpoint_weights(ckpt, shape, model))
    stop = None
    if chat:
        template = ChatTemplate.find(tokenizer.path or BYTES, config.data.chat_template)
        prompt_ids, stop = chat_prompt(template, tokenizer, prompt)
    else:
        prompt_ids = tokenizer.encode(prompt) or tokenizer.separator
    ids = generate_split(holding, model, mesh, prompt_ids, tokens, seed, temperature,
                         shape.vocab_size, stop)
    if not chat:
        return tokenizer.decode(ids)
    answer = ids[len(prompt_ids):]
    return tokenizer.decode(answer[:-1] if answer and answer[-1] == stop else answer)


def main(argv: list[str]) -> int:
    """One rank of `dtrain generate`: `python -m dtrain.train.generation ARGS.json`
    (started for you); rank 0 prints the text."""
    with open(argv[0], encoding="utf-8") as f:
        job: dict[str, Any] = json.load(f)

    def run() -> None:
        text = generate_text(config_from_dict(job["config"]), job["checkpoint"], job["prompt"],
                             job["tokens"], job["seed"], job["temperature"], job["chat"])
        if world_mod.current().is_main:
            print(text, flush=True)

    return exit_code_of(run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
