"""Benchmark 3 of the engine: Hugging Face ``transformers`` on the same GPU and shape.

Called by ``bench/engine.py`` (phase ``hf``) after the engine's own model is freed.
Greedy, batch 1, a ``--prompt-len`` prompt of random tokens, exactly the requested
number of new tokens (``min_new_tokens``); the elapsed time includes the prefill.

Every variant runs on the target of a random target/assistant pair whose greedy tokens
agree at ``--hf-acceptance`` (``bench/engine_hf_pair.py``: the assistant has
``--hf-assistant-layers`` layers of the target's width and vocabulary, the target is
the assistant plus random layers of output scale ``eps``, ``eps`` calibrated on the GPU
at bench time); the pair's construction and calibration are recorded under ``pair``.

Figures (``tokens_per_s``; every variant on the same target):

- ``eager_dynamic_bs1``: plain ``generate``, dynamic cache, ``--hf-assisted-new-tokens``.
- ``assisted_k{K}_constant_bs1``: assisted generation with ``num_assistant_tokens = K``
  (``--hf-assisted-k``), ``num_assistant_tokens_schedule = "constant"`` and no
  confidence stop, as our engine's point (k = K); ``assisted_default_bs1``: the
  installed ``transformers``' default drafting settings; ``assisted_heuristic_bs1``:
  the ``"heuristic"`` schedule (+2 after a fully accepted draft, -1 otherwise, kept
  across calls, so the warm-up calls adapt it). Each: warm-up calls on the first
  prompt, then one timed call on each of ``--hf-assisted-prompts`` random prompts;
  ``assisted_bs1`` is the fastest variant. Each records (``assisted``) the greedy
  agreement over its timed outputs (the assistant's teacher-forced argmax against the
  emitted tokens) with its binomial standard error, the assistant's mean top-1
  probability there, the smallest share of distinct tokens in an output (a loop would
  show), the drafting settings in effect, and the verification counts taken from
  ``transformers`` during the timed calls in vLLM's terms (``num_drafts``,
  ``num_draft_tokens``, ``num_accepted_tokens``, ``num_accepted_tokens_per_pos``) with
  the conditional per-position acceptance they give: accepted / (accepted + drafts
  ended by a rejection), the estimate of the engine's synthetic rate ``a``.
- ``prompt_lookup_bs1``: ``prompt_lookup_num_tokens = 10`` (n-gram drafts).
- ``static_compile_bs1``: its fastest plain ``generate``: ``cache_implementation =
  "static"``, with which ``generate`` compiles the decode forward itself
  (``compile_config``: fullgraph, CUDA graphs), ``--hf-new-tokens``; ``model.forward``
  is not wrapped by hand, which would break its cache handling.

The comparison (:func:`vs_hf_section`, ``engine.json`` key ``vs_hf``):
``generate_bs1`` = our target-only batch-1 tokens/s (phase ``decode``) /
``static_compile_bs1``; ``assisted_bs1`` = our engine's speculative batch-1 tokens/s
(:func:`engine_spec_point`: :class:`~specula.runtime.engine.llm_engine.LLMEngine` with a
random EAGLE-3 head, synthetic acceptance, ``k = --hf-assisted-k``, recorded as
``ours_spec``) / ``assisted_bs1``. Ours runs at synthetic acceptance
``a = --hf-acceptance``, unless the greedy agreement measured on the fastest variant's
outputs differs from ``a`` by more than ``--hf-acceptance-tolerance`` (default 0.03):
then at the measured agreement, rounded to 0.01; ``assisted_acceptance`` and
``vs_hf_notes`` record which.

Assisted generation: Leviathan et al., arXiv 2211.17192; ``transformers``
``AssistedCandidateGenerator``.
"""

from __future__ import annotations

import contextlib
import math
import time

from bench.engine_hf_pair import (
    CALIBRATION_PROMPTS,
    build_controlled_pair,
    calibrate_perturbation,
    distinct_token_fraction,
    greedy_agreement,
    greedy_generate,
    random_prompts,
)


