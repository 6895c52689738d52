"""Incremental detokenization of a generated token stream, with stop strings.

A token of a byte-level tokenizer can end in the middle of a UTF-8 character: decoding the ids so far
then ends in U+FFFD (the replacement character) until the next token completes the character. So each
step emits only the new suffix of the decoded text, holding back a trailing U+FFFD. With stop strings it
also holds back a tail that could be the start of one, and ends the text before the first stop string
found (OpenAI's ``stop``: the stop string is not returned).

Decoding the whole id list at every token costs time linear in the tokens so far (quadratic per request:
about 0.4 ms a token at 4000 tokens and 0.7 ms at 8000 with the test fixtures' byte-level tokenizer, on the
CPU; a few microseconds with the window), and so does building or searching the whole text. So each step
decodes only a window (:class:`IncrementalDecoder`), as vLLM's ``detokenize_incrementally`` does: the ids
from ``start`` on, where the text of the ids before ``read`` is final. The new text is what
``decode(ids[start:])`` adds to ``decode(ids[start:read])``: the same start, so that a decoder's effect at
the start of a sequence (a Metaspace decoder dropping the first token's leading space) cancels. The window
moves on only where the text so far ends in a whole character (no trailing U+FFFD), so every window starts
on a character boundary. If ``decode(ids[start:])`` does not begin with ``decode(ids[start:read])`` (a
decoder whose output is not local), that token's text comes from decoding every id. Each token decodes at
most ``2 * WINDOW`` ids, ``3 * WINDOW`` when the window moves on (the next window's start is decoded too),
plus the ids of a run of tokens that all end inside a character (the window waits for a character
boundary).

Nor is the whole text kept or searched per token: a caller tells the decoder from which character on it
still needs the text (:meth:`IncrementalDecoder.keep`), and gets only that tail. A stop string that
appears with a new token ends after the text that was final before it (the text without its trailing
U+FFFD: only those characters can still change), so :class:`StopChecker` searches the last
``len(longest stop) - 1`` final characters and what follows them, and :class:`TextStream` the text it has
not released (a held-back stop-string prefix and trailing U+FFFD included). The decoded text is final
except its trailing U+FFFD for the decoders the window is exact for (byte-level BPE, Metaspace); that is
what both rely on.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"
#: Ids of a decode window (:class:`IncrementalDecoder`) after which it moves on: each token decodes at most
#: twice as many ids, and three times as many when the window moves on (once per WINDOW tokens at most).
WINDOW = 16


class IncrementalDecoder:
    """The text of a growing list of token ids, one token at a time, each decoding a window of ids (module
    docstring).

    Args:
      decode: token ids -> text (e.g. ``tokenizers.Tokenizer.decode``, special tokens skipped).
      window: ids after which the decode window moves on (default :data:`WINDOW`), >= 1.

    :meth:`add` returns the text from the position given to :meth:`keep` on (a bounded tail), or, when it
    had to decode every id, the whole text.
    Raises:
      ValueError: window < 1.
    """

    def __init__(self, decode: Callable[[list[int]], str], window: int | None = None):
        window = WINDOW if window is None else window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self._decode, self.window = decode, window
        self.ids: list[int] = []
        # ids[_start:_read] decode to _context; the text of ids[:_read] (final) has _final_len characters
        self._start = self._read = self._final_len = 0
        self._context = ""
        self._base, self._tail = 0, ""  # the text after the last add, from character _base on
        self._keep = 0  # the caller needs the text from this character on

    def keep(self, position: int) -> None:
        """Tells the decoder that the characters before ``position`` will not be needed again: later calls of
        :meth:`add` return the text from there on. Positions only move forward; a smaller one is ignored."""
        self._keep = max(self._keep, int(position))

    def add(self, token_id: int) -> tuple[str, int]:
        """Appends one token; returns ``(tail, base)``: the text of every id so far from character ``base`` on.
        ``base`` is the position last given to :meth:`keep`, or 0 with the whole text as ``tail`` (before any
        :meth:`keep`, and whenever every id was decoded: the first window, or a decoder whose text is not
        local, which may have changed the characters before the kept position too)."""
        ids = self.ids
        ids.append(int(token_id))
        keep, tail, base = self._keep, None, 0
        if self._read:  # (keep >= _base: the last tail holds the final text from keep on)
            window = self._decode(ids[self._start:])
            if window.startswith(self._context):
                new = window[len(self._context):]  # the text of ids[_read:], from character _final_len on
                if keep <= self._final_len:  # the final text's characters from keep on are in the last tail
                    tail = self._tail[keep - self._base:self._final_len - self._base] + new
                else:
                    tail = new[keep - self._final_len:]
                base = keep
        if tail is None:  # the first window, or a decoder whose text is not local: decode them all
            tail = self._decode(ids)
        self._base, self._tail = (base, tail) if base else (min(keep, len(tail)), tail[keep:])
        if len(ids) - self._read >= self.window and not tail.endswith(REPLACEMENT):
            # the text ends in a whole character (an empty tail: it ends before keep, in final text)
            self._start, self._read = self._read, len(ids)
            self._final_len = base + len(tail)
            self._context = self._decode(ids[self._start:self._read])
        return tail, base


class StopChecker:
    """Whether the text of a request's generated ids contains one of its stop strings, checked after each token
    with work bounded independently of the tokens so far (module docstring). Call :meth:`add` with every
    token until it returns True.

    Args:
      decode: token ids -> text (the tokenizer's decode of the whole completion).
      stop: the stop strings; empty strings are ignored.
      window: the decode window (:class:`IncrementalDecoder`).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str], window: int | None = None):
        self._stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = IncrementalDecoder(decode, window)

    def add(self, token_id: int) -> bool:
        """Appends one token; returns whether the decoded text of the ids so far contains a stop string (the
        same answer as searching ``decode(ids)``, given that it did not contain one before this token)."""
        tail, base = self.text.add(token_id)
        found = any(s in tail for s in self._stop)
        # a stop string that appears later ends after the final text (tail without its trailing U+FFFD)
        final = base + len(tail.rstrip(REPLACEMENT))
        self.text.keep(final - self._longest + 1)
        return found


