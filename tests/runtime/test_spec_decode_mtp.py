"""DeepSeek-style MTP (arXiv 2412.19437) against the ``speculators`` package's
``MTPDraftModel`` on the same weights: draft logits, every multi-step proposal the
engine makes (one layer reused for every step), greedy output equal to
``transformers``' for k = 1..8, the target distribution under sampling, and load-time
errors for checkpoints that do not fit the target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hidden_state_drafts import (
    HIDDEN_SIZE,
    MAX_TOKENS,
    VOCAB_SIZE,
    layer_config,
    make_engine,
    random_prompts,
    record_proposals,
    save_bigram_target,
)
from model_checks import BLOCK_SIZE, CPU, paged_prefill

from specula.runtime.engine.llm_engine import SamplingParams
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.mtp import load_mtp_draft
from specula.runtime.models.speculators_format import share_target_weights
from specula.runtime.spec_decode.mtp import MTPRunner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.runtime


def _mtp(target_hf, seed: int):
    """A ``speculators`` MTP head (Qwen3 layer) for ``target_hf`` with random weights
    and the target's embeddings and LM head (which its checkpoint does not keep)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config = MTPSpeculatorConfig(
        transformer_layer_config=layer_config("qwen3", num_hidden_layers=1),
        speculators_config=SpeculatorsConfig(
            algorithm="mtp",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    model = MTPDraftModel(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
        model.embed_tokens.weight.copy_(target_hf.model.embed_tokens.weight)
        model.lm_head.weight.copy_(target_hf.lm_head.weight)
    return model.eval()


def _bigram_mtp(target_hf, seed: int):
    """A head that mostly predicts the target's bigram from the token it reads:
    ``eh_proj`` passes the normed embedding on (plus a little of the hidden state), the
    block's residual contributions are small, the final norm is the target's."""
    model = _mtp(target_hf, seed)
    layer = model.mtp_layers[0]
    h = HIDDEN_SIZE
    with torch.no_grad():
        layer.input_proj.weight.mul_(0.05)
        layer.input_proj.weight[:, :h] = torch.eye(h)
        layer.token_layernorm.weight.fill_(1.0)
        layer.self_attn.o_proj.weight.mul_(0.05)
        layer.mlp.down_proj.weight.mul_(0.05)
        layer.final_layernorm.weight.copy_(target_hf.model.norm.weight)
    return model


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_tokenizer) -> Path:
    return save_bigram_target("qwen3", tiny_tokenizer, tmp_path_factory.mktemp("target"), 8)


@pytest.fixture(scope="module")
def target_hf(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def bigram_draft(tmp_path_factory, target_hf) -> Path:
    path = tmp_path_factory.mktemp("mtp-bigram")
    _bigram_mtp(target_hf, seed=9).save_pretrained(path)
    return path


def test_draft_logits_match_speculators(target, target_hf, tmp_path):
    ref = _mtp(target_hf, seed=10)
    ref.save_pretrained(tmp_path)
    ours = load_mtp_draft(
        tmp_path, ModelConfig.from_pretrained(target), torch.float32, torch.device("cpu")
    )
    # speculators never saves the embeddings and head: they must come from the target.
    assert ours.missing_target_weights == {"embed_tokens.weight", "lm_head.weight"}
    share_target_weights(ours, target_hf.model.embed_tokens, target_hf.lm_head.weight)

    gen = torch.Generator().manual_seed(11)
    n = 14
    input_ids = torch.randint(1, VOCAB_SIZE, (n,), generator=gen)
    hidden = torch.randn(n, HIDDEN_SIZE, generator=gen)
    with torch.no_grad():
        expected, _, _ = ref(input_ids=input_ids[None], hidden_states=hidden[None])
    # speculators' step 0: row j reads hidden j and token j + 1.
    rows = expected[0].shape[1]
    spec = KVCacheSpec.from_model_config(ours.config, torch.float32, BLOCK_SIZE)
    runner = MTPRunner(ours, PagedKVCache(spec, 16, CPU), 64)
    with torch.no_grad():
        got = ours.compute_logits(paged_prefill(runner, input_ids[1 : rows + 1], hidden[:rows]))
    torch.testing.assert_close(got, expected[0][0], atol=1e-5, rtol=1e-5)


def check_folded_head_matches_unfolded(target: Path, draft: Path) -> None:
    """In Triton's interpreter: the head in float16, its block's norms folded and every
    projection through the GEMV (tiny configurations), against float32 without folding,
    over six rows. ``eh_proj`` returns its sums of squares (the block's input norm in
    ``qkv_proj``), ``o_proj`` and ``down_proj`` add their residuals."""
    from transformers import AutoModelForCausalLM

    from specula.runtime.kernels import gemv
    from specula.runtime.spec_decode import mtp

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    configs, squares = dict(gemv.CONFIGS), []

    def spy(*args, **kwargs):
        squares.append(kwargs.get("sums_of_squares", False))
        return gemv.gemv(*args, **kwargs)

    mtp.gemv = spy
    gen = torch.Generator().manual_seed(12)
    ids = torch.randint(1, VOCAB_SIZE, (6,), generator=gen)
    hidden = torch.randn(6, HIDDEN_SIZE, generator=gen)
    outs = []
    try:
        for shape in ((128, 64), (64, 64), (256, 64), (64, 128)):  # qkv, o, gate_up; down, eh_proj
            gemv.CONFIGS[shape] = {16: (32, 64, 4, 2)}
        for dtype in (torch.float16, torch.float32):
            model = load_mtp_draft(draft, ModelConfig.from_pretrained(target), dtype, CPU)
            embed = torch.nn.Embedding.from_pretrained(hf.model.embed_tokens.weight.to(dtype))
            share_target_weights(model, embed, hf.lm_head.weight.to(dtype))
            spec = KVCacheSpec.from_model_config(model.config, dtype, BLOCK_SIZE)
            runner = MTPRunner(model, PagedKVCache(spec, 16, CPU), 64)
            assert runner.norms_folded == (dtype == torch.float16)
            with torch.no_grad():
                outs.append(paged_prefill(runner, ids, hidden.to(dtype)).float())
    finally:
        mtp.gemv = gemv.gemv
        gemv.CONFIGS.clear()
        gemv.CONFIGS.update(configs)
    assert squares == [True]  # eh_proj's sums of squares, in float16 only
    # float16 against float32: 5e-4 here; sums of squares off by half give 1.7e-2.
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 2e-3


def test_folded_head_matches_unfolded(interpreted, target, bigram_draft):
    interpreted(check_folded_head_matches_unfolded, target, bigram_draft)


def _speculators_chain(ref, hidden: torch.Tensor, tokens: list[int], drafts: list[int]):
    """The draft tokens ``speculators``' MTP layer proposes after ``tokens``, driven
    step by step with a ``transformers`` KV cache: a prefill over rows ``0 .. n-2``
    (target state ``j``, token ``j + 1``), then one row per step reading the previous
    draft token and the layer's previous output."""
    from transformers import DynamicCache

    layer, cache = ref.mtp_layers[0], DynamicCache()

    def run(states, ids, start):
        pos = torch.arange(start, start + ids.shape[0])[None]
        out = layer(
            hidden_states=states[None],
            token_embeddings=ref.embed_tokens(ids)[None],
            position_ids=pos,
            position_embeddings=ref.rotary_emb(states[None], pos),
            past_key_values=cache,
        )
        return out[0]

    n = len(tokens)
    proposed = []
    with torch.no_grad():
        out = run(hidden, torch.tensor(tokens[1:]), 0)
        for step in range(len(drafts)):
            proposed.append(ref.lm_head(out[-1]).argmax().item())
            if step < len(drafts) - 1:
                out = run(out[-1:], torch.tensor(drafts[step : step + 1]), n - 1 + step)
    return proposed


def test_every_proposal_follows_speculators_layer_step_by_step(target, target_hf, tmp_path):
    """Each draft the engine proposes (k = 5 > n_predict = 1: the one layer is reused)
    equals the ``speculators`` layer's own step-by-step drafting on the same context."""
    ref = _mtp(target_hf, seed=12)
    ref.save_pretrained(tmp_path)
    engine = make_engine(target, "mtp", tmp_path, k=5)
    log = record_proposals(engine)
    prompts = [[5, 9, 14], [3, 8, 21, 30, 7, 2, 40], [11, 4, 60, 61, 62]]
    engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(log) >= 3
    for tokens, drafts in log:
        with torch.no_grad():
            hidden = target_hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        assert drafts == _speculators_chain(ref, hidden, tokens, drafts), len(tokens)


def test_greedy_equals_hf_generate_for_k_1_to_8(
    target, target_hf, bigram_draft, hf_greedy, greedy_rounds
):
    engine = make_engine(target, "mtp", bigram_draft, k=8)
    prompts = random_prompts(seed=11)
    expected = [hf_greedy(target_hf, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    greedy_rounds(engine, prompts, expected, params, ks=range(1, 9))


def test_k_changes_between_steps(target, target_hf, bigram_draft, hf_greedy):
    """Rounds without drafting (k = 0) still deliver the target's states, and the next
    draft prefill consumes all of them: the output stays exact."""
    engine = make_engine(target, "mtp", bigram_draft, k=4)
    prompts = random_prompts(seed=13)[:2]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    got: dict[str, list[int]] = {"0": [], "1": []}
    schedule = [4, 0, 0, 2, 0, 4, 1]
    step = 0
    while engine.has_unfinished_requests():
        engine.set_num_speculative_tokens(schedule[step % len(schedule)])
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        step += 1
    assert [got["0"], got["1"]] == [hf_greedy(target_hf, p, MAX_TOKENS) for p in prompts]
    assert engine.spec_decoding_stats.num_accepted_tokens > 0


@pytest.mark.gpu
def test_greedy_on_gpu_in_cuda_graphs(target, target_hf, bigram_draft, hf_greedy):
    from gpu_checks import check_greedy_on_gpu, gpu_engine

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = random_prompts(seed=11)
    expected = [hf_greedy(target_hf, p, MAX_TOKENS) for p in prompts]
    engine = gpu_engine(target, "mtp", bigram_draft, k=8)
    check_greedy_on_gpu(engine, prompts, expected, ks=(0, 1, 4, 8), max_tokens=MAX_TOKENS)


def test_sampling_keeps_target_distribution(target, target_hf, bigram_draft, sampled_pvalue):
    torch.manual_seed(0)
    engine = make_engine(target, "mtp", bigram_draft, k=3, max_num_seqs=256)
    assert sampled_pvalue(engine, target_hf, [17, 42, 99, 7, 250], num_samples=2000) > 0.001


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
        (
            {"speculators_model_type": "eagle3"},
            r"speculators_model_type is 'eagle3', expected 'mtp'",
        ),
        ({"num_nextn_predict_layers": 2}, r"num_nextn_predict_layers 2 is not supported"),
    ],
    ids=["vocab", "hidden", "model-type", "layers"],
)
def test_mismatched_checkpoint_fails_at_load(changes, message, target, bigram_draft, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(bigram_draft, draft)
    config = json.loads((draft / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("layer_"):
            config["transformer_layer_config"][key.removeprefix("layer_")] = value
        else:
            config[key] = value
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        make_engine(target, "mtp", draft, k=2)


def test_prefix_caching_keeps_greedy_output(target, target_hf, bigram_draft, hf_greedy, prefix_cached):
    prompts_for, run = prefix_cached
    prompts = prompts_for(VOCAB_SIZE, seed=23)
    expected = [hf_greedy(target_hf, p, MAX_TOKENS) for p in prompts]
    engine = make_engine(target, "mtp", bigram_draft, k=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert run(engine, prompts, params) == expected
