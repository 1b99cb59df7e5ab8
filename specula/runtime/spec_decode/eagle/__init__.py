"""EAGLE-3 drafting."""

from specula.runtime.spec_decode.eagle.speculator import EagleSpeculator

__all__ = ["EagleSpeculator"]
