"""Per-request decoding settings (a subset of vLLM's ``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20
"""The most top log-probabilities a request may ask for per token (OpenAI's bound)."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate (completion tokens, not counting the prompt)."""
    temperature: float = 0.0
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1) disables."""
    seed: int | None = None
    """Seeds the request's random draws: the same seed, prompt and settings give the same
    tokens. ``None``: a seed drawn from torch's global generator."""
    stop: list[str] | None = None
    """Stop strings, matched on the detokenized completion; generation ends at the token
    that completes one (that token is still returned; the caller trims the text)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (the stop token is returned)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    logprobs: int | None = None
    """Return each generated token's log-probability and the ``logprobs`` (0 to
    :data:`MAX_LOGPROBS`) most likely tokens' (vLLM's field of the same name); ``None``:
    none are computed."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (0 to :data:`MAX_LOGPROBS`); such
    a request prefills its whole prompt (no prefix-cache reuse), as in vLLM."""

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
