"""Run-time speculation settings on the engine: one k or a per-batch-size schedule,
validated, applied between steps, and picked per step by the batch size."""

from __future__ import annotations

import pytest
import torch

from specula.runtime.engine.llm_engine import SamplingParams
from specula.runtime.engine.spec_schedule import BatchSizeSchedule, SpeculativeConfigError

pytestmark = pytest.mark.runtime

K_MAX = 4


@pytest.fixture(scope="module")
def engine(tiny_llama_target, tiny_llama_draft, make_engine):
    return make_engine(tiny_llama_target, tiny_llama_draft, k=K_MAX, max_num_seqs=4)


@pytest.fixture(autouse=True)
def _restore_k(engine):
    yield
    engine.set_num_speculative_tokens(K_MAX)


# ---- validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "code", "message"),
    [
        ([], "invalid_schedule", "empty"),
        ([[2, 8, 1]], "invalid_schedule", r"range 0 \[2, 8, 1\]: the first range must start"),
        (
            [[1, 4, 2], [6, 8, 1]],
            "invalid_schedule",
            r"range 1 \[6, 8, 1\]: leaves a gap: "
            r"batch sizes 5\.\.5",
        ),
        ([[1, 4, 2], [4, 8, 1]], "invalid_schedule", r"range 1 \[4, 8, 1\]: overlaps"),
        ([[1, 4, 2], [5, 3, 1]], "invalid_schedule", r"range 1 \[5, 3, 1\]: end 3 is below"),
        (
            [[1, 4, 2], [5, 8, K_MAX + 1]],
            "above_max",
            rf"range 1 \[5, 8, {K_MAX + 1}\]: .*max_num_speculative_tokens={K_MAX}",
        ),
        ([[1, 4, -1]], "invalid_value", r"range 0 \[1, 4, -1\]"),
        ([[1, 4]], "invalid_schedule", "three integers"),
    ],
    ids=[
        "empty",
        "not-from-1",
        "gap",
        "overlap",
        "reversed",
        "k-above-max",
        "negative-k",
        "short-range",
    ],
)
def test_invalid_schedule_is_refused_and_changes_nothing(engine, schedule, code, message):
    engine.set_speculative_config(num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 9, 1]])
    before = engine.get_speculative_config()
    with pytest.raises(SpeculativeConfigError, match=message) as info:
        engine.set_speculative_config(num_speculative_tokens_per_batch_size=schedule)
    assert (info.value.code, info.value.param) == (code, "num_speculative_tokens_per_batch_size")
    assert engine.get_speculative_config() == before


def test_single_k_bounds_and_exactly_one_setting(engine):
    with pytest.raises(SpeculativeConfigError, match=f"max_num_speculative_tokens={K_MAX}") as e:
        engine.set_speculative_config(num_speculative_tokens=K_MAX + 1)
    assert e.value.code == "above_max"
    with pytest.raises(SpeculativeConfigError, match="exactly one"):
        engine.set_speculative_config()
    with pytest.raises(SpeculativeConfigError, match="exactly one"):
        engine.set_speculative_config(
            num_speculative_tokens=1, num_speculative_tokens_per_batch_size=[[1, 4, 1]]
        )
    assert engine.get_speculative_config()["num_speculative_tokens"] == K_MAX


def test_get_reflects_set_and_single_k_clears_schedule(engine):
    engine.set_speculative_config(num_speculative_tokens_per_batch_size=[(1, 2, 3), (3, 64, 0)])
    config = engine.get_speculative_config()
    assert config["num_speculative_tokens"] is None
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 64, 0]]
    assert config["max_num_speculative_tokens"] == K_MAX
    engine.set_num_speculative_tokens(2)
    config = engine.get_speculative_config()
    assert (config["num_speculative_tokens"], config["num_speculative_tokens_per_batch_size"]) == (
        2,
        None,
    )


def test_no_speculator_refuses_both_settings(tiny_llama_target, make_engine):
    engine = make_engine(tiny_llama_target)
    for kwargs in (
        {"num_speculative_tokens": 0},
        {"num_speculative_tokens_per_batch_size": [[1, 8, 0]]},
    ):
        with pytest.raises(SpeculativeConfigError, match="no speculator") as info:
            engine.set_speculative_config(**kwargs)
        assert info.value.code == "no_speculator"
    assert engine.get_speculative_config()["num_speculative_tokens_per_batch_size"] is None


