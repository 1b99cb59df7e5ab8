"""Time to first token with and without automatic prefix caching: requests that share a
long system prompt (issue 15: 64 requests, a 2,048-token system prompt), on the engine
itself (requests in, first token out; no HTTP), for an 8B-shaped target in bf16 with
random weights on one GPU.

Two arrival patterns, each run once with another system prompt to warm the kernels for
its shapes, then measured from a cold cache (the first request pays the whole prefill
either way), each with caching off and on in a fresh engine:

- ``burst``: all requests arrive at once; TTFT is each one's first token minus the
  arrival, so it includes the queueing behind the other prefills;
- ``sequential``: one request at a time, the next after the previous finished.

The system prompt is followed by a distinct user suffix per request; every request
decodes ``--max-tokens`` greedy tokens, and the outputs with and without caching are
compared (``outputs_identical``: the fraction of requests whose tokens are equal).

    PYTHONPATH=. python3 bench/prefix_cache.py [--output FILE] [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_e2e import (  # noqa: E402
    LLAMA_8B,
    TINY,
    TINY_DRAFT,
    VLLM_MAX_NUM_BATCHED_TOKENS,
    random_prompts,
    release_memory,
    write_checkpoints,
)


def make_engine(target_dir: Path, caching: bool, args, device: str):
    from specula.runtime.engine.llm_engine import LLMEngine

    return LLMEngine(
        target_dir,
        None,
        served_model_name="bench",
        dtype="bfloat16" if device == "cuda" else "float32",
        max_model_len=args.system_tokens + args.user_tokens + args.max_tokens + 64,
        max_num_seqs=args.requests,
        device=device,
        load_format="dummy",
        max_num_batched_tokens=VLLM_MAX_NUM_BATCHED_TOKENS if device == "cuda" else 4096,
        cudagraph_capture_sizes=[1, 8, 32, args.requests] if device == "cuda" else None,
        enable_prefix_caching=caching,
    )


def serve(engine, prompts: list[list[int]], max_tokens: int, tag: str, burst: bool):
    """TTFTs (seconds) and output tokens of ``prompts``, all at once or one by one."""
    from specula.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ttft: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}

    def run(ids: list[str], arrival: float) -> None:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.new_token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = now - arrival
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    if burst:
        arrival = time.perf_counter()
        for rid, p in zip(ids, prompts, strict=True):
            engine.add_request(rid, p, params)
        run(ids, arrival)
    else:
        for rid, p in zip(ids, prompts, strict=True):
            arrival = time.perf_counter()
            engine.add_request(rid, p, params)
            run([rid], arrival)
    return [ttft[r] for r in ids], [tokens[r] for r in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args(argv)
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.requests, args.system_tokens = min(args.requests, 6), min(args.system_tokens, 100)
    target = TINY if args.dry_run else LLAMA_8B
    dirs = write_checkpoints(Path(tempfile.mkdtemp()), target, TINY_DRAFT)
    vocab = target["vocab_size"]
    system = random_prompts(1, vocab, args.system_tokens, seed=1)[0]
    users = random_prompts(args.requests, vocab, args.user_tokens, seed=2)
    prompts = [system + u for u in users]
    warm_system = random_prompts(1, vocab, args.system_tokens, seed=3)[0]
    warm = [warm_system + u for u in users]  # the measured shapes, another system prompt
    results: dict = {}
    outputs: dict = {}
    for caching in (False, True):
        engine = make_engine(dirs["target"], caching, args, device)
        for pattern in ("burst", "sequential"):
            # The pattern once with another system prompt (kernels compiled and tuned
            # for its shapes), then measured from a cold cache.
            serve(engine, warm, args.max_tokens, f"warm-{pattern}", pattern == "burst")
            engine.scheduler.block_manager = type(engine.scheduler.block_manager)(
                engine.num_gpu_blocks, engine.block_size, enable_prefix_caching=caching
            )
            ttft, toks = serve(engine, prompts, args.max_tokens, pattern, pattern == "burst")
            bm = engine.scheduler.block_manager
            key = f"{pattern}_{'cached' if caching else 'uncached'}"
            results[key] = {
                "mean_ttft_ms": round(1e3 * sum(ttft) / len(ttft), 2),
                "median_ttft_ms": round(1e3 * sorted(ttft)[len(ttft) // 2], 2),
                "max_ttft_ms": round(1e3 * max(ttft), 2),
                "prefix_cache_queries": bm.prefix_cache_queries,
                "prefix_cache_hits": bm.prefix_cache_hits,
            }
            outputs[key] = toks
            print(key, results[key], flush=True)
        del engine
        release_memory()
    summary = {}
    for pattern in ("burst", "sequential"):
        off, on = results[f"{pattern}_uncached"], results[f"{pattern}_cached"]
        same = sum(a == b for a, b in zip(outputs[f"{pattern}_uncached"],
                                          outputs[f"{pattern}_cached"], strict=True))
        summary[pattern] = {
            "ttft_ratio": round(off["mean_ttft_ms"] / on["mean_ttft_ms"], 2),
            "outputs_identical": round(same / args.requests, 3),
        }
    report = {
        "command": "PYTHONPATH=. python3 bench/prefix_cache.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "workload": {
            "requests": args.requests, "system_prompt_tokens": args.system_tokens,
            "user_tokens": args.user_tokens, "max_tokens": args.max_tokens,
            "model": "Llama-3.1-8B shape, bf16, random weights" if device == "cuda" else "tiny",
        },
        "results": results,
        "summary": summary,
        "prefix_cache_ttft_ratio": summary["burst"]["ttft_ratio"],
    }
    print(json.dumps(report["summary"], indent=1))
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
