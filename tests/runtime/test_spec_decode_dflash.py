"""DFlash block drafting (method ``dflash``).

- Reference: a ``speculators`` ``DFlashDraftModel`` with random weights, saved in the
  ``speculators`` format: every block the engine drafts (after prefills, acceptances
  and rejections) equals that model's block on ``transformers``' target states (full
  and reduced draft vocabulary).
- Greedy speculative output equals ``transformers``' greedy ``generate`` of the target
  for k = 1..8; sampled output keeps the target's distribution (chi-square at ALPHA).
- Checkpoints that do not fit the target fail at load, naming the field and both values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
from specula.runtime.engine.llm_engine import LLMEngine, SamplingParams

pytestmark = pytest.mark.runtime

VOCAB_SIZE = 320
"""The vocabulary of the conftest checkpoints (``VOCAB_SIZE`` there)."""
BLOCK_SIZE = 9
"""k = 1..8 fits in one block (block_size - 1 draft tokens)."""
MASK_TOKEN_ID = VOCAB_SIZE - 1
LLAMA_AUX_LAYERS = (0, 2, 3)
"""On the 3-layer Llama target: the embedding output, the input of layer 2 and the last
layer's output (before the final norm, as vLLM captures it)."""
QWEN3_AUX_LAYERS = (1, 2)
DRAFT_VOCAB_SIZE = 200
ALPHA = 0.001
NUM_SAMPLES = 2000
MAX_TOKENS = 16
CPU = torch.device("cpu")


def _speculators_dflash(
    target_dir: Path,
    aux_layers: tuple[int, ...],
    *,
    num_layers: int = 2,
    draft_vocab_size: int | None = None,
    sample_from_anchor: bool = False,
    seed: int = 0,
):
    """A ``speculators`` ``DFlashDraftModel`` for the target in ``target_dir``, random
    body weights (norm weights too), verifier weights loaded by ``speculators``."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    target = json.loads((target_dir / "config.json").read_text())
    assert target["vocab_size"] == VOCAB_SIZE
    layer_config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=target["hidden_size"],
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
    )
    layer_config._attn_implementation = "eager"  # CPU: no flex attention
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=draft_vocab_size or VOCAB_SIZE,
        block_size=BLOCK_SIZE,
        aux_hidden_state_layer_ids=list(aux_layers),
        mask_token_id=MASK_TOKEN_ID,
        sample_from_anchor=sample_from_anchor,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK_SIZE - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=str(target_dir), architectures=target["architectures"]
            ),
        ),
    )
    model = DFlashDraftModel(config)
    if draft_vocab_size is not None:
        target_ids = torch.randperm(VOCAB_SIZE)[:draft_vocab_size].sort().values
        t2d = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
        t2d[target_ids] = True
        model.load_vocab_mappings(t2d, target_ids - torch.arange(draft_vocab_size))
    model.load_verifier_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier")):
                continue
            if name == "lm_head.weight":
                if draft_vocab_size is not None:  # the checkpoint's own head
                    param.normal_(0.0, 0.2)
                continue
            if param.ndim == 1:  # norms: not all ones, so a missing norm shows
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model


def _repeat_draft(model, scale: float = 1000.0):
    """Make a 1-layer DFlash draft propose the anchor token at every slot.

    The Qwen3 target ties its head to its embedding and so repeats its input token about
    one time in four; a draft that proposes repetitions is accepted that often. Nearly
    zero queries make the attention nearly uniform; values project out the mask token's
    embedding, so the block carries the anchor's embedding to every slot (scaled up past
    the residual); context values are tiny (``hidden_norm``); the MLP is off.
    """
    attn = model.layers[0].self_attn
    hidden = model.config.transformer_layer_config.hidden_size
    head_dim = attn.head_dim
    layer_norm = model.layers[0].input_layernorm.weight
    mask = torch.nn.functional.normalize(
        layer_norm * model.embed_tokens.weight[MASK_TOKEN_ID], dim=0
    )
    with torch.no_grad():
        attn.q_norm.weight.mul_(0.01)
        attn.v_proj.weight.copy_(torch.eye(hidden) - torch.outer(mask, mask))
        # Heads 0 and 2 read kv heads 0 and 1 (GQA groups of 2); they write the output.
        attn.o_proj.weight.zero_()
        attn.o_proj.weight[:head_dim, :head_dim] = scale * torch.eye(head_dim)
        attn.o_proj.weight[head_dim:, 2 * head_dim : 3 * head_dim] = scale * torch.eye(head_dim)
        model.layers[0].mlp.down_proj.weight.zero_()
        model.hidden_norm.weight.fill_(0.005)
        model.norm.weight.fill_(1.0)
    return model


def _save(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dflash(tmp_path_factory, tiny_llama_target) -> Path:
    model = _speculators_dflash(tiny_llama_target, LLAMA_AUX_LAYERS, seed=4)
    return _save(model, tmp_path_factory.mktemp("dflash-full"))


@pytest.fixture(scope="module")
def llama_dflash_reduced_vocab(tmp_path_factory, tiny_llama_target) -> Path:
    model = _speculators_dflash(
        tiny_llama_target, LLAMA_AUX_LAYERS, draft_vocab_size=DRAFT_VOCAB_SIZE,
        sample_from_anchor=True, seed=5,
    )
    return _save(model, tmp_path_factory.mktemp("dflash-reduced"))


@pytest.fixture(scope="module")
def qwen3_dflash(tmp_path_factory, tiny_qwen3_target) -> Path:
    model = _repeat_draft(
        _speculators_dflash(tiny_qwen3_target, QWEN3_AUX_LAYERS, num_layers=1, seed=6)
    )
    return _save(model, tmp_path_factory.mktemp("dflash-qwen3"))


def _engine(target: Path, draft: Path, k: int, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine.from_config(RuntimeConfig(
        model=f"file://{target}",
        dtype="float32",
        max_num_seqs=max_num_seqs,
        speculator=SpeculatorRuntimeConfig(
            method="dflash", model=f"file://{draft}", num_speculative_tokens=k
        ),
    ))


# ---- the draft network against speculators ------------------------------------------


def _speculators_reference(draft_dir: Path):
    """``speculators``' ``DFlashDraftModel.from_pretrained`` (eager attention on CPU)."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(draft_dir)
    config.transformer_layer_config._attn_implementation = "eager"
    return DFlashDraftModel.from_pretrained(draft_dir, config=config).eval()