def test_schedule_lookup():
    schedule = BatchSizeSchedule.parse([[1, 1, 4], [2, 8, 2], [9, 32, 0]], max_k=4)
    assert [schedule.k_for(b) for b in (1, 2, 8, 9, 32, 33, 1000)] == [4, 2, 2, 0, 0, 0, 0]


# ---- stepping ------------------------------------------------------------------------


def test_schedule_picks_k_by_batch_size_and_output_stays_greedy(
    engine, tiny_llama_target, hf_model, hf_greedy
):
    """Requests of different lengths finish at different steps, so the batch shrinks
    4 -> 1 and each step verifies the k its batch size maps to, except that the drafts
    come from the step before: after a shrink to a size with a larger k, the first
    step verifies the k of the larger batch it was drafted for."""
    schedule = [[1, 1, 4], [2, 3, 2], [4, 256, 0]]
    expected_k = {1: 4, 2: 2, 3: 2, 4: 0}
    engine.set_speculative_config(num_speculative_tokens_per_batch_size=schedule)
    hf = hf_model(tiny_llama_target)
    gen = torch.Generator().manual_seed(21)
    prompts = [
        torch.randint(1, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 13, 17)
    ]
    lengths = (6, 14, 22, 30)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
    stats = engine.spec_decoding_stats
    drafted_before = stats.num_draft_tokens
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(4)}
    rounds = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        if engine.last_step_num_reqs:
            rounds.append((engine.last_step_num_reqs, engine.last_step_num_speculative_tokens))
    assert {b for b, _ in rounds} == {1, 2, 3, 4}
    previous = [rounds[0][0]] + [b for b, _ in rounds[:-1]]
    assert all(
        k == min(expected_k[b], expected_k[p]) for (b, k), p in zip(rounds, previous, strict=True)
    ), rounds
    assert any(k == expected_k[b] > 0 for b, k in rounds if b < 4), rounds
    assert stats.num_draft_tokens - drafted_before == sum(b * k for b, k in rounds)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        assert got[f"s{i}"] == hf_greedy(hf, p, n), f"request {i}"


def test_single_k_is_used_whatever_the_batch(engine):
    engine.set_num_speculative_tokens(3)
    for i in range(3):
        engine.add_request(f"k{i}", [5 + i, 7, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step_num_reqs:
            seen.add(engine.last_step_num_speculative_tokens)
    assert seen == {3}


def test_pod_starts_below_its_maximum(
    tiny_llama_target, tiny_llama_draft, hf_model, hf_greedy
):
    """``num_speculative_tokens`` is where a pod starts; ``max_num_speculative_tokens``
    bounds what it accepts later (the tuner raises k up to it without a restart)."""
    from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine

    config = RuntimeConfig(
        model=f"file://{tiny_llama_target}",
        dtype="float32",
        max_num_seqs=2,
        speculator=SpeculatorRuntimeConfig(
            method="draft_model",
            model=f"file://{tiny_llama_draft}",
            num_speculative_tokens=2,
            max_num_speculative_tokens=6,
        ),
    )
    engine = LLMEngine.from_config(config)
    spec = engine.get_speculative_config()
    assert (spec["num_speculative_tokens"], spec["max_num_speculative_tokens"]) == (2, 6)
    prompt = [5, 9, 13, 2, 7]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompt, params)
    first = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            first += out.new_token_ids
            if engine.spec_decoding_stats.num_drafts:
                # Raised above the startup k mid-request, up to the maximum.
                engine.set_num_speculative_tokens(6)
    stats = engine.spec_decoding_stats
    assert stats.num_draft_tokens > 2 * stats.num_drafts  # some rounds drafted 6
    assert first == hf_greedy(hf_model(tiny_llama_target), prompt, 24)
    with pytest.raises(SpeculativeConfigError, match="6"):
        engine.set_num_speculative_tokens(7)


def test_maximum_below_startup_k_is_rejected(tiny_llama_draft):
    from pydantic import ValidationError

    from specula.api.runtime_config import SpeculatorRuntimeConfig

    with pytest.raises(ValidationError, match="max_num_speculative_tokens"):
        SpeculatorRuntimeConfig(
            method="draft_model", model=f"file://{tiny_llama_draft}",
            num_speculative_tokens=4, max_num_speculative_tokens=3,
        )
