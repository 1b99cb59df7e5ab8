"""Benchmarks 2 and 4 of the engine: EAGLE-3 speculative decoding with synthetic
acceptance against plain decode, and the attention-state-reuse and CUDA-graph ablations.

Called by ``bench/engine.py`` (phase ``spec``) with the target already built. The head
is EAGLE-3-shaped at the target's width (``fc`` 3H -> H, one decoder layer whose q/k/v
take 2H, ``norm``, ``lm_head`` over a 32000-token draft vocabulary mapped through
``d2t``, embeddings shared with the target), random weights; the target returns the
residual streams entering layers ``(2, L // 2, L - 3)`` from its verification graphs.
Everything runs as in serving except the accept decision: per request and step the
accepted-prefix length is drawn with a fixed per-position acceptance rate (vLLM's
synthetic rejection mode), overriding the greedy rejection sampler's output (the
kernel still runs). Tokens/s counts the emitted tokens (accepted + 1 per request and
step) over the timed steps (CUDA events); ``speedup_vs_nospec`` divides by the
plain-decode tokens/s of the same batch size measured in the same phase.
"""

from __future__ import annotations

import random
import time


def _spec_run(decoder, batch_size: int, k: int, rate: float, steps: int, warmup: int, args):
    import torch

    from bench.engine import DeviceTimer
    from specula.runtime.gpu.spec_decode import synthetic_num_accepted

    device = decoder.device
    rng = random.Random(1000 * k + int(rate * 100) + batch_size)
    prompts = torch.randint(
        0, decoder.target.config.vocab_size, (batch_size, args.prompt_len), device=device
    )
    decoder.start(list(range(batch_size)), prompts, k)
    for _ in range(warmup):
        decoder.step(synthetic_num_accepted(rng, rate, k, batch_size))
    emitted = 0
    output = None
    with DeviceTimer(device) as timer:
        for _ in range(steps):
            accepted = synthetic_num_accepted(rng, rate, k, batch_size)
            output, _ = decoder.step(accepted)
            emitted += sum(accepted) + batch_size
    seconds = timer.seconds
    assert output is not None and output.shape == (batch_size, k + 1)
    return {
        "tokens_per_s": emitted / seconds,
        "step_ms": seconds / steps * 1e3,
        "mean_emitted_per_step": emitted / (steps * batch_size),
    }


def _time_calls(fn, reps: int, device) -> tuple[float, float]:
    """(ms per call on the device timeline incl. any host stall, host ms per call)."""
    import torch

    for _ in range(3):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ms = (time.perf_counter() - t0) / reps * 1e3
        return ms, ms
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host_ms = (time.perf_counter() - t0) / reps * 1e3
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, host_ms


def attn_state_reuse_ablation(decoder, k: int, batch_size: int, args, reps: int) -> dict:
    """Draft prefill step time reading the verification's captured attention state vs
    rebuilding the same metadata on the host and copying it into the draft's own
    buffers (both replay a CUDA graph of the same prefill)."""
    import torch

    from specula.runtime.gpu.draft_graphs import DraftPrefillGraphManager

    target_graphs = decoder.target_graphs
    d = target_graphs.descriptor_for(batch_size, k + 1)
    rebuild = DraftPrefillGraphManager(
        decoder.draft, decoder.buffers, target_graphs, reuse_target_state=False
    )
    rebuild.capture([d])
    prompts = torch.randint(
        0, decoder.target.config.vocab_size, (batch_size, args.prompt_len), device=decoder.device
    )
    decoder.start(list(range(batch_size)), prompts, k)
    for _ in range(4):
        decoder.step([k] * batch_size)
    manager = decoder.manager
    tables = [manager.block_table(r) for r in decoder.request_ids]
    seq_lens = [manager.num_tokens(r) for r in decoder.request_ids]
    reuse_ms, reuse_host_ms = _time_calls(
        lambda: decoder.prefill_graphs.run(d), reps, decoder.device
    )
    rebuild_ms, rebuild_host_ms = _time_calls(
        lambda: rebuild.run(d, tables, seq_lens), reps, decoder.device
    )
    decoder.finish()
    return {
        "config": f"k{k}_bs{batch_size}",
        "reuse_ms": round(reuse_ms, 4),
        "rebuild_ms": round(rebuild_ms, 4),
        "reuse_host_ms": round(reuse_host_ms, 4),
        "rebuild_host_ms": round(rebuild_host_ms, 4),
        "rebuild_over_reuse": round(rebuild_ms / reuse_ms, 3),
        "reps": reps,
    }


