"""Train an EAGLE-3 head and an MTP head on the demo target (CPU, minutes) and save them in
the ``speculators`` format.

The target is frozen. Every step samples windows of the training stream, runs the target once
(no grad) recording its auxiliary hidden states (inputs of the layers in
``eagle3_aux_hidden_state_layer_ids``), its final hidden state and its logits, and updates both
heads (:mod:`specula.demo.heads`) on those features:

- inputs at index ``j``: the target's features at position ``j`` and the token at ``j + 1``;
- ``num_unrolled_steps`` draft steps unrolled with teacher forcing, step ``s`` predicting the
  token at ``j + 2 + s`` (EAGLE-3's training-time test, arXiv 2503.01840);
- loss: forward KL from the target's next-token distribution to the head's (distillation, as
  ``speculators`` trains EAGLE-3; for the EAGLE-3 head over its reduced vocabulary), step ``s``
  weighted by ``beta ** s`` normalised over the steps (FastMTP, arXiv 2509.18362, Eq. 2).

Evaluation on held-out text reports, per draft position, the teacher-forced greedy acceptance:
the fraction of positions where the head's argmax equals the target's at that step and all
earlier ones, and from it the expected mean acceptance length.

``specula demo`` calls :func:`ensure_heads`, which caches the heads under
``<demo dir>/heads-<heads hash>/{eagle3,mtp}``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specula.demo.corpus import Corpus, select_corpus
from specula.demo.heads import (
    Eagle3Head,
    MTPHead,
    TargetShape,
    save_speculators_checkpoint,
)
from specula.demo.recipe import HeadsRecipe, Recipe, heads_hash
from specula.demo.train import (
    adamw_optimizer,
    cosine_lr,
    ensure_cached,
    sample_batch,
    token_stream,
)


@dataclass
class TargetFeatures:
    """The frozen target's view of a batch ``[B, T]`` of tokens."""

    aux_hidden_states: torch.Tensor
    """[B, T, len(aux ids) * H] the inputs of the aux layers (id ``L``: the last layer's
    output before the final norm), concatenated in id order."""
    hidden_states: torch.Tensor
    """[B, T, H] the state MTP reads (``HeadsRecipe.mtp_hidden_state``)."""
    logits: torch.Tensor
    """[B, T, vocab] next-token logits."""


@torch.no_grad()
def target_features(
    target, input_ids: torch.Tensor, aux_layer_ids: tuple[int, ...], mtp_hidden_state: str
) -> TargetFeatures:
    """Run a ``transformers`` Llama/Qwen3 causal LM on ``input_ids [B, T]`` and record its
    hidden states with hooks (Hugging Face's ``output_hidden_states`` ends with the normed
    state, so the pre-norm one is taken at the final norm's input).

    Raises:
        ValueError: an unknown ``mtp_hidden_state``.
    """
    if mtp_hidden_state not in ("final_norm", "pre_norm"):
        raise ValueError(f"mtp_hidden_state must be final_norm or pre_norm, got {mtp_hidden_state!r}")
    layers = target.model.layers
    captured: dict = {}

    def capture_input(i):
        def hook(_module, args, kwargs):
            captured[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def capture_norm(_module, args, output):
        captured[len(layers)] = args[0]
        captured["final_norm"] = output

    handles = [layers[i].register_forward_pre_hook(capture_input(i), with_kwargs=True)
               for i in aux_layer_ids if i < len(layers)]
    handles.append(target.model.norm.register_forward_hook(capture_norm))
    try:
        logits = target(input_ids=input_ids).logits
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1)
    hidden = captured["final_norm" if mtp_hidden_state == "final_norm" else len(layers)]
    return TargetFeatures(aux, hidden, logits.float())


def step_weights(beta: float, num_steps: int) -> list[float]:
    """``beta ** s`` normalised to sum to 1 over ``s = 0 .. num_steps - 1`` (FastMTP Eq. 2)."""
    raw = [beta**s for s in range(num_steps)]
    return [w / sum(raw) for w in raw]


