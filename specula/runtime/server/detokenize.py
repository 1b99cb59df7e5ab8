"""Incremental detokenization with stop strings, for streamed and whole completions.

The text of a completion is always ``tokenizer.decode(all generated ids)`` cut before the first stop
string (OpenAI semantics: the stop string is not returned).  Streaming releases a prefix of that
text as tokens arrive, holding back what may still change: the last ``len(longest stop string) - 1``
characters (they may begin a stop string that the next token completes) and trailing U+FFFD
characters (an incomplete UTF-8 sequence split across byte-level tokens).  The held-back tail is
released at the end, so the streamed deltas concatenate to exactly the non-streamed text.
Re-decoding everything per step is O(n^2) characters over a completion: fine at the lengths served
here, and the simplest way to stay exact.
"""

from __future__ import annotations

from typing import Any


class IncrementalText:
    """Generated text of one request.

    Args:
        tokenizer: a ``transformers`` tokenizer (``decode`` is the only method used).
        stop: stop strings; the text ends before the earliest occurrence of any.
    """

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in (stop or []) if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        """Text so far, already cut at a stop string if one appeared."""
        self.stopped = False
        """A stop string appeared in the decoded text; nothing more is added."""
        self._released = 0

    def add(self, new_token_ids: list[int]) -> None:
        """Append generated tokens and re-decode.  Ignored once :attr:`stopped`."""
        if self.stopped:
            return
        self.token_ids.extend(new_token_ids)
        text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)
        # Search the whole text: re-decoding can change the tail of earlier text
        # (an incomplete UTF-8 sequence completing).
        hits = [i for s in self._stop if (i := text.find(s)) != -1]
        self.stopped = bool(hits)
        self.text = text[:min(hits)] if hits else text

    def delta(self, final: bool) -> str:
        """Text not yet released that can no longer change; everything if ``final``."""
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._holdback
            while end > self._released and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self._released:
            return ""
        out = self.text[self._released : end]
        self._released = end
        return out
