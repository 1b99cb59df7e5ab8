"""LLMEngine API: errors at load and at add_request, k bounds, stop conditions, abort,
counters, and checkpoint URI resolution."""

from __future__ import annotations

import pytest
import torch

from specula.api.runtime_config import PVC_MOUNT_ROOT, RuntimeConfig, SpeculatorRuntimeConfig
from specula.runtime.engine.llm_engine import LLMEngine, SamplingParams
from specula.runtime.loader import resolve_model_uri
from specula.runtime.spec_decode import registry
from specula.runtime.spec_decode.registry import UnsupportedSpeculatorMethod

pytestmark = pytest.mark.runtime

PROMPT = [5, 80, 113, 9, 41, 200]


@pytest.fixture(scope="module")
def engine(tiny_llama_target, tiny_llama_draft, make_engine) -> LLMEngine:
    return make_engine(tiny_llama_target, tiny_llama_draft, k=4, max_num_seqs=4, max_model_len=64)


@pytest.fixture(scope="module")
def reference(engine) -> list[int]:
    """Greedy continuation of PROMPT (ignoring eos), 40 tokens."""
    return engine.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]


def _run(engine: LLMEngine, params: SamplingParams, request_id: str = "r"):
    engine.add_request(request_id, PROMPT, params)
    tokens, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            tokens += out.new_token_ids
            last = out
    return tokens, last


def test_vocab_mismatch_is_rejected_at_load(
    tmp_path, tiny_llama_target, tiny_tokenizer, make_engine
):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=384,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"draft model vocab_size 384 != target vocab_size 320"):
        make_engine(tiny_llama_target, tmp_path)


def test_unsupported_method_and_context_length(
    tiny_llama_target, tiny_llama_draft, make_engine, monkeypatch
):
    # Every method the API names has an implementation now: withdraw one.
    monkeypatch.delitem(registry.SPECULATOR_FACTORIES, "eagle3")
    config = RuntimeConfig(
        model=f"file://{tiny_llama_target}",
        speculator=SpeculatorRuntimeConfig(method="eagle3", model=f"file://{tiny_llama_draft}"),
    )
    with pytest.raises(UnsupportedSpeculatorMethod, match="'eagle3' is not implemented"):
        LLMEngine.from_config(config)
    with pytest.raises(
        ValueError, match="max_model_len 512 exceeds the target's max_position_embeddings 256"
    ):
        make_engine(tiny_llama_target, max_model_len=512)


