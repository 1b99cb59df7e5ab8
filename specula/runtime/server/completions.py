"""``POST /v1/completions``: prompt validation, submission, streamed and whole answers.

One HTTP request with a batch of prompts becomes one engine request per prompt
(choice ``index`` = prompt position), all feeding one asyncio queue, so streamed
chunks of different choices interleave in the order the engine produced them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.server.detokenize import IncrementalText
from specula.runtime.server.engine_loop import EngineDeadError, EngineLoop
from specula.runtime.server.errors import APIError
from specula.runtime.server.protocol import (
    ERROR_TYPE_NOT_FOUND,
    ERROR_TYPE_SERVER,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)


@dataclass
class _Choice:
    prompt_len: int
    text: IncrementalText
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class PreparedCompletion:
    """A validated request: token ids per prompt and the engine's sampling params."""

    request: CompletionRequest
    model_name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    completion_id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def prepare(request: CompletionRequest, loop: EngineLoop, tokenizer: Any) -> PreparedCompletion:
    """Check the model name and lengths, tokenize, and build ``SamplingParams``.

    Raises:
        APIError: 404 for an unknown model; 400 for an empty prompt, a token id
            outside the vocabulary, or a prompt (plus ``max_tokens``) longer than the
            context.
    """
    engine = loop.engine
    assert engine is not None
    name = engine.served_model_name
    if request.model is not None and request.model != name:
        raise APIError(
            404,
            f"The model `{request.model}` does not exist; this server serves `{name}`.",
            type=ERROR_TYPE_NOT_FOUND,
            param="model",
            code="model_not_found",
        )
    raw = request.prompt
    if isinstance(raw, str):
        raw = [raw]
    elif raw and isinstance(raw[0], int):
        raw = [raw]
    # The model's vocabulary can be larger than the tokenizer's (padded embeddings).
    vocab = getattr(engine, "vocab_size", None) or len(tokenizer)
    max_len = engine.max_model_len
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    for i, p in enumerate(raw):
        ids = tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else p
        if not ids:
            raise APIError(400, f"prompt {i} is empty", param="prompt")
        if any(t >= vocab for t in ids):
            raise APIError(400, f"prompt {i} has a token id >= the vocabulary size {vocab}",
                           param="prompt")
        if len(ids) >= max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens, but prompt {i} "
                f"has {len(ids)} tokens; at least one token must be left for the completion.",
                param="prompt",
                code="context_length_exceeded",
            )
        max_tokens = request.max_tokens if request.max_tokens is not None else max_len - len(ids)
        if len(ids) + max_tokens > max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens, but {len(ids)} "
                f"prompt tokens plus max_tokens={max_tokens} make {len(ids) + max_tokens}; "
                "reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        prompts.append(list(ids))
        params.append(
            SamplingParams(
                max_tokens=max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=max(request.top_k, 0),
                seed=request.seed,
                stop=request.stop_list() or None,
                stop_token_ids=list(request.stop_token_ids) if request.stop_token_ids else None,
                ignore_eos=request.ignore_eos,
            )
        )
    return PreparedCompletion(request, name, prompts, params)