def _reference_block_logits(
    ref, hf, seq: list[int], aux_layers: tuple[int, ...]
) -> torch.Tensor:
    """``ref``'s block logits ``[block_size, draft_vocab_size]`` for the block anchored
    at ``seq[-1]``, on target states computed by ``transformers``' ``hf``."""
    anchor = len(seq) - 1
    # Positions past the anchor are hidden from the block; speculators only needs them to
    # exist (it never anchors in the last block_size positions).
    ids = torch.tensor([seq + [1] * (BLOCK_SIZE + 1)])
    length = ids.shape[1]
    captured = {}
    hook = hf.model.norm.register_forward_hook(
        lambda _m, args, _out: captured.__setitem__("pre_norm", args[0])
    )
    with torch.no_grad():
        out = hf.model(ids, output_hidden_states=True)
    hook.remove()
    num_layers = hf.config.num_hidden_layers
    # HF's hidden_states[num_layers] is after the final norm; the speculators format
    # (trained on vLLM's captures) means the last layer's output before it.
    states = [
        captured["pre_norm"] if i == num_layers else out.hidden_states[i] for i in aux_layers
    ]
    loss_mask = torch.zeros(1, length)
    loss_mask[0, anchor] = 1  # the only anchor speculators may pick
    with torch.no_grad():
        _, logits, *_ = ref._backbone_forward(
            torch.cat(states, dim=-1), ids, loss_mask, captured["pre_norm"],
            torch.zeros(1, length, dtype=torch.long), max_anchors=1,
        )
    return logits[0]


