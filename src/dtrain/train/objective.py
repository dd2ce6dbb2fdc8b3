"""Direct preference optimization (DPO, Rafailov et al., 2023): the loss of preference
pairs, each a chosen and a rejected response to one prompt.

Every Holding computes a batch's loss through its `objective` (dtrain.layouts.holding):
by default the model's own, next-token cross-entropy on the data's targets (`sft`).
`Preference` is `[objective] kind = "dpo"`: the batch's rows come in pairs, chosen at
even rows and rejected at odd ones (dtrain.data.preference keeps them together on one
rank and micro-batch), each row's targets its response's tokens. For each row,

    logp = sum over the response's tokens of log p(token | what precedes it)

under the policy (the model being trained) and under the reference (the run's starting
weights, without gradient); then, as TRL's sigmoid loss, with conservative DPO's label
smoothing ls (which TRL 1.x's sigmoid loss no longer takes):

    delta = (logp_chosen - logp_rejected) - (ref_chosen - ref_rejected)
    loss  = mean over pairs of  -(1 - ls) log sigmoid(beta delta) - ls log sigmoid(-beta delta)

At the first step the policy is the reference, delta is 0 and the loss is ln 2. A rank's
loss is the mean over its pairs; every rank holds as many, so the step's mean over ranks
and micro-batches is the mean over all its pairs.

The reference: with LoRA, the same model with its adapters off (dtrain.adapters.lora.
disabled: no second copy of the weights); without, a frozen copy of this rank's
parameters taken as training starts, swapped in for the reference's forward
(torch.func.functional_call), laid out as the policy is.

Under tensor parallelism the logits are split by vocabulary: the log-probabilities come
from the vocab-parallel cross-entropy, without gathering them.

Metrics (TRL's): the rewards beta x (logp - ref) of chosen and rejected responses, their
margin, the share of pairs whose chosen reward is the higher (reward accuracy), and the
policy's log-probabilities of each, over the step's pairs on every data-parallel rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dtrain import comm
from dtrain.adapters.lora import disabled
from dtrain.config.objective import ObjectiveConfig
from dtrain.data.sequences import Batch
from dtrain.tensor_parallel.loss import vocab_parallel_cross_entropy

METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy",
           "logp_chosen", "logp_rejected")
"""What `Preference.take` reports, means over the pairs."""


def _logits(output: torch.Tensor) -> torch.Tensor:
    logits: torch.Tensor = getattr(output, "logits", output)  # a transformers output's
    return logits


class Preference:
    """The DPO loss of a batch of pairs (see the module doc), and its metrics.

    Args:
        cfg: the `[objective]` section (beta, label_smoothing).
        module: what the Holding runs (its `module`): the reference's weights are its own
            (adapters off) or a copy of them taken here.
        adapted: whether the model has LoRA adapters (the reference: them off).
        vocab_size: the whole vocabulary; logits narrower than it are tp's blocks.
        tp: the tensor-parallel group the vocabulary is split over.
    """

    def __init__(self, cfg: ObjectiveConfig, module: nn.Module, adapted: bool, vocab_size: int,
                 tp: comm.GroupLike) -> None:
        self.beta, self.smoothing = cfg.beta, cfg.label_smoothing
        self.vocab_size, self.tp = vocab_size, tp
        self.frozen = None if adapted else {
            name: p.detach().clone() for name, p in module.named_parameters()}
        self.totals: dict[bool, torch.Tensor] = {}  # by training: sums of METRICS, pairs

    def reference(self, module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The reference's forward: `module` with its adapters off, or with the copy of
        its starting weights swapped in."""
        frozen = self.frozen
        if frozen is None:
            def base(x: torch.Tensor) -> torch.Tensor:
                with disabled(module):
                    return _logits(module(x))
            return base
        return lambda x: _logits(torch.func.functional_call(module, frozen, (x,)))

    def logps(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each row's summed log-probability of its targets (ignored positions add 0)."""
        if logits.shape[-1] != self.vocab_size:  # this rank's block of the vocabulary
            nll = vocab_parallel_cross_entropy(logits, targets, self.tp, reduction="none")
        else:
            nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                  reduction="none").view_as(targets)
        return -nll.float().sum(-1)

    def __call__(self, module: nn.Module, batch: Batch | tuple[torch.Tensor, torch.Tensor]
                 ) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            ref = self.logps(self.reference(module)(x), y)
        logps = self.logps(_logits(module(x)), y)
        chosen, rejected = logps[0::2], logps[1::2]
        delta = (chosen - rejected) - (ref[0::2] - ref[1::2])
        losses = (-(1 - self.smoothing) * F.logsigmoid(self.beta * delta)
                  - self.smoothing * F.logsigmoid(-self.beta * delta))
        self._note(module.training, chosen.detach(), rejected.detach(), ref)
        return losses.mean()

    def _note(self, training: bool, chosen: torch.Tensor, rejected: torch.Tensor,
              ref: torch.Tensor) -> None:
        good = self.beta * (chosen - ref[0::2])
        bad = self.beta * (rejected - ref[1::2])
        sums = torch.stack([good.sum(), bad.sum(), (good - bad).sum(), (good > bad).sum(),
                            chosen.sum(), rejected.sum(), good.new_tensor(len(good))])
        before = self.totals.get(training)
        self.totals[training] = sums if before is None else before + sums

    def take(self, training: bool, group: comm.GroupLike, device: torch.device
             ) -> dict[str, float]:
        """The means of METRICS over the pairs since the last take (of training steps or
        of held-out passes), over `group`'s ranks (collective: every rank calls it);
        nothing when no pair was seen."""
        sums = self.totals.pop(training, None)
        if sums is None:
            return {}
        sums = comm.all_reduce(sums.to(device, torch.float64), group=group)
        pairs = float(sums[-1])
        return {name: round(float(v) / pairs, 6) for name, v in zip(METRICS, sums[:-1],
                                                                     strict=True)}

