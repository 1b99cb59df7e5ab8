"""``POST /v1/chat/completions``: the messages rendered by the chat template, then a
completion of the rendered prompt (:mod:`~specula.runtime.server.completions`).

The template is the checkpoint's (``chat_template`` in its tokenizer config) unless the
server was started with ``--chat-template FILE`` (runtime config ``chat_template``),
applied by ``transformers``' ``tokenizer.apply_chat_template(messages,
add_generation_prompt=True)``; the rendered text is tokenized without adding special
tokens (the template writes them), as vLLM does.
"""

from __future__ import annotations

from typing import Any

import jinja2

from specula.runtime.server import completions
from specula.runtime.server.engine_loop import EngineLoop
from specula.runtime.server.errors import APIError
from specula.runtime.server.protocol import ChatCompletionRequest


def prepare(
    request: ChatCompletionRequest, loop: EngineLoop, tokenizer: Any, max_n: int
) -> completions.PreparedCompletion:
    """Render and tokenize the messages, then :func:`completions.build`.

    Raises:
        APIError: 404 for an unknown model; 400 when the model has no chat template,
            the template refuses the messages (its message is passed on), or the
            rendered prompt does not fit the context (``param`` ``messages``).
    """
    engine = completions.check_model(request, loop)
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            f"the model `{engine.served_model_name}` has no chat template, so it cannot "
            "serve chat completions; use /v1/completions, or start the server with "
            "--chat-template FILE",
            param="messages", code="no_chat_template",
        )
    messages = [m.template_input() for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise APIError(400, f"the chat template refused these messages: {exc}",
                       param="messages") from exc
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise APIError(400, "the chat template rendered an empty prompt", param="messages")
    top = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens or request.max_tokens
    return completions.build(engine, request, [ids], max_tokens=max_tokens, max_n=max_n,
                             num_top_logprobs=top, prompt_param="messages", chat=True)
