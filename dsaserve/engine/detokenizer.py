"""Incremental detokenization and stop strings.

Text grows only when the newest tokens decode to complete characters (a byte-level BPE token can end
mid-character; its decode then ends in U+FFFD and is held back). With stop strings, the last
`len(longest stop) - 1` characters are withheld from deltas until the request ends, so a stop string
spanning several tokens never leaks into the streamed text.
"""

from __future__ import annotations

from dsaserve.tokenizer import Tokenizer

CONTEXT_TOKENS = 6  # prompt tokens decoded alongside, for tokenizers whose decode depends on context
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.num_context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> int:
        """Append a token; returns how many characters the text grew by."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return 0
        grown = full[len(prefix) :]
        self.text += grown
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return len(grown)

    def find_stop(self, grown: int) -> str | None:
        """If a stop string now appears in the text, cut the text there and return the string."""
        if not self.stop or grown == 0:
            return None
        start = max(0, len(self.text) - grown - self.holdback)
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        return stop

    def flush(self) -> None:
        """At a non-stop-string finish: decode any held partial character (as U+FFFD if it never completed)."""
        full = self._decode(self.ids[self.num_context :])
        if len(full) > len(self.text) and full.startswith(self.text):
            self.text = full

    def delta(self, finished: bool) -> str:
        """New text since the last call; withholds a possible stop-string prefix until finished."""
        limit = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : limit]
        self.emitted = limit
        return out