class TextStream:
    """The text of one request's generated ids, released piece by piece.

    Args:
      decode: token ids -> text (e.g. ``tokenizers.Tokenizer.decode``, special tokens skipped).
      stop: stop strings; empty strings are ignored.
      window: the decode window (:class:`IncrementalDecoder`).

    The pieces returned by :meth:`add` and then :meth:`finish`, joined, are :attr:`text`. Each token's work
    is bounded by the decode window and the text not released yet, not by the text so far.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), window: int | None = None):
        self._stop = tuple(s for s in stop if s)
        self._decoder = IncrementalDecoder(decode, window)
        self.stopped = False  # a stop string was found: later tokens are ignored
        self._released: list[str] = []  # the pieces released, in order
        self._sent = 0  # characters released
        self._pending = ""  # the decoded text after them (cut before a stop string): held back

    @property
    def ids(self) -> list[int]:
        """The token ids added so far."""
        return self._decoder.ids

    @property
    def text(self) -> str:
        """The whole text so far (ended before the first stop string), including what is held back."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return (self._released[0] if self._released else "") + self._pending

    @property
    def pending(self) -> str:
        """The text decoded but not released yet (an incomplete character, a possible start of a stop string)."""
        return self._pending

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text that can be released now ("" if none: an
        incomplete character, or a possible start of a stop string, is held back)."""
        if self.stopped:
            return ""
        tail, base = self._decoder.add(token_id)
        sent = self._sent - base  # where the text not released yet starts in tail
        if base == 0:  # every id was decoded: the released text is read from it (a decoder may rewrite it)
            self._released = [tail[:sent]]
        cut = self._find_stop(tail, sent)
        if cut is not None:
            self.stopped = True
            return self._release(tail[:cut], sent, cut)
        end = len(tail.rstrip(REPLACEMENT))
        end -= self._stop_prefix(tail, end)
        piece = self._release(tail, sent, end)
        self._decoder.keep(self._sent)
        return piece

    def finish(self) -> str:
        """The text held back (call once, after the last token): all of it, a trailing U+FFFD included."""
        return self._release(self._pending, 0, len(self._pending))

    def _release(self, tail: str, sent: int, end: int) -> str:
        """Releases ``tail[sent:end]`` (nothing if end <= sent); the rest of ``tail`` is held back."""
        if end <= sent:
            self._pending = tail[sent:]
            return ""
        piece, self._pending = tail[sent:end], tail[end:]
        self._released.append(piece)
        self._sent += len(piece)
        return piece

    def _find_stop(self, text: str, start: int) -> int | None:
        """Where the earliest stop string starts in ``text`` at or after ``start`` (the released text: a
        held-back tail is never released while it may start one), or None."""
        found = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _stop_prefix(self, text: str, end: int) -> int:
        """Length of the longest tail of ``text[:end]`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, end), best, -1):
                if text.endswith(s[:n], 0, end):
                    best = n
                    break
        return best
