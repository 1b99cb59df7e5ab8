"""``POST /v1/completions`` and ``POST /v1/chat/completions``: prompt validation,
submission, streamed and whole answers in either route's shape.

Each choice (``index`` = ``prompt_index * n + j``, as vLLM numbers them) is one engine
request; all feed one asyncio queue, so streamed chunks interleave in the engine's order.
A chat prompt is the chat template's text, tokenized without adding special tokens (the
template writes them), as vLLM does.  Log-probabilities are the engine's; ``-inf``
(excluded by top-k or top-p) is answered as -9999.0, as vLLM does, since JSON has no
infinity; a token's string is ``tokenizer.decode([token_id])``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jinja2

from specula.runtime.engine.request import TokenLogprobs
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.server.detokenize import IncrementalText
from specula.runtime.server.engine_loop import EngineDeadError, EngineLoop
from specula.runtime.server.protocol import (
    ERROR_TYPE_NOT_FOUND,
    ERROR_TYPE_SERVER,
    INT64_MAX,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)

_MIN_LOGPROB = -9999.0


@dataclass
class _Choice:
    prompt_index: int
    params: SamplingParams
    text: IncrementalText
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """With ``logprobs``, one per token of :attr:`text` (``text.token_ids``)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_streamed: int = 0
    """Leading :attr:`logprobs` already sent."""
    text_offset: int = 0
    """Characters of the tokens already sent (``text_offset`` of the next one)."""
    echo: str | None = None
    """The prompt's text while it is still to be sent before the completion's."""


def _completion_prompts(request: CompletionRequest, tokenizer: Any,
                        vocab: int) -> tuple[list[list[int]], list[str] | None]:
    """The token ids of each prompt, and with ``echo`` each prompt's text; ``vocab`` is
    the model's vocabulary size (which can exceed the tokenizer's: padded embeddings)."""
    raw: Any = request.prompt
    if isinstance(raw, str) or isinstance(raw[0], int):
        raw = [raw]
    prompts: list[list[int]] = []
    for i, p in enumerate(raw):
        ids = tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else p
        if not ids:
            raise APIError(400, f"prompt {i} is empty", param="prompt")
        if any(t >= vocab for t in ids):
            raise APIError(400, f"prompt {i} has a token id >= the vocabulary size {vocab}",
                           param="prompt")
        prompts.append(list(ids))
    if not request.echo:
        return prompts, None
    return prompts, [p if isinstance(p, str) else tokenizer.decode(
        p, skip_special_tokens=True, clean_up_tokenization_spaces=False) for p in raw]


def _render_chat(request: ChatCompletionRequest, tokenizer: Any, model_name: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"the model `{model_name}` has no chat template, so it cannot serve "
                       "chat completions; use /v1/completions, or start the server with "
                       "--chat-template FILE", param="messages", code="no_chat_template")
    messages = [m.template_input() for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise APIError(400, f"the chat template refused these messages: {exc}",
                       param="messages") from exc
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise APIError(400, "the chat template rendered an empty prompt", param="messages")
    return ids


def engine_unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"engine unavailable: {exc}", type=ERROR_TYPE_SERVER)


