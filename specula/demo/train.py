"""Train the demo's tokenizer, target and draft on the Python standard library (CPU, minutes).

Steps, all seeded:

1. Select the corpus (:mod:`specula.demo.corpus`) and train a byte-level BPE tokenizer on it.
2. Train the target, a Llama-architecture causal LM, with next-token cross-entropy, AdamW and a
   linear-warmup cosine schedule, on random windows of the EOS-joined token stream.
3. Build the draft: one decoder layer of the target's width, initialised from the target's
   embeddings, first layer, final norm and LM head (an early-exit view of the target, as in
   LayerSkip, arXiv 2404.16710), then distil it on the target's next-token distributions with
   forward KL plus a small cross-entropy term (DistillSpec, arXiv 2310.08461, shows that
   distilling the draft on the target raises the acceptance rate).
4. Save both in Hugging Face layout, each with the shared tokenizer.

Run as ``python -m specula.demo.train --out DIR`` (which then also trains the EAGLE-3 and MTP
heads of :mod:`specula.demo.train_heads` into ``DIR/heads-<hash>``); ``specula demo`` calls
:func:`ensure_models`, which caches the result under ``<cache>/demo/<recipe-hash>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specula.demo.corpus import Corpus, select_corpus
from specula.demo.recipe import ModelShape, Recipe, cache_root, recipe_hash
from specula.demo.tokenizer import EOS_TOKEN, save_tokenizer, train_bpe

#: Written last into a trained cache directory; its absence means the run was interrupted.
COMPLETE_MARKER = "COMPLETE.json"


def llama_config(shape: ModelShape, recipe: Recipe, vocab_size: int, eos_id: int):
    """A ``transformers.LlamaConfig`` for ``shape``; untied LM head, SDPA attention, fp32."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        torch_dtype="float32",
        attn_implementation="sdpa",
    )


def token_stream(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """Encode ``texts`` and join them with EOS after each document. Returns ``[num_tokens]``
    int64."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(
    stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``stream``: inputs ``[batch_size, seq_len]`` and next-token labels of
    the same shape."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    windows = stream[idx]  # [batch_size, seq_len + 1]
    return windows[:, :-1], windows[:, 1:]


def cosine_lr(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.95) over ``model``'s parameters; only matrices are decayed."""
    # Decay only matrices: norms' gains shrinking towards zero hurts small models.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def evaluate(
    target, draft, stream: torch.Tensor, recipe: Recipe
) -> dict[str, float]:
    """Validation next-token loss (nats/token) of both models and their greedy agreement (the
    fraction of positions where the draft's argmax equals the target's — the per-token
    acceptance rate of greedy speculative decoding on teacher-forced text)."""
    gen = torch.Generator().manual_seed(recipe.seed + 7)
    t_loss = d_loss = agree = 0.0
    for _ in range(recipe.eval_batches):
        x, y = sample_batch(stream, recipe.batch_size, recipe.seq_len, gen)
        tl = target(input_ids=x).logits
        t_loss += F.cross_entropy(tl.flatten(0, 1), y.flatten()).item()
        if draft is not None:
            dl = draft(input_ids=x).logits
            d_loss += F.cross_entropy(dl.flatten(0, 1), y.flatten()).item()
            agree += (dl.argmax(-1) == tl.argmax(-1)).float().mean().item()
    n = recipe.eval_batches
    out = {"target_val_loss": t_loss / n}
    if draft is not None:
        out |= {"draft_val_loss": d_loss / n, "greedy_agreement": agree / n}
    return out


def train_target(model, stream: torch.Tensor, recipe: Recipe, progress: bool) -> float:
    """Train ``model`` in place with next-token cross-entropy; returns the last smoothed loss."""
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = adamw_optimizer(model, recipe.target_lr, recipe.weight_decay)
    model.train()
    ema = None
    bar = tqdm(range(recipe.target_steps), desc="target", disable=not progress, unit="step")
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = recipe.target_lr * cosine_lr(
                step, recipe.target_steps, recipe.warmup_steps, recipe.min_lr_ratio
            )
        x, y = sample_batch(stream, recipe.batch_size, recipe.seq_len, gen)
        logits = model(input_ids=x).logits  # [batch, seq_len, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    model.eval()
    return float(ema)


