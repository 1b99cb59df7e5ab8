"""Reference figures on the GPU for the engine benchmarks: device copy bandwidth, the
batch-1 decode roofline of a Llama-3.1-8B-shaped model, and Hugging Face
``transformers``' decode speed on that shape (eager dynamic cache, and its fastest
plain ``generate``: static cache with ``torch.compile``).

Weights are random (bf16): decode speed does not depend on their values, and greedy
decoding runs for exactly ``--new-tokens`` tokens (``min_new_tokens``).

Usage (GPU machine)::

    python bench/hf_baseline.py --out bench/results/hf_baseline.json

Writes the command, GPU, software versions and date with the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
"""The Llama-3.1-8B architecture (``config.json`` of meta-llama/Llama-3.1-8B, without the
long-context rope scaling, which does not change decode cost at short context)."""


def copy_bandwidth_bytes_per_s(num_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    return 2 * num_bytes / seconds


def _decode_tokens_per_s(model, batch_size: int, prompt_len: int, new_tokens: int, **gen) -> float:
    prompt = torch.randint(0, model.config.vocab_size, (batch_size, prompt_len), device="cuda")
    kwargs = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **gen
    )
    for _ in range(2):  # warm-up (and compilation)
        model.generate(prompt, **kwargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(prompt, **kwargs)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == prompt_len + new_tokens
    # Prefill is included in the elapsed time; it is a small share at these lengths and
    # is reported separately so that the decode rate can be corrected.
    return batch_size * new_tokens / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/hf_baseline.json"))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args(argv)

    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    bandwidth = copy_bandwidth_bytes_per_s()
    config = LlamaConfig(**LLAMA_31_8B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Copy bandwidth counts bytes read plus written; a decode step reads the weights once.
    roofline_step_s = weight_bytes / bandwidth
    results: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
        },
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "weight_bytes": weight_bytes,
        "roofline_step_ms_bs1": round(roofline_step_s * 1e3, 3),
        "roofline_tokens_per_s_bs1": round(1 / roofline_step_s, 1),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "hf_generate": {},
    }
    print(json.dumps(results, indent=2), flush=True)
    with torch.inference_mode():
        for bs in (1, 8, 32):
            tps = _decode_tokens_per_s(model, bs, args.prompt_len, args.new_tokens)
            results["hf_generate"][f"eager_dynamic_bs{bs}"] = round(tps, 1)
            print(f"eager dynamic cache bs{bs}: {tps:.1f} tok/s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        if not args.skip_compile:
            # With a static cache, generate() compiles the decode forward itself
            # (generation_config.compile_config: fullgraph, "reduce-overhead", i.e. CUDA
            # graphs); wrapping model.forward in torch.compile by hand breaks its cache.
            model.generation_config.cache_implementation = "static"
            tps = _decode_tokens_per_s(model, 1, args.prompt_len, args.new_tokens)
            results["hf_generate"]["static_compile_bs1"] = round(tps, 1)
            results["hf_static_compile_fraction_of_roofline_bs1"] = round(
                tps * roofline_step_s, 3
            )
            print(f"static cache + torch.compile bs1: {tps:.1f} tok/s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
