"""Benchmark 3 of the engine: Hugging Face ``transformers`` on the same GPU and shape.

Called by ``bench/engine.py`` (phase ``hf``) after the engine's own model is freed.
The target is ``transformers``' ``LlamaForCausalLM`` of the same shape with random
bf16 weights; greedy, exactly ``--hf-new-tokens`` new tokens (``min_new_tokens``),
after a ``--prompt-len`` prompt, batch 1; the elapsed time includes the prefill.

- ``static_compile_bs1``: its fastest plain ``generate``: ``cache_implementation =
  "static"``, with which ``generate`` compiles the decode forward itself
  (``compile_config``: fullgraph, CUDA graphs); ``model.forward`` is not wrapped by
  hand, which would break its cache handling.
- ``assisted_bs1``: assisted generation (``assistant_model``: a Llama of the target's
  width and vocabulary with ``--hf-assistant-layers`` layers, random weights, default
  ``num_assistant_tokens`` schedule). With random weights its drafts are almost never
  accepted, so this is the cost of its speculation machinery at ~0 acceptance, not a
  speed it would reach with a trained assistant; the acceptance is reported.
- ``prompt_lookup_bs1``: ``prompt_lookup_num_tokens`` (n-gram drafts from the prompt).
"""

from __future__ import annotations

import time


def _generate_tokens_per_s(
    model, prompt, new_tokens: int, reps: int, **gen
) -> tuple[float, object]:
    import torch

    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **gen)
    for _ in range(reps):  # warm-up (and compilation)
        model.generate(prompt, **kwargs)
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = model.generate(prompt, **kwargs)
    sync()
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return prompt.shape[0] * new_tokens / elapsed, out


def run_hf_phase(shape: dict, dtype, device, args) -> dict:
    """Measure ``transformers``' generate variants at batch 1; returns the ``hf``
    section (tokens/s per variant, assistant shape, acceptance)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t_start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype).eval()
        assistant_shape = dict(shape, num_hidden_layers=args.hf_assistant_layers)
        assistant = LlamaForCausalLM(LlamaConfig(**assistant_shape)).to(dtype).eval()
    prompt = torch.randint(0, shape["vocab_size"], (1, args.prompt_len), device=device)
    section: dict = {
        "prompt_len": args.prompt_len,
        "new_tokens": args.hf_new_tokens,
        "assistant": (
            f"LlamaForCausalLM, {args.hf_assistant_layers} layers of the target's width and "
            "vocabulary, random weights"
        ),
        "tokens_per_s": {},
    }
    reps = 1 if device.type != "cuda" else 2
    with torch.inference_mode():
        tps, _ = _generate_tokens_per_s(model, prompt, args.hf_assisted_new_tokens, reps)
        section["tokens_per_s"]["eager_dynamic_bs1"] = round(tps, 1)
        print(f"HF eager dynamic bs1: {tps:.1f} tok/s", flush=True)
        tps, out = _generate_tokens_per_s(
            model, prompt, args.hf_assisted_new_tokens, reps, assistant_model=assistant
        )
        section["tokens_per_s"]["assisted_bs1"] = round(tps, 1)
        section["assisted_new_tokens"] = args.hf_assisted_new_tokens
        # The assistant and target agree at a position iff the assistant's greedy token
        # there is the target's: measure it directly over the emitted sequence.
        logits = assistant(out).logits[0, args.prompt_len - 1 : -1]
        agree = (logits.argmax(-1) == out[0, args.prompt_len :]).float().mean().item()
        section["assistant_greedy_agreement"] = round(agree, 4)
        print(f"HF assisted bs1: {tps:.1f} tok/s (agreement {agree:.3f})", flush=True)
        tps, _ = _generate_tokens_per_s(
            model, prompt, args.hf_assisted_new_tokens, reps, prompt_lookup_num_tokens=10
        )
        section["tokens_per_s"]["prompt_lookup_bs1"] = round(tps, 1)
        print(f"HF prompt lookup bs1: {tps:.1f} tok/s", flush=True)
        del assistant
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model.generation_config.cache_implementation = "static"
        t0 = time.perf_counter()
        try:
            tps, _ = _generate_tokens_per_s(model, prompt, args.hf_new_tokens, reps)
        except Exception as exc:  # noqa: BLE001 - recorded, the other figures stand
            section["static_compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"HF static cache + compile failed: {exc}", flush=True)
        else:
            section["tokens_per_s"]["static_compile_bs1"] = round(tps, 1)
            print(f"HF static cache + compile bs1: {tps:.1f} tok/s", flush=True)
        section["static_compile_warmup_and_run_s"] = round(time.perf_counter() - t0, 1)
    section["wall_s"] = round(time.perf_counter() - t_start, 1)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return section