def init_draft_from_target(draft, target) -> None:
    """Copy embeddings, the first ``num_hidden_layers`` decoder layers, the final norm and the
    LM head from ``target`` into ``draft`` (same width required).

    Raises:
        ValueError: hidden sizes or vocabularies differ.
    """
    if draft.config.hidden_size != target.config.hidden_size:
        raise ValueError("draft initialisation from the target needs equal hidden sizes")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError("draft and target vocabularies differ")
    src = target.state_dict()
    own = draft.state_dict()
    draft.load_state_dict({k: src[k].clone() for k in own}, strict=True)


def distill_draft(draft, target, stream: torch.Tensor, recipe: Recipe, progress: bool) -> float:
    """Distil ``draft`` on ``target``: loss = KL(p_target || p_draft) at temperature T (scaled by
    T^2) + ``distill_ce_weight`` * cross-entropy on the corpus. Returns the last smoothed loss."""
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    opt = adamw_optimizer(draft, recipe.draft_lr, recipe.weight_decay)
    temp = recipe.distill_temperature
    draft.train()
    target.eval()
    ema = None
    bar = tqdm(range(recipe.draft_steps), desc="draft ", disable=not progress, unit="step")
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = recipe.draft_lr * cosine_lr(
                step, recipe.draft_steps, recipe.warmup_steps, recipe.min_lr_ratio
            )
        x, y = sample_batch(stream, recipe.batch_size, recipe.seq_len, gen)
        with torch.no_grad():
            t_logp = F.log_softmax(target(input_ids=x).logits / temp, dim=-1).flatten(0, 1)
        d_logits = draft(input_ids=x).logits.flatten(0, 1)  # [batch * seq_len, vocab]
        kl = F.kl_div(F.log_softmax(d_logits / temp, -1), t_logp, log_target=True,
                      reduction="batchmean") * temp * temp
        loss = kl + recipe.distill_ce_weight * F.cross_entropy(d_logits, y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), recipe.grad_clip)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    draft.eval()
    return float(ema)


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def train_models(
    out_dir: Path, recipe: Recipe, corpus: Corpus | None = None, progress: bool = True
) -> dict:
    """Train tokenizer, target and draft per ``recipe`` and save them under ``out_dir/target``
    and ``out_dir/draft`` (HF layout: config.json, model.safetensors, tokenizer files).

    Returns the training report (wall times in seconds, losses in nats/token, sizes).
    """
    from transformers import LlamaForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    t0, c0 = time.perf_counter(), time.process_time()
    corpus = corpus or select_corpus(recipe.corpus)
    train_texts, val_texts = corpus.split(recipe.corpus.val_fraction)
    tok = train_bpe(train_texts, recipe.vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)
    train_stream = token_stream(tok, train_texts, eos_id)
    val_stream = token_stream(tok, val_texts, eos_id)
    t_tok = time.perf_counter()
    if progress:
        print(
            f"corpus: {len(corpus.paths)} files, {corpus.num_bytes / 1e6:.2f} MB from "
            f"{corpus.root}; tokenizer: {tok.get_vocab_size()} tokens; "
            f"{train_stream.numel():,} train / {val_stream.numel():,} val tokens "
            f"({t_tok - t0:.1f}s)",
            flush=True,
        )

    vocab = tok.get_vocab_size()
    torch.manual_seed(recipe.seed)
    target = LlamaForCausalLM(llama_config(recipe.target, recipe, vocab, eos_id))
    target_train_loss = train_target(target, train_stream, recipe, progress)
    t_target = time.perf_counter()

    torch.manual_seed(recipe.seed + 1)
    draft = LlamaForCausalLM(llama_config(recipe.draft, recipe, vocab, eos_id))
    init_draft_from_target(draft, target)
    draft_init_eval = evaluate(target, draft, val_stream, recipe)
    draft_train_loss = distill_draft(draft, target, train_stream, recipe, progress)
    t_draft = time.perf_counter()

    metrics = evaluate(target, draft, val_stream, recipe)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per phase above is enough
    for name, model in (("target", target), ("draft", draft)):
        d = out_dir / name
        d.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(d), safe_serialization=True)
        save_tokenizer(tok, d, recipe.max_position_embeddings)
    t_end = time.perf_counter()
    return {
        "recipe": recipe.to_json(),
        "corpus": {"root": str(corpus.root), "files": len(corpus.paths),
                   "bytes": corpus.num_bytes, "digest": corpus.digest,
                   "train_tokens": train_stream.numel(), "val_tokens": val_stream.numel()},
        "vocab_size": vocab,
        "params": {"target": _num_params(target), "draft": _num_params(draft)},
        "tokens_seen": {
            "target": recipe.target_steps * recipe.batch_size * recipe.seq_len,
            "draft": recipe.draft_steps * recipe.batch_size * recipe.seq_len,
        },
        "train_loss": {"target": target_train_loss, "draft": draft_train_loss},
        "draft_before_distillation": draft_init_eval,
        **metrics,
        "wall_s": {"tokenizer": t_tok - t0, "target": t_target - t_tok,
                   "draft": t_draft - t_target, "save": t_end - t_draft, "total": t_end - t0},
        # CPU seconds of all threads: on a shared machine wall time overstates the work.
        "cpu_s": time.process_time() - c0,
        "num_threads": torch.get_num_threads(),
    }


