"""The demo's training recipe: model shapes, budget and hyperparameters, and its hash.

The recipe hash names the cache directory of the trained checkpoints, so any change here (or in
the corpus) trains new models instead of silently reusing old ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specula.demo.corpus import CorpusSpec

#: Bump when the training code changes in a way that changes the weights for the same recipe.
RECIPE_VERSION = 1


@dataclass(frozen=True)
class ModelShape:
    """Shape of a Llama-architecture decoder (names as in ``transformers.LlamaConfig``)."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the demo checkpoints, besides the corpus contents."""

    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    vocab_size: int = 2048
    """BPE vocabulary size shared by target and draft (a draft must share the target's
    vocabulary for token-level verification)."""

    seq_len: int = 128
    """Training context length, in tokens (the demo's prompts plus 64 new tokens fit)."""

    max_position_embeddings: int = 256
    """Context the checkpoints declare; the server derives its default ``max_model_len`` from
    it. RoPE positions beyond ``seq_len`` are untrained, so prompts + completions should stay
    within ``seq_len``."""

    rope_theta: float = 10000.0
    batch_size: int = 16
    """Sequences per optimizer step. Small batches and more steps learn more from a token
    budget this far below the critical batch size."""

    target: ModelShape = ModelShape(6, 192, 512, 4, 4)
    """Target: 6 layers of width 192 (3.4M parameters with untied embeddings). Narrow
    and deep: the token budget of a few CPU minutes trains small widths much further, and
    depth is what makes the target costlier per step than a one-layer draft."""

    draft: ModelShape = ModelShape(1, 192, 512, 4, 4)
    """Draft: one layer of the target's width (1.2M parameters), initialised from the target's
    embeddings, first decoder layer, final norm and LM head, then distilled; 1/6 of the
    target's decoder compute per token."""

    target_steps: int = 450
    """Optimizer steps for the target (tokens seen = steps * batch_size * seq_len)."""

    draft_steps: int = 150
    """Distillation steps for the draft."""

    target_lr: float = 3e-3
    draft_lr: float = 2e-3
    warmup_steps: int = 15
    min_lr_ratio: float = 0.1
    """Cosine schedule floor, as a fraction of the peak learning rate."""

    weight_decay: float = 0.1
    grad_clip: float = 1.0
    distill_temperature: float = 1.0
    distill_ce_weight: float = 0.1
    """Weight of the plain next-token loss next to the KL(target || draft) distillation loss."""

    eval_batches: int = 6
    seed: int = 1234

    def to_json(self) -> dict:
        return asdict(self)


#: Bump when the head-training code changes the weights for the same :class:`HeadsRecipe`.
HEADS_VERSION = 1


@dataclass(frozen=True)
class HeadsRecipe:
    """The EAGLE-3 and MTP heads trained on the demo target (:mod:`specula.demo.train_heads`).

    Context length, warmup, weight decay and clipping are the :class:`Recipe`'s.
    """

    eagle3_aux_hidden_state_layer_ids: tuple[int, ...] = (2, 4, 6)
    """Target layers whose input the EAGLE-3 head reads (vLLM's ``aux_hidden_state_layers``
    numbering; ``6`` is the last layer's output before the final norm, which ``speculators``
    accepts as the final hidden state). The default ``(2, L // 2, L - 3)`` repeats layer 3
    for the 6-layer target, so low, middle and top are spelled out."""

    eagle3_draft_vocab_size: int = 1024
    """The EAGLE-3 head's vocabulary: the most frequent training tokens, mapped to target ids
    through ``d2t`` (EAGLE-3 prunes the vocabulary the same way)."""

    eagle3_norm_output: bool = True
    """Feed the normed state, not the layer's raw output, to the next draft step
    (``speculators``' ``norm_output``, EAGLE 3.1). On the demo target it lifts teacher-forced
    acceptance at draft positions 2 and 3 from 0.39 / 0.23 to 0.50 / 0.35 (250 steps)."""

    num_unrolled_steps: int = 3
    """Draft steps unrolled per training example (EAGLE-3's training-time test)."""

    steps: int = 400
    """Optimizer steps; both heads train on the same batches of target features (about one
    CPU-second per step)."""

    batch_size: int = 8
    """Sequences per step (of the recipe's ``seq_len``); every sequence is unrolled
    ``num_unrolled_steps`` times per head, so half the target's batch costs about as much."""

    lr: float = 3e-3
    eagle3_step_weight_beta: float = 0.8
    """Loss weight of unrolled step ``s`` is proportional to ``beta ** s`` (EAGLE-3: 0.8)."""

    mtp_step_weight_beta: float = 0.6
    """The same for MTP (FastMTP, arXiv 2509.18362, Eq. 2: 0.6)."""

    mtp_hidden_state: str = "final_norm"
    """Which target state feeds MTP: ``final_norm`` (the target's output hidden state after its
    final norm, what vLLM hands its MTP proposers) or ``pre_norm`` (before it)."""

    num_speculative_tokens: int = 3
    """``speculative_tokens`` written into the checkpoints' proposal config."""

    eval_batches: int = 6
    seed: int = 1236

    def to_json(self) -> dict:
        return asdict(self)


def heads_hash(heads: HeadsRecipe) -> str:
    """16 hex digits of SHA-256 over ``heads`` and :data:`HEADS_VERSION`; the target they are
    trained on is keyed by the directory above (:func:`recipe_hash`)."""
    blob = json.dumps({"version": HEADS_VERSION, "heads": heads.to_json()}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def recipe_hash(recipe: Recipe, corpus_digest: str) -> str:
    """16 hex digits of SHA-256 over the recipe, :data:`RECIPE_VERSION`, the Python minor
    version and the corpus digest."""
    payload = {
        "version": RECIPE_VERSION,
        "recipe": recipe.to_json(),
        "corpus_digest": corpus_digest,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    blob = json.dumps(payload, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_root() -> Path:
    """``$SPECULA_CACHE_DIR``, else ``$XDG_CACHE_HOME/specula``, else ``~/.cache/specula``."""
    env = os.environ.get("SPECULA_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specula"
