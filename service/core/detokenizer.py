"""Incremental detokenization and stop strings for one stream.

Decoding token by token would split multi-byte characters (Chinese, emoji) across tokens and lose
the spaces some tokenizers add between tokens. Instead each step decodes a short window that starts a
few tokens back and emits only what the window added, holding text back while it ends in an
incomplete character (U+FFFD) or could still be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), include_stop: bool = False
    ) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._tokens: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens already turned into text
        self._text = ""  # all text decoded so far (before stop-string truncation)
        self._emitted = 0  # characters of _text already returned
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the text that can be shown now."""
        if self.stopped:
            return ""
        self._tokens.extend(token_ids)
        window_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) > len(window_text) and not new_text.endswith(REPLACEMENT):
            self._text += new_text[len(window_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
        return self._release()

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an incomplete tail included)."""
        if not self.stopped and self._read_offset < len(self._tokens):
            window_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            self._text += self._decode(self._tokens[self._prefix_offset :])[len(window_text) :]
            self._read_offset = len(self._tokens)
        if self.stopped:
            return ""
        tail = self._text[self._emitted :]
        self._emitted = len(self._text)
        return tail

    def _release(self) -> str:
        end = len(self._text)
        if self._stop:
            found = self._find_stop()
            if found is not None:
                self.stopped = True
                end = found
            else:
                end -= self._held_back()
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self) -> int | None:
        # Only the not-yet-emitted text (plus a stop string's length of context) can hold a new match.
        start = max(0, self._emitted - max(map(len, self._stop)))
        best: int | None = None
        for s in self._stop:
            i = self._text.find(s, start)
            if i >= 0:
                end = i + len(s) if self._include_stop else i
                best = end if best is None else min(best, end)
        return best

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        tail_len = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), tail_len, -1):
                if self._text.endswith(s[:n]):
                    tail_len = n
                    break
        return min(tail_len, len(self._text) - self._emitted)
