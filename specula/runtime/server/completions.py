"""``POST /v1/completions`` and ``POST /v1/chat/completions``: prompt validation,
submission, streamed and whole answers in either route's shape.

One HTTP request with a batch of prompts and ``n`` samples each becomes one engine
request per choice (choice ``index`` = ``prompt_index * n + j``, as vLLM numbers them),
all feeding one asyncio queue, so streamed chunks of different choices interleave in
the order the engine produced them.

Log-probabilities are the engine's (:class:`~specula.runtime.engine.request.TokenLogprobs`:
the target's distribution after the request's temperature, top-k and top-p; greedy
requests: the raw logits' log-softmax); ``-inf`` (a token the request's top-k or top-p
excludes) is answered as -9999.0, as vLLM does, since JSON has no infinity. A token's
string is ``tokenizer.decode([token_id])``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from specula.runtime.engine.request import TokenLogprobs
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.server.detokenize import IncrementalText
from specula.runtime.server.engine_loop import EngineDeadError, EngineLoop
from specula.runtime.server.errors import APIError
from specula.runtime.server.protocol import (
    ERROR_TYPE_NOT_FOUND,
    ERROR_TYPE_SERVER,
    INT64_MAX,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    GenerationRequest,
    UsageInfo,
)

_MIN_LOGPROB = -9999.0


@dataclass
class _Choice:
    prompt_index: int
    text: IncrementalText
    finished: bool = False
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    """Generated tokens that carry log-probabilities (with ``logprobs``)."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_streamed: int = 0
    """Leading :attr:`logprobs` already streamed."""
    text_offset: int = 0
    """Characters of the tokens already streamed (``text_offset`` of the next one)."""
    started: bool = False
    """Its first chunk (the echoed prompt) went out."""


@dataclass
class PreparedCompletion:
    """A validated request: token ids per prompt and the engine's sampling params per
    choice."""

    model_name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    """``len(prompts) * n``: choice ``i`` samples prompt ``i // n``."""
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool
    num_top_logprobs: int | None
    """``None``: no log-probabilities."""
    chat: bool = False
    echo: list[str] | None = None
    """The prompts' text, prepended to each choice's text."""
    completion_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.completion_id:
            prefix = "chatcmpl" if self.chat else "cmpl"
            self.completion_id = f"{prefix}-{uuid.uuid4().hex}"


