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
from specula.runtime.spec_decode.base import DraftOutput, ProposeInputs

VOCAB_SIZE = 320
HIDDEN_SIZE = 64
PROMPT_LENS = (3, 9, 17, 30)
MAX_TOKENS = 16
LAYER_DAMPING = 0.02
"""Scale of the target layers' residual contributions (attention and MLP outputs)."""
AUX_IDS = (0, 1, 3)
"""EAGLE-3 auxiliary layers of the 3-layer target: the embeddings, layer 1's input and
the last layer's output (all three kinds of id)."""


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


def record_proposals(engine: LLMEngine) -> list[tuple[list[int], list[int]]]:
    """Make ``engine`` log every draft its speculator proposes as ``(verified tokens,
    drafts)`` of one request (the tokens being the request's prompt and output once the
    step that proposed them ended); drafting itself is unchanged. Requests that finished
    in that step are left out (their drafts are never verified)."""
    speculator = engine.speculator
    assert speculator is not None
    log: list[tuple[list[int], list[int]]] = []
    pending: list[tuple[list, list[list[int]]]] = []
    propose, step = speculator.propose, engine.step

    def recording(inputs: ProposeInputs) -> DraftOutput | None:
        out = propose(inputs)
        if out is not None:
            rows = inputs.idx_mapping.tolist()
            requests = [engine.input_batch._requests[r] for r in rows]
            pending.append((requests, out.draft_token_ids.tolist()))
        return out

    def stepping():
        outputs = step()
        for requests, drafts in pending:
            for request, d in zip(requests, drafts, strict=True):
                if not request.finished:
                    log.append((list(request.token_ids), d))
        pending.clear()
        return outputs

    speculator.propose = recording  # type: ignore[method-assign]
    engine.step = stepping  # type: ignore[method-assign]
    return log


def eagle3_head(
    target_hf,
    *,
    draft_vocab: torch.Tensor | None,
    seed: int,
    model_type: str = "llama",
    num_layers: int = 1,
    aux_ids: tuple[int, ...] | None = AUX_IDS,
    layer_overrides: dict | None = None,
    **flags,
):
    """A ``speculators`` EAGLE-3 head for ``target_hf`` with random weights.

    ``draft_vocab``: sorted target ids of a reduced draft vocabulary (``None``: all).
    Embeddings are the target's; ``lm_head`` random.
    """
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = layer_config(model_type, num_hidden_layers=num_layers, **(layer_overrides or {}))
    # Dense float masks instead of flex attention (CPU).
    layer._attn_implementation = "eager"
    num_draft = VOCAB_SIZE if draft_vocab is None else len(draft_vocab)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=num_draft,
        eagle_aux_hidden_state_layer_ids=None if aux_ids is None else list(aux_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
        **flags,
    )
    model = Eagle3DraftModel(config)
    if draft_vocab is not None:
        t2d = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
        t2d[draft_vocab] = True
        model.load_vocab_mappings(t2d, draft_vocab - torch.arange(num_draft))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
        model.embed_tokens.weight.copy_(target_hf.model.embed_tokens.weight)
    return model.eval()


def bigram_eagle3_head(target_hf, draft_vocab: torch.Tensor, seed: int):
    """A head that mostly predicts the target's bigram from the token it reads: its
    attention looks at its own position only (query/key biases whose rotary dot product
    peaks at distance 0) and copies the normed embedding; the hidden-state path stays
    (fc, a damped hidden_norm) but is small."""
    model = eagle3_head(
        target_hf,
        draft_vocab=draft_vocab,
        seed=seed,
        layer_overrides={"num_key_value_heads": 4, "attention_bias": True},
        norm_before_residual=True,
    )
    h = HIDDEN_SIZE
    attn = model.layers[0].self_attn
    head_bias = torch.zeros(16)
    head_bias[[0, 1, 2, 3, 8, 9, 10, 11]] = 25.0  # the fastest-rotating frequency pairs
    with torch.no_grad():
        model.fc.weight.mul_(0.25)
        for proj in (attn.q_proj, attn.k_proj):
            proj.weight.zero_()
            proj.bias.copy_(head_bias.repeat(4))
        attn.v_proj.weight.zero_()
        attn.v_proj.weight[:, :h] = torch.eye(h)
        attn.v_proj.bias.zero_()
        attn.o_proj.weight.copy_(torch.eye(h))
        attn.o_proj.bias.zero_()
        model.layers[0].mlp.down_proj.weight.mul_(0.1)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(model.layers[0], norm).weight.fill_(1.0)
        model.layers[0].hidden_norm.weight.fill_(0.1)
        model.norm.weight.copy_(target_hf.model.norm.weight)
        model.lm_head.weight.copy_(target_hf.lm_head.weight[draft_vocab])
    return model


def save_speculators(model, path: Path, *, keep_embeddings: bool = True) -> Path:
    """Save ``model`` in the ``speculators`` format; without ``keep_embeddings`` the
    checkpoint lacks ``embed_tokens`` (the runtime then shares the target's)."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path)
    if not keep_embeddings:
        (file,) = path.glob("*.safetensors")
        tensors = load_file(file)
        del tensors["embed_tokens.weight"]
        save_file(tensors, file, metadata={"format": "pt"})
    return path


def draft_vocab_ids(seed: int, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(VOCAB_SIZE, generator=gen)[:size].sort().values
