"""Incremental detokenization: streamed deltas always concatenate to the whole text."""

from __future__ import annotations

import random

import pytest

from specula.runtime.server.detokenize import IncrementalText

pytestmark = pytest.mark.runtime


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _feed(tok, ids, stop, rng) -> tuple[IncrementalText, list[str]]:
    acc, deltas, i = IncrementalText(tok, stop), [], 0
    while i < len(ids) and not acc.stopped:
        n = rng.randint(1, 4)  # a speculative step emits 1..k+1 tokens
        acc.add(ids[i : i + n])
        i += n
        deltas.append(acc.delta(final=False))
    deltas.append(acc.delta(final=True))
    return acc, deltas


def test_deltas_concatenate_to_decoded_text(tiny_tokenizer):
    rng = random.Random(0)
    text = "def speculative_decoding(target, draft, k): the quick brown fox ünïcödé ✓"
    ids = tiny_tokenizer(text)["input_ids"]
    for _ in range(20):
        acc, deltas = _feed(tiny_tokenizer, ids, None, rng)
        assert "".join(deltas) == acc.text == _decode(tiny_tokenizer, ids)
        # Multi-byte characters split over byte-level tokens are never streamed half-done.
        assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("stop", [["brown"], ["k)", "zzz"], ["ck b"], ["✓"], ["o"]])
def test_stop_string_is_cut_and_never_streamed(tiny_tokenizer, stop):
    rng = random.Random(1)
    text = "def speculative_decoding(target, draft, k): the quick brown fox ✓ tail"
    ids = tiny_tokenizer(text)["input_ids"]
    full = _decode(tiny_tokenizer, ids)
    expected = full[: min(full.find(s) for s in stop if s in full)]
    for _ in range(20):
        acc, deltas = _feed(tiny_tokenizer, ids, stop, rng)
        assert acc.stopped
        assert acc.text == expected
        assert "".join(deltas) == expected


def test_random_token_streams(tiny_tokenizer):
    # Arbitrary ids (as a random tiny model emits) include lone bytes of multi-byte
    # characters; the invariant must still hold.
    rng = random.Random(2)
    vocab = len(tiny_tokenizer)
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        full = _decode(tiny_tokenizer, ids)
        cand = full[5:7]
        stop = [cand] if len(full) > 8 and cand.strip() and "\ufffd" not in cand else None
        acc, deltas = _feed(tiny_tokenizer, ids, stop, rng)
        assert "".join(deltas) == acc.text
        if stop:
            assert acc.text == full[: full.find(stop[0])]
        else:
            assert acc.text == full
