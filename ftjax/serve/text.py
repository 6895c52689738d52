"""Incremental detokenization of a generated token stream, with stop strings.

A token of a byte-level tokenizer can end in the middle of a UTF-8 character: decoding the ids so far
then ends in U+FFFD (the replacement character) until the next token completes the character. So each
step emits only the new suffix of the decoded text, holding back a trailing U+FFFD. With stop strings it
also holds back a tail that could be the start of one, and ends the text before the first stop string
found (OpenAI's ``stop``: the stop string is not returned).

Decoding the whole id list at every token costs time linear in the tokens so far (quadratic per request:
about 0.1 ms a token at 1000 tokens with a byte-level tokenizer). So each step decodes only a window, as
vLLM's ``detokenize_incrementally`` does: the ids from ``start`` on, where the text of the ids before
``read`` is final. The new text is what ``decode(ids[start:])`` adds to ``decode(ids[start:read])``: the
same start, so that a decoder's effect at the start of a sequence (a Metaspace decoder dropping the
first token's leading space) cancels. The window moves on only where the text so far ends in a whole
character (no trailing U+FFFD), so every window starts on a character boundary. If
``decode(ids[start:])`` does not begin with ``decode(ids[start:read])`` (a decoder whose output is not
local), that token's text comes from decoding every id, as before.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"
#: Ids of a decode window (:class:`TextStream`) after which it moves on: each token decodes at most about
#: twice as many ids, and the window's two decodes happen once per WINDOW tokens.
WINDOW = 16


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
        # the decode window (module docstring): ids[:_read] decode to _final, ids[_start:_read] to _context
        self._start = self._read = 0
        self._final = self._context = ""

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
        text = self._decode_all()
        cut = self._find_stop(text)
        if cut is not None:
            self.stopped, self._text = True, text[:cut]
            return self._release(cut)
        self._text = text
        end = len(text.rstrip(REPLACEMENT))
        end -= self._stop_prefix(text[:end])
        return self._release(end)

    def _decode_all(self) -> str:
        """The text of every id so far, from the window's decode (module docstring)."""
        ids, start = self.ids, self._start
        window = self._decode(ids[start:]) if start else None
        if window is not None and window.startswith(self._context):
            text = self._final + window[len(self._context):]
        else:  # the first window, or a decoder whose text is not local: decode them all
            text = self._decode(ids)
        if len(ids) - self._read >= WINDOW and not text.endswith(REPLACEMENT):
            self._start, self._read = self._read, len(ids)
            self._final = text
            self._context = self._decode(ids[self._start:self._read])
        return text

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
