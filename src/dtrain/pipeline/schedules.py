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
- "zb1p" (ZB-H1, Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): each backward
  split in B, the input's gradient the stage before waits for, and W, the weights'
  gradients nobody waits for (dtrain.pipeline.split_backward); a stage sends the
  input's gradient as soon as B is done and runs W where 1F1B would wait. No rank holds
  more micro-batches than 1F1B's first stage, p (a micro-batch lives from its F to its
  W); with F, B and W of equal time the bubble is (p-1)(F+B-W), a third of 1F1B's.

ZB-H1 in its steady state runs, on stage i, F of micro-batch x, B of x - (p-1-i) and W
of x - (p-1) in turn (`zb_h1`): B as late on each stage as 1F1B's, W p-1 micro-batches
behind F everywhere, so that no stage holds more than p. Every schedule's lists can be
checked (`check_actions`): each micro-batch has one
F and one B (and one W where W is split off) per chunk, and executed in order with
blocking receives, no rank waits for a message that never comes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from dtrain.errors import ConfigError, DtrainError
from dtrain.mesh import dims
from dtrain.mesh.config import ParallelConfig
from dtrain.models.config import ModelConfig

SCHEDULES = dims.SCHEDULES  # the mesh's vocabulary: Dims.schedule is one of them


@dataclass(frozen=True)
class Action:
    """Run the forward ("F"), backward ("B": under a zero-bubble schedule the input's
    gradient alone) or weights' gradients ("W") of micro-batch `micro` on chunk `chunk`."""

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
    stage_balance(p.stage_layers, p.pp * p.virtual_stages,
                  model.n_layer if model.arch in ("gpt", "llama") else None)


def stage_balance(spec: str, stages: int, blocks: int | None = None) -> str | list[int]:
    """`[parallel] stage_layers` as `dtrain.pipeline.cut` takes it: "params", "auto" or
    each stage's blocks (`blocks`: the model's, where known, to check them against).

    Raises:
        ConfigError: sizes that are not `stages` positive whole numbers adding up to the
            blocks.
    """
    if spec in ("", "auto"):
        return spec or "params"
    try:
        sizes = [int(part) for part in spec.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != stages or min(sizes, default=0) < 1 or \
            (blocks is not None and sum(sizes) != blocks):
        total = f" adding up to the model's {blocks} blocks" if blocks is not None else ""
        raise ConfigError(f"parallel.stage_layers = {spec!r}: give {stages} positive sizes "
                          f"(pp x virtual_stages, in stage order){total}, or \"auto\"")
    return sizes


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
    if name == "zb1p":
        return list(_zero_bubble(pp, microbatches)[rank])
    return interleaved(pp, rank, microbatches, chunks)


SPLIT = ("zb1p",)
"""The schedules that split each backward into B and W."""


def zb_h1(pp: int, rank: int, microbatches: int) -> list[Action]:
    """Rank `rank`'s actions under ZB-H1 (see the module doc): in its step x, stage i
    runs F of micro-batch x, B of x - (p-1-i) and W of x - (p-1), those that exist."""
    actions = []
    for x in range(microbatches + pp - 1):
        for kind, micro in (("F", x), ("B", x - (pp - 1 - rank)), ("W", x - (pp - 1))):
            if 0 <= micro < microbatches:
                actions.append(Action(kind, micro))
    return actions


@functools.cache
def _zero_bubble(pp: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    lists = tuple(tuple(zb_h1(pp, rank, microbatches)) for rank in range(pp))
    check_actions(lists, pp, microbatches, 1)
    return lists


def check_actions(lists: Sequence[Sequence[Action]], pp: int, microbatches: int,
                  chunks: int) -> None:
    """Whether every rank's `lists[rank]` can run (see the module doc): one F and one B
    (and one W where any is split off) per micro-batch and chunk, and executed in order
    with blocking receives, every rank reaches its end. Chunk c of rank r is virtual
    stage c * pp + r.

    Raises:
        DtrainError: a missing or repeated action, or a rank that would wait forever,
            named with what it waits for.
    """
    split = any(a.kind == "W" for actions in lists for a in actions)
    kinds = ("F", "B", "W") if split else ("F", "B")
    for rank, actions in enumerate(lists):
        want = sorted((k, j, c) for k in kinds for j in range(microbatches)
                      for c in range(chunks))
        have = sorted((a.kind, a.micro, a.chunk) for a in actions)
        if have != want:
            raise DtrainError(f"pipeline schedule: rank {rank}'s actions are not one "
                              f"{'/'.join(kinds)} per micro-batch and chunk")
    stages = pp * chunks
    done: set[tuple[str, int, int]] = set()  # (kind, micro, stage)
    at = [0] * pp
    while any(at[r] < len(lists[r]) for r in range(pp)):
        moved = False
        for rank in range(pp):
            while at[rank] < len(lists[rank]):
                a = lists[rank][at[rank]]
                stage = a.chunk * pp + rank
                needs = {"F": ("F", a.micro, stage - 1) if stage > 0 else None,
                         "B": ("B", a.micro, stage + 1) if stage < stages - 1
                         else ("F", a.micro, stage),
                         "W": ("B", a.micro, stage)}[a.kind]
                if a.kind == "B" and ("F", a.micro, stage) not in done:
                    needs = ("F", a.micro, stage)
                if needs is not None and needs not in done:
                    break
                done.add((a.kind, a.micro, stage))
                at[rank] += 1
                moved = True
        if not moved:
            stuck = [f"rank {r} at {lists[r][at[r]]}" for r in range(pp) if at[r] < len(lists[r])]
            raise DtrainError(f"pipeline schedule: no rank can go on ({', '.join(stuck)}): "
                              "each waits for a message that never comes")


def peak_live(actions: Sequence[Action]) -> int:
    """The most micro-batches whose activations a rank holds at once under `actions`:
    from a micro-batch's F to its W (its B where backward is not split)."""
    split = any(a.kind == "W" for a in actions)
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == ("W" if split else "B") else 0
        peak = max(peak, live)
    return peak


def forward_only(pp: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """Forwards in the order every rank runs them (evaluation)."""
    if chunks == 1:
        return [Action("F", i) for i in range(microbatches)]
    return [a for a in interleaved(pp, pp - 1, microbatches, chunks) if a.kind == "F"]
