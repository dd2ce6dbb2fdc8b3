"""Conversations and prompt/completion pairs as token ids with a loss mask.

    template = ChatTemplate.find(data.tokenizer, data.chat_template)
    ids, targets = encode_chat(messages, template, tokenizer, train_on="assistant")

A conversation (`[{"role": "user", "content": "..."}, ...]`, the OpenAI and Hugging Face
form) is rendered by the tokenizer's own chat template, the Jinja text of its
`tokenizer_config.json` (or `chat_template.jinja`) beside `tokenizer.json`, with the same
environment transformers renders it in (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `tojson`, `strftime_now`, `bos_token` and `eos_token`). The rendered
text is tokenized whole, special tokens recognised, no others added: exactly what
`tokenizer.apply_chat_template(messages, tokenize=True)` gives.

Which tokens are targets (`train_on`):
- "assistant": every assistant turn, from just after the generation prompt the template
  writes before it (`add_generation_prompt=True`) to the end of the turn, the template's
  end-of-turn token included and trailing whitespace excluded. The span is found by
  rendering the conversation up to the turn with a generation prompt, and through the
  turn: the difference is the turn, whatever the template's markup. A template with
  `{% generation %}` blocks gets the same tokens transformers marks with
  `return_assistant_tokens_mask=True` (tests/data/test_chat.py checks it).
- "completion": the last assistant turn only (a conversation's answer; for
  prompt/completion pairs, the completion).
- "all": every token.
A template that renders earlier turns differently once later ones follow (one that drops
past reasoning, say) cannot be cut this way and is refused with the conversation named.

A prompt/completion pair of strings is `prompt + completion` tokenized apart (no template)
with the end-of-text token after it; the targets are the completion and that token
("completion") or all of it ("all"). A pair whose prompt and completion are lists of
messages is the conversation prompt + completion, the completion's turns its answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    import jinja2

    from dtrain.data.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a message may have."""
TrainOn = Literal["assistant", "completion", "all"]
Message = dict[str, str]
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
FIX = "[data] chat_template"


def _environment() -> jinja2.Environment:
    """The Jinja environment chat templates are written for (as transformers builds it)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks an assistant's tokens for
        transformers; here its body renders as is (the turn is found by rendering)."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
            next(parser.stream)
            return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json keeps it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def tokenizer_config(tokenizer: str) -> dict[str, object]:
    """The `tokenizer_config.json` beside the tokenizer.json `tokenizer` names, {} for the
    bytes tokenizer or where there is none."""
    if not tokenizer or tokenizer == "bytes":
        return {}
    file = Path(tokenizer).parent / TOKENIZER_CONFIG
    if not file.is_file():
        return {}
    config = json.loads(file.read_text())
    return config if isinstance(config, dict) else {}


def eos_text(tokenizer: str) -> str:
    """The text of the end-of-sequence token `tokenizer_config.json` names (transformers'
    `tokenizer.eos_token`), "" where it names none."""
    return _token_text(tokenizer_config(tokenizer).get("eos_token"))


@dataclass
class ChatTemplate:
    """A chat template and the special tokens it may name.

    Attributes:
        source: the Jinja text.
        bos_token, eos_token: the texts `bos_token` and `eos_token` stand for.
        origin: where it came from, for messages.
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""
    origin: str = FIX

    def __post_init__(self) -> None:
        import jinja2

        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"the chat template of {self.origin} does not parse (line "
                              f"{exc.lineno}: {exc.message}): fix it or give {FIX}") from exc

    @classmethod
    def find(cls, tokenizer: str, given: str = "") -> ChatTemplate:
        """The chat template `given` ([data] chat_template: a .jinja file or the template
        itself), else the tokenizer's own: `chat_template.jinja` or the "chat_template"
        of `tokenizer_config.json` beside its tokenizer.json; the special tokens from
        that tokenizer_config.json either way.

        Raises:
            ConfigError: no template anywhere (the message names [data] chat_template), or
                one that does not parse.
        """
        folder = Path(tokenizer).parent if tokenizer and tokenizer != "bytes" else None
        config = tokenizer_config(tokenizer)
        tokens = {"bos_token": _token_text(config.get("bos_token")),
                  "eos_token": _token_text(config.get("eos_token"))}
        if given:
            path = Path(given)
            if "{" not in given and path.is_file():
                return cls(path.read_text(), origin=f"{FIX} {given!r}", **tokens)
            if "{" not in given:
                raise ConfigError(f"{FIX} {given!r} is neither a file nor a Jinja template: "
                                  "give a .jinja file or the template text")
            return cls(given, origin=FIX, **tokens)
        if folder is not None and (folder / TEMPLATE_FILE).is_file():
            return cls((folder / TEMPLATE_FILE).read_text(),
                       origin=str(folder / TEMPLATE_FILE), **tokens)
        found = config.get("chat_template")
        if isinstance(found, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
            found = named.get("default")
        if isinstance(found, str) and found:
            return cls(found, origin=str(folder / TOKENIZER_CONFIG) if folder else FIX,
                       **tokens)
        whose = f"the tokenizer {tokenizer!r}" if folder is not None else "the bytes tokenizer"
        raise ConfigError(f"{whose} has no chat template (no {TEMPLATE_FILE} and no "
                          f"\"chat_template\" in {TOKENIZER_CONFIG} beside it): give {FIX} "
                          "(a .jinja file or the template text)")

    @classmethod
    def for_records(cls, tokenizer: str, given: str, required: bool) -> ChatTemplate | None:
        """The template records are rendered with: `find`'s, required for chat; for
        prompt/completion pairs the tokenizer's if it has one (pairs of messages need it,
        pairs of strings none), a `given` one always.

        Raises:
            ConfigError: see `find`, where a template is required or given.
        """
        try:
            return cls.find(tokenizer, given)
        except ConfigError:
            if required or given:
                raise
            return None

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        """The text of `messages`, with the assistant's generation prompt after them when
        asked (to generate, or to find where an assistant's turn starts).

        Raises:
            ConfigError: the template raised (raise_exception, or a value it cannot use).
        """
        import jinja2

        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the chat template of {self.origin} refused a conversation "
                              f"({exc}): fix the conversation or give {FIX}") from exc


