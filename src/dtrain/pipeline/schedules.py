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
- "zbv" (ZB-V, same paper): two chunks per rank placed in a V (`Placement`): rank r holds
  stages r and 2p-1-r, so the first rank holds both ends and the turn at the last rank
  needs no message. Each rank keeps at most 2p chunk-sized micro-batches live, 1F1B's
  peak (a chunk is half a stage), and with F, B and W of equal time the steady state has
  no bubble. The paper's fixed order (`zb_v_rank`), whose idle time stays the same for
  any m whatever the times; with fewer than 2p-1 micro-batches, lists made by running
  the step on equal times (`greedy`).
- "dualpipev" (DeepSeek-V3's DualPipe cut in half, the V placement): after a warm-up,
  each rank runs pairs, the forward of one micro-batch with the backward of another
  (`Action.with_next`), so that one's communication can run under the other's compute
  (a pair's messages are received before either half computes and sent after both:
  `Pipeline(overlap=True)` computes the backward in a second thread); the cool-down
  splits B from W to fill the bubble. Needs at least 2p micro-batches (`dualpipe_v`).

ZB-H1 in its steady state runs, on stage i, F of micro-batch x, B of x - (p-1-i) and W
of x - (p-1) in turn (`zb_h1`): B as late on each stage as 1F1B's, W p-1 micro-batches
behind F everywhere, so that no stage holds more than p. Every schedule's lists can be
checked (`check_actions`): each micro-batch has one F and one B (and one W where W is
split off) per chunk, and executed in order with blocking receives, no rank waits for a
message that never comes. `simulate` runs them on given F, B and W times: the idle share
each rank has (the planner's bubble for every schedule).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from dtrain.errors import ConfigError, DtrainError
from dtrain.mesh import dims
from dtrain.mesh.config import ParallelConfig
from dtrain.mesh.dims import V_SHAPED
from dtrain.models.config import ModelConfig

SCHEDULES = dims.SCHEDULES  # the mesh's vocabulary: Dims.schedule is one of them


@dataclass(frozen=True)
class Action:
    """Run the forward ("F"), backward ("B": under a zero-bubble schedule the input's
    gradient alone) or weights' gradients ("W") of micro-batch `micro` on chunk `chunk`."""

    kind: str
    micro: int
    chunk: int = 0
    with_next: bool = False
    """DualPipeV's pairs: this forward and the backward after it form one overlapped step."""

    def __repr__(self) -> str:
        return (f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")
                + ("&" if self.with_next else ""))


@dataclass(frozen=True)
class Placement:
    """Which virtual stage each (rank, chunk) runs: looped (`chunk * pp + rank`, as
    interleaved 1F1B) or, for the V-shaped schedules, rank r holds stages r and 2pp-1-r."""

    pp: int
    chunks: int = 1
    v: bool = False

    @classmethod
    def of(cls, schedule: str, pp: int, chunks: int = 1) -> Placement:
        return cls(pp, chunks, schedule in V_SHAPED)

    @property
    def stages(self) -> int:
        return self.pp * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        if self.v and chunk == 1:
            return 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def holder(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) of a virtual stage."""
        chunk, rank = divmod(stage, self.pp)
        if self.v and chunk == 1:
            rank = self.pp - 1 - rank
        return rank, chunk


def check(name: str, pp: int, microbatches: int, chunks: int) -> None:
    """Raise a ConfigError naming what to change if the schedule cannot run so."""
    if name not in SCHEDULES:
        raise ConfigError(f"schedule={name!r}: use one of {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise ConfigError(f"microbatches={microbatches} must be positive")
    if name in V_SHAPED:
        if chunks != 2:
            raise ConfigError(f"schedule {name!r} runs two chunks per rank in a V, not "
                              f"{chunks}: set virtual_stages = 2")
        if name == "dualpipev" and microbatches < 2 * pp:
            raise ConfigError(f"schedule 'dualpipev' needs at least 2 x pp = {2 * pp} "
                              f"micro-batches, not {microbatches}: raise microbatches")
    elif name == "interleaved":
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


EQUAL = (1.0, 1.0, 1.0)
"""F, B and W of a chunk taking the same time."""


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
    if name in SPLIT:
        return list(_zero_bubble(name, pp, microbatches)[rank])
    return interleaved(pp, rank, microbatches, chunks)


SPLIT = ("zb1p", "zbv", "dualpipev")
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


def zb_v(pp: int, microbatches: int) -> list[list[Action]]:
    """Every rank's actions under ZB-V (see the module doc): the paper's handcrafted
    order (`zb_v_rank`) where there are at least 2pp-1 micro-batches, else the lists
    `greedy` makes on equal times with at most 2pp chunk-sized micro-batches live."""
    if microbatches >= 2 * pp - 1:
        return [zb_v_rank(pp, rank, microbatches) for rank in range(pp)]
    return greedy(Placement(pp, 2, v=True), microbatches, EQUAL, live=2 * pp)


def zb_v_rank(pp: int, rank: int, microbatches: int) -> list[Action]:
    """Rank `rank`'s ZB-V order (Qi et al., 2023; torch's ScheduleZBVZeroBubble runs the
    same): 2(p-r)-1 forwards of chunk 0; r of chunk 1 then chunk 0; p-r of F, B and W of
    chunk 1; the steady state, F, B and W of chunk 0 then of chunk 1; r of B of chunk 0
    then chunk 1; p-r of B and W of chunk 0; the Ws left, chunk 1's first. A fixed order
    like 1F1B's: its idle time stays what it is at the first micro-batch whatever the F,
    B and W times, where lists made for equal times idle more with every micro-batch
    once W is much shorter than F and B. Needs m >= 2p-1."""
    p, r, m = pp, rank, microbatches
    actions: list[Action] = []
    at = {kind: [0, 0] for kind in "FBW"}

    def run(kind: str, chunk: int) -> None:
        if at[kind][chunk] < m:
            actions.append(Action(kind, at[kind][chunk], chunk))
            at[kind][chunk] += 1

    for _ in range(2 * (p - r) - 1):
        run("F", 0)
    for _ in range(r):
        run("F", 1)
        run("F", 0)
    for _ in range(p - r):
        for kind in "FBW":
            run(kind, 1)
    while at["F"][1] < at["F"][0] or at["F"][0] < m:
        run("F", 0)
        run("B", 0)
        run("W", 0)
        for kind in "FBW":
            run(kind, 1)
    for _ in range(r):
        run("B", 0)
        run("B", 1)
    for _ in range(p - r):
        run("B", 0)
        run("W", 0)
    for chunk in (1, 0):
        while at["W"][chunk] < at["B"][chunk]:
            run("W", chunk)
    return actions


def greedy(place: Placement, microbatches: int, times: tuple[float, float, float],
           live: int) -> list[list[Action]]:
    """Run the step on `times` (F, B, W) and record what each rank chooses whenever it is
    free: a ready B (the oldest micro-batch, the later stage first), else a ready F while
    fewer than `live` micro-batches are held (the later stage first; one place kept for
    the later chunk's forward of a micro-batch the rank holds), else the oldest W. Each
    chunk runs its forwards and its backwards in micro-batch order.

    Raises:
        DtrainError: a rank that can never go on.
    """
    pp, m = place.pp, microbatches
    finish: dict[tuple[str, int, int], float] = {}  # (kind, micro, stage) -> end time
    lists: list[list[Action]] = [[] for _ in range(pp)]
    free = [0.0] * pp
    nxt = {(kind, r, c): 0 for kind in "FB" for r in range(pp) for c in range(place.chunks)}
    waiting: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]  # W to run
    held = [0] * pp
    cost = dict(zip("FBW", times, strict=True))

    def ready(key: tuple[str, int, int], now: float) -> bool:
        return key in finish and finish[key] <= now

    def choose(r: int, now: float) -> Action | None:
        backs, forwards = [], []
        for c in range(place.chunks):
            j, s = nxt[("B", r, c)], place.stage(r, c)
            after = ("B", j, s + 1) if s + 1 < place.stages else ("F", j, s)
            if j < m and ready(("F", j, s), now) and ready(after, now):
                backs.append(Action("B", j, c))
            j = nxt[("F", r, c)]
            limit = live
            if c + 1 < place.chunks and nxt[("F", r, c + 1)] < j:  # keep a place for the
                limit -= 1  # later chunk's forward of a micro-batch this rank holds
            if j < m and held[r] < limit and (s == 0 or ready(("F", j, s - 1), now)):
                forwards.append(Action("F", j, c))
        if backs:
            return min(backs, key=lambda a: (a.micro, -place.stage(r, a.chunk)))
        if forwards:
            return min(forwards, key=lambda a: -place.stage(r, a.chunk))
        if waiting[r]:
            j, c = waiting[r][0]
            return Action("W", j, c)
        return None

    total = 3 * m * place.chunks
    while any(len(actions) < total for actions in lists):
        now = min(free[x] for x in range(pp) if len(lists[x]) < total)
        due = [x for x in range(pp) if len(lists[x]) < total and free[x] == now]
        chosen = next(((x, a) for x in due if (a := choose(x, now)) is not None), None)
        if chosen is None:  # the ranks due idle until the next action anywhere ends
            after = [t for t in [*finish.values(), *free] if t > now]
            if not after:
                raise DtrainError(f"pipeline schedule: ranks {due} can never go on")
            for x in due:
                free[x] = min(after)
            continue
        r, action = chosen
        stage = place.stage(r, action.chunk)
        free[r] += cost[action.kind]
        finish[(action.kind, action.micro, stage)] = free[r]
        lists[r].append(action)
        if action.kind == "W":
            waiting[r].popleft()
            held[r] -= 1
        else:
            nxt[(action.kind, r, action.chunk)] += 1
            if action.kind == "F":
                held[r] += 1
            else:
                waiting[r].append((action.micro, action.chunk))
    return lists


def dualpipe_v(pp: int, rank: int, microbatches: int) -> list[Action]:
    """Rank `rank`'s actions under DualPipeV (DeepSeek's DualPipe on the V placement), in
    its eight phases: forwards of chunk 0 to fill the pipe; forwards of both chunks; B and
    W of chunk 1 beside its forwards; the steady state of pairs, a forward of one chunk
    with a full backward (B then W) of the other; the last pairs; backwards of both
    chunks, their W deferred from the middle on; B of chunk 0 beside deferred Ws; the
    remaining Ws."""
    p, r, m = pp, rank, microbatches
    actions: list[Action] = []
    at = {"F": [0, 0], "B": [0, 0]}
    deferred: deque[tuple[int, int]] = deque()

    def run(kind: str, chunk: int, with_next: bool = False) -> None:
        actions.append(Action(kind, at[kind][chunk], chunk, with_next))
        at[kind][chunk] += 1

    def backward(chunk: int, split: bool) -> None:
        """B of `chunk`'s next micro-batch, its W at once or (`split`) deferred."""
        micro = at["B"][chunk]
        run("B", chunk)
        if split:
            deferred.append((micro, chunk))
        else:
            actions.append(Action("W", micro, chunk))

    def weights() -> None:
        micro, chunk = deferred.popleft()
        actions.append(Action("W", micro, chunk))

    def pair(forward: int) -> None:
        run("F", forward, with_next=True)
        backward(1 - forward, split=False)

    for _ in range(2 * (p - r - 1)):
        run("F", 0)
    for _ in range(r + 1):
        run("F", 0)
        run("F", 1)
    for _ in range(p - r - 1):
        backward(1, split=True)
        weights()
        run("F", 1)
    for _ in range(m - 2 * p + r + 1):
        pair(0)
        pair(1)
    for _ in range(p - r - 1):
        backward(1, split=False)
        pair(1)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        backward(1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        backward(0, split)
    for _ in range(p - r - 1):
        weights()
        backward(0, split=True)
    for _ in range(r + 1):
        weights()
    return actions


@functools.cache
def _zero_bubble(name: str, pp: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    if name == "zbv":
        made = zb_v(pp, microbatches)
    elif name == "dualpipev":
        made = [dualpipe_v(pp, rank, microbatches) for rank in range(pp)]
    else:
        made = [zb_h1(pp, rank, microbatches) for rank in range(pp)]
    lists = tuple(tuple(actions) for actions in made)
    check_actions(lists, Placement.of(name, pp, 2 if name in V_SHAPED else 1), microbatches)
    return lists


def _needs(a: Action, stage: int, stages: int) -> tuple[str, int, int] | None:
    """What must be done before `a` on `stage`: the input (F), the output's gradient (B,
    after its own F) or B (W)."""
    if a.kind == "F":
        return ("F", a.micro, stage - 1) if stage > 0 else None
    if a.kind == "W":
        return ("B", a.micro, stage)
    return ("B", a.micro, stage + 1) if stage < stages - 1 else ("F", a.micro, stage)


@dataclass(frozen=True)
class _Step:
    """What a rank runs next: one action, or a DualPipeV pair (a forward and the backward
    after it, their messages received before either computes and sent after both)."""

    does: tuple[tuple[str, int, int], ...]  # (kind, micro, stage) of each
    needs: frozenset[tuple[str, int, int]]


def _step(actions: Sequence[Action], at: int, rank: int, place: Placement) -> _Step:
    pair = actions[at:at + 2] if actions[at].with_next else actions[at:at + 1]
    does = tuple((a.kind, a.micro, place.stage(rank, a.chunk)) for a in pair)
    needs = set()
    for a, (_, _, stage) in zip(pair, does, strict=True):
        needs.add(_needs(a, stage, place.stages))
        if a.kind == "B":
            needs.add(("F", a.micro, stage))
    return _Step(does, frozenset(n for n in needs if n is not None) - set(does))


def check_actions(lists: Sequence[Sequence[Action]], place: Placement,
                  microbatches: int) -> None:
    """Whether every rank's `lists[rank]` can run (see the module doc): one F and one B
    (and one W where any is split off) per micro-batch and chunk, and executed in order
    with blocking receives, every rank reaches its end.

    Raises:
        DtrainError: a missing or repeated action, or a rank that would wait forever,
            named with what it waits for.
    """
    pp, chunks = place.pp, place.chunks
    split = any(a.kind == "W" for actions in lists for a in actions)
    kinds = ("F", "B", "W") if split else ("F", "B")
    for rank, actions in enumerate(lists):
        want = sorted((k, j, c) for k in kinds for j in range(microbatches)
                      for c in range(chunks))
        have = sorted((a.kind, a.micro, a.chunk) for a in actions)
        if have != want:
            raise DtrainError(f"pipeline schedule: rank {rank}'s actions are not one "
                              f"{'/'.join(kinds)} per micro-batch and chunk")
    done: set[tuple[str, int, int]] = set()  # (kind, micro, stage)
    at = [0] * pp
    while any(at[r] < len(lists[r]) for r in range(pp)):
        moved = False
        for rank in range(pp):
            while at[rank] < len(lists[rank]):
                step = _step(lists[rank], at[rank], rank, place)
                if any(n not in done for n in step.needs):
                    break
                done.update(step.does)
                at[rank] += len(step.does)
                moved = True
        if not moved:
            stuck = [f"rank {r} at {lists[r][at[r]]}" for r in range(pp) if at[r] < len(lists[r])]
            raise DtrainError(f"pipeline schedule: no rank can go on ({', '.join(stuck)}): "
                              "each waits for a message that never comes")


def simulate(lists: Sequence[Sequence[Action]], place: Placement,
             times: tuple[float, float, float], comm: float = 0.0
             ) -> tuple[float, list[float]]:
    """The step's length and each rank's idle share when every F, B and W of a chunk
    takes `times` (a B not split from its W: B + W) and a message between two ranks
    `comm`: each action starts when its rank is free and what it needs has ended, plus
    `comm` where that was on another rank (lists that pass `check_actions`)."""
    split = any(a.kind == "W" for actions in lists for a in actions)
    cost = {"F": times[0], "B": times[1] + (0 if split else times[2]), "W": times[2]}
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * place.pp
    busy = [0.0] * place.pp
    at = [0] * place.pp
    while any(at[r] < len(lists[r]) for r in range(place.pp)):
        for rank in range(place.pp):
            while at[rank] < len(lists[rank]):
                step = _step(lists[rank], at[rank], rank, place)
                if any(n not in end for n in step.needs):
                    break
                took = sum(cost[kind] for kind, _, _ in step.does)
                free[rank] = max([free[rank]] + [
                    end[n] + (comm if place.holder(n[2])[0] != rank else 0.0)
                    for n in step.needs]) + took
                end.update(dict.fromkeys(step.does, free[rank]))
                busy[rank] += took
                at[rank] += len(step.does)
    length = max(free)
    return length, [1 - b / length for b in busy]


def peak_live(actions: Sequence[Action]) -> int:
    """The most micro-batches whose activations a rank holds at once under `actions`
    (of any chunk, each counted): from a micro-batch's F to its W (its B where backward
    is not split)."""
    split = any(a.kind == "W" for a in actions)
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == ("W" if split else "B") else 0
        peak = max(peak, live)
    return peak


def forward_only(pp: int, microbatches: int, chunks: int = 1, v: bool = False
                 ) -> list[Action]:
    """Forwards in the order every rank runs them (evaluation); under the V placement
    every chunk-0 forward before the chunk-1 ones (sends never block)."""
    if chunks == 1 or v:
        return [Action("F", i, c) for c in range(chunks) for i in range(microbatches)]
    return [a for a in interleaved(pp, pp - 1, microbatches, chunks) if a.kind == "F"]