@pytest.mark.parametrize("checkpoint", ["llama_dflash", "llama_dflash_reduced_vocab"])
def test_every_block_follows_speculators(checkpoint, request, tiny_llama_target, hf_model):
    from hidden_state_drafts import record_proposals

    draft_dir = request.getfixturevalue(checkpoint)
    engine = _engine(tiny_llama_target, draft_dir, k=8, max_num_seqs=4)
    spec = engine.speculator
    assert spec.aux_hidden_state_layers == LLAMA_AUX_LAYERS
    log = record_proposals(engine)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (6, 15, 2)]
    engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(log) >= 6
    hf = hf_model(tiny_llama_target)
    reference = _speculators_reference(draft_dir)
    first = spec.config.first_draft_slot
    for seq, drafts in log:
        ref = _reference_block_logits(reference, hf, seq, LLAMA_AUX_LAYERS)
        if reference.d2t is None:
            ref_ids = ref.argmax(-1)
        else:
            ref_ids = (torch.arange(DRAFT_VOCAB_SIZE) + reference.d2t)[ref.argmax(-1)]
        assert drafts == ref_ids[first : first + 8].tolist(), f"context of {len(seq)}"
    if reference.d2t is not None:
        # Over the target vocabulary, ids outside the draft vocabulary get -inf.
        logits = spec.compute_logits(torch.randn(3, 64, generator=gen))
        outside = torch.ones(VOCAB_SIZE, dtype=torch.bool)
        outside[torch.arange(DRAFT_VOCAB_SIZE) + reference.d2t] = False
        assert torch.isneginf(logits[:, outside]).all()
        assert torch.isfinite(logits[:, ~outside]).all()


# ---- end to end ---------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    """Random prompts of different lengths (1 to 17 tokens)."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (1, 4, 9, 17)]


def test_greedy_dflash_equals_hf_generate(
    tiny_qwen3_target, qwen3_dflash, hf_model, hf_greedy, greedy_rounds
):
    hf = hf_model(tiny_qwen3_target)
    prompts = _prompts()
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    # Fewer slots than prompts: the last prompt waits and joins a running batch.
    engine = _engine(tiny_qwen3_target, qwen3_dflash, k=8, max_num_seqs=3)
    assert engine.get_speculative_config()["method"] == "dflash"
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for r in greedy_rounds(engine, prompts, expected, params, ks=range(1, 9)):
        assert r.num_draft_tokens == r.k * r.num_drafts, f"k={r.k}"


