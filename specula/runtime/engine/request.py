"""A request's state inside the engine, and its stop conditions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from specula.runtime.engine.sampling_params import SamplingParams


class TokenLogprobs(NamedTuple):
    """One token's log-probability under the target's processed distribution
    (:func:`~specula.runtime.engine.sampler.token_logprobs`) and the most likely tokens'
    ``(token_id, logprob)``, most likely first (``SamplingParams.logprobs`` of them)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """What one :meth:`~specula.runtime.engine.llm_engine.LLMEngine.step` produced for
    one request."""

    request_id: str
    new_token_ids: list[int]
    """Tokens produced by this step (several with speculation). A final eos or stop token
    id is included; the stop *string* is not trimmed (see ``stop_reason``)."""
    finished: bool
    finish_reason: str | None
    """``"stop"`` (eos, stop token or stop string), ``"length"`` (max_tokens or
    max_model_len), ``"abort"``, or ``None`` while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request; ``None`` for eos,
    length, abort, or while running (vLLM's ``CompletionOutput.stop_reason``)."""
    logprobs: list[TokenLogprobs] | None = None
    """One per ``new_token_ids`` entry when the request asked (``SamplingParams.logprobs``)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With ``SamplingParams.prompt_logprobs``, in the request's first output: one per
    prompt token, the first ``None`` (nothing predicts it)."""


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int
    """Seeds every random draw of the request (its own or drawn at random)."""
    token_ids: list[int] = field(init=False)
    """Prompt then output tokens."""
    row: int = -1
    """Row of the engine's per-request device state while running (-1: none)."""
    num_computed_tokens: int = 0
    """Leading tokens whose target KV is cached and valid."""
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def reuses_prefix_cache(self) -> bool:
        """Whether a prefill may start after cached prefix blocks: not while the prompt's
        log-probabilities, which need the logits at every prompt position, are due."""
        return self.params.prompt_logprobs is None or self.num_output_tokens > 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_tokens(self, new_token_ids: list[int], tokenizer: Any,
                      max_model_len: int) -> list[int]:
        """Append tokens in order until a stop condition holds (checked after each token:
        eos unless ``ignore_eos``, a stop token id, a stop string in the detokenized
        completion, ``max_tokens``, ``max_model_len``); returns the tokens appended, those
        after the stop dropped."""
        start, params = len(self.token_ids), self.params
        stop_ids = set(params.stop_token_ids or ())
        for token in new_token_ids:
            self.token_ids.append(token)
            if token in self.eos_token_ids and not params.ignore_eos:
                self.finish_reason = "stop"
            elif token in stop_ids:
                self.finish_reason, self.stop_reason = "stop", token
            elif params.stop and (matched := self._match_stop_string(tokenizer)) is not None:
                self.finish_reason, self.stop_reason = "stop", matched
            elif (self.num_output_tokens >= params.max_tokens
                  or len(self.token_ids) >= max_model_len):
                self.finish_reason = "length"
            if self.finished:
                break
        return self.token_ids[start:]

    def _match_stop_string(self, tokenizer: Any) -> str | None:
        stops = self.params.stop or []
        # Every earlier token was checked already, so a new match must end in the newest
        # token; decoding a tail long enough for the longest stop string suffices (x4:
        # byte-level tokens may carry a fraction of a character).
        window = 4 * max(len(s) for s in stops) + 4
        output = self.token_ids[self.num_prompt_tokens :]
        tail = tokenizer.decode(output[-window:], skip_special_tokens=True)
        return next((s for s in stops if s in tail), None)