def run_spec_phase(model, runner, cache, baseline_forward, args, device) -> dict:
    """Benchmarks 2 and 4 (see the module docstring). ``baseline_forward`` is the plain
    decode forward (CUDA-graph manager ``run`` on the GPU, eager on the CPU)."""
    import torch

    from bench.engine import decode_run
    from specula.runtime.spec_decode.eagle.runner import Eagle3Runner, random_eagle3_head
    from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache
    from specula.runtime.gpu.spec_decode import GPUEagle3SpecDecoder
    from specula.runtime.models.llama_eagle3 import default_aux_hidden_state_layer_ids

    t_start = time.perf_counter()
    ks = [int(k) for k in args.spec_ks.split(",")]
    rates = [float(a) for a in args.spec_rates.split(",")]
    batch_sizes = [int(b) for b in args.spec_batch_sizes.split(",")]
    config = model.config
    aux_ids = default_aux_hidden_state_layer_ids(config.num_hidden_layers)
    draft_vocab = min(args.draft_vocab_size, config.vocab_size)
    head = random_eagle3_head(
        config,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=aux_ids,
        dtype=runner.dtype,
        device=device,
    )
    head.embed_tokens = model.model.embed_tokens  # shared, as speculators checkpoints do
    draft_spec = KVCacheSpec.from_model_config(head.config, runner.dtype, cache.spec.block_size)
    draft_cache = PagedKVCache(draft_spec, cache.num_blocks, device)
    draft = Eagle3Runner(head, draft_cache, runner.max_model_len, runner.attn_num_splits)
    manager = cache.block_manager(watermark=0.0)
    graphs = device.type == "cuda"
    decoder = GPUEagle3SpecDecoder(
        runner,
        draft,
        manager,
        aux_ids,
        max(batch_sizes),
        ks,
        use_cuda_graphs=graphs,
        capture_sizes=batch_sizes,
    )
    section: dict = {
        "head": (
            f"EAGLE-3 shape: fc {len(aux_ids)}H->H, 1 decoder layer (qkv from 2H), "
            f"lm_head over {draft_vocab} draft tokens with d2t, random weights"
        ),
        "aux_hidden_state_layer_ids": list(aux_ids),
        "head_weight_bytes": sum(
            p.numel() * p.element_size()
            for n, p in head.named_parameters()
            if not n.startswith("embed_tokens")
        ),
        "acceptance": "synthetic: position i accepted with probability a given i-1 accepted",
        "timed_steps": args.spec_steps,
        "warmup_steps": args.spec_warmup,
        "prompt_len": args.prompt_len,
    }
    if graphs:
        t0 = time.perf_counter()
        decoder.capture()
        section["cudagraph_capture_s"] = round(time.perf_counter() - t0, 1)
    nospec = {}
    for bs in batch_sizes:
        res = decode_run(runner, manager, baseline_forward, bs, args, device)
        nospec[bs] = res["tokens_per_s"]
        print(f"no speculation bs{bs}: {res['tokens_per_s']:.1f} tok/s", flush=True)
    section["nospec_tokens_per_s"] = {f"bs{b}": round(v, 1) for b, v in nospec.items()}
    tps, emitted, step_ms, speedup = {}, {}, {}, {}
    for bs in batch_sizes:
        for rate in rates:
            for k in ks:
                key = f"a{rate}_k{k}_bs{bs}"
                res = _spec_run(decoder, bs, k, rate, args.spec_steps, args.spec_warmup, args)
                decoder.finish()
                tps[key] = round(res["tokens_per_s"], 1)
                emitted[key] = round(res["mean_emitted_per_step"], 3)
                step_ms[key] = round(res["step_ms"], 3)
                speedup[key] = round(res["tokens_per_s"] / nospec[bs], 3)
                print(
                    f"{key}: {tps[key]} tok/s, {step_ms[key]} ms/step, "
                    f"{emitted[key]} tokens/step, speedup {speedup[key]}",
                    flush=True,
                )
    section["tokens_per_s"] = tps
    section["step_ms"] = step_ms
    section["mean_emitted_per_step"] = emitted
    section["expected_emitted_per_step"] = {
        f"a{a}_k{k}": round(sum(a**i for i in range(k + 1)), 3) for a in rates for k in ks
    }
    out = {"spec_decode": section, "speedup_vs_nospec": speedup}

    ab_k, ab_bs = args.ablation_k, min(batch_sizes)
    if graphs:
        out["attn_state_reuse"] = attn_state_reuse_ablation(
            decoder, ab_k, ab_bs, args, reps=args.ablation_reps
        )
        print("attn_state_reuse:", out["attn_state_reuse"], flush=True)
        eager = GPUEagle3SpecDecoder(
            runner, draft, manager, aux_ids, max(batch_sizes), [ab_k], use_cuda_graphs=False
        )
        res = _spec_run(eager, ab_bs, ab_k, 0.8, args.eager_steps, 2, args)
        eager.finish()
        key = f"a0.8_k{ab_k}_bs{ab_bs}"
        out["spec_cudagraph_vs_eager"] = {
            "config": key,
            "cudagraph_tokens_per_s": tps.get(key),
            "eager_tokens_per_s": round(res["tokens_per_s"], 1),
            "eager_timed_steps": args.eager_steps,
            "ratio": round(tps[key] / res["tokens_per_s"], 2) if key in tps else None,
        }
        print("spec_cudagraph_vs_eager:", out["spec_cudagraph_vs_eager"], flush=True)
    section["wall_s"] = round(time.perf_counter() - t_start, 1)
    del decoder
    torch.cuda.empty_cache() if graphs else None
    return out


def spec_markdown_table(out: dict) -> str:
    """``speedup_vs_nospec`` as a table: one row per (acceptance, batch), one column
    per ``k``."""
    speedup = out["speedup_vs_nospec"]
    emitted = out["spec_decode"]["mean_emitted_per_step"]
    ks = sorted({int(key.split("_")[1][1:]) for key in speedup})
    rows = ["| acceptance | batch | " + " | ".join(f"k={k}" for k in ks) + " |"]
    rows.append("|---|---|" + "---|" * len(ks))
    seen = []
    for key in speedup:
        a, _, bs = key.split("_")
        if (a, bs) in seen:
            continue
        seen.append((a, bs))
        cells = []
        for k in ks:
            name = f"{a}_k{k}_{bs}"
            cells.append(f"{speedup[name]} ({emitted[name]})" if name in speedup else "")
        rows.append(f"| {a[1:]} | {bs[2:]} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\nspeedup vs no speculation (mean tokens emitted per step)"