class CompletionRun:
    """The engine requests of one HTTP request and their accumulated text."""

    def __init__(self, prep: PreparedCompletion, loop: EngineLoop, tokenizer: Any) -> None:
        self.prep = prep
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        stop = prep.request.stop_list()
        self.choices = [_Choice(len(p), IncrementalText(tokenizer, stop)) for p in prep.prompts]
        self._ids = [f"{prep.completion_id}-{i}" for i in range(len(prep.prompts))]
        self._index = {rid: i for i, rid in enumerate(self._ids)}
        self._submitted: list[str] = []

    async def submit(self) -> None:
        """Add every prompt to the engine.

        Raises:
            APIError: 400 when the engine refuses a prompt, 503 when it is not running.
        """
        for rid, ids, params in zip(self._ids, self.prep.prompts, self.prep.params, strict=True):
            self._submitted.append(rid)
            try:
                await self._loop.add_request(rid, ids, params, self._queue)
            except ValueError as exc:
                raise APIError(400, str(exc)) from exc
            except EngineDeadError as exc:
                raise engine_unavailable(exc) from exc

    def abort_unfinished(self) -> None:
        for rid in self._submitted:
            if not self.choices[self._index[rid]].finished:
                self._loop.abort_request(rid)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def next_update(self) -> int | None:
        """Wait for one engine output; apply it; return the choice index it changed.

        Returns ``None`` for an output of an already-finished choice.

        Raises:
            APIError: 503 if the engine died meanwhile.
        """
        out = await self._queue.get()
        if isinstance(out, BaseException):
            raise engine_unavailable(out)
        i = self._index[out.request_id]
        choice = self.choices[i]
        if choice.finished:
            return None
        choice.text.add(out.new_token_ids)
        if out.finished:
            choice.finished = True
            choice.finish_reason = out.finish_reason
        if choice.text.stopped and not choice.finished:
            # The stop string showed up in text before the engine noticed (it may
            # detokenize differently); end the choice here and free its slot.
            choice.finished = True
            choice.finish_reason = "stop"
            self._loop.abort_request(out.request_id)
        if choice.text.stopped:
            choice.finish_reason = "stop"
        return i

    def usage(self) -> UsageInfo:
        prompt = sum(c.prompt_len for c in self.choices)
        completion = sum(len(c.text.token_ids) for c in self.choices)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


def engine_unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"engine unavailable: {exc}", type=ERROR_TYPE_SERVER)


async def complete(prep: PreparedCompletion, loop: EngineLoop, tokenizer: Any) -> CompletionResponse:
    """Run every prompt to completion and return the whole response."""
    run = CompletionRun(prep, loop, tokenizer)
    try:
        await run.submit()
        while not run.done:
            await run.next_update()
    finally:
        run.abort_unfinished()
    choices = [
        CompletionChoice(index=i, text=c.text.text, finish_reason=c.finish_reason)
        for i, c in enumerate(run.choices)
    ]
    return CompletionResponse(
        id=prep.completion_id,
        created=prep.created,
        model=prep.model_name,
        choices=choices,
        usage=run.usage(),
    )


async def start_stream(prep: PreparedCompletion, loop: EngineLoop, tokenizer: Any) -> CompletionRun:
    """Submit the prompts before the response starts, so refusals are plain 4xx."""
    run = CompletionRun(prep, loop, tokenizer)
    try:
        await run.submit()
    except BaseException:
        run.abort_unfinished()
        raise
    return run


async def stream(run: CompletionRun) -> AsyncIterator[str]:
    """Server-sent events: one ``data: {chunk}`` per text delta or finish, then
    optionally a usage chunk, then ``data: [DONE]``.

    A client that disconnects cancels this generator; ``finally`` aborts its engine
    requests so they stop using batch slots.
    """
    prep = run.prep
    include_usage = bool(prep.request.stream_options and prep.request.stream_options.include_usage)

    def chunk(choices: list[dict[str, Any]], usage: UsageInfo | None = None) -> str:
        body: dict[str, Any] = {
            "id": prep.completion_id,
            "object": "text_completion",
            "created": prep.created,
            "model": prep.model_name,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage.model_dump() if usage is not None else None
        return f"data: {json.dumps(body)}\n\n"

    try:
        while not run.done:
            try:
                i = await run.next_update()
            except APIError as exc:
                yield f"data: {json.dumps(exc.body())}\n\n"
                break
            if i is None:
                continue
            c = run.choices[i]
            text = c.text.delta(final=c.finished)
            if text or c.finished:
                yield chunk(
                    [{"index": i, "text": text, "finish_reason": c.finish_reason if c.finished
                      else None, "logprobs": None}]
                )
        else:
            if include_usage:
                yield chunk([], run.usage())
        yield "data: [DONE]\n\n"
    finally:
        run.abort_unfinished()
