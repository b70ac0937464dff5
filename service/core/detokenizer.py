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

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an incomplete tail included), up to a stop
        string in it."""
        if self.stopped:
            return ""
        if self._read_offset < len(self._tokens):
            window_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            self._text += self._decode(self._tokens[self._prefix_offset :])[len(window_text) :]
            self._read_offset = len(self._tokens)
        return self._release(final=True)

    def _release(self, final: bool = False) -> str:
        end = len(self._text)
        if self._stop:
            found = self._find_stop()
            if found is not None:
                self.stopped = True
                end = found
            elif not final:
                end -= self._held_back()
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self) -> int | None:
        """Where the text ends for the stop string that the new text completes first: fed token by token, the
        reply would have ended there (a longer stop string that began earlier but ends later never completes).
        Its start, or its end with include_stop."""
        # Only the not-yet-emitted text (plus a stop string's length of context) can hold a new match.
        start = max(0, self._emitted - max(map(len, self._stop)))
        best: tuple[int, int] | None = None  # (where the match ends, where it starts)
        for s in self._stop:
            i = self._text.find(s, start)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        if best is None:
            return None
        return best[0] if self._include_stop else best[1]

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        tail_len = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), tail_len, -1):
                if self._text.endswith(s[:n]):
                    tail_len = n
                    break
        return min(tail_len, len(self._text) - self._emitted)
