"""Speculative decoding with a plain, smaller draft model of the same vocabulary
(Leviathan et al., arXiv 2211.17192); vLLM's ``draft_model`` method."""

from specula.runtime.spec_decode.draft_model.speculator import PlainDraftModelSpeculator

__all__ = ["PlainDraftModelSpeculator"]
