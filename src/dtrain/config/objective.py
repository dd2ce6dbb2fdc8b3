"""The `[objective]` section: what a run's loss is.

    [objective]  kind = "dpo", beta = 0.1

`sft` (the default) is next-token cross-entropy on the targets the data marks (every
token of text, the assistant's or completion's tokens of chat and prompt/completion
data). `dpo` is direct preference optimization (Rafailov et al., 2023) on preference
pairs (`[data] format = "preference"`): the loss is -log sigmoid(beta x the policy's
log-ratio of chosen over rejected less the reference's), with conservative DPO's label
smoothing (dtrain.train.objective computes it).

It is the Trainer's (dtrain.train), defined here, below it, so the config's checks that
span sections can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.adapters.config import AdapterConfig
from dtrain.data.config import DataConfig
from dtrain.errors import ConfigError
from dtrain.mesh.config import ParallelConfig


@dataclass
class ObjectiveConfig:
    kind: Literal["sft", "dpo"] = "sft"
    """sft: next-token cross-entropy on the data's targets; dpo: preference pairs."""
    beta: float = 0.1
    """DPO's beta: how far the policy may move from the reference (TRL's beta)."""
    label_smoothing: float = 0.0
    """DPO's label smoothing: the share of pairs taken to be mislabeled (conservative DPO,
    Mitchell 2023: TRL's sigmoid loss before 1.0; TRL 1.x's sigmoid loss ignores it)."""
    reference: Literal["base"] = "base"
    """DPO's reference model: the run's starting weights. With LoRA, the base with the
    adapters off (no second copy of the weights); without, a frozen copy of this rank's
    parameters, taken as training starts."""

    def check(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"objective.beta = {self.beta} must be above 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"objective.label_smoothing = {self.label_smoothing} must be in "
                              "[0, 0.5)")


def check_objective(objective: ObjectiveConfig, data: DataConfig, adapter: AdapterConfig,
                    parallel: ParallelConfig) -> None:
    """The objective against the data and the layout.

    Raises:
        ConfigError: dpo on data that is not preference pairs (or pairs under sft), dpo
            with packing other than padding, or dpo in a layout it does not take yet
            (pipeline, context parallelism; ZeRO-3 without LoRA).
    """
    pairs = data.format == "preference"
    if objective.kind == "sft" and pairs:
        raise ConfigError('data.format = "preference" is pairs to prefer one of, not text to '
                          'learn: set objective.kind = "dpo"')
    if objective.kind != "dpo":
        return
    if not pairs:
        raise ConfigError(f'objective.kind = "dpo" needs preference pairs: set data.format = '
                          f'"preference" (records with prompt, chosen and rejected), not '
                          f'{data.format!r}')
    if data.packing in ("stream", "block_causal"):
        raise ConfigError(f'objective.kind = "dpo" with data.packing = {data.packing!r}: each '
                          'response is its own padded row; set data.packing = "pad" (or "auto")')
    layout = {"parallel.pp > 1": parallel.pp > 1, "parallel.cp > 1": parallel.cp > 1,
              "parallel.zero = 3 without LoRA": parallel.zero == 3 and adapter.kind == "none"}
    for what, given in layout.items():
        if given:
            raise ConfigError(f'objective.kind = "dpo" with {what} is not supported yet (data '
                              'parallel, ZeRO and tensor parallelism are; ZeRO-3 with '
                              '[adapter] kind = "lora")')