@contextlib.contextmanager
def count_verifications():
    """Record every verification step of ``transformers``' assisted generation
    (``AssistedCandidateGenerator``) by wrapping ``update_candidate_strategy``, which
    receives the target's logits over the draft and the number of matches after each
    step. Yields a dict: ``steps``, a list of ``(num_draft_tokens, num_accepted_tokens)``,
    and ``settings``, the drafting settings in effect at the first step."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    log: dict = {"steps": [], "settings": None}
    original = AssistedCandidateGenerator.update_candidate_strategy

    def update(self, input_ids, scores, num_matches):
        if log["settings"] is None:
            config = self.assistant_generation_config
            log["settings"] = {
                "num_assistant_tokens": self.num_assistant_tokens,
                "num_assistant_tokens_schedule": config.num_assistant_tokens_schedule,
                "assistant_confidence_threshold": self.generation_config.assistant_confidence_threshold,
            }
        log["steps"].append((scores.shape[1] - 1, int(num_matches)))  # [1, drafted + 1, V]
        return original(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = update
    try:
        yield log
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = original


def acceptance_counts(steps: list[tuple[int, int]]) -> dict:
    """vLLM-style counters over verification steps ``(drafted, accepted)`` (steps that
    drafted nothing are not drafts), and the conditional per-position acceptance: the
    maximum-likelihood estimate of a fixed rate ``a`` at which each draft position is
    accepted given the previous one was, accepted / (accepted + drafts ended by a
    rejection), overall and per position."""
    drafts = [(d, a) for d, a in steps if d > 0]
    max_len = max((d for d, _ in drafts), default=0)
    per_pos = [sum(a > i for _, a in drafts) for i in range(max_len)]
    reached = [sum(d > i and a >= i for d, a in drafts) for i in range(max_len)]
    accepted = sum(a for _, a in drafts)
    rejections = sum(a < d for d, a in drafts)
    return {
        "num_drafts": len(drafts),
        "num_draft_tokens": sum(d for d, _ in drafts),
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "mean_draft_length": round(sum(d for d, _ in drafts) / max(1, len(drafts)), 3),
        "mean_acceptance_length": round(1 + accepted / max(1, len(drafts)), 3),
        "conditional_acceptance": round(accepted / max(1, accepted + rejections), 4),
        "conditional_acceptance_per_pos": [
            round(n / r, 4) if r else None for n, r in zip(per_pos, reached, strict=True)
        ],
    }


DRAFTING_KEYS = (
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
)
"""The assistant's ``generation_config`` fields that set how assisted generation drafts."""


def assisted_variants(k: int, defaults: dict) -> dict[str, dict]:
    """Name -> the assistant's drafting settings (:data:`DRAFTING_KEYS`) of each assisted
    run; ``defaults`` are those of a freshly built assistant (``transformers`` fills
    unset ones with its defaults when it drafts)."""
    return {
        f"k{k}_constant": dict(
            num_assistant_tokens=k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,  # no confidence stop: always k drafts
        ),
        "default": dict(defaults),
        "heuristic": dict(defaults, num_assistant_tokens_schedule="heuristic"),
    }


def _generate_tokens_per_s(model, prompt, new_tokens: int, reps: int, **gen):
    import torch

    for _ in range(reps):  # warm-up (and compilation)
        greedy_generate(model, prompt, new_tokens, **gen)
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = greedy_generate(model, prompt, new_tokens, **gen)
    sync()
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return prompt.shape[0] * new_tokens / elapsed, out