class CompletionRun:
    """One HTTP request's engine requests (choice ``i`` samples prompt ``i // n``) and their text.

    Raises:
        APIError: 404 for an unknown model; 400 for an empty prompt, a token id outside the
            vocabulary, a model without a chat template, messages the template refuses (its message
            is passed on), ``n`` above ``max_n``, or a prompt (plus ``max_tokens``) longer than the
            context (``param`` ``prompt`` or ``messages``, or ``max_tokens``).
    """

    def __init__(self, request: GenerationRequest, loop: EngineLoop, tokenizer: Any,
                 max_n: int) -> None:
        engine = loop.engine
        assert engine is not None
        self.model_name = name = engine.served_model_name
        if request.model is not None and request.model != name:
            raise APIError(404, f"The model `{request.model}` does not exist; this server serves "
                           f"`{name}`.", type=ERROR_TYPE_NOT_FOUND, param="model",
                           code="model_not_found")
        self.chat = isinstance(request, ChatCompletionRequest)
        if isinstance(request, ChatCompletionRequest):
            prompts, echo = [_render_chat(request, tokenizer, name)], None
            max_tokens = request.max_completion_tokens or request.max_tokens
            top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        else:
            assert isinstance(request, CompletionRequest)
            prompts, echo = _completion_prompts(request, tokenizer, engine.vocab_size)
            max_tokens, top_logprobs = request.max_tokens, request.logprobs
        if request.n > max_n:
            raise APIError(400, f"n={request.n} exceeds this server's maximum of {max_n} "
                           "samples per prompt", param="n")
        max_len = engine.max_model_len
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        self.choices: list[_Choice] = []
        for i, ids in enumerate(prompts):
            if len(ids) >= max_len:
                raise APIError(400, f"This model's maximum context length is {max_len} tokens, but "
                               f"{'the templated prompt' if self.chat else f'prompt {i}'} has "
                               f"{len(ids)} tokens; at least one token must be left for the "
                               "completion.", param="messages" if self.chat else "prompt",
                               code="context_length_exceeded")
            limit = max_tokens if max_tokens is not None else max_len - len(ids)
            if len(ids) + limit > max_len:
                raise APIError(400, f"This model's maximum context length is {max_len} tokens, but "
                               f"{len(ids)} prompt tokens plus max_tokens={limit} make "
                               f"{len(ids) + limit}; reduce the prompt or max_tokens.",
                               param="max_tokens", code="context_length_exceeded")
            for j in range(request.n):
                seed = request.seed
                if seed is not None:
                    seed = (seed + j + INT64_MAX + 1) % 2**64 - INT64_MAX - 1
                params = SamplingParams(
                    max_tokens=limit, temperature=request.temperature, top_p=request.top_p,
                    top_k=max(request.top_k, 0), seed=seed, stop=stop or None,
                    stop_token_ids=list(request.stop_token_ids or []) or None,
                    ignore_eos=request.ignore_eos, logprobs=top_logprobs,
                    prompt_logprobs=top_logprobs if echo is not None else None)
                self.choices.append(_Choice(i, params, IncrementalText(tokenizer, stop),
                                            echo=echo[i] if echo is not None else None))
        self.request, self.prompts = request, prompts
        self.top_logprobs, self.tokenizer, self._loop = top_logprobs, tokenizer, loop
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._queue: asyncio.Queue = asyncio.Queue()

    async def submit(self) -> None:
        """Add every choice's request to the engine; on failure abort those added.

        Raises:
            APIError: 400 when the engine refuses a prompt, 503 when it is not running."""
        try:
            for i, choice in enumerate(self.choices):
                await self._loop.add_request(
                    f"{self.id}-{i}", self.prompts[choice.prompt_index], choice.params, self._queue)
        except BaseException as exc:
            self.abort_unfinished()
            if isinstance(exc, ValueError):
                raise APIError(400, str(exc)) from exc
            if isinstance(exc, EngineDeadError):
                raise engine_unavailable(exc) from exc
            raise

    def abort_unfinished(self) -> None:
        for i, choice in enumerate(self.choices):
            if not choice.finished:
                self._loop.abort_request(f"{self.id}-{i}")

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def next_update(self) -> int | None:
        """Wait for one engine output and apply it; return the index of the choice it
        changed, ``None`` for an output of an already-finished choice.

        Raises:
            APIError: 503 if the engine died meanwhile.
        """
        out = await self._queue.get()
        if isinstance(out, BaseException):
            raise engine_unavailable(out)
        i = int(out.request_id.rsplit("-", 1)[1])
        choice = self.choices[i]
        if choice.finished:
            return None
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if out.logprobs is not None and not choice.text.stopped:
            choice.logprobs += out.logprobs
        choice.text.add(out.new_token_ids)
        if out.finished:
            choice.finished, choice.finish_reason = True, out.finish_reason
        if choice.text.stopped:
            if not choice.finished:
                # The stop string showed up in text before the engine noticed (it may
                # detokenize differently); end the choice here and free its slot.
                self._loop.abort_request(out.request_id)
            choice.finished, choice.finish_reason = True, "stop"
        return i

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.text.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _body(self, choices: list[dict[str, Any]], suffix: str = "", **extra: Any) -> dict:
        kind = "chat.completion" + suffix if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.model_name, "choices": choices, **extra}

    def _choice(self, i: int, text: str, whole: bool = False) -> dict[str, Any]:
        """Choice ``i``'s part not sent yet: ``text`` and the new log-probabilities (in
        a completion's first part, the echoed prompt's); ``whole``: as the one choice
        of a whole answer (chat: ``message`` instead of ``delta``)."""
        c = self.choices[i]
        lp: dict[str, Any] | None = None
        if self.top_logprobs is not None:
            lp = self._chat_logprobs(c) if self.chat else self._completion_logprobs(c)
        if not self.chat:
            body: dict[str, Any] = {"text": (c.echo or "") + text}
        elif whole:
            body = {"message": {"role": "assistant", "content": text}}
        else:
            body = {"delta": {"content": text} if text or not c.finished else {}}
        c.num_streamed, c.echo = len(c.logprobs), None
        return {"index": i, **body, "logprobs": lp,
                "finish_reason": c.finish_reason if c.finished else None}

    def _completion_logprobs(self, c: _Choice) -> dict[str, list[Any]]:
        """OpenAI's legacy shape for ``c``'s unsent tokens (the prompt's first while its
        echo is unsent); ``text_offset`` continues from ``c.text_offset``."""
        ids, lps = c.text.token_ids[c.num_streamed:], list(c.logprobs[c.num_streamed:])
        if c.echo is not None:
            prompt = self.prompts[c.prompt_index]
            ids, lps = prompt + ids, (c.prompt_logprobs or [None] * len(prompt)) + lps
        out: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(ids, lps, strict=True):
            text = self.tokenizer.decode([token_id])
            out["tokens"].append(text)
            out["text_offset"].append(c.text_offset)
            c.text_offset += len(text)
            out["token_logprobs"].append(None if lp is None else max(lp.logprob, _MIN_LOGPROB))
            out["top_logprobs"].append(None if lp is None else {
                self.tokenizer.decode([t]): max(v, _MIN_LOGPROB) for t, v in lp.top})
        return out

    def _chat_logprobs(self, c: _Choice) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.decode([token_id])
            return {"token": text, "logprob": max(logprob, _MIN_LOGPROB),
                    "bytes": list(text.encode())}

        pairs = zip(c.text.token_ids[c.num_streamed:], c.logprobs[c.num_streamed:], strict=True)
        return {"content": [
            {**entry(t, lp.logprob), "top_logprobs": [entry(*top) for top in lp.top]}
            for t, lp in pairs]}

    async def complete(self) -> dict[str, Any]:
        """Run every choice to completion and return the whole response."""
        await self.submit()
        try:
            while not self.done:
                await self.next_update()
        finally:
            self.abort_unfinished()
        choices = [self._choice(i, c.text.delta(final=True), whole=True)
                   for i, c in enumerate(self.choices)]
        return self._body(choices, usage=self.usage())

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events, once :meth:`submit` returned: one ``data: {chunk}`` per text delta,
        new log-probabilities or finish, the usage chunk if asked, then ``data: [DONE]``. Its
        ``finally`` aborts the engine requests left when a client that disconnects cancels it."""
        options = self.request.stream_options
        with_usage = bool(options and options.include_usage)

        def chunk(choices: list[dict[str, Any]], usage: dict | None = None) -> str:
            extra = {"usage": usage} if with_usage else {}
            return f"data: {json.dumps(self._body(choices, '.chunk', **extra))}\n\n"

        try:
            if self.chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for i in range(len(self.choices))])
            while not self.done:
                try:
                    i = await self.next_update()
                except APIError as exc:
                    yield f"data: {json.dumps(exc.body)}\n\n"
                    break
                if i is None:
                    continue
                c = self.choices[i]
                text = c.text.delta(final=c.finished)
                if text or c.finished or len(c.logprobs) > c.num_streamed or c.echo is not None:
                    yield chunk([self._choice(i, text)])
            else:
                if with_usage:
                    yield chunk([], self.usage())
            yield "data: [DONE]\n\n"
        finally:
            self.abort_unfinished()