def chat_prompt(template: ChatTemplate, tokenizer: Tokenizer, text: str
                ) -> tuple[list[int], int | None]:
    """The ids of a one-message conversation from the user, `text`, with the generation
    prompt after it (what a model trained on the template answers), and the template's
    end-of-turn id (the first token the template writes after an assistant's content:
    where an answer stops), None if it writes nothing there.

    Raises:
        ConfigError: the template refused the conversation.
    """
    asked = [{"role": "user", "content": text}]
    prompt = template.render(asked, add_generation_prompt=True)
    mark = "\x00dtrain\x00"  # content no template alters, to find what follows it
    turn = template.render([*asked, {"role": "assistant", "content": mark}])
    after = turn[turn.find(mark) + len(mark):] if mark in turn else ""
    ends = tokenizer.encode(after) if after.strip() else []
    return tokenizer.encode(prompt), ends[0] if ends else None


def check_messages(value: object, where: str) -> list[Message]:
    """`value` as a conversation: a non-empty list of {"role", "content"} with known roles.

    Raises:
        ConfigError: anything else, naming `where` (a file and line).
    """
    if not isinstance(value, list) or not value:
        raise ConfigError(f'{where}: "messages" must be a non-empty list of '
                          '{"role": ..., "content": ...}')
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ConfigError(f'{where}: a message is not {{"role": ..., "content": "..."}} '
                              f"({json.dumps(message)[:80]})")
        if message.get("role") not in ROLES:
            raise ConfigError(f"{where}: unknown role {message.get('role')!r}: give one of "
                              f"{', '.join(ROLES)}")
    return value


def assistant_spans(messages: list[Message], template: ChatTemplate, train_on: TrainOn,
                    answer_from: int = 0, where: str = "") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its targets (see the module
    doc); `answer_from`: with "completion", only assistant turns from this message on.

    Raises:
        ConfigError: the template renders earlier turns differently once later ones follow.
    """
    text = template.render(messages)
    if train_on == "all":
        return text, [(0, len(text))]
    spans = []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "completion":
        turns = [i for i in turns if i >= answer_from] if answer_from else turns[-1:]
    for i in turns:
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError(f"{where}: the chat template of {template.origin} renders the "
                              f"turns before message {i} differently once it follows, so its "
                              f"tokens cannot be told apart: give {FIX} a template that "
                              "renders turns in order, or set [data] train_on = \"all\"")
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def encode_chat(messages: list[Message], template: ChatTemplate, tokenizer: Tokenizer,
                train_on: TrainOn = "assistant", answer_from: int = 0, where: str = ""
                ) -> tuple[np.ndarray, np.ndarray]:
    """A conversation's ids and which of them are targets (bool), as `assistant_spans`
    marks them: a token is a target if any of its characters is in a span.

    Raises:
        ConfigError: see `assistant_spans`.
    """
    text, spans = assistant_spans(messages, template, train_on, answer_from, where)
    return tokenizer.encode_spans(text, spans)


def encode_prompt_completion(prompt: object, completion: object, tokenizer: Tokenizer,
                             template: ChatTemplate | None, train_on: TrainOn,
                             where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """A prompt/completion pair's ids and targets (see the module doc).

    Raises:
        ConfigError: fields of the wrong kind, or lists of messages without a template.
    """
    if isinstance(prompt, str) and isinstance(completion, str):
        head, tail = tokenizer.encode_document(prompt), tokenizer.encode_document(completion)
        end = np.asarray(tokenizer.separator, dtype=head.dtype)
        ids = np.concatenate([head, tail, end])
        targets = np.ones(len(ids), dtype=bool)
        if train_on != "all":
            targets[: len(head)] = False
        return ids, targets
    if isinstance(prompt, list) and isinstance(completion, list):
        if template is None:
            raise ConfigError(f"{where}: prompt and completion are messages, which need a "
                              f"chat template: give {FIX}")
        messages = check_messages(prompt + completion, where)
        return encode_chat(messages, template, tokenizer,
                           "all" if train_on == "all" else "completion",
                           answer_from=len(prompt), where=where)
    raise ConfigError(f'{where}: "prompt" and "completion" must both be strings or both '
                      "lists of messages")
