"""The data formats `[data] format` names, and which tokens each can make targets.

Torch is not imported here: `dtrain data prepare` reads these before any worker starts.
"""

from __future__ import annotations

from enum import Enum

from dtrain.data.chat import TrainOn
from dtrain.data.records import Kind
from dtrain.errors import ConfigError


class Format(Enum):
    """How data.path is read."""

    TEXT = "text"
    JSONL = "jsonl"
    CHAT = "chat"
    PROMPT_COMPLETION = "prompt_completion"
    PREFERENCE = "preference"
    TOKENS = "tokens"

    @property
    def records(self) -> Kind | None:
        """The kind of record a line holds, for the formats with loss masks."""
        return {Format.CHAT: Kind.CHAT, Format.PROMPT_COMPLETION: Kind.PROMPT_COMPLETION,
                Format.PREFERENCE: Kind.PREFERENCE}.get(self)

    @classmethod
    def parse(cls, value: str, key: str = "data.format") -> Format:
        """The format named `value`.

        Raises:
            ConfigError: no format has that name.
        """
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(f.value) for f in cls)
            raise ConfigError(f"{key} = {value!r} is not a data format: give one of {names}"
                              ) from None



def train_on_of(fmt: Format, value: str, key: str = "data.train_on") -> TrainOn:
    """data.train_on for `fmt`: auto is the assistant's turns for chat, the completion
    for prompt_completion, the responses for preference (nothing else: DPO compares the
    responses' log-probabilities), every token for the rest.

    Raises:
        ConfigError: an unknown value, or one the format has no such tokens for.
    """
    if value not in ("auto", "assistant", "completion", "all"):
        raise ConfigError(f"{key} = {value!r} is unknown: give auto, assistant, "
                          "completion or all")
    if fmt is Format.CHAT:
        return "assistant" if value == "auto" else value  # type: ignore[return-value]
    if fmt is Format.PREFERENCE:
        if value not in ("auto", "completion"):
            raise ConfigError(f"{key} = {value!r} does not apply to preference data, whose "
                              "targets are the responses (chosen and rejected): remove it")
        return "completion"
    if fmt is Format.PROMPT_COMPLETION:
        if value == "assistant":
            raise ConfigError(f'{key} = "assistant" needs chat data: for '
                              'prompt_completion give "completion" or "all"')
        return "completion" if value == "auto" else value  # type: ignore[return-value]
    if value not in ("auto", "all"):
        where = ("its targets were chosen by `dtrain data prepare --train-on`"
                 if fmt is Format.TOKENS else "every token of text is a target")
        raise ConfigError(f"{key} = {value!r} needs chat or prompt_completion data, "
                          f"not data.format = {fmt.value!r} ({where}): remove it or set it to "
                          '"all"')
    return "all"
