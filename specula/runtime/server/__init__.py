"""The runtime's HTTP side: OpenAI-compatible completions, health, Prometheus metrics
and the speculative-config admin API, around one ``LLMEngine`` (``specula serve``)."""
