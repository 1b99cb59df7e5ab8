"""Speculative decoding: the speculator hierarchy, the rejection sampler and its counters."""