def run_assisted(target, assistant, prompts, new_tokens: int, reps: int, settings: dict) -> dict:
    """One assisted-generation variant, ``settings`` on the assistant's generation
    config: ``reps`` warm-up calls on ``prompts[0]``, then one timed call per row of
    ``prompts`` (``[n, prompt_len]``); tokens/s, agreement and verification counts over
    the timed calls."""
    import torch

    for key, value in settings.items():
        setattr(assistant.generation_config, key, value)
    sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
    outs, elapsed = [], 0.0
    with count_verifications() as log:
        for _ in range(reps):
            greedy_generate(target, prompts[:1], new_tokens, assistant_model=assistant)
        log["steps"].clear()
        log["settings"] = None
        for i in range(prompts.shape[0]):
            sync()
            t0 = time.perf_counter()
            outs.append(
                greedy_generate(target, prompts[i : i + 1], new_tokens, assistant_model=assistant)
            )
            sync()
            elapsed += time.perf_counter() - t0
    out = torch.cat(outs)  # [n, prompt_len + new_tokens]
    assert out.shape == (prompts.shape[0], prompts.shape[1] + new_tokens)
    prompt_len = prompts.shape[1]
    agree, top1 = greedy_agreement(assistant, out, prompt_len)
    return {
        "tokens_per_s": round(out[:, prompt_len:].numel() / elapsed, 1),
        "settings": {k: v for k, v in settings.items() if v is not None} or "default",
        "settings_in_effect": log["settings"],
        "timed_calls": prompts.shape[0],
        "agreement": round(agree, 4),
        "agreement_stderr": round(math.sqrt(agree * (1 - agree) / out[:, prompt_len:].numel()), 4),
        "assistant_mean_top1_prob": round(top1, 4),
        "distinct_token_fraction": distinct_token_fraction(out, prompt_len),
        **acceptance_counts(log["steps"]),
    }


