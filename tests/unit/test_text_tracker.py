"""Incremental detokenisation: the streamed text equals a whole decode, whatever the chunking."""

from __future__ import annotations

import random

import pytest

from agent_mtp.engine.text import TextTracker
from tests.tiny import tiny_tokenizer

TEXTS = [
    "Plain ASCII text with spaces, punctuation; and numbers 12345.",
    "Grüße aus Köln: naïve café, déjà vu — “quotes” and ‘more’.",
    "中文字符 mixed with English and 日本語のテキスト, emoji 🙂🚀 and ✓ marks.",
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n\n- item 1\n- item 2',
]


def _decode(tok: object, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))  # type: ignore[attr-defined]


def _feed(tracker: TextTracker, ids: list[int], rng: random.Random) -> tuple[str, list[int]]:
    """Feed ``ids`` in random chunks of 1-5 tokens; return (streamed text, kept ids)."""
    streamed, kept, i = [], [], 0
    while i < len(ids) and not tracker.stopped:
        chunk = ids[i : i + rng.randint(1, 5)]
        delta, n = tracker.extend(chunk)
        streamed.append(delta)
        kept += chunk[:n]
        i += len(chunk)
    streamed.append(tracker.finish())
    return "".join(streamed), kept


def _encoded(text: str) -> tuple[object, list[int], str]:
    tok = tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    return tok, ids, _decode(tok, ids)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_whole_decode(text: str) -> None:
    tok, ids, whole = _encoded(text)
    rng = random.Random(0)
    for _ in range(20):
        tracker = TextTracker(tok, ())
        streamed, kept = _feed(tracker, ids, rng)
        assert streamed == whole and kept == ids
        assert tracker.text == whole


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_cut_the_text_and_the_ids_as_a_whole_decode_would(text: str) -> None:
    tok, ids, whole = _encoded(text)
    rng = random.Random(1)
    for start in range(2, len(whole) - 4, max(1, len(whole) // 9)):
        stop = whole[start : start + rng.randint(1, 4)]
        tracker = TextTracker(tok, (stop,))
        streamed, kept = _feed(tracker, ids, rng)
        assert streamed == whole[: whole.find(stop)], stop
        assert stop in _decode(tok, kept) and stop not in _decode(tok, kept[:-1]), stop


def test_text_is_held_back_inside_a_character_and_a_stop_prefix() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("a🙂", add_special_tokens=False)
    assert len(ids) > 2  # the emoji's four bytes are several tokens
    tracker = TextTracker(tok, ())
    deltas = [tracker.extend([i])[0] for i in ids]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == "a🙂"
    tracker = TextTracker(tok, ("xyz",))
    assert tracker.extend(tok.encode("abc xy", add_special_tokens=False))[0] == "abc "  # "xy" may start the stop
    assert tracker.extend(tok.encode("w", add_special_tokens=False))[0] == "xyw"


def _metaspace_tokenizer() -> object:
    """A SentencePiece-style tokenizer: words carry a leading "▁" that decoding turns into a space, except at the
    start of the decoded ids (so a window's text is not a plain suffix of the whole text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁the", "▁weather", "▁in", "▁Paris", "▁is", "▁sunny", "▁and", "▁warm", "[UNK]"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")


def test_a_tokenizer_that_strips_the_first_space_streams_the_whole_decode() -> None:
    tok = _metaspace_tokenizer()
    ids = tok.encode("the weather in Paris is sunny and warm", add_special_tokens=False)  # type: ignore[attr-defined]
    whole = _decode(tok, ids)
    assert whole == "the weather in Paris is sunny and warm"
    assert _decode(tok, ids[1:]) == "weather in Paris is sunny and warm"  # no leading space: a window needs its head
    rng = random.Random(2)
    for _ in range(20):
        streamed, kept = _feed(TextTracker(tok, ()), ids, rng)
        assert streamed == whole and kept == ids
    streamed, _ = _feed(TextTracker(tok, (" and",)), ids, rng)
    assert streamed == "the weather in Paris is sunny"


def test_the_backend_decode_is_the_tokenizers_own() -> None:
    """The tracker decodes through the ``tokenizers`` backend of a fast tokenizer (a third of a decode saved, twice
    per pass): it returns what the tokenizer's own decode does, special tokens and odd bytes included; tokenizers
    that decode their own way keep their decode."""
    from agent_mtp.engine.text import _backend_decoder

    rng = random.Random(4)
    for tok in (tiny_tokenizer(), _metaspace_tokenizer()):
        tracker = TextTracker(tok, ())
        assert tracker._backend is not None
        size = len(tok)  # type: ignore[arg-type]
        for _ in range(200):
            ids = [rng.randrange(size) for _ in range(rng.randint(0, 12))]
            assert tracker.decode(ids) == _decode(tok, ids)

    class OwnDecode(type(tiny_tokenizer())):  # type: ignore[misc]
        def decode(self, *args: object, **kwargs: object) -> str:
            return "own"

    own = tiny_tokenizer()
    own.__class__ = OwnDecode
    assert _backend_decoder(own) is None and TextTracker(own, ()).decode([1, 2]) == "own"
