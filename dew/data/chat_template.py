"""Chat templates: a checkpoint's Jinja template turning a list of messages into the prompt text.

`render_chat` renders the way transformers' `apply_chat_template` does (a sandboxed Jinja
environment that trims blocks, with loop controls, a `tojson` that keeps non-ASCII characters,
`raise_exception` and `strftime_now`), so a prompt matches what the model was tuned on.
`chat_template(directory)` reads a tokenizer directory's template and special tokens: the
`chat_template.jinja` file transformers writes, else tokenizer_config.json's `chat_template` (a
string, or a list of named templates whose "default" is used).

Needs jinja2 (`pip install 'dew-ml[serve]'`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
"""The special tokens a template may read by name (tokenizer_config.json's entries)."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A template's text, the special tokens it may read (`{"bos_token": "<s>", ...}`) and where it
    came from."""

    template: str
    special_tokens: Mapping[str, str]
    source: str

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra) -> str:
        return render_chat(self.template, messages, add_generation_prompt, **{**self.special_tokens, **extra})

    def check(self) -> None:
        """Refuse (ValueError naming `source` and the template's line) a template that cannot render a
        conversation: not valid Jinja, reading another template (`include`, `extends`, `import`: a
        chat template renders alone), or failing on one user message other than by its own
        `raise_exception` (a template may refuse a conversation; it may not break on every one)."""
        jinja2 = _jinja2()
        try:
            tree = _environment().parse(self.template)
            _environment().from_string(self.template)  # compiling finds unknown filters and tests
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ValueError(f"{self.source}, line {error.lineno}: the chat template is not valid Jinja "
                             f"({error.message}): fix the template") from None
        for node in tree.find_all((jinja2.nodes.Include, jinja2.nodes.Extends, jinja2.nodes.Import,
                                   jinja2.nodes.FromImport)):
            raise ValueError(f"{self.source}, line {node.lineno}: the chat template reads another template "
                             f"({type(node).__name__.lower()}), and a chat template renders alone: put that "
                             "text in the template itself")
        try:
            _compiled(self.template).render(messages=[{"role": "user", "content": "Hello"}],
                                            add_generation_prompt=True, **self.special_tokens)
        except _TemplateRefusal:
            pass
        except Exception as error:  # noqa: BLE001 - any failure of the template's own code is reported
            raise ValueError(f"{self.source}, line {_template_line(error)}: the chat template fails on a "
                             f"conversation of one user message ({type(error).__name__}: {error}): fix the "
                             "template") from None


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                **special_tokens) -> str:
    """The prompt text `template` makes of `messages` (`[{"role": ..., "content": ...}, ...]`).

    `add_generation_prompt` appends the opening of the assistant's turn; `special_tokens` (such as
    `bos_token="<s>"`) and any other keyword are visible to the template. A template that calls
    `raise_exception(message)` raises ValueError with that message.
    """
    jinja2 = _jinja2()
    try:
        return _compiled(template).render(messages=[dict(m) for m in messages],
                                          add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"the chat template refused the messages: {error}") from None


def chat_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template of the tokenizer files in `directory`, or None when they have none."""
    directory = Path(directory)
    settings = {}
    config = directory / "tokenizer_config.json"
    if config.is_file():
        settings = json.loads(config.read_text(encoding="utf-8"))
    special = {name: _token_text(settings[name]) for name in SPECIAL_TOKENS if _token_text(settings.get(name))}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    return ChatTemplate(template, special, str(config))


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or `{"content": ...}`."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _jinja2():
    try:
        import jinja2
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'dew-ml[serve]' (or pip install jinja2)") from None
    return jinja2


def _template_line(error: BaseException) -> int | None:
    """The template line an error was raised at (Jinja maps its frames to `<template>` lines)."""
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == "<template>"]
    return lines[-1] if lines else None


class _TemplateRefusal(Exception):
    """What a template's `raise_exception(message)` raises: the template refusing a conversation."""


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    jinja2 = _jinja2()
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(f"the chat template is not valid Jinja (line {error.lineno}: {error.message})") from None


@functools.lru_cache(maxsize=1)
def _environment():
    jinja2 = _jinja2()
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks;
        rendering keeps its body as it is."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            return caller()

    class Refusal(_TemplateRefusal, jinja2.exceptions.TemplateError):
        pass

    def raise_exception(message):
        raise Refusal(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which no chat format expects.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return environment
