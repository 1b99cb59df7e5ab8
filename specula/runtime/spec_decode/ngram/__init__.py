"""Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram``
method): draft tokens are copied from an earlier occurrence of the sequence's last n-gram,
so no draft model is needed."""

from specula.runtime.spec_decode.ngram.speculator import NgramSpeculator, ngram_lookup

__all__ = ["NgramSpeculator", "ngram_lookup"]