def test_plain_decode_steps_feed_the_context_and_k_changes_between_steps(
    tiny_qwen3_target, qwen3_dflash, hf_model, hf_greedy
):
    """Steps with k = 0 decode plainly but still hand the draft its context; k changes
    between the steps of running requests."""
    hf = hf_model(tiny_qwen3_target)
    prompts = _prompts()
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    engine = _engine(tiny_qwen3_target, qwen3_dflash, k=8, max_num_seqs=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    schedule = [0, 0, 3, 8, 0, 1, 5]
    step = 0
    while engine.has_unfinished_requests():
        engine.set_num_speculative_tokens(schedule[step % len(schedule)])
        step += 1
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert engine.spec_decoding_stats.num_accepted_tokens > 0


def test_the_block_is_cached_before_its_rows_attend(tiny_qwen3_target, qwen3_dflash, monkeypatch):
    """A block's rows read each other's keys, so the draft writes the block's keys and
    values to the cache before attention, not inside it (``paged_attention``'s
    ``new_kv``): there each row's program takes its own key as the request's last and
    reads the other rows' slots while their programs write them. On a GPU every draft
    was then rejected. Off CUDA ``new_kv`` runs the unfused references, which hid it;
    they now refuse positions that do not end each context. The target's decode steps
    still take the fused write."""
    import specula.runtime.worker.model_runner as model_runner
    from specula.runtime.spec_decode.dflash.runner import DFlashRunner

    fused, drafting = [], [False]
    forward, attention = DFlashRunner.forward, model_runner.paged_attention

    def draft_forward(self, *args, **kwargs):
        drafting[0] = True
        try:
            return forward(self, *args, **kwargs)
        finally:
            drafting[0] = False

    def paged_attention(*args, new_kv=None, **kwargs):
        fused.append((drafting[0], new_kv is not None))
        return attention(*args, new_kv=new_kv, **kwargs)

    monkeypatch.setattr(DFlashRunner, "forward", draft_forward)
    monkeypatch.setattr(model_runner, "paged_attention", paged_attention)
    engine = _engine(tiny_qwen3_target, qwen3_dflash, k=3)
    engine.generate(_prompts()[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.spec_decoding_stats.num_draft_tokens > 0
    assert (False, True) in fused, "the target's steps write their keys inside attention"
    assert (True, False) in fused, "the draft's attention was not seen"
    assert (True, True) not in fused, "a draft block attended before its keys were cached"


@pytest.mark.gpu
def test_greedy_on_gpu_in_cuda_graphs(tiny_qwen3_target, qwen3_dflash, hf_model, hf_greedy):
    from gpu_checks import check_greedy_on_gpu, gpu_engine

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    hf = hf_model(tiny_qwen3_target)
    prompts = _prompts()
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    engine = gpu_engine(tiny_qwen3_target, "dflash", qwen3_dflash, k=8)
    check_greedy_on_gpu(engine, prompts, expected, ks=(0, 3, 8), max_tokens=MAX_TOKENS)


def test_sampled_dflash_keeps_target_distribution(
    tiny_qwen3_target, qwen3_dflash, hf_model, sampled_pvalue
):
    engine = _engine(tiny_qwen3_target, qwen3_dflash, k=3, max_num_seqs=256)
    hf = hf_model(tiny_qwen3_target)
    assert sampled_pvalue(engine, hf, [17, 42, 99, 7, 250], NUM_SAMPLES) > ALPHA


# ---- checkpoints that do not fit ----------------------------------------------------


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _set_layer(field: str, value):
    return lambda c: c["transformer_layer_config"].__setitem__(field, value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.__setitem__("speculators_model_type", "eagle3"),
         r"speculators_model_type is 'eagle3', expected 'dflash'"),
        (_set_layer("vocab_size", 512), r"vocab_size 512 != target vocab_size 320"),
        (_set_layer("hidden_size", 32), r"hidden_size 32 != target hidden_size 64"),
        (lambda c: c.__setitem__("target_hidden_size", 128),
         r"target_hidden_size 128 != target hidden_size 64"),
        (lambda c: c.__setitem__("aux_hidden_state_layer_ids", [0, 2, 7]),
         r"aux_hidden_state_layer_ids contains 7, outside \[0, 3\].*num_hidden_layers=3"),
        (lambda c: c.__setitem__("mask_token_id", None), r"mask_token_id None"),
    ],
    ids=["model-type", "vocab", "hidden", "target-hidden", "aux-layer", "mask-token"],
)
def test_mismatched_checkpoint_fails_at_load(
    edit, message, tmp_path, llama_dflash, tiny_llama_target
):
    draft = _edited(llama_dflash, tmp_path / "draft", edit)
    with pytest.raises(ValueError, match=message):
        _engine(tiny_llama_target, draft, k=3)


def test_k_beyond_the_block_fails_at_load(
    llama_dflash, llama_dflash_reduced_vocab, tiny_llama_target
):
    with pytest.raises(
        ValueError, match=r"max_num_speculative_tokens 9 exceeds the 8 .*block_size 9"
    ):
        _engine(tiny_llama_target, llama_dflash, k=9)
    # With sample_from_anchor the anchor slot drafts too: the whole block is usable.
    engine = _engine(tiny_llama_target, llama_dflash_reduced_vocab, k=9)
    assert engine.max_num_speculative_tokens == 9
    with pytest.raises(ValueError, match=r"max_num_speculative_tokens 10 exceeds the 9"):
        _engine(tiny_llama_target, llama_dflash_reduced_vocab, k=10)


def test_wrong_weights_fail_at_load(tmp_path, llama_dflash, tiny_llama_target):
    # Two aux layers declared, fc trained on three: the shape mismatch is named.
    draft = _edited(
        llama_dflash, tmp_path / "draft",
        lambda c: c.__setitem__("aux_hidden_state_layer_ids", [0, 2]),
    )
    with pytest.raises(
        ValueError, match=r"fc.weight: checkpoint shape \(64, 192\) != model shape \(64, 128\)"
    ):
        _engine(tiny_llama_target, draft, k=3)


def test_prefix_caching_keeps_greedy_output(
    tiny_qwen3_target, qwen3_dflash, hf_model, hf_greedy, prefix_cached
):
    prompts_for, run = prefix_cached
    hf = hf_model(tiny_qwen3_target)
    prompts = prompts_for(VOCAB_SIZE, seed=24)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    engine = _engine(tiny_qwen3_target, qwen3_dflash, k=4, max_num_seqs=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert run(engine, prompts, params) == expected