def head_inputs(
    head: Eagle3Head | MTPHead, feats: TargetFeatures, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(target features [B, T-1, F], tokens [B, T-1], positions [B, T-1])``: index ``j``
    pairs the features at position ``j`` with the token at ``j + 1``."""
    src = feats.aux_hidden_states if isinstance(head, Eagle3Head) else feats.hidden_states
    b, t = input_ids.shape
    positions = torch.arange(1, t, device=input_ids.device).expand(b, -1)
    return src[:, :-1], input_ids[:, 1:], positions


def target_log_probs(head: Eagle3Head | MTPHead, feats: TargetFeatures) -> torch.Tensor:
    """The target's next-token log-probabilities over the head's vocabulary, [B, T, V_head]
    (for a reduced EAGLE-3 vocabulary: renormalised over it, as ``speculators`` does)."""
    logits = feats.logits
    if isinstance(head, Eagle3Head):
        logits = logits[..., head.draft_token_ids]
    return F.log_softmax(logits, dim=-1)


def unrolled_loss(
    head: Eagle3Head | MTPHead,
    feats: TargetFeatures,
    input_ids: torch.Tensor,
    num_steps: int,
    weights: list[float],
    with_accuracy: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted KL(target || head) over the unrolled steps.

    Args:
        with_accuracy: also compare greedy tokens (costs an argmax over the vocabulary).

    Returns:
        ``(loss, correct)``: the scalar loss (nats/token) and, with ``with_accuracy``, per
        step ``s`` a bool ``[B, T - 1 - s]`` telling where the head's argmax (in target ids)
        equals the target's (else an empty list).
    """
    hidden, ids, positions = head_inputs(head, feats, input_ids)
    target_logp = target_log_probs(head, feats)
    outs = head.unroll(hidden, ids, positions, num_steps)
    vocab = head.draft_token_ids if isinstance(head, Eagle3Head) else None
    loss = torch.zeros((), device=input_ids.device)
    correct = []
    n_valid = ids.shape[1]
    for s, (out, w) in enumerate(zip(outs, weights, strict=True)):
        n = n_valid - s  # step s at index j predicts the token at j + 2 + s
        logq = F.log_softmax(head.logits(out[:, :n]).float(), dim=-1)  # [B, n, V_head]
        logp = target_logp[:, 1 + s: 1 + s + n]
        kl = (logp.exp() * (logp - logq)).sum(-1).mean()
        loss = loss + w * kl
        if with_accuracy:
            pred = logq.argmax(-1)
            pred = pred if vocab is None else vocab[pred]
            correct.append(pred == feats.logits[:, 1 + s: 1 + s + n].argmax(-1))
    return loss, correct


def prefix_acceptance(correct: list[torch.Tensor]) -> list[float]:
    """Per draft position ``s``: fraction of chains (start indices valid for every step) whose
    steps ``0..s`` all match the target's greedy token — greedy speculative decoding's
    per-position acceptance rate on teacher-forced text."""
    n = correct[-1].shape[1]
    ok = torch.ones_like(correct[0][:, :n])
    out = []
    for c in correct:
        ok = ok & c[:, :n]
        out.append(ok.float().mean().item())
    return out


@torch.no_grad()
def evaluate_heads(
    target, heads: dict[str, Eagle3Head | MTPHead], stream: torch.Tensor, recipe: Recipe,
    hr: HeadsRecipe,
) -> dict[str, dict]:
    """Teacher-forced per-position greedy acceptance and mean acceptance length
    (``1 + sum``) of each head on ``stream``."""
    gen = torch.Generator().manual_seed(hr.seed + 7)
    sums = {name: [0.0] * hr.num_unrolled_steps for name in heads}
    aux_ids = heads["eagle3"].aux_hidden_state_layer_ids
    device = target.device
    for _ in range(hr.eval_batches):
        x = sample_batch(stream, hr.batch_size, recipe.seq_len, gen)[0].to(device)
        feats = target_features(target, x, aux_ids, hr.mtp_hidden_state)
        for name, head in heads.items():
            w = [1.0] * hr.num_unrolled_steps
            _, correct = unrolled_loss(head, feats, x, hr.num_unrolled_steps, w,
                                       with_accuracy=True)
            sums[name] = [a + b for a, b in zip(sums[name], prefix_acceptance(correct),
                                                 strict=True)]
    out = {}
    for name, acc in sums.items():
        per_pos = [a / hr.eval_batches for a in acc]
        out[name] = {"acceptance_per_position": per_pos,
                     "mean_acceptance_length": 1.0 + sum(per_pos)}
    return out


def draft_vocabulary(stream: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent token ids of ``stream`` (ties: lower id first),
    ascending — EAGLE-3's frequency-pruned draft vocabulary."""
    counts = torch.bincount(stream, minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)


def build_heads(target, hr: HeadsRecipe, train_stream: torch.Tensor) -> dict:
    """Fresh heads on ``target`` (a ``transformers`` causal LM), seeded by ``hr.seed``."""
    shape = TargetShape.from_hf_config(target.config)
    embed = target.model.embed_tokens.weight
    lm_head = target.lm_head.weight
    torch.manual_seed(hr.seed)
    vocab = draft_vocabulary(train_stream, shape.vocab_size,
                             min(hr.eagle3_draft_vocab_size, shape.vocab_size))
    heads = {
        "eagle3": Eagle3Head(shape, embed, lm_head, hr.eagle3_aux_hidden_state_layer_ids, vocab,
                             hr.eagle3_norm_output),
        "mtp": MTPHead(shape, embed, lm_head),
    }
    return {name: head.to(target.device) for name, head in heads.items()}


def train_heads_on(
    target, heads: dict, stream: torch.Tensor, recipe: Recipe, hr: HeadsRecipe,
    progress: bool,
) -> dict[str, list[float]]:
    """Train ``heads`` in place (AdamW, warmup + cosine schedule, clipping from ``recipe``);
    returns each head's loss per step."""
    gen = torch.Generator().manual_seed(hr.seed + 1)
    betas = {"eagle3": hr.eagle3_step_weight_beta, "mtp": hr.mtp_step_weight_beta}
    weights = {name: step_weights(betas[name], hr.num_unrolled_steps) for name in heads}
    opts = {name: adamw_optimizer(h, hr.lr, recipe.weight_decay) for name, h in heads.items()}
    aux_ids = heads["eagle3"].aux_hidden_state_layer_ids
    history: dict[str, list[float]] = {name: [] for name in heads}
    device = target.device
    for head in heads.values():
        head.train()
    bar = tqdm(range(hr.steps), desc="heads ", disable=not progress, unit="step")
    for step in bar:
        lr = hr.lr * cosine_lr(step, hr.steps, recipe.warmup_steps, recipe.min_lr_ratio)
        x = sample_batch(stream, hr.batch_size, recipe.seq_len, gen)[0].to(device)
        feats = target_features(target, x, aux_ids, hr.mtp_hidden_state)
        for name, head in heads.items():
            for g in opts[name].param_groups:
                g["lr"] = lr
            loss, _ = unrolled_loss(head, feats, x, hr.num_unrolled_steps, weights[name])
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.trainable_parameters(), recipe.grad_clip)
            opts[name].step()
            history[name].append(loss.item())
        bar.set_postfix({name: f"{h[-1]:.3f}" for name, h in history.items()})
    for head in heads.values():
        head.eval()
    return history


def _smoothed(losses: list[float], window: int = 20) -> float:
    tail = losses[-window:]
    return sum(tail) / len(tail)


def train_heads(
    model_dir: Path, out_dir: Path, recipe: Recipe, hr: HeadsRecipe,
    corpus: Corpus | None = None, progress: bool = True, device: str | None = None,
) -> dict:
    """Train both heads on the target in ``model_dir/target`` and save them under
    ``out_dir/eagle3`` and ``out_dir/mtp`` (``speculators`` format; the verifier path written
    into them is the target's).

    ``device``: where to train (default: CUDA when available, else the CPU).

    The training and validation streams are rebuilt exactly as :func:`specula.demo.train.
    train_models` built them (same corpus split, the target's tokenizer).

    Returns the report: losses (nats/token), teacher-forced acceptance, wall and CPU seconds.
    """
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specula.demo.tokenizer import EOS_TOKEN

    hf_logging.disable_progress_bar()  # the training bar is the one to watch
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(os.cpu_count() or 1)
    t0, c0 = time.perf_counter(), time.process_time()
    target_dir = model_dir / "target"
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    corpus = corpus or select_corpus(recipe.corpus)
    train_texts, val_texts = corpus.split(recipe.corpus.val_fraction)
    eos_id = tok.token_to_id(EOS_TOKEN)
    train_stream = token_stream(tok, train_texts, eos_id)
    val_stream = token_stream(tok, val_texts, eos_id)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    target.to(device).eval().requires_grad_(False)
    heads = build_heads(target, hr, train_stream)
    vocab = heads["eagle3"].draft_token_ids
    coverage = torch.isin(val_stream, vocab.cpu()).float().mean().item()
    before = evaluate_heads(target, heads, val_stream, recipe, hr)
    t_setup = time.perf_counter()
    history = train_heads_on(target, heads, train_stream, recipe, hr, progress)
    t_train = time.perf_counter()
    after = evaluate_heads(target, heads, val_stream, recipe, hr)
    for name, head in heads.items():
        save_speculators_checkpoint(head, out_dir / name, hr.num_speculative_tokens,
                                    str(target_dir))
    t_end = time.perf_counter()
    return {
        "heads_recipe": hr.to_json(),
        "params": {name: sum(p.numel() for p in h.trainable_parameters())
                   for name, h in heads.items()},
        "eagle3_draft_vocab_size": int(vocab.numel()),
        "eagle3_draft_vocab_val_coverage": coverage,
        "train_loss": {name: {"first": _smoothed(h[:20]), "last": _smoothed(h)}
                       for name, h in history.items()},
        "before_training": before,
        "teacher_forced": after,
        "wall_s": {"setup": t_setup - t0, "train": t_train - t_setup, "total": t_end - t0},
        "cpu_s": time.process_time() - c0,
        "num_threads": torch.get_num_threads(),
        "device": str(target.device),
    }


def ensure_heads(
    model_dir: Path, recipe: Recipe | None = None, heads: HeadsRecipe | None = None,
    retrain: bool = False, progress: bool = True,
) -> tuple[Path, dict, bool]:
    """Return ``(dir, report, trained)`` of the cached heads for the demo target in
    ``model_dir``, training them first when missing (or ``retrain``).

    ``dir`` is ``model_dir/heads-<heads_hash(heads)>`` with ``eagle3/`` and ``mtp/`` inside; an
    interrupted run (no completion marker) is trained again from scratch.
    """
    recipe = recipe or Recipe()
    heads = heads or HeadsRecipe()
    out = model_dir / f"heads-{heads_hash(heads)}"
    message = f"training the EAGLE-3 and MTP heads into {out} (first run; CPU, minutes)"
    return ensure_cached(
        out, lambda d: train_heads(model_dir, d, recipe, heads, progress=progress), retrain,
        message if progress else None,
    )
