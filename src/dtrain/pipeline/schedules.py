"""Pipeline schedules: the order in which one rank runs forwards and backwards.

A rank holds `chunks` model pieces (virtual stages `chunk * pp + rank`; one chunk unless
interleaved). Each schedule is the list of actions, F(micro-batch, chunk) or B(...), one
rank executes; sends never block and receives wait, so any order that respects the data
dependencies runs. With p stages, m micro-batches and v chunks per rank the idle share
(bubble) of a step is about (p-1)/(m+p-1), and (p-1)/(v·m+p-1) interleaved:

- "gpipe" (Huang et al., 2019): every forward, then every backward; m micro-batches of
  activations live at once.
- "1f1b" (PipeDream-flush, Narayanan et al., 2019): after p-1-rank warm-up forwards, one
  forward then one backward; at most p micro-batches live on a stage. Same bubble as GPipe.
- "interleaved" (Megatron-LM, Narayanan et al., 2021): 1F1B over v chunks per rank,
  micro-batches in groups of p; the bubble shrinks v times at v times the messages. Needs
  m to be a multiple of p.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.errors import ConfigError
from dtrain.mesh import dims
from dtrain.mesh.config import ParallelConfig
from dtrain.models.config import ModelConfig

SCHEDULES = dims.SCHEDULES  # the mesh's vocabulary: Dims.schedule is one of them


@dataclass(frozen=True)
class Action:
    """Run the forward ("F") or backward ("B") of micro-batch `micro` on chunk `chunk`."""

    kind: str
    micro: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def check(name: str, pp: int, microbatches: int, chunks: int) -> None:
    """Raise a ConfigError naming what to change if the schedule cannot run so."""
    if name not in SCHEDULES:
        raise ConfigError(f"schedule={name!r}: use one of {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise ConfigError(f"microbatches={microbatches} must be positive")
    if name == "interleaved":
        if chunks < 2:
            raise ConfigError("the interleaved schedule needs at least 2 chunks (virtual "
                              "stages) per rank")
        if microbatches % pp:
            raise ConfigError(f"the interleaved schedule needs micro-batches in groups of "
                              f"pp={pp}: make microbatches ({microbatches}) a multiple of {pp}")
    elif chunks != 1:
        raise ConfigError(f"schedule {name!r} runs one chunk per rank, not {chunks}: use "
                          "'interleaved' for virtual stages")


def check_config(parallel: ParallelConfig, model: ModelConfig, grad_accum: int) -> None:
    """A pipeline's `[parallel]` keys against the model and the run (`train.grad_accum`).

    Raises:
        ConfigError: more stages than layers, gradient accumulation beside micro-batches,
            or a schedule that cannot run so.
    """
    p = parallel
    if model.arch == "gpt" and p.pp * p.virtual_stages > model.n_layer:
        raise ConfigError(f"parallel.pp x parallel.virtual_stages = {p.pp * p.virtual_stages} "
                          f"stages but the model has {model.n_layer} layers: use at most "
                          f"{model.n_layer} stages")
    if grad_accum != 1:
        raise ConfigError("train.grad_accum with parallel.pp > 1: the pipeline accumulates "
                          "over parallel.microbatches instead; set train.grad_accum = 1")
    try:
        check(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    except ConfigError as exc:
        raise ConfigError(f"parallel.schedule = {p.schedule!r}: {exc}") from None


def gpipe(pp: int, rank: int, microbatches: int) -> list[Action]:
    return ([Action("F", i) for i in range(microbatches)]
            + [Action("B", i) for i in range(microbatches)])


def one_f_one_b(pp: int, rank: int, microbatches: int) -> list[Action]:
    warmup = min(pp - rank - 1, microbatches)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    return actions + [Action("B", i) for i in range(microbatches - warmup, microbatches)]


def interleaved(pp: int, rank: int, microbatches: int, chunks: int) -> list[Action]:
    total = microbatches * chunks

    def order(k: int, backward: bool) -> Action:
        group, within = divmod(k, pp * chunks)
        chunk = within // pp
        return Action("B" if backward else "F", group * pp + within % pp,
                      chunks - 1 - chunk if backward else chunk)

    warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)
    actions = [order(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [order(warmup + k, False), order(k, True)]
    return actions + [order(k, True) for k in range(total - warmup, total)]


def build(name: str, pp: int, rank: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """The actions rank `rank` of `pp` runs for one step.

    Raises:
        ConfigError: unknown name, or micro-batches/chunks the schedule cannot use.
    """
    check(name, pp, microbatches, chunks)
    if name == "gpipe":
        return gpipe(pp, rank, microbatches)
    if name == "1f1b":
        return one_f_one_b(pp, rank, microbatches)
    return interleaved(pp, rank, microbatches, chunks)


def forward_only(pp: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """Forwards in the order every rank runs them (evaluation)."""
    if chunks == 1:
        return [Action("F", i) for i in range(microbatches)]
    return [a for a in interleaved(pp, pp - 1, microbatches, chunks) if a.kind == "F"]
