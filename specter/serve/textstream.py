"""Generated token ids to text deltas that are safe to send, with OpenAI ``stop`` strings.

Contract: ``TextStream(decode, stop, eos_token_ids)`` (an id, several, or None) is fed the growing
list of a request's new token ids (``update(ids)``, then ``update(ids, final=True)`` once
generation ended) and returns each time a ``(delta, stopped)`` pair:

- the text is always ``decode(ids)`` of the whole id list (a trailing end-of-sequence token,
  any of ``eos_token_ids``, dropped), never a concatenation of per-token decodes, so a multi-byte
  character split across tokens comes out whole: while the decoded text ends in U+FFFD (an
  incomplete UTF-8 sequence) that tail is held back until a later update completes it or the
  final update flushes it;
- ``stop`` strings: as soon as the text holds one, it is cut just before it (the earliest one
  when an update completes several; the stop string itself is never sent) and ``stopped`` is
  True; the caller then ends generation. While
  no stop has matched, a tail that could still grow into a stop string is held back, so a client
  never receives half of a stop string;
- the deltas concatenated equal ``text``, the final text of the response.

Not thread-safe: one stream belongs to one request, used from one thread.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 eos_token_ids: int | Iterable[int] | None = None) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._eos = frozenset(() if eos_token_ids is None else (eos_token_ids,) if isinstance(eos_token_ids, int)
                              else eos_token_ids)
        self.text = ""  # what has been handed out so far
        self.stopped = False  # a stop string matched
        self.ended_by_eos = False  # the last id seen was the end-of-sequence token

    def update(self, ids: Sequence[int], final: bool = False) -> tuple[str, bool]:
        """The new text to send for ``ids`` (all new tokens so far) and whether a stop matched."""
        if self.stopped:
            return "", True
        ids = list(ids)
        self.ended_by_eos = bool(ids) and ids[-1] in self._eos
        if self.ended_by_eos:
            ids = ids[:-1]
        full = self._decode(ids) if ids else ""
        if not final:
            full = full.rstrip(REPLACEMENT)
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            return self._advance(full[:max(cut, len(self.text))]), True
        if not final:
            full = full[:len(full) - self._stop_prefix_len(full)]
        return self._advance(full), False

    def _advance(self, upto: str) -> str:
        # A tokenizer whose decode rewrites earlier text (rare: clean-up of spaces) cannot take
        # back what was sent; the new text continues from the length already sent.
        if len(upto) <= len(self.text):
            return ""
        delta = upto[len(self.text):]
        self.text += delta
        return delta

    def _first_stop(self, text: str) -> int | None:
        # only text not yet sent can hold a new match (the sent text holds no stop string)
        start = max(0, len(self.text) - max((len(s) for s in self._stop), default=0))
        found = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