def test_prompt_too_long_and_bad_params(engine):
    with pytest.raises(
        ValueError,
        match=r"prompt \(60 tokens\) plus max_tokens \(16\) exceeds max_model_len \(64\)",
    ):
        engine.add_request("long", [1] * 60, SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("zero", PROMPT, SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("topp", PROMPT, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 320\)"):
        engine.add_request("oov", [320], SamplingParams())
    engine.add_request("dup", PROMPT, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", PROMPT, SamplingParams())
    engine.abort_request("dup")
    assert engine.step()[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_num_speculative_tokens_bounds(engine):
    assert engine.get_speculative_config() == {
        "method": "draft_model",
        "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": None,
        "max_num_speculative_tokens": 4,
        "model": engine.speculator_config.model,
    }
    with pytest.raises(ValueError, match=r"num_speculative_tokens 5 outside \[0, 4\]"):
        engine.set_num_speculative_tokens(5)
    with pytest.raises(ValueError):
        engine.set_num_speculative_tokens(-1)
    engine.set_num_speculative_tokens(2)
    assert engine.get_speculative_config()["num_speculative_tokens"] == 2
    engine.set_num_speculative_tokens(4)


def test_max_tokens_truncates_a_speculative_step(engine, reference):
    tokens, last = _run(engine, SamplingParams(max_tokens=3, ignore_eos=True))
    assert tokens == reference[:3]
    assert (last.finished, last.finish_reason, last.stop_reason) == (True, "length", None)


def test_stop_token_ids(engine, reference):
    stop_at = 7
    stop_token = reference[stop_at]
    first = reference.index(stop_token)
    tokens, last = _run(
        engine, SamplingParams(max_tokens=40, stop_token_ids=[stop_token], ignore_eos=True)
    )
    assert tokens == reference[: first + 1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop_token)


def test_eos_stops_unless_ignored(engine, reference):
    eos = reference[5]  # pretend this token is the end of sequence
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({eos})
    try:
        tokens, last = _run(engine, SamplingParams(max_tokens=40))
        assert tokens == reference[: reference.index(eos) + 1]
        assert (last.finish_reason, last.stop_reason) == ("stop", None)
        tokens, last = _run(engine, SamplingParams(max_tokens=10, ignore_eos=True))
        assert tokens == reference[:10] and last.finish_reason == "length"
    finally:
        engine.eos_token_ids = saved


def test_stop_string(engine, reference):
    tok = engine.tokenizer
    # The shortest prefix of the completion whose text ends with a fresh two-character
    # string, so the stop must fire exactly at that token.
    for end in range(4, 30):
        text = tok.decode(reference[:end])
        stop = text[-2:]
        if stop.strip() and stop not in tok.decode(reference[: end - 1]):
            break
    else:
        pytest.skip("no usable stop string in the reference completion")
    tokens, last = _run(engine, SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True))
    assert tokens == reference[:end]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)


def test_abort_running_request_and_counters(engine):
    before = engine.generation_tokens_total
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    outs = engine.step()
    produced = sum(len(o.new_token_ids) for o in outs)
    assert engine.scheduler_stats()["num_requests_running"] == 2
    engine.abort_request("a")
    stats = engine.scheduler_stats()
    assert (stats["num_requests_running"], stats["num_requests_waiting"]) == (1, 0)
    while engine.has_unfinished_requests():
        outs = engine.step()
        produced += sum(len(o.new_token_ids) for o in outs)
        assert all(o.finish_reason == "abort" for o in outs if o.request_id == "a")
    assert engine.generation_tokens_total - before == produced
    engine.abort_request("unknown")  # ignored
    assert not engine.has_unfinished_requests()


def test_last_tokens_do_not_wait_for_the_step_in_flight(tiny_llama_target, tiny_llama_draft,
                                                        make_engine):
    """Asynchronous scheduling queues the next step before reading the last one, so a step
    runs after a request's last tokens (its tokens dropped). The call that reads those last
    tokens returns them without also reading that step; the next call does, emitting nothing."""
    engine = make_engine(tiny_llama_target, tiny_llama_draft, k=2, max_num_seqs=2)
    engine.async_scheduling = True
    reads: list[object] = []
    finish = engine._finish
    engine._finish = lambda step: reads.append(step) or finish(step)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=7, ignore_eos=True))
    tokens: list[int] = []
    outs: list = []
    while not any(o.finished for o in outs):
        before = len(reads)
        outs = engine.step()
        tokens += [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 7 and len(reads) - before == 1  # the last tokens' step only
    assert engine.has_unfinished_requests() and engine._in_flight is not None
    assert engine.step() == [] and len(reads) - before == 2
    assert not engine.has_unfinished_requests()


def test_draft_positions_must_advance_by_a_constant(tiny_llama_target, tiny_llama_draft,
                                                     make_engine, monkeypatch):
    from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator

    monkeypatch.setattr(AutoRegressiveSpeculator, "advance_draft_positions", lambda self, p: p * 2)
    with pytest.raises(ValueError, match="constant, got 0 -> 0, 1 -> 2"):
        make_engine(tiny_llama_target, tiny_llama_draft, k=2)


def test_waiting_requests_are_counted(tiny_llama_target, make_engine):
    engine = make_engine(tiny_llama_target, max_num_seqs=1)
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=4))
    engine.add_request("y", PROMPT, SamplingParams(max_tokens=4))
    def counts() -> tuple[int, int]:
        stats = engine.scheduler_stats()
        return stats["num_requests_running"], stats["num_requests_waiting"]

    assert counts() == (0, 2)
    engine.step()
    assert counts() == (1, 1)
    with pytest.raises(ValueError, match="no speculator"):
        engine.set_num_speculative_tokens(1)


def test_resolve_model_uri(tmp_path):
    assert resolve_model_uri(f"file://{tmp_path}") == tmp_path
    with pytest.raises(FileNotFoundError, match=f"{PVC_MOUNT_ROOT}/claim/sub"):
        resolve_model_uri("pvc://claim/sub")
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model_uri("hf://specula-test/absent-model")
    with pytest.raises(ValueError, match="unsupported model URI"):
        resolve_model_uri("s3://bucket/model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without GPU")
def test_create_engine_picks_the_device(tiny_llama_target):
    from specula.runtime.engine.llm_engine import create_engine

    def config(device: str) -> RuntimeConfig:
        return RuntimeConfig(model=f"file://{tiny_llama_target}", dtype="float32", device=device)

    engine = create_engine(config("auto"))
    assert type(engine) is LLMEngine and engine.device.type == "cpu"
    with pytest.raises(ValueError, match="no CUDA device"):
        create_engine(config("cuda"))
