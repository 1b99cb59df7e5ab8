"""The demo's EAGLE-3 and MTP heads: trained a few steps on a tiny target, saved, and loaded by
the ``speculators`` reference package, whose forward must give the same logits as ours on the
same inputs (this pins the checkpoint format); training lowers the loss; the cache trains once.
"""

from __future__ import annotations

import json

import pytest
import torch

from specula.demo.recipe import HeadsRecipe, ModelShape, Recipe

VOCAB = 96
NUM_STEPS = 3
RECIPE = Recipe(seq_len=16, max_position_embeddings=64, warmup_steps=2)
HEADS = HeadsRecipe(eagle3_aux_hidden_state_layer_ids=(1, 2, 4), eagle3_draft_vocab_size=64,
                    num_unrolled_steps=NUM_STEPS, steps=30, batch_size=4, eval_batches=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved 4-layer GQA Llama target, a token stream with structure to learn, and both heads
    trained on it for ``HEADS.steps`` steps (with their per-step losses)."""
    from transformers import LlamaForCausalLM

    from specula.demo.train import llama_config
    from specula.demo.train_heads import build_heads, train_heads_on

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("heads")
    torch.manual_seed(0)
    target = LlamaForCausalLM(llama_config(ModelShape(4, 32, 64, 4, 2), RECIPE, VOCAB, 0)).eval()
    target.requires_grad_(False)
    # A random target's next-token distributions are nearly uniform (KL to anything is tiny);
    # a sharper LM head gives the heads something to learn.
    target.lm_head.weight.data.mul_(30)
    target.save_pretrained(str(root / "target"))
    # Frequent low ids (a reduced draft vocabulary keeps them) in a repeating pattern.
    gen = torch.Generator().manual_seed(1)
    stream = torch.cat([torch.randperm(48, generator=gen)[:12] for _ in range(200)])
    heads = build_heads(target, HEADS, stream)
    history = train_heads_on(target, heads, stream, RECIPE, HEADS, progress=False)
    return root, target, stream, heads, history


def _features(target, stream):
    from specula.demo.train_heads import target_features

    x = stream[:RECIPE.seq_len][None]  # [1, T]
    return x, target_features(target, x, HEADS.eagle3_aux_hidden_state_layer_ids, "final_norm")


def test_training_lowers_both_losses(tiny) -> None:
    *_, history = tiny
    for name, losses in history.items():
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < 0.6 * first, (name, first, last)


def test_eagle3_checkpoint_loads_in_speculators_with_identical_logits(tiny) -> None:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from specula.demo.heads import save_speculators_checkpoint
    from specula.demo.train_heads import head_inputs

    root, target, stream, heads, _ = tiny
    head = heads["eagle3"]
    save_speculators_checkpoint(head, root / "eagle3", NUM_STEPS, str(root / "target"))
    config = json.loads((root / "eagle3" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]

    config = Eagle3SpeculatorConfig.from_pretrained(str(root / "eagle3"))
    # Its default flex attention needs lengths in multiples of 128; SDPA takes dense masks.
    config.transformer_layer_config._attn_implementation = "sdpa"
    ref = Eagle3DraftModel.from_pretrained(str(root / "eagle3"), config=config).eval()
    assert ref.draft_vocab_size == 64 and ref.verifier_vocab_size == VOCAB
    # d2t holds offsets to target ids; t2d marks the same ids.
    assert torch.equal(ref.d2t + torch.arange(64), head.draft_token_ids)
    assert torch.equal(ref.t2d.nonzero().flatten(), head.draft_token_ids)

    x, feats = _features(target, stream)
    hidden, ids, positions = head_inputs(head, feats, x)
    captured: list[torch.Tensor] = []
    ref.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        ref(hidden_states=hidden, input_ids=ids, document_ids=torch.zeros_like(ids),
            position_ids=positions, ttt_steps=NUM_STEPS)
        ours = head(hidden, ids, positions, NUM_STEPS)
    assert len(captured) == NUM_STEPS
    for step, (a, b) in enumerate(zip(ours, captured, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"draft step {step}")


def test_mtp_checkpoint_loads_in_speculators_with_identical_logits(tiny) -> None:
    from speculators.models.mtp import MTPDraftModel

    from specula.demo.heads import save_speculators_checkpoint

    root, target, stream, heads, _ = tiny
    head = heads["mtp"]
    save_speculators_checkpoint(head, root / "mtp", NUM_STEPS, str(root / "target"))
    ref = MTPDraftModel.from_pretrained(str(root / "mtp")).eval()
    # Embeddings and LM head come from the verifier, as speculators saves MTP heads.
    assert torch.equal(ref.lm_head.weight, target.lm_head.weight)

    x, feats = _features(target, stream)
    t = x.shape[1]
    with torch.no_grad():
        ref_logits, _, _ = ref(input_ids=x, hidden_states=feats.hidden_states,
                               position_ids=torch.arange(t)[None])
        # speculators' first step pairs the hidden state at j with the token at j + 1, at
        # position j, over the first T - NUM_STEPS - 1 indices; later steps unroll differently
        # (no training-time test), so the first step pins the format.
        n = ref_logits[0].shape[1]
        ours = head(feats.hidden_states[:, :n], x[:, 1:1 + n], torch.arange(n)[None], 1)
    torch.testing.assert_close(ours[0], ref_logits[0], atol=2e-5, rtol=1e-4)


def test_eagle3_rejects_bad_aux_layer_ids(tiny) -> None:
    from specula.demo.heads import Eagle3Head, TargetShape

    _, target, _, heads, _ = tiny
    shape = TargetShape.from_hf_config(target.config)
    args = (shape, target.model.embed_tokens.weight, target.lm_head.weight)
    vocab = heads["eagle3"].draft_token_ids
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \(1, 5\).*\[0, 4\]"):
        Eagle3Head(*args, (1, 5), vocab)
    with pytest.raises(ValueError, match="distinct"):
        Eagle3Head(*args, (2, 2), vocab)


def test_heads_are_cached_next_to_the_demo_models(demo_cache) -> None:
    from specula.demo.train import ensure_models
    from specula.demo.train_heads import ensure_heads

    recipe = demo_cache(target_layers=4)
    heads = HeadsRecipe(eagle3_aux_hidden_state_layer_ids=(1, 2, 3), eagle3_draft_vocab_size=200,
                        num_unrolled_steps=2, steps=2, batch_size=2, eval_batches=1)
    model_dir, _, _ = ensure_models(recipe, progress=False)
    out, report, trained = ensure_heads(model_dir, recipe, heads, progress=False)
    assert trained and out.parent == model_dir
    for name in ("eagle3", "mtp"):
        assert {"config.json", "model.safetensors"} <= {p.name for p in (out / name).iterdir()}
        accept = report["teacher_forced"][name]["acceptance_per_position"]
        assert len(accept) == 2 and 1.0 >= accept[0] >= accept[1] >= 0.0
    assert report["eagle3_draft_vocab_size"] == 200
    again = ensure_heads(model_dir, recipe, heads, progress=False)
    assert again == (out, report, False)
