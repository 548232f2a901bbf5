"""Incremental detokenisation with stop strings that may span block boundaries."""

from __future__ import annotations

from typing import Any


class TextTracker:
    """Turns accepted token ids into safe text deltas.

    Held back until more tokens arrive: a trailing incomplete UTF-8 character (U+FFFD) and any suffix that could
    be the start of a stop string. When a stop string appears, the text is cut before it and the token ids are cut
    after the token that completed it.

    Each pass decodes only a window of tokens (from the last settled boundary), as streaming detokenizers do, so a
    pass costs the same at token 10 and at token 1000 (a whole-output decode took ~0.1 ms per pass at 512 tokens):
    the text is the settled text plus what the window adds to the text of its settled head.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self._settled = ""
        """The text of ids[:_read], final (it ended on a whole character)."""
        self._base = 0
        """Where the decoded window starts (the previous settled boundary: context for the tokens after it)."""
        self._read = 0
        self._head = ""
        """The text of ids[_base:_read] alone."""
        self._backend = _backend_decoder(tokenizer)

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=True))
        return str(self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def extend(self, new_ids: list[int]) -> tuple[str, int]:
        """Add tokens; return (text delta, number of the new tokens kept). Fewer kept means a stop string hit."""
        previous_len = len(self.text)
        start_ids = len(self.ids)
        self.ids += new_ids
        self._update_text()
        if self.stop:
            hit = self._find_stop(max(0, previous_len - self.max_stop))
            if hit is not None:
                self.stopped = True
                kept = self._tokens_to_complete(start_ids, hit)
                self.ids = self.ids[: start_ids + kept]
                self.text = self.text[:hit]
                return self._flush_to(len(self.text)), kept
        return self._flush_to(self._safe_length()), len(new_ids)

    def _update_text(self) -> None:
        window = self.decode(self.ids[self._base :])
        if window.startswith(self._head):
            self.text = self._settled + window[len(self._head) :]
        else:  # a tokenizer whose window text is not its head's plus more: decode everything (rare)
            self.text = self.decode(self.ids)
        if not self.text.endswith("\ufffd"):  # a whole character: settle, the next window starts here
            self._settled = self.text
            self._base, self._read = self._read, len(self.ids)
            self._head = self.decode(self.ids[self._base : self._read])

    def finish(self) -> str:
        """Everything not yet emitted (call once at the end)."""
        return self._flush_to(len(self.text))

    def _flush_to(self, end: int) -> str:
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def _find_stop(self, search_from: int) -> int | None:
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        return min(hits) if hits else None

    def _tokens_to_complete(self, start_ids: int, hit: int) -> int:
        for kept in range(1, len(self.ids) - start_ids + 1):
            text = self.decode(self.ids[: start_ids + kept])
            if any(text.find(s, max(0, hit - self.max_stop)) >= 0 for s in self.stop):
                return kept
        return len(self.ids) - start_ids

    def _safe_length(self) -> int:
        end = len(self.text)
        while end > self.emitted and self.text[end - 1] == "\ufffd":
            end -= 1
        for s in self.stop:
            for n in range(min(len(s) - 1, end - self.emitted), 0, -1):
                if self.text[end - n : end] == s[:n]:
                    end -= n
                    break
        return max(end, self.emitted)


def _backend_decoder(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer, whose ``decode(ids, skip_special_tokens)``
    is what the tokenizer's own ``decode`` returns without clean-up (transformers 5 ``TokenizersBackend._decode``)
    minus its argument handling: a third of a decode here, twice per pass. None for any other tokenizer."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or type(backend).__module__.split(".")[0] != "tokenizers":
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep the tokenizer's own decode
        return None
    kind = type(tokenizer)
    if kind._decode is not TokenizersBackend._decode or kind.decode is not PreTrainedTokenizerBase.decode:
        return None  # a tokenizer that decodes its own way
    return backend
