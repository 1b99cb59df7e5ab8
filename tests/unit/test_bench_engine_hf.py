"""The engine benchmark's Hugging Face side (``bench/engine_hf.py``,
``bench/engine_hf_pair.py``) on a tiny CPU Llama: the controlled-agreement pair, its
calibration, and the verification counts read from ``transformers``' assisted generation."""

from __future__ import annotations

import math

import pytest
import torch

from bench.engine_hf import (
    DRAFTING_KEYS,
    acceptance_counts,
    assisted_variants,
    count_verifications,
)
from bench.engine_hf_pair import (
    build_controlled_pair,
    calibrate_perturbation,
    greedy_agreement,
    greedy_generate,
    random_prompts,
    set_perturbation,
    solve_decreasing,
)

SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
ASSISTANT_LAYERS, PROMPT_LEN, NEW = 2, 16, 32


def test_acceptance_counts_hand_built():
    # (drafted, accepted): a full accept, a reject at position 1, a reject at 0, an
    # empty draft (not a draft), a draft cut to 2 tokens and fully accepted.
    counts = acceptance_counts([(4, 4), (4, 1), (4, 0), (0, 0), (2, 2)])
    assert counts["num_drafts"] == 4
    assert counts["num_draft_tokens"] == 14
    assert counts["num_accepted_tokens"] == 7
    assert counts["num_accepted_tokens_per_pos"] == [3, 2, 1, 1]
    assert counts["mean_acceptance_length"] == round(1 + 7 / 4, 3)
    # 7 accepted positions, 2 rejected ones: the per-position rate's estimate.
    assert counts["conditional_acceptance"] == round(7 / 9, 4)
    # Position 0 reached by 4 drafts (3 accepted); 1 by 3 (2); 2 by 1 (1); 3 by 1 (1).
    assert counts["conditional_acceptance_per_pos"] == [0.75, round(2 / 3, 4), 1.0, 1.0]


def test_solve_decreasing_finds_the_crossing_and_reuses_evaluations():
    calls = []

    def fn(x):
        calls.append(x)
        return 1.0 / (1.0 + x)

    seen: dict = {}
    x = solve_decreasing(fn, 0.25, seen, 1e-3, 1e3, rel_tol=1e-3)
    assert math.isclose(x, 3.0, rel_tol=2e-3)
    first = len(calls)
    # A nearby target starts from the bracket the first search left.
    solve_decreasing(fn, 0.2, seen, 1e-3, 1e3, rel_tol=1e-3)
    assert len(calls) - first < first


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    prompts = random_prompts(SHAPE["vocab_size"], 8, PROMPT_LEN, torch.device("cpu"))
    with torch.no_grad():
        target, assistant, info = build_controlled_pair(
            SHAPE, ASSISTANT_LAYERS, torch.float32, torch.device("cpu"), prompts, NEW, 0.8
        )
    return target, assistant, info, prompts


def test_pair_shares_the_assistant_and_equals_it_at_eps_zero(pair):
    target, assistant, info, prompts = pair
    assert target.config.num_hidden_layers == SHAPE["num_hidden_layers"]
    assert assistant.config.num_hidden_layers == ASSISTANT_LAYERS
    with torch.inference_mode():
        set_perturbation(target, ASSISTANT_LAYERS, 0.0)
        torch.testing.assert_close(target(prompts).logits, assistant(prompts).logits)
        set_perturbation(target, ASSISTANT_LAYERS, 1.0)
        assert not torch.allclose(target(prompts).logits, assistant(prompts).logits)
    # The logit scale makes the assistant's mean top-1 probability the target acceptance.
    assert abs(info["assistant_mean_top1_prob"] - 0.8) < 0.01
    assert info["embedding_scale"] > 1


def test_calibration_reaches_the_target_agreement_on_rollouts(pair):
    target, assistant, _, prompts = pair
    with torch.inference_mode():
        record = calibrate_perturbation(
            target, assistant, ASSISTANT_LAYERS, prompts, NEW, 0.8, rollouts=3
        )
        rollout = greedy_generate(target, prompts, NEW)
        agree, _ = greedy_agreement(assistant, rollout, PROMPT_LEN)
    # 256 positions: the binomial standard error at 0.8 is 0.025.
    assert abs(agree - 0.8) < 0.08, record
    assert 0 < record["eps"] < 100
    assert record["rounds"][-1]["rollout_agreement"] == round(agree, 4)


@pytest.mark.parametrize("variant", ["k3_constant", "default"])
def test_verification_counts_match_the_output(pair, variant):
    target, assistant, _, prompts = pair
    defaults = {key: getattr(assistant.generation_config, key) for key in DRAFTING_KEYS}
    for key, value in assisted_variants(3, defaults)[variant].items():
        setattr(assistant.generation_config, key, value)
    with torch.inference_mode(), count_verifications() as log:
        out = greedy_generate(target, prompts[:1], NEW, assistant_model=assistant)
        agreed = assistant(out).logits[0, PROMPT_LEN - 1 : -1].argmax(-1) == out[0, PROMPT_LEN:]
    steps = log["steps"]
    # Each verification emits its accepted draft tokens and one token of the target's;
    # the accepted ones are the leading run of positions where the assistant's greedy
    # token (fp32, teacher-forced) is the emitted one.
    assert sum(a + 1 for _, a in steps) == NEW
    pos = 0
    for drafted, accepted in steps:
        run = agreed[pos : pos + drafted].tolist() + [False]
        assert accepted == run.index(False), (pos, drafted, accepted)
        if variant == "k3_constant":  # k, or what the length budget leaves
            assert drafted == min(3, NEW - pos - 1)
        pos += accepted + 1
    if variant == "k3_constant":
        assert log["settings"]["num_assistant_tokens"] == 3
    counts = acceptance_counts(steps)
    assert counts["num_accepted_tokens"] == sum(a for _, a in steps)
