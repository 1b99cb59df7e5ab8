"""The ``openai`` client against a real ``specula serve`` process (tiny Llama target,
its 1-layer draft as a ``draft_model`` speculator, a chat template from
``--chat-template FILE``): both routes, streamed and not, every field the server
implements, greedy output and log-probabilities against ``transformers``, and every
refusal raised as the client's own exception type while the server keeps serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from test_server_cli import _free_port
from transformers import AutoTokenizer

pytestmark = pytest.mark.runtime

MODEL = "tiny"
MAX_MODEL_LEN = 128
MAX_N = 4
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "You verify drafts."},
            {"role": "user", "content": "the quick brown fox"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory, tiny_llama_target: Path, tiny_llama_draft: Path) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("openai-server")
    (tmp / "template.jinja").write_text(TEMPLATE)
    port = _free_port()
    (tmp / "runtime.json").write_text(json.dumps({
        "model": f"file://{tiny_llama_target}", "served_model_name": MODEL, "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN, "host": "127.0.0.1", "port": port, "max_n": MAX_N,
        "speculator": {"method": "draft_model", "model": f"file://{tiny_llama_draft}",
                       "num_speculative_tokens": 3},
    }))
    proc = subprocess.Popen(
        [sys.executable, "-m", "specula.cli", "serve", "--config", str(tmp / "runtime.json"),
         "--chat-template", str(tmp / "template.jinja")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail(f"server never became healthy (exit={proc.poll()})")
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_target: Path):
    tok = AutoTokenizer.from_pretrained(tiny_llama_target)
    tok.chat_template = TEMPLATE
    return tok


def templated_ids(tokenizer, messages=MESSAGES) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-softmax of ``transformers``' logits at each position."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ---- chat ----------------------------------------------------------------------------


def test_greedy_chat_equals_completion_of_templated_prompt(client, tokenizer, hf_model,
                                                           tiny_llama_target, hf_greedy):
    ids = templated_ids(tokenizer)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    [choice] = chat.choices
    assert (choice.index, choice.message.role, choice.finish_reason) == (0, "assistant", "length")
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 12
    text = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, **GREEDY)
    assert choice.message.content == text.choices[0].text
    expected = hf_greedy(hf_model(tiny_llama_target), ids, 12)
    assert choice.message.content == decode(tokenizer, expected)


def test_chat_stream_with_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=10, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.finish_reason is None
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in body)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs_are_the_targets(client, tokenizer, hf_model, tiny_llama_target, hf_greedy):
    ids = templated_ids(tokenizer)
    hf = hf_model(tiny_llama_target)
    expected = hf_greedy(hf, ids, 8)
    ref = hf_logprobs(hf, ids + expected)
    for stream in (False, True):
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                              logprobs=True, top_logprobs=3, stream=stream, **GREEDY)
        if stream:
            content = [t for c in resp if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.content]
        else:
            content = resp.choices[0].logprobs.content
        assert len(content) == 8
        for j, (token_id, entry) in enumerate(zip(expected, content, strict=True)):
            row = ref[len(ids) - 1 + j]
            assert entry.token == tokenizer.decode([token_id])
            assert entry.bytes == list(entry.token.encode())
            assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert entry.top_logprobs[0].token == entry.token  # greedy: ranks first
            assert tops == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_chat_stop_seed_top_p_and_content_parts(client):
    base = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, **GREEDY)
    text = base.choices[0].message.content
    stop = text[3:5]
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, stop=[stop],
                                         **GREEDY)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    parts = [{"role": "system", "content": "You verify drafts."},
             {"role": "user", "content": [{"type": "text", "text": "the quick brown fox"}]}]
    same = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=16, **GREEDY)
    assert same.choices[0].message.content == text
    sampled = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                              temperature=0.9, top_p=0.9, seed=11)
               for _ in range(2)]
    assert sampled[0].choices[0].message.content == sampled[1].choices[0].message.content


def test_chat_n_samples(client):
    greedy = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=3,
                                            **GREEDY)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 24
    sampled = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, n=4,
                                             temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                                 n=4, temperature=1.0, seed=5, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = ["" for _ in texts]
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == texts  # seeded: the same samples, streamed or not


# ---- completions ---------------------------------------------------------------------


def test_completion_n_samples(client):
    greedy = client.completions.create(model=MODEL, prompt=["a fox", "the draft"], max_tokens=6,
                                       n=2, **GREEDY)
    texts = [c.text for c in greedy.choices]
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]
    sampled = client.completions.create(model=MODEL, prompt="a fox", max_tokens=12, n=4, seed=1,
                                        temperature=1.0, extra_body={"ignore_eos": True})
    assert len({c.text for c in sampled.choices}) > 1
    one = client.completions.create(model=MODEL, prompt="a fox", max_tokens=12, seed=1,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    assert one.choices[0].text == sampled.choices[0].text  # sample 0 keeps the seed


def test_completion_echo_and_logprobs(client, tokenizer, hf_model, tiny_llama_target, hf_greedy):
    prompt = "the quick brown fox"
    ids = tokenizer(prompt)["input_ids"]
    hf = hf_model(tiny_llama_target)
    expected = hf_greedy(hf, ids, 6)
    ref = hf_logprobs(hf, ids + expected)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True,
                                       logprobs=2, **GREEDY)
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    all_ids = ids + expected
    assert lp.tokens == [tokenizer.decode([t]) for t in all_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(all_ids)):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1][all_ids[j]].item(), abs=1e-4)
        assert len(lp.top_logprobs[j]) <= 2
        values = list(lp.top_logprobs[j].values())
        assert values == sorted(values, reverse=True)
    for j in range(len(ids), len(all_ids)):  # greedy: the chosen token ranks first
        assert next(iter(lp.top_logprobs[j])) == lp.tokens[j]
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(all_ids))]
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True,
                                              logprobs=2, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    no_echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=0,
                                        **GREEDY)
    assert no_echo.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in expected]
    assert no_echo.choices[0].logprobs.top_logprobs == [{}] * 6


def test_completion_stream_with_usage(client):
    whole = client.completions.create(model=MODEL, prompt="a fox", max_tokens=8, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="a fox", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


# ---- refusals ------------------------------------------------------------------------

LONG = "fox " * MAX_MODEL_LEN
BAD_CHAT = [
    ("unknown_role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("message_without_content", {"messages": [{"role": "user"}]}, "messages"),
    ("content_not_text", {"messages": [{"role": "user", "content": 42}]}, "messages"),
    ("message_not_an_object", {"messages": ["hi"]}, "messages"),
    ("no_messages", {"messages": []}, "messages"),
    ("too_long_once_templated", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("n_above_max", {"messages": MESSAGES, "n": MAX_N + 1}, "n"),
    ("top_logprobs_above_20", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("top_logprobs_without_logprobs", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("unknown_field", {"messages": MESSAGES, "extra_body": {"tools_x": 1}}, "tools_x"),
    ("max_tokens_zero", {"messages": MESSAGES, "max_completion_tokens": 0},
     "max_completion_tokens"),
]
BAD_COMPLETION = [
    ("logprobs_above_5", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("n_above_max", {"prompt": "x", "n": MAX_N + 1}, "n"),
    ("best_of_not_n", {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ("prompt_too_long", {"prompt": LONG}, "prompt"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "param"), [c[1:] for c in BAD_CHAT], ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_raises_bad_request(client, body, param, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, stream=stream, **body)
    assert info.value.status_code == 400
    assert info.value.param == param and info.value.type == "invalid_request_error"
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **GREEDY)
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "param"), [c[1:] for c in BAD_COMPLETION],
                         ids=[c[0] for c in BAD_COMPLETION])
def test_bad_completion_raises_bad_request(client, body, param, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, stream=stream, **body)
    assert info.value.param == param
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=2, **GREEDY)
    assert ok.usage.completion_tokens == 2


def test_context_error_code_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}])
    assert info.value.code == "context_length_exceeded"
    for create in (lambda: client.chat.completions.create(model="gpt-5", messages=MESSAGES),
                   lambda: client.completions.create(model="gpt-5", prompt="x")):
        with pytest.raises(openai.NotFoundError):
            create()
