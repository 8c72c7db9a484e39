"""Chat conversations as token ids with a `Role` per token, rendered with the checkpoint's own template.

A conversation is `[{"role": "user", "content": "..."}, ...]`. `encode_chat` renders it whole with
the chat template (`dew.data.chat_template`), tokenizes the text as transformers'
`apply_chat_template(tokenize=True)` does (no special tokens added beyond the template's), and gives
each token the role of the message whose rendering it belongs to. Where each message ends is found
by rendering the conversation's prefixes: messages `[:i]` render to a prefix of messages `[:i+1]` in
every template that writes each turn once (SmolLM2's, Qwen 2.5's, Llama 3's), and the ids of a
prefix's text are the leading ids of the whole text wherever the template puts a special token or a
pre-tokenizer split at the boundary. Rules where that does not hold, each exact and explicit:

- An assistant message's span starts after the turn's opening, the text the template writes for
  `add_generation_prompt=True` (`<|im_start|>assistant\\n`): the opening is `Role.NONE`, since a
  model generating the turn is given it, and the message's tokens are its content and end-of-turn.
- A token that crosses the boundary between two spans (the tokenizer merged text across it) counts
  with the later span.
- Text the template writes before the first message (a BOS) is `Role.NONE` when the template
  renders an empty conversation; when it refuses to (Qwen's reads `messages[0]`), that text goes
  with the first message.
- A template that renders an earlier message differently once later ones follow (Qwen 3 drops
  earlier turns' reasoning) has no per-message spans: it is refused, naming the message.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dew.data.chat_template import ChatTemplate, chat_template


class Role(enum.IntEnum):
    """Whose text a token of a chat row is: a message's role, or `NONE` for text no message wrote
    (padding, and the template's own text such as an assistant turn's opening). Rows carry roles as
    int32 under `text_roles`; `LMObjective(loss_role=Role.ASSISTANT)` keeps only those targets."""

    NONE = 0
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4

    @classmethod
    def of(cls, value, what: str = "role") -> "Role":
        """The message role `value` names: a `Role` other than NONE, or its name in any case ("assistant")."""
        if isinstance(value, Role) and value != Role.NONE:
            return value
        if isinstance(value, str) and value.upper() in cls.__members__ and value.upper() != "NONE":
            return cls[value.upper()]
        raise ValueError(f"{what} {value!r} is not a message role: use one of {MESSAGE_ROLES}")


MESSAGE_ROLES = [role.name.lower() for role in Role if role != Role.NONE]
"""The role names a conversation's messages may carry."""


def template_of(tokenizer, template: str | Path | None = None) -> ChatTemplate:
    """The chat template a conversation is rendered with: the Jinja file `template` when given (with
    the tokenizer's special tokens), else the tokenizer directory's own (`chat_template.jinja`, or
    tokenizer_config.json's `chat_template`; a GGUF checkpoint's loaded tokenizer carries the file's).
    A tokenizer without one is refused, naming where Dew looked."""
    path = getattr(tokenizer, "path", None)
    found = None if path is None else chat_template(Path(path).parent)
    if template is not None:
        file = Path(template)
        if not file.is_file():
            raise FileNotFoundError(f"chat template file {file} does not exist: pass a Jinja file")
        special = dict(found.special_tokens) if found is not None else {}
        return ChatTemplate(file.read_text(encoding="utf-8"), special, str(file))
    if found is None:
        where = ("a byte tokenizer has no files" if path is None else
                 f"{Path(path).parent} has no chat_template.jinja and its tokenizer_config.json no chat_template")
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name', tokenizer)!r} has no chat template ({where}): "
                         "pass the template as a Jinja file (ChatData(template=...), --data.template FILE), or use "
                         "an instruction-tuned checkpoint's tokenizer, which carries one")
    return found


def template_if_any(tokenizer, template: str | Path | None = None) -> ChatTemplate | None:
    """`template_of(tokenizer, template)`, or None when no file is given and the tokenizer carries no
    template (for data whose records may be plain text, which needs none)."""
    path = getattr(tokenizer, "path", None)
    if template is None and (path is None or chat_template(Path(path).parent) is None):
        return None
    return template_of(tokenizer, template)


def check_messages(messages, where: str) -> list[dict[str, str]]:
    """`messages` as a list of `{"role", "content"}` dicts, refused by name unless each role is a message
    role of `Role` and each content a string."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError(f"{where}: messages is {messages!r}; give a non-empty list of {{'role', 'content'}} objects")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}, message {index}: {message!r} is not an object with 'role' and 'content'")
        Role.of(message["role"], f"{where}, message {index}: role")
        if not isinstance(message["content"], str):
            raise ValueError(f"{where}, message {index}: content is {type(message['content']).__name__}; Dew's chat "
                             "data reads text content, a string")
        checked.append(dict(message))
    return checked


def encode_chat(messages: Sequence[Mapping[str, Any]], tokenizer, template: ChatTemplate,
                where: str = "the conversation") -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32 `[T]`, their roles int32 `[T]`) of one conversation rendered with `template`
    (see the module's rules). `where` names the conversation in errors."""
    messages = check_messages(messages, where)
    render = lambda count, opening=False: template.render(messages[:count], add_generation_prompt=opening)
    try:
        start = render(0)
    except ValueError:  # a template that reads messages[0]: its leading text goes with the first message
        start = ""
    full = render(len(messages))
    # Character spans, each (end, role), in order.
    spans, before = [], start
    for index, message in enumerate(messages):
        text = render(index + 1)
        if not text.startswith(before) or not full.startswith(text):
            changed = index - 1 if not text.startswith(before) else index
            raise ValueError(
                f"{where}: the chat template ({template.source}) renders message {changed} "
                f"({messages[changed]['role']}) differently once later messages follow, so its messages have no "
                "spans of their own to give roles to; render such conversations yourself, or use a template that "
                "writes each turn once")
        role = Role.of(message["role"])
        if role == Role.ASSISTANT:
            opening = _opening(render, index, start)
            if not opening.startswith(before) or not text.startswith(opening):
                raise ValueError(
                    f"{where}: message {index} (assistant) does not start with the turn's opening that the chat "
                    f"template ({template.source}) writes for add_generation_prompt ({opening[len(before):]!r}), so "
                    "a model generating from that opening would not produce this turn")
            spans.append((len(opening), Role.NONE))
        spans.append((len(text), role))
        before = text
    ids = np.asarray(tokenizer.encode(full), np.int32)
    roles = np.zeros(len(ids), np.int32)
    begin = _shared_length(tokenizer.encode(start), ids) if start else 0
    for end, role in spans:
        stop = _shared_length(tokenizer.encode(full[:end]), ids)
        roles[begin:stop] = int(role)
        begin = max(begin, stop)
    return ids, roles


def _opening(render, index: int, start: str) -> str:
    """The text of messages `[:index]` with the assistant turn's opening after it; for a first message
    under a template that cannot render an empty conversation, the leading text `start` (no opening)."""
    try:
        return render(index, opening=True)
    except ValueError:
        if index:
            raise
        return start


def _shared_length(prefix_ids: Sequence[int], ids: np.ndarray) -> int:
    """How many leading ids `prefix_ids` shares with `ids`: where a prefix's tokens end in the whole
    text's (a token the tokenizer merged across the cut is not shared, so it goes with what follows)."""
    prefix = np.asarray(prefix_ids, np.int64)[: len(ids)]
    differ = np.flatnonzero(prefix != ids[: len(prefix)])
    return int(differ[0]) if len(differ) else len(prefix)
