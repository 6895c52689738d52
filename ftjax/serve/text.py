"""Incremental detokenization of a generated token stream, with stop strings.

A token of a byte-level tokenizer can end in the middle of a UTF-8 character: decoding the ids so far
then ends in U+FFFD (the replacement character) until the next token completes the character. So each
step decodes the whole generated id list and emits only the new suffix of the text, holding back a
trailing U+FFFD. With stop strings it also holds back a tail that could be the start of one, and ends the
text before the first stop string found (OpenAI's ``stop``: the stop string is not returned).
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one request's generated ids, released piece by piece.

    Args:
      decode: token ids -> text (e.g. ``tokenizers.Tokenizer.decode``, special tokens skipped).
      stop: stop strings; empty strings are ignored.

    The pieces returned by :meth:`add` and then :meth:`finish`, joined, are :attr:`text`.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.stopped = False  # a stop string was found: later tokens are ignored
        self._text = ""  # the decoded text so far, cut before a stop string
        self._sent = 0  # characters of it released

    @property
    def text(self) -> str:
        """The whole text so far (ended before the first stop string), including what is held back."""
        return self._text

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text that can be released now ("" if none: an
        incomplete character, or a possible start of a stop string, is held back)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        text = self._decode(self.ids)
        cut = self._find_stop(text)
        if cut is not None:
            self.stopped, self._text = True, text[:cut]
            return self._release(cut)
        self._text = text
        end = len(text.rstrip(REPLACEMENT))
        end -= self._stop_prefix(text[:end])
        return self._release(end)

    def finish(self) -> str:
        """The text held back (call once, after the last token): all of it, a trailing U+FFFD included."""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        piece, self._sent = self._text[self._sent:end], end
        return piece

    def _find_stop(self, text: str) -> int | None:
        """Where the earliest stop string starts in ``text`` (at or after the released text: a held-back tail is
        never released while it may start one), or None."""
        found = [i for i in (text.find(s, self._sent) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
