"""EAGLE-3 speculative decoding (Li et al., arXiv 2503.01840); vLLM's ``eagle3`` method."""

from specula.runtime.spec_decode.eagle.speculator import Eagle3Speculator

__all__ = ["Eagle3Speculator"]