def check_model(request: GenerationRequest, loop: EngineLoop) -> Any:
    """The engine, if ``request.model`` names it (or nothing).

    Raises:
        APIError: 404 for an unknown model.
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
    return engine


def build(
    engine: Any, request: GenerationRequest, prompts: list[list[int]], *,
    max_tokens: int | None, max_n: int, num_top_logprobs: int | None = None,
    echo: list[str] | None = None, prompt_param: str = "prompt", chat: bool = False,
) -> PreparedCompletion:
    """Check ``n`` and the lengths and build ``n`` ``SamplingParams`` per prompt
    (sample ``j`` seeded ``seed + j``, wrapped into int64, when ``seed`` is given).

    Raises:
        APIError: 400 for ``n`` above ``max_n``, or a prompt (plus ``max_tokens``)
            longer than the context (``param`` is ``prompt_param`` or ``max_tokens``).
    """
    if request.n > max_n:
        raise APIError(400, f"n={request.n} exceeds this server's maximum of {max_n} "
                       "samples per prompt", param="n")
    max_len = engine.max_model_len
    params: list[SamplingParams] = []
    for i, ids in enumerate(prompts):
        which = f"prompt {i}" if prompt_param == "prompt" else "the templated prompt"
        if len(ids) >= max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens, but {which} "
                f"has {len(ids)} tokens; at least one token must be left for the completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        limit = max_tokens if max_tokens is not None else max_len - len(ids)
        if len(ids) + limit > max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens, but {len(ids)} "
                f"prompt tokens plus max_tokens={limit} make {len(ids) + limit}; "
                "reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        for j in range(request.n):
            seed = request.seed
            if seed is not None:
                seed = (seed + j + INT64_MAX + 1) % 2**64 - INT64_MAX - 1
            params.append(SamplingParams(
                max_tokens=limit,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=max(request.top_k, 0),
                seed=seed,
                stop=request.stop_list() or None,
                stop_token_ids=list(request.stop_token_ids) if request.stop_token_ids else None,
                ignore_eos=request.ignore_eos,
                logprobs=num_top_logprobs,
                prompt_logprobs=num_top_logprobs if echo is not None else None,
            ))
    return PreparedCompletion(
        engine.served_model_name, prompts, params, request.n, request.stop_list(),
        request.stream, bool(request.stream_options and request.stream_options.include_usage),
        num_top_logprobs, chat, echo,
    )


def prepare(
    request: CompletionRequest, loop: EngineLoop, tokenizer: Any, max_n: int
) -> PreparedCompletion:
    """Check the model name, tokenize, and :func:`build`.

    Raises:
        APIError: 404 for an unknown model; 400 for an empty prompt, a token id
            outside the vocabulary, and :func:`build`'s refusals.
    """
    engine = check_model(request, loop)
    raw = request.prompt
    if isinstance(raw, str):
        raw = [raw]
    elif raw and isinstance(raw[0], int):
        raw = [raw]
    # The model's vocabulary can be larger than the tokenizer's (padded embeddings).
    vocab = getattr(engine, "vocab_size", None) or len(tokenizer)
    prompts: list[list[int]] = []
    for i, p in enumerate(raw):
        ids = tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else p
        if not ids:
            raise APIError(400, f"prompt {i} is empty", param="prompt")
        if any(t >= vocab for t in ids):
            raise APIError(400, f"prompt {i} has a token id >= the vocabulary size {vocab}",
                           param="prompt")
        prompts.append(list(ids))
    echo = None
    if request.echo:
        echo = [p if isinstance(p, str) else _decode(tokenizer, p) for p in raw]
    return build(engine, request, prompts, max_tokens=request.max_tokens, max_n=max_n,
                 num_top_logprobs=request.logprobs, echo=echo)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class CompletionRun:
    """The engine requests of one HTTP request and their accumulated text."""

    def __init__(self, prep: PreparedCompletion, loop: EngineLoop, tokenizer: Any) -> None:
        self.prep = prep
        self.tokenizer = tokenizer
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.choices = [_Choice(i // prep.n, IncrementalText(tokenizer, prep.stop))
                        for i in range(len(prep.params))]
        self._ids = [f"{prep.completion_id}-{i}" for i in range(len(self.choices))]
        self._index = {rid: i for i, rid in enumerate(self._ids)}
        self._submitted: list[str] = []

    async def submit(self) -> None:
        """Add every choice's request to the engine.

        Raises:
            APIError: 400 when the engine refuses a prompt, 503 when it is not running.
        """
        for rid, choice, params in zip(self._ids, self.choices, self.prep.params, strict=True):
            self._submitted.append(rid)
            try:
                await self._loop.add_request(
                    rid, self.prep.prompts[choice.prompt_index], params, self._queue)
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
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if out.logprobs is not None and not choice.text.stopped:
            choice.token_ids += out.new_token_ids
            choice.logprobs += out.logprobs
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
        prompt = sum(len(p) for p in self.prep.prompts)
        completion = sum(len(c.text.token_ids) for c in self.choices)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    # -- log-probabilities in either route's shape -------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, c: _Choice, start: int, echo: bool) -> CompletionLogprobs:
        """The legacy shape for ``c``'s tokens from ``start`` (with ``echo``, the prompt's
        tokens first), offsets continuing from ``c.text_offset``."""
        ids, lps = c.token_ids[start:], list(c.logprobs[start:])
        if echo:
            ids = self.prep.prompts[c.prompt_index] + ids
            lps = (c.prompt_logprobs or [None] * len(self.prep.prompts[c.prompt_index])) + lps
        out = CompletionLogprobs()
        for token_id, lp in zip(ids, lps, strict=True):
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.text_offset.append(c.text_offset)
            c.text_offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(max(lp.logprob, _MIN_LOGPROB))
            out.top_logprobs.append(
                {self.token_text(t): max(v, _MIN_LOGPROB) for t, v in lp.top})
        return out

    def chat_logprobs(self, c: _Choice, start: int) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": max(logprob, _MIN_LOGPROB),
                    "bytes": list(text.encode())}

        return ChatLogprobs(content=[
            ChatTokenLogprob(**entry(t, lp.logprob),
                             top_logprobs=[ChatTopLogprob(**entry(*top)) for top in lp.top])
            for t, lp in zip(c.token_ids[start:], c.logprobs[start:], strict=True)
        ])


def engine_unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"engine unavailable: {exc}", type=ERROR_TYPE_SERVER)


async def complete(
    prep: PreparedCompletion, loop: EngineLoop, tokenizer: Any
) -> CompletionResponse | ChatCompletionResponse:
    """Run every choice to completion and return the whole response."""
    run = CompletionRun(prep, loop, tokenizer)
    try:
        await run.submit()
        while not run.done:
            await run.next_update()
    finally:
        run.abort_unfinished()
    logprobs = prep.num_top_logprobs is not None
    if prep.chat:
        return ChatCompletionResponse(
            id=prep.completion_id, created=prep.created, model=prep.model_name,
            choices=[ChatChoice(index=i, message=ChatResponseMessage(content=c.text.text),
                                finish_reason=c.finish_reason,
                                logprobs=run.chat_logprobs(c, 0) if logprobs else None)
                     for i, c in enumerate(run.choices)],
            usage=run.usage(),
        )
    echo = prep.echo
    choices = [
        CompletionChoice(
            index=i, text=(echo[c.prompt_index] if echo else "") + c.text.text,
            finish_reason=c.finish_reason,
            logprobs=run.completion_logprobs(c, 0, echo is not None) if logprobs else None,
        )
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
    """Server-sent events: one ``data: {chunk}`` per text delta, new log-probabilities
    or finish, then optionally a usage chunk, then ``data: [DONE]``. Chat chunks
    (``chat.completion.chunk``) open each choice with ``delta.role``; completions with
    ``echo`` open it with the prompt.

    A client that disconnects cancels this generator; ``finally`` aborts its engine
    requests so they stop using batch slots.
    """
    prep = run.prep
    logprobs = prep.num_top_logprobs is not None

    def chunk(choices: list[dict[str, Any]], usage: UsageInfo | None = None) -> str:
        body: dict[str, Any] = {
            "id": prep.completion_id,
            "object": "chat.completion.chunk" if prep.chat else "text_completion",
            "created": prep.created,
            "model": prep.model_name,
            "choices": choices,
        }
        if prep.include_usage:
            body["usage"] = usage.model_dump() if usage is not None else None
        return f"data: {json.dumps(body)}\n\n"

    def delta(i: int, c: _Choice, text: str) -> dict[str, Any]:
        lp: Any = None
        if prep.chat:
            if logprobs:
                lp = run.chat_logprobs(c, c.num_streamed).model_dump()
            body = {"index": i, "delta": {"content": text} if text or not c.finished else {}}
        else:
            echo = prep.echo is not None and not c.started
            if echo:
                text = prep.echo[c.prompt_index] + text  # type: ignore[index]
            if logprobs:
                lp = run.completion_logprobs(c, c.num_streamed, echo).model_dump()
            body = {"index": i, "text": text}
        c.num_streamed, c.started = len(c.logprobs), True
        return {**body, "logprobs": lp, "finish_reason": c.finish_reason if c.finished else None}

    try:
        if prep.chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}
                         for i in range(len(run.choices))])
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
            if text or c.finished or len(c.logprobs) > c.num_streamed or (
                    prep.echo is not None and not c.started):
                yield chunk([delta(i, c, text)])
        else:
            if prep.include_usage:
                yield chunk([], run.usage())
        yield "data: [DONE]\n\n"
    finally:
        run.abort_unfinished()