def run_hf_phase(shape: dict, dtype, device, args) -> dict:
    """Measure ``transformers``' generate variants at batch 1 (module docstring);
    returns the ``hf`` section: ``tokens_per_s`` per variant, ``pair`` (construction and
    calibration), ``assisted`` (per assisted variant), ``assisted_best`` (the fastest
    variant's name) and ``assisted_agreement`` (its agreement)."""
    import torch
    from transformers.utils import is_sklearn_available

    t_start = time.perf_counter()
    new = args.hf_assisted_new_tokens
    prompts = random_prompts(
        shape["vocab_size"],
        max(CALIBRATION_PROMPTS, args.hf_assisted_prompts),
        args.prompt_len,
        device,
    )
    prompt = prompts[:1]  # plain generate and prompt lookup
    section: dict = {
        "prompt_len": args.prompt_len,
        "new_tokens": args.hf_new_tokens,
        "assisted_new_tokens": new,
        "assisted_timed_prompts": args.hf_assisted_prompts,
        "target_acceptance": args.hf_acceptance,
        "tokens_per_s": {},
    }
    # Not inference mode: tensors made there would become the models' parameters, which
    # the compiled static-cache generate below then reads.
    with torch.no_grad():
        target, assistant, info = build_controlled_pair(
            shape,
            args.hf_assistant_layers,
            dtype,
            device,
            prompts[:CALIBRATION_PROMPTS],
            new,
            args.hf_acceptance,
        )
        calibration = calibrate_perturbation(
            target,
            assistant,
            args.hf_assistant_layers,
            prompts[:CALIBRATION_PROMPTS],
            new,
            args.hf_acceptance,
            args.hf_calibration_rollouts,
        )
    section["pair"] = {
        "assistant": (
            f"LlamaForCausalLM, {args.hf_assistant_layers} layers of the target's width and "
            "vocabulary, random weights"
        ),
        "target": (
            f"the assistant's embeddings, {args.hf_assistant_layers} layers, norm and lm_head, "
            f"then {shape['num_hidden_layers'] - args.hf_assistant_layers} random layers with "
            "o_proj and down_proj scaled by eps"
        ),
        **info,
        "calibration": calibration,
    }
    print(f"HF pair calibrated: {json_line(section['pair'])}", flush=True)
    reps = 1 if device.type != "cuda" else 2
    with torch.inference_mode():
        tps, _ = _generate_tokens_per_s(target, prompt, new, reps)
        section["tokens_per_s"]["eager_dynamic_bs1"] = round(tps, 1)
        print(f"HF eager dynamic bs1: {tps:.1f} tok/s", flush=True)
        section["assisted"] = {}
        defaults = {key: getattr(assistant.generation_config, key) for key in DRAFTING_KEYS}
        for name, settings in assisted_variants(args.hf_assisted_k, defaults).items():
            res = run_assisted(
                target, assistant, prompts[: args.hf_assisted_prompts], new, reps, settings
            )
            section["assisted"][name] = res
            section["tokens_per_s"][f"assisted_{name}_bs1"] = res["tokens_per_s"]
            print(f"HF assisted {name} bs1: {json_line(res)}", flush=True)
        best = max(section["assisted"], key=lambda n: section["assisted"][n]["tokens_per_s"])
        section["assisted_best"] = best
        section["assisted_agreement"] = section["assisted"][best]["agreement"]
        section["tokens_per_s"]["assisted_bs1"] = section["assisted"][best]["tokens_per_s"]
        section["sklearn_available"] = is_sklearn_available()  # adapts the confidence stop
        tps, _ = _generate_tokens_per_s(target, prompt, new, reps, prompt_lookup_num_tokens=10)
        section["tokens_per_s"]["prompt_lookup_bs1"] = round(tps, 1)
        print(f"HF prompt lookup bs1: {tps:.1f} tok/s", flush=True)
        del assistant
        if device.type == "cuda":
            torch.cuda.empty_cache()
        target.generation_config.cache_implementation = "static"
        t0 = time.perf_counter()
        try:
            tps, _ = _generate_tokens_per_s(target, prompt, args.hf_new_tokens, reps)
        except Exception as exc:  # noqa: BLE001 - recorded, the other figures stand
            section["static_compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"HF static cache + compile failed: {exc}", flush=True)
        else:
            section["tokens_per_s"]["static_compile_bs1"] = round(tps, 1)
            print(f"HF static cache + compile bs1: {tps:.1f} tok/s", flush=True)
        section["static_compile_warmup_and_run_s"] = round(time.perf_counter() - t0, 1)
    section["wall_s"] = round(time.perf_counter() - t_start, 1)
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return section


def engine_spec_point(shape: dict, dtype, device, args, rate: float, k: int) -> dict:
    """Our engine's speculative decoding at batch 1, end to end as ``bench/engine_e2e.py``
    measures it: an :class:`~specula.runtime.engine.llm_engine.LLMEngine` on ``shape``
    with random weights (``load_format: dummy``) and a random 1-layer EAGLE-3 head
    (``engine_e2e``'s: draft vocabulary ``min(32000, vocab)``, aux layers ``(2, L // 2,
    L - 3)``), synthetic acceptance ``rate`` and ``k`` draft tokens, greedy, with the hf
    phase's lengths (prompts of ``--prompt-len`` random tokens, ``--hf-assisted-new-tokens``
    new ones, ``ignore_eos``): one warm-up request, then ``--hf-assisted-prompts`` timed
    ones, one at a time.
    ``tokens_per_s`` counts every new token over the requests' whole time, prefill
    included, as HF's figures do; ``decode_tokens_per_s`` leaves out each request's first
    token and the time before it (``engine_e2e``'s measure). The same engine with
    speculation off (k = 0) gives ``nospec_tokens_per_s`` and ``speedup_vs_nospec``."""
    import tempfile
    from pathlib import Path

    from bench.engine_e2e import random_prompts as e2e_prompts
    from bench.engine_e2e import release_memory, timed_run, write_checkpoints
    from specula.api.runtime_config import SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine

    dtype_name = str(dtype).removeprefix("torch.")
    target = dict(
        shape, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype=dtype_name
    )
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_checkpoints(Path(tmp), target, target)
        engine = LLMEngine(
            dirs["target"],
            None,
            served_model_name="bench",
            speculator_config=SpeculatorRuntimeConfig(
                method="eagle3", model=f"file://{dirs['eagle3']}", num_speculative_tokens=k
            ),
            dtype=dtype_name,
            max_model_len=args.max_model_len,
            max_num_seqs=1,
            device=str(device),
            block_size=args.block_size,
            load_format="dummy",
            synthetic_acceptance_rate=float(rate),
            cudagraph_capture_sizes=[1] if device.type == "cuda" else None,
        )
    new = args.hf_assisted_new_tokens
    prompts = e2e_prompts(args.hf_assisted_prompts + 1, shape["vocab_size"], args.prompt_len, 0)

    def measure(engine) -> dict:
        timed_run(engine, prompts[:1], new)  # warm-up
        runs = [timed_run(engine, [p], new) for p in prompts[1:]]
        seconds = sum(r["end_to_end_s"] for r in runs)
        accepted = [r["mean_acceptance_length"] for r in runs if r["mean_acceptance_length"]]
        return {
            "tokens_per_s": round(len(runs) * new / seconds, 1),
            "decode_tokens_per_s": round(
                sum(r["decode_tokens_per_s"] for r in runs) / len(runs), 1
            ),
            "mean_acceptance_length": (
                round(sum(accepted) / len(accepted), 3) if accepted else None
            ),
        }

    spec = measure(engine)
    engine.set_num_speculative_tokens(0)
    nospec = measure(engine)
    del engine
    release_memory()
    return {
        "key": f"a{float(rate)}_k{k}_bs1",
        "method": "eagle3",
        "synthetic_acceptance": float(rate),
        "num_speculative_tokens": k,
        "tokens_per_s": spec["tokens_per_s"],
        "decode_tokens_per_s": spec["decode_tokens_per_s"],
        "mean_acceptance_length": spec["mean_acceptance_length"],
        "nospec_tokens_per_s": nospec["tokens_per_s"],
        "nospec_decode_tokens_per_s": nospec["decode_tokens_per_s"],
        "speedup_vs_nospec": round(spec["tokens_per_s"] / nospec["tokens_per_s"], 3),
        "new_tokens": new,
        "timed_requests": args.hf_assisted_prompts,
    }


def vs_hf_section(results: dict, hf: dict, args, spec_point) -> dict:
    """The ``vs_hf`` section: our speed over theirs (module docstring of
    ``bench/engine.py`` for the phases).

    - ``generate_bs1``: our target-only batch-1 decode (``results["target_decode"]``)
      over their static + compiled ``generate``.
    - ``assisted_bs1``: our engine's speculative decoding at batch 1 and ``k =
      --hf-assisted-k``, ``spec_point(rate, k)`` (recorded as ``ours_spec``), over the
      fastest of their assisted variants, whose pair was calibrated to the greedy
      agreement ``--hf-acceptance``. ``rate`` is that agreement, unless the agreement
      measured on the fastest variant's output differs from it by more than
      ``--hf-acceptance-tolerance``: then the measured one, rounded to 0.01.
    """
    ours_bs1 = results.get("target_decode", {}).get("tokens_per_s", {}).get("bs1")
    rate, k, tol = args.hf_acceptance, args.hf_assisted_k, args.hf_acceptance_tolerance
    theirs = hf["tokens_per_s"]
    static, assisted = theirs.get("static_compile_bs1"), theirs.get("assisted_bs1")
    best = hf["assisted"][hf["assisted_best"]]
    measured = best["agreement"]
    rate_used = rate if abs(measured - rate) <= tol else round(measured, 2)
    point = spec_point(rate_used, k)
    numerator = point["tokens_per_s"]
    vs: dict = {
        "generate_bs1": round(ours_bs1 / static, 3) if ours_bs1 and static else None,
        "assisted_bs1": round(numerator / assisted, 3) if numerator and assisted else None,
        "ours_target_only_bs1_tokens_per_s": ours_bs1,
        "ours_spec": point,
        "assisted_acceptance": {
            "target": rate,
            "hf_variant": hf["assisted_best"],
            "hf_greedy_agreement": measured,
            "hf_greedy_agreement_stderr": best["agreement_stderr"],
            "hf_conditional_acceptance": best["conditional_acceptance"],
            "tolerance": tol,
            "ours_rate_used": point["key"],
        },
    }
    vs["vs_hf_notes"] = (
        f"assisted_bs1 = our engine's speculative tokens/s (LLMEngine, random EAGLE-3 head, "
        f"synthetic acceptance, k={k}, batch 1, prefill included, ours_spec) / the fastest "
        f"HF assisted variant ({hf['assisted_best']}); HF's random target/assistant pair is "
        f"calibrated to greedy agreement {rate} (target = assistant + a perturbation of size "
        f"eps, hf.pair). Ours runs at synthetic acceptance {rate} unless the agreement "
        f"measured on HF's timed output differs from it by more than {tol}; then at the "
        "measured agreement (assisted_acceptance.ours_rate_used). generate_bs1 = our "
        "target-only bs1 (the decode phase's target runner) / HF static cache + compile."
    )
    vs["hf"] = hf
    return vs


def json_line(obj) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))
