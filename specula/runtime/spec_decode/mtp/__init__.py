"""DeepSeek-style multi-token prediction (arXiv 2412.19437) as a speculator; vLLM's
``mtp`` method."""

from specula.runtime.spec_decode.mtp.speculator import MTPSpeculator

__all__ = ["MTPSpeculator"]
