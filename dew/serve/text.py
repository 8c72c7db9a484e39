"""`TextStream`: a continuation's token ids turned into text as they come, with stop strings cut out; and
`Spelling`: each token's text and offset in that text, for log-probabilities.

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


class Pieces:
    """The text each token of a sequence adds to it (decoded with `decode`), after `context` (token ids whose
    text is not counted, such as a continuation's prompt): `push(token)` returns it, "" while the token leaves a
    character unfinished (its text then comes with the token that completes the character), and `rest()` the
    bytes that never completed one, at the end. `length` counts the characters returned so far."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = ()):
        self._decode = decode
        self._tokens = [int(t) for t in context[-_CONTEXT_TOKENS:]]
        self._prefix, self._read = 0, len(self._tokens)
        self._before: str | None = None  # the text of tokens[prefix:read], once decoded
        self.length = 0

    def adds(self, token: int) -> str | None:
        """The text `token` would add next; None when it would add none yet (inside a character, or nothing)."""
        if self._before is None:
            self._before = self._decode(self._tokens[self._prefix: self._read])
        window = self._decode(self._tokens[self._prefix:] + [int(token)])
        if len(window) <= len(self._before) or window.endswith(_INCOMPLETE):
            return None  # inside a character: wait for the rest of its bytes
        return window[len(self._before):]

    def push(self, token: int) -> str:
        """Add `token`; the text it adds (maybe "")."""
        text = self.adds(token)
        self._tokens.append(int(token))
        if text is None:
            return ""
        self._prefix, self._read, self._before = self._read, len(self._tokens), None
        self.length += len(text)
        return text

    def rest(self) -> str:
        """The text of the tokens whose bytes never completed a character (U+FFFD for those bytes)."""
        before = self._decode(self._tokens[self._prefix: self._read])
        window = self._decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        self._before = None
        self.length += len(window) - len(before)
        return window[len(before):]


class TextStream:
    """The text of a continuation of `prompt` (token ids), decoded with `decode`, ending before the
    first of `stop` (strings).

    `push(token)` adds a token and returns the text now safe to show (maybe ""); `stopped` turns
    true when a stop string appeared (push nothing more); `close()` returns the text held back, at
    the end. `text` is all text shown so far.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt: Sequence[int], stop: Sequence[str] = ()):
        self._pieces = Pieces(decode, prompt)
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # decoded, not shown: it may begin a stop string
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        piece = self._pieces.push(token)
        return self._add(piece) if piece else ""

    def close(self) -> str:
        """The text still held back: a partial stop string, or bytes that never completed a character."""
        if self.stopped:
            return ""
        shown = self._add(self._pieces.rest())
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


class Spelling:
    """Each token's text for a completion's log-probabilities, and where it begins in the answer's text.

    A token is spelled as the text it adds in its place (`Pieces`, after `context`), and its offset counts
    the characters of the text before it from `offset`, so offsets index the text answered. Partial
    characters follow vLLM's convention: a token whose bytes leave a character unfinished reads "", and the
    token that completes it reads the whole character. (vLLM decodes each token alone and, where that ends
    inside a character, again together with the token before it; what still ends inside one reads "". So
    it gives the whole character only to the second token of two; here the completing token gets it however
    many tokens the character spans, and the tokens before it share its offset.) A special token the text
    leaves out (an EOS) reads as itself and takes no room: its offset is where the text goes on. An
    alternative reads as the text it would have added in the drawn token's place, so the bytes that would
    complete a character read as that character; those that would leave one unfinished all read "", as in
    vLLM, and share that key of `top_logprobs` (the most likely kept)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], spell: Callable[[int], str],
                 context: Sequence[int] = (), offset: int = 0):
        self._decode, self._spell = decode, spell
        self._pieces = Pieces(decode, context)
        self._offset = offset

    def alternative(self, token: int) -> str:
        """What `token` in the next place would read."""
        text = self._pieces.adds(token)
        return self._own(token) if text is None else text

    def push(self, token: int) -> tuple[str, int]:
        """(the text, the offset) of the next token, which the next places come after."""
        offset = self._offset + self._pieces.length
        return self._pieces.push(token) or self._own(token), offset

    def _own(self, token: int) -> str:
        """A token that adds no text in its place: a special token the text leaves out reads as itself, a part
        of a character as ""."""
        return self._spell(token) if self._decode([int(token)]) == "" else ""


def _longest_stop_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins some stop string (0 when none)."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best
