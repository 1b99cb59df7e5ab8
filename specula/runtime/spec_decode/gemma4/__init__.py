"""Gemma4 multi-token prediction with a ``gemma4_assistant`` draft that reads the
target's KV cache (method ``gemma4_mtp``)."""

from specula.runtime.spec_decode.gemma4.speculator import Gemma4MTPSpeculator

__all__ = ["Gemma4MTPSpeculator"]
