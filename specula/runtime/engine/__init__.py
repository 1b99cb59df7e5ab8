"""The engine: requests, scheduling, KV cache, model runner, sampling and ``LLMEngine``."""
