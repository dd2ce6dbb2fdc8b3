"""A next-token loss that never holds the logits of every token at once (`[train] loss`).

    loss = linear_cross_entropy(hidden, head.weight, head.bias, targets, chunk=1024)
    apply(model, "chunked", 1024)        # the model's training loss computed that way

The plain loss multiplies the final hidden states by the output head for every token at
once: N x V logits, their log-softmax kept for backward (N x V more) and in backward their
gradient (N x V again). At Llama 3's vocabulary of 128K, 4 x 8192 tokens make 16 GiB of
fp32 logits per copy. Here the tokens go `chunk` at a time: for each chunk the forward
computes its logits (chunk x V), their softmax in place, its loss, and right away what the
chunk gives the gradients: its rows of the hidden states' gradient (an N x d buffer), and
its share of the head's weight and bias gradients (summed over the chunks in fp32). Only
those gradients are kept; backward scales them by the incoming gradient. One chunk's
logits at most exist at any time: what lives through the step is the size of the hidden
states plus the size of the head, what comes and goes one chunk's logits.

Why the gradients in forward (as Liger-Kernel's fused linear cross-entropy and Apple's
cut-cross-entropy do) rather than each chunk's logits computed again in backward
(torch.utils.checkpoint over the chunks): the memory is the same, and the head is
multiplied three times (logits, the hidden states' gradient, the weight's) instead of
four, the head being the largest product of a large-vocabulary model; under tensor
parallelism the softmax's all-reduces run once instead of twice. The cost: forward does
backward's work, wasted when no backward follows; so without autograd (evaluation,
`torch.no_grad`) only the loss is computed.

The vocabulary may be split across ranks (tensor parallelism's column-parallel head,
dtrain.tensor_parallel.loss): each rank holds its block of the head's rows, the softmax's
maximum, its sum of exponentials and the target's logit are all-reduced per chunk through
a `VocabularySplit`, and each rank's gradient of the hidden states is its block's share,
summed over the group by the caller (Megatron's copy-to-group before the head).

Which models (`apply`): dtrain's GPT and Llama and the Hugging Face families whose logits
are `lm_head(final hidden states)` (dtrain.models.hf.FAMILIES), whose head is a plain
linear layer (or its column-parallel split) and whose loss is dtrain's cross-entropy
(`CrossEntropy`, or its vocab-parallel form). It is the training loss only: a forward
without targets (generation, DPO's log-probabilities, `infer`) still returns logits, and a
forward with targets returns `(None, loss)` (no logits exist to return).
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from dtrain.errors import ConfigError
from dtrain.graph_break import graph_break

LossKind = Literal["plain", "chunked", "auto"]
"""`[train] loss`: the logits of every token at once, chunk by chunk, or chunk by chunk
from `AUTO_VOCABULARY` token ids on (where the model can)."""

AUTO_VOCABULARY = 32000
"""`loss = "auto"` chunks the loss of a model with at least this many token ids (Llama 2's
and Mistral's 32000, GPT-2's 50257, Llama 3's 128256, Qwen's 151936): from there on the
plain loss's three fp32 copies of the logits (384 KB a token at 32000, 1.5 MB at 128256)
are a large share of what a step holds per token (Llama 3.2 1B's blocks keep about 1.1 MB
a token for backward in bf16), or more than all of it. Below it (dtrain's byte
vocabulary, 256) they are small, and one product over all tokens is the fastest."""

DEFAULT_CHUNK = 1024
"""Tokens per chunk: at a 128K vocabulary one chunk's fp32 logits are 0.5 GiB (against
16 GiB for 4 x 8192 tokens at once), and 1024 rows keep the head's products large enough
to run at a GPU's full rate."""


class VocabularySplit(Protocol):
    """How this rank's block of the vocabulary meets the others' in the softmax."""

    def first(self, width: int) -> int:
        """The token id of this block's first row, the blocks being `width` rows each."""

    def all_max(self, x: torch.Tensor) -> None:
        """`x` replaced, in place, by its elementwise maximum over the blocks."""

    def all_sum(self, x: torch.Tensor) -> None:
        """`x` replaced, in place, by its sum over the blocks."""


