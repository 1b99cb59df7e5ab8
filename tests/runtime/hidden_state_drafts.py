"""Targets, engines and checks shared by the tests of hidden-state-conditioned drafts
(EAGLE-3, MTP).

Random draft heads agree with a random target only by chance, which leaves the accept
branch of verification untested. So these tests pair a *bigram-dominated* target (its
layers' residual contributions scaled down, so its prediction at position ``p`` leans on
the embedding of ``t_p``) with heads built to predict that bigram from the token they
read (``t_{p+1}``): the pair agrees often but not always, like a trained head.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
from specula.runtime.engine.llm_engine import LLMEngine
from specula.runtime.spec_decode.base import DraftProposal, SpeculatorInput

VOCAB_SIZE = 320
HIDDEN_SIZE = 64
PROMPT_LENS = (3, 9, 17, 30)
MAX_TOKENS = 16
LAYER_DAMPING = 0.02
"""Scale of the target layers' residual contributions (attention and MLP outputs)."""


def _shape(**overrides) -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        **overrides,
    }


def layer_config(model_type: str, **overrides):
    """A ``transformers`` config of the draft-test shape (``llama`` or ``qwen3``)."""
    from transformers import LlamaConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[model_type]
    if model_type == "qwen3":
        overrides = {"head_dim": HIDDEN_SIZE // 4, **overrides}  # Qwen3's default is 128
    return cls(**_shape(**overrides))


def save_bigram_target(model_type: str, tokenizer, path: Path, seed: int) -> Path:
    """Save a 3-layer untied target whose layers are damped by :data:`LAYER_DAMPING`."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = layer_config(
        model_type,
        num_hidden_layers=3,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    cls = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[model_type]
    model = cls(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(LAYER_DAMPING)
            layer.mlp.down_proj.weight.mul_(LAYER_DAMPING)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_engine(target: Path, method: str, draft: Path, k: int, max_num_seqs: int = 3) -> LLMEngine:
    """A float32 engine serving ``target`` with the ``method`` speculator on ``draft``."""
    return LLMEngine.from_config(
        RuntimeConfig(
            model=f"file://{target}",
            dtype="float32",
            max_num_seqs=max_num_seqs,
            speculator=SpeculatorRuntimeConfig(
                method=method, model=f"file://{draft}", num_speculative_tokens=k
            ),
        )
    )


def random_prompts(seed: int) -> list[list[int]]:
    """Prompts of :data:`PROMPT_LENS` tokens, avoiding the eos id 0."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def record_proposals(engine: LLMEngine) -> list[tuple[list[list[int]], DraftProposal]]:
    """Make ``engine``'s speculator log every ``propose`` call (its requests' verified
    tokens and the proposal) into the returned list; drafting itself is unchanged."""
    speculator = engine.speculator
    assert speculator is not None
    log: list[tuple[list[list[int]], DraftProposal]] = []
    propose = speculator.propose

    def recording(inputs: SpeculatorInput, k: int) -> DraftProposal:
        proposal = propose(inputs, k)
        log.append(([list(t) for t in inputs.token_ids], proposal))
        return proposal

    speculator.propose = recording  # type: ignore[method-assign]
    return log
