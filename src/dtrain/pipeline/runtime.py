"""Run a pipeline schedule on this rank: forwards, backwards, messages, the loss.

    pipe = Pipeline(my_pieces, group=mesh.group("pp"), microbatches=8, schedule="1f1b",
                    loss_fn=F.cross_entropy)
    loss = pipe.step(inputs, targets)   # forward + backward of the whole batch
    optimizer.step()                    # over this rank's pieces' parameters

Each rank holds its chunks (virtual stages `chunk * pp + rank`, or under the V-shaped
schedules stages `rank` and `2pp-1-rank`: dtrain.pipeline.schedules.Placement; a message
between two chunks of one rank is handed over without the network). The batch is cut into
micro-batches along dim 0: the first virtual stage reads `inputs`, the last computes
`loss_fn(output, targets)` per micro-batch, divided by their number, so the accumulated
gradients equal one backward of the whole batch's mean loss. The mean loss is returned
on every rank of the group.

Pieces that hold sharded gradients (ZeRO) are recognised by a protocol, not a type: a piece
with both `accumulated_grad(param)` (the unsharded gradient accumulated under `no_sync`, a
view to adjust in place) and `reduce_gradients()` (reduce what was accumulated, keep this
rank's shards) holds its gradients outside `param.grad`; its `group` is its data-parallel
group. With tied weights the pipeline runs every backward of such a piece under `no_sync`,
adds the other stage's gradient of a tied parameter to `accumulated_grad(param)`, then calls
`reduce_gradients()`. A piece with an `averaging` of its own (live replicas: a redo over
the survivors must not wait on a stage still waiting for this one's sends) is driven the
same way, tied weights or not. A piece with `grad_parts(is_split=, counted=)` (ZeRO,
DataParallel) gives its gradients to the clip that way (dtrain.data_parallel.clip).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from dtrain import comm
from dtrain.data_parallel import clip
from dtrain.data_parallel.clip import GradPart
from dtrain.errors import ConfigError
from dtrain.models.rows import weighted
from dtrain.pipeline import schedules
from dtrain.pipeline.p2p import Channels
from dtrain.pipeline.pieces import (
    Ahead,
    ExtraLoss,
    Tie,
    counted_elsewhere,
    hidden_for_loss,
    piece_in,
)
from dtrain.pipeline.schedules import Action, Placement
from dtrain.pipeline.split_backward import WeightGrads
from dtrain.timeline import span

_Piece = TypeVar("_Piece", bound=nn.Module)  # a pipeline piece, of whatever module class
_T = TypeVar("_T")

_TIED_TAG = 1



def averages_apart(piece: object) -> bool:
    """Whether `piece` averages over live replicas of its own choosing (its `averaging` set, as
    fault tolerance's live replicas do, dtrain.ft.live): it then reduces after the schedule,
    with `reduce_gradients()`, not inside its last backward, where a redo over the
    survivors would wait on stages still waiting for this one's sends."""
    return getattr(piece, "averaging", None) is not None


def holds_shards(piece: object) -> bool:
    """Whether `piece` keeps sharded gradients: it has both `accumulated_grad(param)` and
    `reduce_gradients()` (ZeRO does; DataParallel does not). See the module's docstring."""
    return (callable(getattr(piece, "accumulated_grad", None))
            and callable(getattr(piece, "reduce_gradients", None)))


_INFER_TAG = 1
"""Activations of `Pipeline.infer` (each message with its header), apart from the step's."""


SPANS = {"F": "forward", "B": "backward", "W": "weights"}
"""The timeline's name of each action (a zero-bubble schedule's W: "weights")."""


def _tag(kind: str, chunk: int) -> int:
    """Activations into chunk c travel on tag 2 + 2c, gradients on 3 + 2c."""
    return 2 + 2 * chunk + (kind == "grad")


class Pipeline:
    """This rank's part of a pipeline-parallel model and the schedule that drives it.

    Args:
        pieces: this rank's model pieces, one per chunk (a module or a list); piece c is
            virtual stage `c * pp + rank` (see `pieces_for`).
        group: the pipeline group (`mesh.group("pp")`), stages in rank order.
        microbatches: micro-batches per step; the batch must divide into them.
        schedule: "gpipe", "1f1b", "interleaved", or a zero-bubble one, each backward
            split in B and W (dtrain.pipeline.split_backward): "zb1p", and on two chunks
            per rank in a V "zbv" and "dualpipev".
        loss_fn: `loss_fn(output, target)` on the last stage, a mean over the micro-batch;
            a last piece that gives its loss the final hidden states
            (dtrain.pipeline.pieces.hidden_for_loss: a chunked loss) is asked for those.
        tied: parameters shared with another stage (say input embedding and output head):
            (this rank's parameter, the other stage's rank in `group`, or the parameter on
            this rank it is a twin of: `Tie`). Their gradients are summed across both after
            every step, as one shared parameter's would be.
        timeline: record (kind, micro, chunk, start, end) of every action of the last step
            in `self.events`, in seconds from the step's start; `start` is when its compute
            began, after any wait for a message (for bubble measurements and plots).
        extra_loss: `extra_loss(chunk)`, the loss this rank's piece of that chunk computed
            on the way in its last forward (a mixture of experts' balance loss:
            dtrain.pipeline.pieces.extra_loss_of), added to the model's: each stage
            backpropagates its own with the gradient from the stages after it, and the
            returned loss counts it.
        overlap: under "dualpipev", compute each pair's backward in a second thread while
            its forward computes, the backward's collectives (a MoE layer's all-to-all,
            tp's, ZeRO's) on the groups' twins (`dtrain.Mesh.second_lane()` makes them
            first), so one's communication runs under the other's compute. Off: a pair's
            halves run one after the other, as any schedule's actions.

    Raises:
        ConfigError: an unknown schedule, or micro-batches/chunks it cannot use.
    """

    def __init__(self, pieces: nn.Module | Sequence[nn.Module], group: comm.GroupLike = None,
                 microbatches: int = 1, schedule: str = "1f1b",
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 tied: Sequence[Tie] = (), timeline: bool = False,
                 extra_loss: ExtraLoss | None = None, overlap: bool = False) -> None:
        self.pieces = [pieces] if isinstance(pieces, nn.Module) else list(pieces)
        self.group = comm.resolve(group)
        self.pp, self.rank, self.chunks = self.group.size, self.group.rank, len(self.pieces)
        self.microbatches, self.schedule, self.loss_fn = microbatches, schedule, loss_fn
        self.extra_loss, self.overlap = extra_loss, overlap
        self._hidden = [hidden_for_loss(piece) for piece in self.pieces]
        """Per chunk: its piece gives `loss_fn` its final hidden states (a chunked loss)."""
        self._ahead = [found if found is not None and found.predicts_ahead else None
                       for found in map(piece_in, self.pieces)]
        """Per chunk: the last Piece of a model predicting ahead (multi-token prediction),
        given each micro-batch's tokens and targets, whose `ahead_loss` joins the loss."""
        self.actions = schedules.build(schedule, self.pp, self.rank, microbatches, self.chunks)
        self.place = Placement.of(schedule, self.pp, self.chunks)
        self._last_backward = {a.chunk: i for i, a in enumerate(self.actions)
                               if a.kind in "BW"}
        """Each chunk's last action making gradients (its piece reduces them there)."""
        self.tied = list(tied)
        # Sharded pieces (ZeRO) keep gradients as shards, not in param.grad. With tied
        # weights they accumulate every micro-batch without communication; the tied
        # gradients are then summed across stages, unsharded, before each piece reduces its
        # own (see holds_shards).
        self._defer = ((bool(self.tied) and any(holds_shards(p) for p in self.pieces))
                       or any(averages_apart(p) for p in self.pieces))
        self.timeline, self.events = timeline, []
        self.peak_live = 0
        self._micro_positions: list[torch.Tensor] | None = None  # this step's, if packed
        self._micro_in: list[torch.Tensor] | None = None  # this step's, where a chunk reads them
        self._weights: Sequence[float] | None = None
        first = next((p for piece in self.pieces for p in piece.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._channels = Channels(self.group, self.device)
        # zero-bubble schedules: each backward in B (the input's gradient) and W (the
        # weights'), the weights' products split (dtrain.pipeline.split_backward)
        self.keepers = [WeightGrads.install(p) for p in self.pieces] \
            if schedule in schedules.SPLIT else []
        if any(not keeper.installed for keeper in self.keepers):
            raise ConfigError(f"schedule {schedule!r} splits each backward at the linear layers' "
                              "products, and a piece of this rank has none: use '1f1b'")
        self._whole = {i for i, (a, b) in enumerate(zip(self.actions, self.actions[1:],
                                                        strict=False))
                       if self.keepers and a.kind == "B" and b.kind == "W"
                       and (a.micro, a.chunk) == (b.micro, b.chunk)}
        """Indices of the Bs whose own W comes next: one backward computes both."""
        self._plain = {(self.actions[i].micro, self.actions[i].chunk) for i in self._whole}
        """Their (micro-batch, chunk): autograd's own products, nothing split or kept."""

    # ------------------------------------------------------------------ placement
    def _stage(self, chunk: int) -> int:
        return self.place.stage(self.rank, chunk)

    def _is_first(self, chunk: int) -> bool:
        return self._stage(chunk) == 0

    def _is_last(self, chunk: int) -> bool:
        return self._stage(chunk) == self.place.stages - 1

    def _neighbour(self, chunk: int, step: int) -> tuple[int, int]:
        """(rank, chunk) of the stage `step` (+1 or -1) from this rank's `chunk`."""
        return self.place.holder(self._stage(chunk) + step)

    def _split(self, batch: torch.Tensor | None, what: str) -> list[torch.Tensor]:
        if batch is None:
            raise ConfigError(f"pipeline: this rank holds the {what} stage: pass its {what}s")
        if batch.shape[0] % self.microbatches:
            raise ConfigError(f"pipeline: a batch of {batch.shape[0]} does not split into "
                              f"{self.microbatches} micro-batches: make it a multiple")
        return list(batch.chunk(self.microbatches))

    def _needs(self, kind: str) -> bool:
        """Whether a chunk of this rank reads the micro-batches' "input"s (the first stage,
        and a last one predicting ahead) or their "target"s (the last stage)."""
        if kind == "input":
            return any(self._is_first(c) or self._ahead[c] is not None
                       for c in range(self.chunks))
        return any(self._is_last(c) for c in range(self.chunks))

    # ------------------------------------------------------------------ step
    def step(self, inputs: torch.Tensor | None = None,
             targets: torch.Tensor | None = None, positions: torch.Tensor | None = None,
             weights: Sequence[float] | None = None) -> torch.Tensor:
        """Forward and backward of the batch; gradients accumulate in the pieces'
        parameters. Returns the mean loss (a 0-d tensor) on every rank.

        Args:
            positions: rows of packed documents (dtrain.models.rows): each token's
                place in its document, the whole batch's, which every stage is given
                micro-batch by micro-batch (`Piece.forward`).
            weights: each micro-batch's loss weight in place of 1 / micro-batches (the
                mean over the targets of the batch, where micro-batches hold different
                numbers of targets: dtrain.layouts.pipeline).
        """
        return self._run(self.actions, inputs, targets, backward=True, positions=positions,
                         weights=weights)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor | None = None,
                 targets: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                 weights: Sequence[float] | None = None) -> torch.Tensor:
        """The mean loss of the batch, forwards only (`positions` and `weights` as
        `step` takes them)."""
        order = schedules.forward_only(self.pp, self.microbatches, self.chunks, self.place.v)
        return self._run(order, inputs, targets, backward=False, positions=positions,
                         weights=weights)

    @torch.no_grad()
    def infer(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The output of the whole model for `inputs` (token ids every rank holds alike),
        one forward through the stages in order, without micro-batches or a loss: on the
        last stage's rank; None on the others. Each call may have another shape
        (generation feeds a prompt, then one token at a time)."""
        out = None
        for chunk in sorted(range(self.chunks), key=self._stage):
            if self._is_first(chunk):
                x = inputs
            else:
                x = self._channels.recv_shaped(self._neighbour(chunk, -1)[0], _INFER_TAG)
            y = self.pieces[chunk](x)
            if self._is_last(chunk):
                out = y
            else:
                self._channels.send_shaped(y, self._neighbour(chunk, 1)[0], _INFER_TAG)
        return out

    def _run(self, actions: list[Action], inputs: torch.Tensor | None,
             targets: torch.Tensor | None, backward: bool,
             positions: torch.Tensor | None = None,
             weights: Sequence[float] | None = None) -> torch.Tensor:
        micro_in = self._micro_in = self._split(inputs, "input") if self._needs("input") \
            else None
        micro_tg = self._split(targets, "target") if self._needs("target") else None
        self._micro_positions = None if positions is None else self._split(positions,
                                                                           "position")
        self._weights = weights
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor,
                                                 torch.Tensor | None]] = {}
        self._total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.events, self.peak_live = [], 0
        self._origin = time.perf_counter()
        index = 0
        while index < len(actions):
            action = actions[index]
            if action.with_next and backward and self.overlap:
                self._pair(action, actions[index + 1], index, micro_in, micro_tg)
                if index + 1 in self._whole:
                    self._mark(actions[index + 2])
                index += 3 if index + 1 in self._whole else 2
                continue
            start, waited = time.perf_counter(), self._channels.waited
            if action.kind == "F":
                inp = self._input(action, micro_in, backward)
                out = self._timed(action, start, waited, functools.partial(
                    self._forward, action, inp, micro_tg, backward))
                self._send_output(action, out)
            elif action.kind == "B":
                grad = self._output_grad(action)
                inp = self._timed(action, start, waited,
                                  functools.partial(self._backward, action, grad, index))
                self._send_input_grad(action, inp)
                if index in self._whole:  # its W done within it: an empty span at its end
                    index += 1
                    self._mark(actions[index])
            else:
                self._timed(action, start, waited,
                            functools.partial(self._weights_of, action, index))
            index += 1
        self._channels.flush()
        if backward:
            self._sum_tied()
        return comm.all_reduce(self._total, group=self.group).float() / self.microbatches

    def _timed(self, action: Action, start: float, waited: float,
               compute: Callable[[], _T]) -> _T:
        """`compute()` as the action's span, and on the timeline from when its compute
        began (`start` plus the receives' wait since `waited`) to its end."""
        kind = SPANS[action.kind]
        with span(kind, kind, micro=action.micro, chunk=action.chunk):
            result = compute()
        if self.timeline:
            began = start + self._channels.waited - waited
            self.events.append((action.kind, action.micro, action.chunk,
                                began - self._origin, time.perf_counter() - self._origin))
        return result

    def _mark(self, action: Action) -> None:
        """An empty span on the timeline for `action`, done within the one before."""
        if self.timeline:
            now = self.events[-1][4]
            self.events.append((action.kind, action.micro, action.chunk, now, now))

    def _pair(self, f: Action, b: Action, index: int, micro_in, micro_tg) -> None:
        """DualPipeV's overlapped pair: both halves' messages received, then B computed in
        a second thread, its collectives on the second lane (dtrain.comm.second_lane),
        while F computes here; then both halves' messages sent."""
        inp = self._input(f, micro_in, True)
        grad = self._output_grad(b)
        failed: list[BaseException] = []
        done: list[torch.Tensor] = []

        def backward() -> None:
            try:
                with comm.second_lane():
                    done.append(self._timed(b, time.perf_counter(), self._channels.waited,
                                            lambda: self._backward(b, grad, index + 1)))
            except BaseException as exc:  # raised again on the pipeline's thread
                failed.append(exc)

        thread = threading.Thread(target=backward, name="dtrain-pipeline-backward")
        thread.start()
        try:
            out = self._timed(f, time.perf_counter(), self._channels.waited,
                              lambda: self._forward(f, inp, micro_tg, True))
        finally:
            thread.join()
        if failed:
            raise failed[0]
        self._send_output(f, out)
        self._send_input_grad(b, done[0])

    def _input(self, action: Action, micro_in, backward: bool) -> torch.Tensor:
        """The forward's input: the micro-batch on the first stage, else received."""
        chunk = action.chunk
        if self._is_first(chunk):
            return micro_in[action.micro]
        inp = self._channels.recv(self._neighbour(chunk, -1)[0], _tag("act", chunk))
        return inp.requires_grad_(backward and inp.is_floating_point())

    def _forward(self, action: Action, inp: torch.Tensor, micro_tg,
                 backward: bool) -> torch.Tensor:
        """The piece's output (the last stage's: its loss share), kept for the backward,
        the losses counted."""
        chunk = action.chunk
        hidden = self._hidden[chunk]  # the last piece's final hidden states, for the loss
        given: dict[str, torch.Tensor | bool | Ahead] = {"hidden": True} if hidden else {}
        if self._micro_positions is not None:
            given["positions"] = self._micro_positions[action.micro]
        weight = None if self._weights is None else self._weights[action.micro]
        ahead = self._ahead[chunk]
        if ahead is not None and backward and self._micro_in is not None:
            given["ahead"] = Ahead(self._micro_in[action.micro], micro_tg[action.micro], weight)
        with self._products(action):
            out = self.pieces[chunk](inp, **given)
        if self._is_last(chunk):
            loss = self.loss_fn(out, micro_tg[action.micro])
            # a chunked loss is finite without targets (0), so it carries its own zero;
            # the plain one (0 / 0 there) takes it from the logits
            out = loss / self.microbatches if weight is None else \
                weighted(loss, weight, loss if hidden else out)
            more = None if ahead is None else ahead.ahead_loss  # weighed as the loss is
            if more is not None:
                out = out + (more / self.microbatches if weight is None else more)
        extra = self._extra(chunk)
        for loss in ([out] if self._is_last(chunk) else []) + ([extra] if extra is not None
                                                                 else []):
            self._total += loss.detach().double() * self.microbatches
        if backward:
            self._saved[(action.micro, chunk)] = (inp, out, extra)
            self.peak_live = max(self.peak_live, len(self._saved))
        return out

    def _products(self, action: Action) -> contextlib.AbstractContextManager[None]:
        """Autograd's own linear products for a micro-batch whose W comes right after its
        B (dtrain.pipeline.split_backward.WeightGrads.plain), else nothing."""
        if (action.micro, action.chunk) in self._plain:
            return self.keepers[action.chunk].plain()
        return contextlib.nullcontext()

    def _send_output(self, action: Action, out: torch.Tensor) -> None:
        if not self._is_last(action.chunk):
            peer, into = self._neighbour(action.chunk, 1)
            self._channels.send(out, peer, _tag("act", into))

    def _extra(self, chunk: int) -> torch.Tensor | None:
        """The chunk's share of the extra loss of its last forward, per micro-batch (the
        loss is the micro-batches' mean), or None."""
        extra = self.extra_loss(chunk) if self.extra_loss is not None else None
        return None if extra is None else extra / self.microbatches

    def _quiet(self, chunk: int, index: int) -> contextlib.AbstractContextManager[None]:
        """The piece's `no_sync` for every action making gradients but its last of the
        step (its gradients are reduced then), and for all of a piece that reduces after
        the schedule; else nothing."""
        piece = self.pieces[chunk]
        deferred = self._defer and (holds_shards(piece) or averages_apart(piece))
        if hasattr(piece, "no_sync") and (deferred or index != self._last_backward[chunk]):
            return piece.no_sync()
        return contextlib.nullcontext()

    def _output_grad(self, action: Action) -> torch.Tensor | None:
        """The gradient of the backward's output, from the next stage (None on the last)."""
        if self._is_last(action.chunk):
            return None
        return self._channels.recv(self._neighbour(action.chunk, 1)[0],
                                   _tag("grad", action.chunk))

    def _backward(self, action: Action, grad: torch.Tensor | None, index: int
                  ) -> torch.Tensor:
        """B of the saved micro-batch (its weights' products deferred to W under a
        zero-bubble schedule, unless its W comes next: then both at once, as the last
        action making gradients where W would be); the input, its gradient filled."""
        chunk = action.chunk
        inp, out, extra = self._saved.pop((action.micro, chunk))
        whole = index in self._whole
        split = self.keepers[chunk].deferring(action.micro) if self.keepers and not whole \
            else self._products(action)
        with self._quiet(chunk, index + whole), split:
            if grad is None:
                (out if extra is None else out + extra).backward()
            elif extra is None:
                torch.autograd.backward(out, grad)
            else:  # the blocks' own loss joins the gradient from the stages after
                torch.autograd.backward([out, extra], [grad, torch.ones_like(extra)])
        return inp

    def _send_input_grad(self, action: Action, inp: torch.Tensor) -> None:
        if not self._is_first(action.chunk):
            peer, into = self._neighbour(action.chunk, -1)
            self._channels.send(inp.grad, peer, _tag("grad", into))

    def _weights_of(self, action: Action, index: int) -> None:
        with self._quiet(action.chunk, index):
            self.keepers[action.chunk].run(action.micro)

    def grad_parts(self, is_split: Callable[[nn.Parameter], bool] | None = None
                   ) -> list[GradPart]:
        """This rank's gradients as parts of the whole model's norm (dtrain.data_parallel.clip),
        after `step`: each piece's own `grad_parts` where it has them (ZeRO's shards are
        summed over "dp"), else its parameters' .grad; over "tp" too where `is_split(param)`.
        A tied parameter counts on the lower stage only."""
        elsewhere = counted_elsewhere(self.tied, self.rank)

        def counted(p: nn.Parameter) -> bool:
            return id(p) not in elsewhere

        parts: list[GradPart] = []
        seen: set[int] = set()  # a parameter two plain pieces share counts once
        for piece in self.pieces:
            if callable(getattr(piece, "grad_parts", None)):
                parts += piece.grad_parts(is_split=is_split, counted=counted)
                continue
            for p in piece.parameters():
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    split = is_split is not None and is_split(p)
                    parts.append(GradPart(p.grad, over=("tp",) if split else (),
                                          counted=counted(p)))
        return parts

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so the norm of the whole model's gradient (every stage's, a tied
        parameter counted once) is at most `max_norm`; returns that norm (collective over
        the pipeline group, and over the data-parallel group of sharded pieces). Pieces
        split by tensor parallelism need the tp group: use `grad_parts(is_split)` with
        dtrain.data_parallel.clip."""
        groups = {"pp": self.group}
        dp = next((piece.group for piece in self.pieces if holds_shards(piece)), None)
        if dp is not None:
            groups["dp"] = dp
        norm = clip.clip_grad_norm_(self.grad_parts(), max_norm, groups, self.device)
        return torch.tensor(norm, dtype=torch.float32, device=self.device)

    def _grad(self, param: nn.Parameter) -> tuple[torch.Tensor, bool]:
        """`param`'s accumulated gradient (a sharded piece's unsharded one, to adjust in
        place), and whether it is a sharded piece's."""
        sharded = next((p for p in self.pieces if holds_shards(p)
                        and any(q is param for q in p.parameters())), None)
        if sharded is not None:
            return sharded.accumulated_grad(param), True
        return (param.grad if param.grad is not None else torch.zeros_like(param)), False

    def _set_grad(self, param: nn.Parameter, total: torch.Tensor) -> None:
        grad, sharded = self._grad(param)
        if sharded:
            grad.copy_(total)
        else:
            param.grad = total

    @torch.no_grad()
    def _sum_tied(self) -> None:
        """Both holders of a tied parameter end with the sum of their gradients, added in
        stage order on both so they stay bitwise equal."""
        for param, peer in self.tied:
            mine = self._grad(param)[0]
            if isinstance(peer, nn.Parameter):  # a twin on this rank: the later stage's
                total = self._grad(peer)[0] + mine
                self._set_grad(peer, total)
                self._set_grad(param, total.clone())
                continue
            theirs = torch.empty_like(mine)
            handle = comm.send(mine.contiguous(), peer, self.group, async_op=True,
                               tag=_TIED_TAG)
            comm.recv(theirs, peer, self.group, tag=_TIED_TAG)
            handle.wait()
            self._set_grad(param, mine + theirs if self.rank < peer else theirs + mine)
        if self._defer:
            for piece in self.pieces:
                if holds_shards(piece) or averages_apart(piece):
                    piece.reduce_gradients()


@torch.no_grad()
def full_state_dict(whole: nn.Module, mine: Sequence[nn.Module],
                    group: comm.GroupLike = None) -> dict[str, torch.Tensor]:
    """The whole model's state_dict on every rank of the pipeline group (collective).

    Every rank builds the whole model and trains only its pieces; each name is held by one
    rank (a tied weight appears under its own name on each side), which contributes it
    while the others contribute zeros, and an all-reduce sums them exactly.
    """
    held = {name for piece in mine for name in piece.state_dict()}
    out = {}
    for name, tensor in whole.state_dict().items():
        mine_or_zero = tensor.clone() if name in held else torch.zeros_like(tensor)
        out[name] = comm.all_reduce(mine_or_zero, group=group)
    return out


def pieces_for(pieces: Sequence[_Piece], group: comm.GroupLike = None,
               schedule: str = "1f1b") -> list[_Piece]:
    """This rank's pieces of a model cut into `pp * v` pieces: piece `c * pp + rank` for
    each chunk c (one chunk per rank when there are pp pieces), or under a V-shaped
    `schedule` pieces `rank` and `2pp-1-rank` (dtrain.pipeline.schedules.Placement)."""
    g = comm.resolve(group)
    if len(pieces) % g.size:
        raise ConfigError(f"{len(pieces)} pieces do not divide among pp={g.size} ranks: cut "
                          f"the model into a multiple of {g.size}")
    place = Placement.of(schedule, g.size, len(pieces) // g.size)
    return [pieces[place.stage(g.rank, c)] for c in range(place.chunks)]