class WholeVocabulary:
    """The whole vocabulary on this rank: nothing to meet."""

    def first(self, width: int) -> int:
        return 0

    def all_max(self, x: torch.Tensor) -> None:
        return None

    def all_sum(self, x: torch.Tensor) -> None:
        return None


WHOLE = WholeVocabulary()


def softmax_cross_entropy_(z: torch.Tensor, targets: torch.Tensor, split: VocabularySplit,
                           ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cross-entropy of each row of fp32 logits `z` (rows, this block's width), which
    it overwrites with their softmax (over the whole vocabulary, every block's).

        loss = log(sum_v exp(z_v - m)) - (z_target - m),   m = max_v z_v

    needs three numbers per row from across the blocks: the maximum, the sum of
    exponentials and the target's logit (only the block holding it has it).

    Returns (each row's loss, 0 where the target is `ignore_index`; each row's target as
    an index into this block, 0 where it is elsewhere; whether this block holds the row's
    target, False where it is ignored).
    """
    width = z.shape[-1]
    first = split.first(width)
    top = z.max(dim=-1).values
    split.all_max(top)
    z.sub_(top.unsqueeze(-1))
    ignored = targets == ignore_index
    here = (targets >= first) & (targets < first + width) & ~ignored
    local = (targets - first).masked_fill(~here, 0)
    picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
    z.exp_()
    sums = torch.stack([z.sum(dim=-1), picked])
    split.all_sum(sums)
    total, picked = sums.unbind(0)
    z.div_(total.unsqueeze(-1))
    return (total.log() - picked).masked_fill(ignored, 0.0), local, here


def softmax_to_gradient_(probs: torch.Tensor, local: torch.Tensor, here: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor:
    """`probs` (rows, width), the softmax `softmax_cross_entropy_` left, made in place the
    gradient of the rows' losses times `scale` (per row; 0 for an ignored target):
    (softmax - onehot(target)) * scale. Returns `probs`."""
    probs.scatter_add_(-1, local.unsqueeze(-1), -here.unsqueeze(-1).to(probs.dtype))
    return probs.mul_(scale.unsqueeze(-1))


class _ChunkedCtx(FunctionCtx):
    """_LinearCrossEntropy's ctx as its forward fills it (torch types a ctx as a bare
    FunctionCtx)."""

    needs_input_grad: tuple[bool, ...]
    saved_tensors: tuple[torch.Tensor, ...]
    kept: tuple[bool, bool, bool]
    count: torch.Tensor
    dtypes: tuple[torch.dtype, torch.dtype]


def _chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            targets: torch.Tensor, chunk: int, ignore_index: int, split: VocabularySplit,
            wants: tuple[bool, bool, bool]
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                       torch.Tensor | None]:
    """The sum of the rows' losses, and the gradients of that sum `wants` names (of the
    hidden states, the weight, the bias; the weight's and bias's in fp32), chunk by chunk:
    (sum, grad_hidden, grad_weight, grad_bias), None where not wanted."""
    wants_hidden, wants_weight, wants_bias = wants
    grad_hidden = torch.empty_like(hidden) if wants_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
        if wants_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
        if wants_bias else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        h, t = hidden[rows], targets[rows]
        z = F.linear(h, weight, bias).float()  # a chunk's logits: the largest tensor here
        losses, local, here = softmax_cross_entropy_(z, t, split, ignore_index)
        total += losses.sum()
        if not any(wants):
            continue
        counted = (t != ignore_index).to(z.dtype)
        grad = softmax_to_gradient_(z, local, here, counted).to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden[rows] = grad.mm(weight)
        if grad_weight is not None:
            grad_weight.add_(grad.t().mm(h.to(weight.dtype)))
        if grad_bias is not None:
            grad_bias.add_(grad.sum(0))
        del z, grad  # before the next chunk's logits: one chunk's alive at a time
    return total, grad_hidden, grad_weight, grad_bias


class _LinearCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of `targets` under logits `hidden @ weight^T + bias`, chunk
    by chunk: forward computes the loss and its gradients at once (`_chunks`) and keeps
    the gradients alone; backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx: _ChunkedCtx, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, targets: torch.Tensor, chunk: int,
                ignore_index: int, split: VocabularySplit) -> torch.Tensor:
        wants = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                 bias is not None and ctx.needs_input_grad[2])
        total, *grads = _chunks(hidden, weight, bias, targets, chunk, ignore_index, split,
                                wants)
        ctx.save_for_backward(*(g for g in grads if g is not None))
        ctx.kept = wants
        ctx.count = (targets != ignore_index).sum().clamp(min=1)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / ctx.count

    @staticmethod
    def backward(ctx: _ChunkedCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scale = grad / ctx.count
        hidden_dtype, weight_dtype = ctx.dtypes
        saved = iter(ctx.saved_tensors)
        grad_hidden, grad_weight, grad_bias = (
            (next(saved) * scale).to(dtype) if kept else None for kept, dtype in
            zip(ctx.kept, (hidden_dtype, weight_dtype, weight_dtype), strict=True))
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


@graph_break
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, targets: torch.Tensor,
                         chunk: int = DEFAULT_CHUNK, ignore_index: int = -100,
                         split: VocabularySplit = WHOLE) -> torch.Tensor:
    """The mean cross-entropy of `targets` under the logits `hidden @ weight^T + bias`,
    computed `chunk` tokens at a time: equal to
    `F.cross_entropy(F.linear(hidden, weight, bias), targets)` (and so are its
    gradients), holding one chunk's logits at most. Runs eagerly under torch.compile (a
    loop of large products, nothing to fuse).

    Args:
        hidden: the final hidden states, (..., d); under a split vocabulary each rank's
            whole (their gradient is this block's share: sum it over the group).
        weight: the head, (V, d), or this rank's block of its rows (V / ranks, d).
        bias: the head's bias (V,) or its block, or None.
        targets: token ids (...), `ignore_index` where no loss is taken (loss masks,
            padding); the mean is over the others, 0 when there are none.
        split: how the vocabulary is split across ranks (WHOLE: not at all).

    Raises:
        ValueError: `chunk` below 1, or targets that do not match the hidden states.
    """
    if chunk < 1:
        raise ValueError(f"chunk = {chunk}: a chunk holds at least one token")
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat = targets.reshape(-1)
    if flat.shape[0] != rows.shape[0]:
        raise ValueError(f"{flat.shape[0]} targets for {rows.shape[0]} hidden states")
    if not torch.is_grad_enabled():  # no backward to come: the loss alone
        total, *_ = _chunks(rows, weight, bias, flat, chunk, ignore_index, split,
                            (False, False, False))
        return total / (flat != ignore_index).sum().clamp(min=1)
    loss: torch.Tensor = _LinearCrossEntropy.apply(rows, weight, bias, flat, chunk,
                                                   ignore_index, split)
    return loss


def plain_head(head: nn.Module, wanted: type[nn.Module] = nn.Linear) -> str | None:
    """Why the logits of `head` are not `F.linear(x, head.weight, head.bias)` of a
    `wanted` layer (a LoRA adapter beside it, a subclass computing more, another module),
    None when they are."""
    if type(head) is wanted and not hasattr(head, "lora_A"):
        return None
    adapted = " (adapted by LoRA)" if hasattr(head, "lora_A") else ""
    return (f"the output head is a {type(head).__name__}{adapted}, whose logits are not "
            f"its weight's product alone")


@runtime_checkable
class ChunkedLoss(Protocol):
    """A loss module that can also compute itself from the final hidden states and the
    head, chunk by chunk: `CrossEntropy`, and tensor parallelism's vocab-parallel one
    (dtrain.tensor_parallel.loss)."""

    def refusal(self, head: nn.Module) -> str | None:
        """Why it cannot over `head` (a few words for an error), None when it can."""

    def chunked(self, hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        """The loss of `targets` under `head(hidden)`, `chunk` tokens at a time.

        Raises:
            ConfigError: `refusal(head)` says why not.
        """


class CrossEntropy(nn.CrossEntropyLoss):
    """nn.CrossEntropyLoss (the mean over targets that are not -100), which can also be
    computed from the hidden states and an nn.Linear head, chunk by chunk
    (`linear_cross_entropy`). Tensor parallelism swaps it for the vocab-parallel loss as
    any nn.CrossEntropyLoss."""

    def refusal(self, head: nn.Module) -> str | None:
        if self.weight is not None or self.label_smoothing or self.reduction != "mean":
            return "the loss has class weights, label smoothing or a reduction other than mean"
        return plain_head(head)

    def chunked(self, hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        why = self.refusal(head)
        if why is not None:
            raise ConfigError(f"train.loss = \"chunked\": {why}: use train.loss = \"plain\"")
        assert isinstance(head, nn.Linear)  # refusal checked it
        return linear_cross_entropy(hidden, head.weight, head.bias, targets, chunk,
                                    self.ignore_index)


@runtime_checkable
class ChunkableLM(Protocol):
    """A language model whose loss can be computed chunk by chunk: its logits are its
    output head applied to its final hidden states, and `loss_chunk` says how it computes
    its loss (dtrain's GPT and Llama, and dtrain.models.hf.HFCausalLM)."""

    loss_fn: nn.Module
    loss_chunk: int
    """Tokens per chunk of its training loss; 0: the plain loss (every token's logits)."""

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The last block's output -> the head's input (after the final norm)."""

    def output_head(self) -> nn.Module | None:
        """The module mapping final hidden states to logits; None where the model makes
        its logits in a way dtrain does not know as that."""


def chunked_loss(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor
                 ) -> torch.Tensor:
    """`model`'s loss of `targets` from its final hidden states, `model.loss_chunk` tokens
    at a time (its forward, or a pipeline's last stage).

    Raises:
        ConfigError: the model cannot (`why_not_chunked`).
    """
    why = why_not_chunked(model)
    if why is not None:
        raise ConfigError(f"train.loss = \"chunked\": {why}: use train.loss = \"plain\"")
    assert isinstance(model, ChunkableLM)  # checked by why_not_chunked, as the rest
    head, loss_fn = model.output_head(), model.loss_fn
    assert head is not None and isinstance(loss_fn, ChunkedLoss)
    return loss_fn.chunked(hidden, head, targets, model.loss_chunk)


def why_not_chunked(model: nn.Module) -> str | None:
    """Why `model`'s loss cannot be computed chunk by chunk (a few words), None if it can."""
    if not isinstance(model, ChunkableLM):
        return f"{type(model).__name__} computes its own loss"
    head = model.output_head()
    if head is None:
        return (f"{type(model).__name__}'s logits are not a head on its final hidden states "
                "that dtrain knows")
    if not isinstance(model.loss_fn, ChunkedLoss):
        return f"its loss_fn is a {type(model.loss_fn).__name__}, not dtrain's CrossEntropy"
    return model.loss_fn.refusal(head)


def apply(model: nn.Module, kind: LossKind, chunk: int = DEFAULT_CHUNK) -> str:
    """Make `model` compute its training loss as `kind` says (`[train] loss`): "plain",
    "chunked" (`chunk` tokens at a time), or "auto" (chunked where the model can and its
    vocabulary has AUTO_VOCABULARY ids or more). Applying it again replaces the choice.
    Call it on the whole model before tensor parallelism splits its head.

    Returns the banner's words for a chunked loss ("" for the plain one).

    Raises:
        ConfigError: "chunked" for a model that cannot (a custom module, a LoRA-adapted
            head, ...), in one line naming the reason.
    """
    why = why_not_chunked(model)
    if kind == "chunked" and why is not None:
        raise ConfigError(f"train.loss = \"chunked\": {why}: use train.loss = \"plain\"")
    if why is not None:  # "plain", or "auto" where the model cannot
        if isinstance(model, ChunkableLM):
            model.loss_chunk = 0
        return ""
    assert isinstance(model, ChunkableLM)  # why_not_chunked says so
    vocab = int(getattr(model.output_head(), "out_features", 0))
    chunked = kind == "chunked" or (kind == "auto" and vocab >= AUTO_VOCABULARY)
    model.loss_chunk = chunk if chunked else 0
    return f"chunked loss ({chunk} tokens a chunk)" if chunked else ""