def ensure_models(
    recipe: Recipe | None = None, retrain: bool = False, progress: bool = True
) -> tuple[Path, dict, bool]:
    """Return ``(dir, report, trained)`` of the cached demo checkpoints, training them first
    (``trained`` True) when the cache has no complete entry for this recipe and corpus, or
    ``retrain`` is set.

    ``dir`` is ``<cache_root()>/demo/<recipe-hash>`` with ``target/`` and ``draft/`` inside.
    """
    recipe = recipe or Recipe()
    corpus = select_corpus(recipe.corpus)
    out = cache_root() / "demo" / recipe_hash(recipe, corpus.digest)
    message = f"training the demo models into {out} (first run; CPU, a few minutes)"
    return ensure_cached(
        out, lambda d: train_models(d, recipe, corpus, progress), retrain,
        message if progress else None,
    )


def ensure_cached(
    out: Path, train: Callable[[Path], dict], retrain: bool, message: str | None
) -> tuple[Path, dict, bool]:
    """Return ``(out, report, trained)``: the report in ``out``'s completion marker, or,
    when there is none (or ``retrain``), the report of ``train(out)`` run into an emptied
    ``out``, printing ``message`` first unless it is ``None``.

    The marker is written last (atomically), so an interrupted run is trained again
    from scratch. The report is returned as a cached run returns it (read back from
    JSON: lists, not tuples).
    """
    marker = out / COMPLETE_MARKER
    if marker.is_file() and not retrain:
        return out, json.loads(marker.read_text()), False
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if message is not None:
        print(message, flush=True)
    text = json.dumps(train(out), indent=2)
    tmp = out / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, marker)
    return out, json.loads(text), True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specula.demo.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output directory (target/, draft/)")
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--draft-steps", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=None, help="corpus cap in bytes")
    p.add_argument("--no-heads", dest="heads", action="store_false",
                   help="skip the EAGLE-3 and MTP heads")
    args = p.parse_args(argv)
    recipe = Recipe()
    if args.target_steps is not None:
        recipe = dataclasses.replace(recipe, target_steps=args.target_steps)
    if args.draft_steps is not None:
        recipe = dataclasses.replace(recipe, draft_steps=args.draft_steps)
    if args.max_bytes is not None:
        recipe = dataclasses.replace(
            recipe, corpus=dataclasses.replace(recipe.corpus, max_bytes=args.max_bytes)
        )
    args.out.mkdir(parents=True, exist_ok=True)
    report = train_models(args.out, recipe)
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("params", "target_val_loss", "draft_val_loss",
                                             "greedy_agreement", "wall_s")}, indent=2))
    if args.heads:
        from specula.demo.recipe import HeadsRecipe, heads_hash
        from specula.demo.train_heads import train_heads

        heads = HeadsRecipe()
        heads_report = train_heads(args.out, args.out / f"heads-{heads_hash(heads)}", recipe,
                                   heads)
        (args.out / "heads_report.json").write_text(json.dumps(heads_report, indent=2))
        print(json.dumps({k: heads_report[k] for k in ("teacher_forced", "wall_s")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
