"""Benchmark 1: target-only decode on the GPU engine path.

A Llama-3.1-8B-shaped ``LlamaForCausalLM`` (our model class) with random bfloat16
weights, built on the GPU (meta device, ``to_empty``, normal initialisation: decode
speed does not depend on the values), runs through
:class:`specula.runtime.gpu.model_runner.GPUModelRunner` over a paged KV cache:
a 128-token prompt per request (prefill), then greedy decode steps, each step's
metadata built on the host from the block manager and its input the previous step's
argmax on the device (no host synchronisation inside the timed loop). Timed with CUDA
events over ``--steps`` decode steps after ``--warmup`` steps, at batch 1, 8, 32 and 128,
with CUDA graphs (:class:`specula.runtime.gpu.cudagraph.CUDAGraphManager`, default
capture sizes) and eagerly (the CUDA-graphs-vs-eager ablation).

``roofline_fraction_bs1`` = (weight bytes / measured device copy bandwidth) / measured
batch-1 step time; a step reads every weight once, and the copy bandwidth counts bytes
read plus written (``bench/hf_baseline.py``'s function). Also reported: the step time of
a CUDA graph holding only the batch-1 GEMMs (every weight matrix, lm_head included), to
separate the GEMV bandwidth from the cost of everything else in a step.

Run on the GPU machine (about 2 minutes on an H100)::

    PYTHONPATH=. python3 bench/engine.py

Merges its figures into ``bench/results/engine.json`` (key ``target_decode`` and the
top-level ``roofline_fraction_bs1``; other keys are kept) with the command, GPU,
software versions and date. ``--dry-run`` runs a tiny model on the CPU with the Triton
kernels in the interpreter (eager only) to check the plumbing, and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

DEFAULT_OUTPUT = HERE / "results" / "engine.json"

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--batch-sizes", default="1,8,32,128")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=256, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=16, help="decode steps before timing")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--attn-num-splits", type=int, default=None)
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    return p.parse_args(argv)


def build_random_model(hf_config_kwargs: dict, dtype, device, seed: int = 0):
    """Our ``LlamaForCausalLM`` with random weights: N(0, 0.02) matrices, unit norms."""
    import torch
    from transformers import LlamaConfig

    from specula.runtime.models.config import ModelConfig
    from specula.runtime.models.llama import LlamaForCausalLM

    config = ModelConfig.from_hf_config(LlamaConfig(**hf_config_kwargs))
    with torch.device("meta"):
        model = LlamaForCausalLM(config, device=device)
        model.to(dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def decode_run(runner, manager, forward, batch_size: int, args, device) -> dict:
    """Prefill ``batch_size`` random prompts, then ``warmup + steps`` greedy decode steps
    through ``forward(input_ids, positions, metadata) -> hidden``; returns the timed
    steps' figures. Frees the requests' blocks at the end."""
    import torch

    from specula.runtime.gpu.paged_kv import metadata_from_block_manager

    ids = list(range(batch_size))
    for r in ids:
        manager.allocate(r, args.prompt_len)
    metadata, positions = metadata_from_block_manager(
        manager, ids, [args.prompt_len] * batch_size, runner.max_blocks_per_req, device
    )
    prompts = torch.randint(
        0, runner.config.vocab_size, (batch_size * args.prompt_len,), device=device
    )
    hidden, _ = runner.forward(prompts, positions, metadata)
    next_ids = runner.compute_logits(hidden[runner.last_token_indices(metadata)]).argmax(-1)

    def step(next_ids):
        for r in ids:
            manager.append_slots(r, 1)
        metadata, positions = metadata_from_block_manager(
            manager, ids, [1] * batch_size, runner.max_blocks_per_req, device
        )
        hidden = forward(next_ids, positions, metadata)
        return runner.compute_logits(hidden).argmax(-1)  # [batch_size]

    for _ in range(args.warmup):
        next_ids = step(next_ids)
    timing = device.type == "cuda"
    if timing:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        next_ids = step(next_ids)
    if timing:
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        seconds = time.perf_counter() - t0
    assert next_ids.shape == (batch_size,)
    for r in ids:
        manager.free(r)
    step_s = seconds / args.steps
    return {"step_ms": step_s * 1e3, "tokens_per_s": batch_size / step_s}


def gemm_only_step_ms(model, device, reps: int = 50) -> float:
    """Batch-1 step time of a CUDA graph holding only the weight GEMMs of a decode step
    (qkv, o, gate_up, down per layer, and lm_head)."""
    import torch
    import torch.nn.functional as F

    config = model.config
    hidden = torch.randn(1, config.hidden_size, dtype=model.lm_head_weight.dtype, device=device)
    attn_in = torch.randn(
        1, config.num_attention_heads * config.head_dim, dtype=hidden.dtype, device=device
    )
    mlp_in = torch.randn(1, config.intermediate_size, dtype=hidden.dtype, device=device)

    def gemms():
        for layer in model.model.layers:
            layer.self_attn.qkv_proj(hidden)
            layer.self_attn.o_proj(attn_in)
            layer.mlp.gate_up_proj(hidden)
            layer.mlp.down_proj(mlp_in)
        return F.linear(hidden, model.lm_head_weight)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gemms()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemms()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def software_versions() -> dict:
    import torch
    import transformers
    import triton

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }


def markdown_table(section: dict) -> str:
    rows = [
        "| batch | tok/s (CUDA graphs) | step ms | tok/s (eager) | graphs / eager |",
        "|---|---|---|---|---|",
    ]
    for key, tps in section["tokens_per_s"].items():
        eager = section.get("eager_tokens_per_s", {}).get(key)
        ratio = section.get("cudagraph_vs_eager", {}).get(key)
        rows.append(f"| {key[2:]} | {tps} | {section['step_ms'][key]} | {eager} | {ratio} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # Must precede the first triton import: @triton.jit reads it at definition time.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from specula.runtime.gpu.cudagraph import CUDAGraphManager
    from specula.runtime.gpu.model_runner import GPUModelRunner
    from specula.runtime.gpu.paged_kv import KVCacheSpec, PagedKVCache

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.dry_run:
        torch.set_num_threads(1)
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY
        batch_sizes = [b for b in batch_sizes if b <= 2] or [1]
        args.prompt_len, args.steps, args.warmup = 8, 3, 1
        args.block_size, args.max_model_len = 4, 32
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on the GPU machine, or use --dry-run", file=sys.stderr)
            return 2
        from bench.hf_baseline import LLAMA_31_8B

        device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA_31_8B
    t_start = time.perf_counter()
    section: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
        "software": software_versions(),
        "model": "Llama-3.1-8B shape, random weights" if not args.dry_run else "tiny Llama",
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "decode_steps": args.steps,
        "warmup_steps": args.warmup,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "attn_num_splits": args.attn_num_splits or "kernel default",
    }
    if device.type == "cuda":
        from bench.hf_baseline import copy_bandwidth_bytes_per_s

        bandwidth = copy_bandwidth_bytes_per_s()
        torch.cuda.empty_cache()
    model = build_random_model(shape, dtype, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    section["weight_bytes"] = weight_bytes

    max_bs = max(batch_sizes)
    spec = KVCacheSpec.from_model_config(model.config, dtype, args.block_size)
    context = args.prompt_len + args.warmup + args.steps
    blocks_per_req = -(-context // args.block_size)
    if context > args.max_model_len:
        raise SystemExit(f"prompt + steps = {context} tokens > --max-model-len")
    cache = PagedKVCache(spec, max_bs * blocks_per_req + 8, device)
    runner = GPUModelRunner(model, cache, args.max_model_len, attn_num_splits=args.attn_num_splits)
    manager = cache.block_manager(watermark=0.0)

    if device.type == "cuda":
        roofline_step_s = weight_bytes / bandwidth
        section["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
        section["roofline_step_ms_bs1"] = round(roofline_step_s * 1e3, 3)
        gemm_ms = gemm_only_step_ms(model, device)
        section["gemm_only_step_ms_bs1"] = round(gemm_ms, 3)
        section["gemm_only_fraction_of_roofline_bs1"] = round(roofline_step_s * 1e3 / gemm_ms, 3)
        graphs = CUDAGraphManager(runner, max_num_reqs=max_bs)
        t0 = time.perf_counter()
        graphs.capture()
        section["cudagraph_capture_s"] = round(time.perf_counter() - t0, 1)
        section["cudagraph_capture_sizes"] = graphs.capture_sizes
        section["tokens_per_s"], section["step_ms"] = {}, {}
        for bs in batch_sizes:
            res = decode_run(runner, manager, graphs.run, bs, args, device)
            section["tokens_per_s"][f"bs{bs}"] = round(res["tokens_per_s"], 1)
            section["step_ms"][f"bs{bs}"] = round(res["step_ms"], 3)
            print(
                f"CUDA graphs bs{bs}: {res['tokens_per_s']:.1f} tok/s, "
                f"{res['step_ms']:.3f} ms/step",
                flush=True,
            )
        section["roofline_fraction_bs1"] = (
            round(roofline_step_s * 1e3 / section["step_ms"]["bs1"], 3)
            if "bs1" in section["step_ms"]
            else None
        )

    def eager(input_ids, positions, metadata):
        return runner.forward(input_ids, positions, metadata)[0]

    if not args.skip_eager:
        section["eager_tokens_per_s"], eager_ms = {}, {}
        for bs in batch_sizes:
            res = decode_run(runner, manager, eager, bs, args, device)
            section["eager_tokens_per_s"][f"bs{bs}"] = round(res["tokens_per_s"], 1)
            eager_ms[f"bs{bs}"] = res["step_ms"]
            print(
                f"eager bs{bs}: {res['tokens_per_s']:.1f} tok/s, {res['step_ms']:.3f} ms/step",
                flush=True,
            )
        if "step_ms" in section:
            section["cudagraph_vs_eager"] = {
                k: round(eager_ms[k] / section["step_ms"][k], 2) for k in section["step_ms"]
            }
        else:
            section["tokens_per_s"] = section["eager_tokens_per_s"]
            section["step_ms"] = {k: round(v, 3) for k, v in eager_ms.items()}
    section["wall_s"] = round(time.perf_counter() - t_start, 1)

    print(json.dumps(section, indent=2))
    print(markdown_table(section))
    if args.dry_run:
        return 0
    results = json.loads(args.output.read_text()) if args.output.exists() else {}
    results["target_decode"] = section
    results["roofline_fraction_bs1"] = section["roofline_fraction_bs1"]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
