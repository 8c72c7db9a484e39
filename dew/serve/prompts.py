"""Prompts as token ids for the server: a completion's text as the tokenizer reads it, and a chat's
messages rendered with the chat template, in which text that spells a special token (`<|im_start|>`)
is plain text unless the server reads it as the token (`dew serve --special-tokens-in-messages`).

transformers' `apply_chat_template(tokenize=True)` and vLLM encode the rendered conversation whole,
so a message that spells `<|im_end|>\\n<|im_start|>system` opens a turn of its own making. Here only
the template's own special tokens are special. Before rendering, every string in the messages has its
special-token text (and, at its two ends, any piece of one that the template's next or previous text
could complete) swapped for a random marker; after rendering, the template's special tokens become
stand-ins that a copy of the tokenizer holds as ordinary added tokens with the same matching rules,
and the markers turn back into their text. That copy reads special-token text as plain text
(`encode_special_tokens`), so one encoding cuts the text where the template put its tokens, as the
tokenizer itself does, and spells out the rest; a conversation with no special-token text in it
encodes to exactly the tokenizer's own ids (tests/serve/test_prompts.py).

A Hugging Face tokenizer encodes through `encode_batch_fast`, which lets go of Python's lock while it
works and keeps no character offsets (a third less memory for a long prompt, which is refused after).
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers

from dew.data.chat_template import ChatTemplate
from dew.data.tokenizers import HFTokenizer

# Supplementary Private Use Area-B: characters no tokenizer gives a meaning to and no special token holds.
_PRIVATE = 0x100000
_PRIVATE_SIZE = 0xFFFE
_MARK_CHARS = 6  # 96 random bits a marker: no text sent in good faith holds one


def _mark() -> str:
    return "".join(chr(_PRIVATE + secrets.randbelow(_PRIVATE_SIZE)) for _ in range(_MARK_CHARS))


class PromptEncoder:
    """Token ids of completion prompts (`text`) and chat prompts (`chat`) for `tokenizer`; with
    `special_in_messages`, special-token text in a message is read as the token, as transformers does."""

    def __init__(self, tokenizer, *, special_in_messages: bool = False):
        self.tokenizer = tokenizer
        self.special_in_messages = special_in_messages
        self._escaping = False  # whether chat text hides special-token text behind stand-ins
        hf = self._hf = tokenizer.tokenizer if isinstance(tokenizer, HFTokenizer) else None
        specials = {} if hf is None else {token.content: index for index, token in
                                          hf.get_added_tokens_decoder().items() if token.special}
        if not specials or special_in_messages:
            return
        self._escaping = True
        self._specials = specials
        self._copy = None  # (the tokenizer's copy, special text -> stand-in, stand-in id -> special id)
        self._copying = threading.Lock()
        # Longest first, so that at each position the longest special token matches, as the tokenizer's does.
        self._special = re.compile("|".join(re.escape(text) for text in sorted(specials, key=len, reverse=True)))
        self._heads = {text[:k] for text in specials for k in range(1, len(text))}
        self._tails = {text[k:] for text in specials for k in range(1, len(text))}
        self._longest = max(map(len, specials))

    def prepare(self) -> None:
        """Make what chat prompts need now (the tokenizer's copy), rather than when the first one comes."""
        if self._escaping:
            self._copied()

    def _copied(self) -> tuple:
        """The tokenizer's copy in which each special token is a stand-in of plain text, made by the first
        chat prompt (a real vocabulary's copy takes a fifth of a second, which a server's start does not wait for)."""
        with self._copying:
            if self._copy is None:
                hf = self._hf
                added = hf.get_added_tokens_decoder()
                plain = tokenizers.Tokenizer.from_str(hf.to_str())
                stand_ins: dict[str, str] = {}
                real: dict[int, int] = {}  # the copy's stand-in id -> the special token's id
                for text, index in self._specials.items():
                    token, stand_in = added[index], _mark()
                    plain.add_tokens([tokenizers.AddedToken(stand_in, single_word=token.single_word,
                                                            lstrip=token.lstrip, rstrip=token.rstrip,
                                                            normalized=token.normalized, special=False)])
                    stand_ins[text] = stand_in
                    real[plain.token_to_id(stand_in)] = index
                plain.encode_special_tokens = True
                self._copy = plain, stand_ins, real
            return self._copy

    def text(self, text: str) -> list[int]:
        """A completion prompt's ids: special-token text is the token, as the client wrote it."""
        if self._hf is None:
            return self.tokenizer.encode(text)
        return self._hf.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def chat(self, template: ChatTemplate, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids of `messages` rendered with `template` and a generation prompt (see the module)."""
        if not self._escaping:
            return self.text(template.render(messages))
        plain, stand_ins, real = self._copied()
        marks: dict[str, str] = {}  # marker -> the text it hides
        escaped = [_map_strings(message, lambda text: self._escape(text, marks)) for message in messages]
        text = self._special.sub(lambda found: stand_ins[found.group()], template.render(escaped))
        if marks:
            text = re.sub("|".join(map(re.escape, marks)), lambda found: marks[found.group()], text)
        ids = plain.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return [real.get(i, i) for i in ids]

    def _escape(self, text: str, marks: dict[str, str]) -> str:
        """`text` with special-token text, and any piece of one at either end, hidden behind markers."""
        def hide(piece: str) -> str:
            mark = _mark()
            while mark in marks:
                mark = _mark()
            marks[mark] = piece
            return mark

        text = self._special.sub(lambda found: hide(found.group()), text)
        limit = min(self._longest - 1, len(text))
        tail = next((k for k in range(limit, 0, -1) if text[-k:] in self._heads), 0)
        if tail:
            text = text[:-tail] + hide(text[-tail:])
        head = next((k for k in range(min(limit, len(text)), 0, -1) if text[:k] in self._tails), 0)
        if head:
            text = hide(text[:head]) + text[head:]
        return text


def _map_strings(value, change):
    """`value` (JSON-like) with `change` applied to every string in it, keys left alone."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {key: _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_strings(item, change) for item in value]
    return value
