"""`TextStream`: a continuation's token ids turned into text as they come, with stop strings cut out.

Decoding a whole continuation at every token costs quadratic time, and decoding each token alone
breaks characters whose bytes span tokens and drops the space a SentencePiece token carries at the
start. So each step decodes a short window: the tokens from `prefix` (a few already read, for their
context) to the end, and emits what that window adds past the text of `prefix..read`. A window that
ends inside a character (its text ends in U+FFFD) waits for the next token.

Stop strings are found in the text on the host; the text stops before the first one. Text that
could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"
_CONTEXT_TOKENS = 4


class TextStream:
    """The text of a continuation of `prompt` (token ids), decoded with `decode`, ending before the
    first of `stop` (strings).

    `push(token)` adds a token and returns the text now safe to show (maybe ""); `stopped` turns
    true when a stop string appeared (push nothing more); `close()` returns the text held back, at
    the end. `text` is all text shown so far.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt: Sequence[int], stop: Sequence[str] = ()):
        self._decode = decode
        context = list(prompt[-_CONTEXT_TOKENS:])
        self._tokens = context
        self._prefix, self._read = 0, len(context)
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # decoded, not shown: it may begin a stop string
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self._tokens.append(int(token))
        before = self._decode(self._tokens[self._prefix: self._read])
        window = self._decode(self._tokens[self._prefix:])
        if len(window) <= len(before) or window.endswith(_INCOMPLETE):
            return ""  # inside a character: wait for the rest of its bytes
        self._prefix, self._read = self._read, len(self._tokens)
        return self._add(window[len(before):])

    def close(self) -> str:
        """The text still held back: a partial stop string, or bytes that never completed a character."""
        if self.stopped:
            return ""
        before = self._decode(self._tokens[self._prefix: self._read])
        window = self._decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        shown = self._add(window[len(before):])
        if not self.stopped:
            shown += self._show(self._pending)
            self._pending = ""
        return shown

    def _add(self, new: str) -> str:
        if self.stopped:
            return ""
        pending = self._pending + new
        cut = min((i for i in (pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return self._show(pending[:cut])
        keep = _longest_stop_prefix(pending, self._stop)
        self._pending = pending[len(pending) - keep:] if keep else ""
        return self._show(pending[: len(pending) - keep])

    def _show(self, text: str) -> str:
        self.text += text
        return text


def _longest_stop_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins some stop string (0 when none)."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best
