"""EAGLE-3 (arXiv 2503.01840) against the ``speculators`` package's ``Eagle3DraftModel``
on the same weights: draft logits, every multi-step proposal the engine makes, greedy
output equal to ``transformers``' for k = 1..8, the target distribution under sampling,
and load-time errors for checkpoints that do not fit the target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hidden_state_drafts import (
    AUX_IDS,
    HIDDEN_SIZE,
    MAX_TOKENS,
    VOCAB_SIZE,
    bigram_eagle3_head,
    draft_vocab_ids,
    eagle3_head,
    make_engine,
    random_prompts,
    record_proposals,
    save_bigram_target,
    save_speculators,
)
from model_checks import BLOCK_SIZE, CPU, paged_prefill

from specula.runtime.engine.llm_engine import SamplingParams
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.llama_eagle3 import load_eagle3_draft
from specula.runtime.spec_decode.eagle import Eagle3Runner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.runtime

@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_tokenizer) -> Path:
    return save_bigram_target("llama", tiny_tokenizer, tmp_path_factory.mktemp("target"), 5)


@pytest.fixture(scope="module")
def target_hf(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def bigram_draft(tmp_path_factory, target_hf) -> Path:
    model = bigram_eagle3_head(target_hf, draft_vocab_ids(seed=1, size=288), seed=2)
    return save_speculators(model, tmp_path_factory.mktemp("eagle3-bigram"), keep_embeddings=False)


def _speculators_logits(model, aux, input_ids, ttt_steps: int) -> list[torch.Tensor]:
    """``speculators``' forward on one sequence; returns each TTT step's draft-vocab
    logits ``[seq_len, draft_vocab_size]`` (read from ``lm_head``)."""
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out[0]))
    n = input_ids.shape[0]
    try:
        with torch.no_grad():
            model(
                hidden_states=aux[None],
                input_ids=input_ids[None],
                document_ids=torch.zeros(1, n, dtype=torch.long),
                position_ids=torch.arange(n)[None],
                ttt_steps=ttt_steps,
            )
    finally:
        hook.remove()
    return captured


def _target_aux(target_hf, tokens: list[int]) -> torch.Tensor:
    """``transformers``' residual stream entering layers :data:`AUX_IDS` of the target,
    ``[len(tokens), 3H]``; id ``num_hidden_layers`` is the last layer's output before
    the final norm (``hidden_states[-1]`` of ``transformers`` is after it)."""
    pre_norm: list[torch.Tensor] = []
    hook = target_hf.model.norm.register_forward_hook(
        lambda mod, inp, out: pre_norm.append(inp[0][0])
    )
    try:
        with torch.no_grad():
            out = target_hf.model(torch.tensor([tokens]), output_hidden_states=True)
    finally:
        hook.remove()
    states = [s[0] for s in out.hidden_states[:-1]] + pre_norm
    return torch.cat([states[i] for i in AUX_IDS], dim=-1)


@pytest.mark.parametrize(
    ("model_type", "num_layers", "reduced", "flags"),
    [
        ("llama", 1, True, {}),
        ("llama", 2, True, {"norm_before_residual": True, "norm_before_fc": True}),
        ("qwen3", 1, False, {"fc_norm": True, "norm_output": True}),
    ],
    ids=["llama", "llama-2-layers-norms", "qwen3-full-vocab"],
)
def test_draft_logits_match_speculators(
    model_type, num_layers, reduced, flags, target, target_hf, tmp_path
):
    draft_vocab = draft_vocab_ids(seed=3, size=200) if reduced else None
    ref = eagle3_head(
        target_hf,
        draft_vocab=draft_vocab,
        seed=4,
        model_type=model_type,
        num_layers=num_layers,
        **flags,
    )
    ours = load_eagle3_draft(
        save_speculators(ref, tmp_path),
        ModelConfig.from_pretrained(target),
        torch.float32,
        torch.device("cpu"),
    )
    gen = torch.Generator().manual_seed(5)
    n = 12
    input_ids = torch.randint(1, VOCAB_SIZE, (n,), generator=gen)
    aux = torch.randn(n, len(AUX_IDS) * HIDDEN_SIZE, generator=gen)
    (expected,) = _speculators_logits(ref, aux, input_ids, ttt_steps=1)

    spec = KVCacheSpec.from_model_config(ours.config, torch.float32, BLOCK_SIZE)
    runner = Eagle3Runner(ours, PagedKVCache(spec, 16, CPU), 64)
    with torch.no_grad():
        fused = ours.combine_hidden_states(aux)
        normed, _ = paged_prefill(runner, input_ids, fused)
        got = ours.compute_draft_vocab_logits(normed)
        full = ours.compute_logits(normed)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Over the target vocabulary: draft id i sits at target id i + d2t[i]; the rest is
    # -inf, so sampled drafts have probability zero there.
    ids = torch.arange(VOCAB_SIZE) if draft_vocab is None else draft_vocab
    torch.testing.assert_close(full[:, ids], expected, atol=1e-5, rtol=1e-5)
    outside = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(full[:, outside]).all()


def test_every_proposal_follows_speculators_multi_step_forward(
    target, target_hf, tmp_path, tiny_tokenizer
):
    """Each draft the engine proposes (k = 4, over prefill, acceptances and rejections)
    equals ``speculators``' own TTT unrolling on the same context: step ``s`` of its
    forward at the last verified row reads draft token ``s`` and its previous state."""
    ref = eagle3_head(target_hf, draft_vocab=draft_vocab_ids(seed=6, size=256), seed=7)
    draft = save_speculators(ref, tmp_path, keep_embeddings=False)
    k = 4
    engine = make_engine(target, "eagle3", draft, k=k)
    assert engine.speculator.aux_hidden_state_layers == AUX_IDS
    log = record_proposals(engine)
    prompts = [[5, 9, 14], [3, 8, 21, 30, 7, 2, 40], [11, 4, 60, 61, 62]]
    engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(log) >= 4
    d2t_ids = ref.d2t + torch.arange(ref.d2t.shape[0])
    for tokens, drafts in log:
        n = len(tokens)
        aux = _target_aux(target_hf, tokens[:-1])  # [n - 1, 3H]
        # Row j reads token j+1; the drafts extend the sequence for later TTT steps.
        input_ids = torch.tensor(tokens[1:] + drafts[:-1])
        aux = torch.cat([aux, aux.new_zeros(k - 1, aux.shape[1])])
        steps = _speculators_logits(ref, aux, input_ids, ttt_steps=k)
        expected = [d2t_ids[logits[n - 2].argmax()].item() for logits in steps]
        assert drafts == expected, f"context of {n} tokens"


def test_greedy_equals_hf_generate_for_k_1_to_8(
    target, target_hf, bigram_draft, hf_greedy, greedy_rounds
):
    engine = make_engine(target, "eagle3", bigram_draft, k=8)
    prompts = random_prompts(seed=11)
    expected = [hf_greedy(target_hf, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    greedy_rounds(engine, prompts, expected, params, ks=range(1, 9))


@pytest.mark.gpu
def test_greedy_on_gpu_in_cuda_graphs(target, target_hf, bigram_draft, hf_greedy):
    from gpu_checks import check_greedy_on_gpu, gpu_engine

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = random_prompts(seed=11)
    expected = [hf_greedy(target_hf, p, MAX_TOKENS) for p in prompts]
    engine = gpu_engine(target, "eagle3", bigram_draft, k=8)
    check_greedy_on_gpu(engine, prompts, expected, ks=(0, 1, 4, 8), max_tokens=MAX_TOKENS)


def test_sampling_keeps_target_distribution(target, target_hf, bigram_draft, sampled_pvalue):
    torch.manual_seed(0)
    engine = make_engine(target, "eagle3", bigram_draft, k=3, max_num_seqs=256)
    assert sampled_pvalue(engine, target_hf, [17, 42, 99, 7, 250], num_samples=2000) > 0.001


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("layer_"):
            config["transformer_layer_config"][key.removeprefix("layer_")] = value
        elif value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"layer_vocab_size": 400},
            r"transformer_layer_config\.vocab_size 400 != target vocab_size 320",
        ),
        (
            {"layer_hidden_size": 96},
            r"transformer_layer_config\.hidden_size 96 != target hidden_size 64",
        ),
        ({"target_hidden_size": 32}, r"target_hidden_size 32 != target hidden_size 64"),
        (
            {"speculators_model_type": "eagle"},
            r"speculators_model_type is 'eagle', expected 'eagle3'",
        ),
        (
            {"eagle_aux_hidden_state_layer_ids": [0, 7, 2]},
            r"eagle_aux_hidden_state_layer_ids contains 7, outside \[0, 3\].*num_hidden_layers=3",
        ),
    ],
    ids=["vocab", "hidden", "target-hidden", "model-type", "aux-layer"],
)
def test_mismatched_checkpoint_fails_at_load(changes, message, target, bigram_draft, tmp_path):
    draft = _edit_config(bigram_draft, tmp_path / "draft", **changes)
    with pytest.raises(ValueError, match=message):
        make_engine(target, "eagle3", draft, k=2)


def test_default_aux_layers_when_the_checkpoint_names_none(target, bigram_draft, tmp_path):
    draft = _edit_config(bigram_draft, tmp_path / "draft", eagle_aux_hidden_state_layer_ids=None)
    engine = make_engine(target, "eagle3", draft, k=2)
    # (2, L // 2, L - 3) for the 3-layer target.
    assert engine.speculator.aux_hidden_state_layers == (2, 1, 0)
    assert engine.aux_hidden_state_layers == (2, 1, 0)


def test_prefix_caching_keeps_greedy_output(target, target_hf, bigram_draft, hf_greedy, prefix_cached):
    prompts_for, run = prefix_cached
    prompts = prompts_for(VOCAB_SIZE, seed=22)
    expected = [hf_greedy(target_hf, p, MAX_TOKENS) for p in prompts]
    engine = make_engine(target, "eagle3", bigram_draft, k=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert run(engine, prompts, params) == expected
