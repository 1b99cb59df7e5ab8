"""Benchmark 5 of the engine: real text through the GPU engine.

The demo's trained models (``make demo``: a 6-layer Llama target, 3.4 M parameters,
and its EAGLE-3 head, trained on Python source) serve the demo's 8 code prompts,
greedy, 64 new tokens each:

- ``tokens_identical``: the GPU engine (:class:`~specula.runtime.gpu.engine.GPULLMEngine`:
  paged KV, Triton kernels, CUDA graphs, EAGLE-3 in graphs) gives the same greedy
  tokens as the CPU path (:class:`~specula.runtime.engine.llm_engine.LLMEngine` on the
  CPU, float32), with and without the head; per-prompt first divergence otherwise.
  Both run float32, so the check is not decided by bfloat16 rounding.
- acceptance per position and mean acceptance length of the head on both paths;
- GPU throughput of the same workload, target only vs EAGLE-3 (k = 4), and of a
  continuous-batching load (``--requests`` requests of mixed lengths through
  ``max_num_seqs = --max-num-seqs``; with ``--num-gpu-blocks`` small enough, requests
  are preempted and recomputed): tokens/s, steps, preemptions, and that every output
  still equals its greedy reference.

Usage (GPU machine, after ``make demo`` or with a copy of its cache)::

    PYTHONPATH=. python3 bench/engine_real.py [--demo-dir DIR]

Merges the ``real_text`` section (with the command, GPU, software versions and date)
into ``bench/results/engine.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine import DEFAULT_OUTPUT, software_versions  # noqa: E402

from specula.demo.prompts import PROMPTS  # noqa: E402


def find_demo_dir(explicit: Path | None) -> tuple[Path, Path]:
    """``(target dir, EAGLE-3 head dir)`` of a completed demo cache.

    Raises:
        FileNotFoundError: no completed demo (run ``make demo``) or no trained head.
    """
    if explicit is not None:
        candidates = [explicit]
    else:
        from specula.demo.recipe import cache_root

        root = cache_root() / "demo"
        candidates = sorted(root.glob("*/COMPLETE.json"), key=lambda p: p.stat().st_mtime)
        candidates = [p.parent for p in reversed(candidates)]
    for demo in candidates:
        heads = sorted(demo.glob("heads-*/eagle3/config.json"))
        if (demo / "target" / "config.json").is_file() and heads:
            return demo / "target", heads[-1].parent
    raise FileNotFoundError(
        f"no demo models with a trained EAGLE-3 head in {candidates or 'the demo cache'}; "
        "run `make demo` first or pass --demo-dir"
    )


def _spec_config(head: Path, k: int):
    from specula.api.runtime_config import SpeculatorRuntimeConfig

    return SpeculatorRuntimeConfig(
        method="eagle3", model=f"file://{head}", num_speculative_tokens=k
    )


def _run(engine, prompts: list[list[int]], params) -> dict:
    """Generate; returns outputs, wall seconds, steps and acceptance counters."""
    steps = 0
    original = engine.step

    def counting():
        nonlocal steps
        steps += 1
        return original()

    engine.step = counting
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    engine.step = original
    stats = engine.spec_decoding_stats
    per_pos = [round(a / stats.num_drafts, 4) for a in stats.num_accepted_tokens_per_pos]
    return {
        "outputs": outputs,
        "seconds": seconds,
        "steps": steps,
        "num_drafts": stats.num_drafts,
        "acceptance_per_position": per_pos if stats.num_drafts else [],
        "mean_acceptance_length": (
            round(1 + stats.num_accepted_tokens / stats.num_drafts, 3) if stats.num_drafts else None
        ),
    }


def _first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    out = []
    for x, y in zip(a, b, strict=True):
        pos = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), None)
        if pos is None and len(x) != len(y):
            pos = min(len(x), len(y))
        out.append(pos)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", type=Path, default=None)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-gpu-blocks", type=int, default=64)
    p.add_argument("--dry-run", action="store_true", help="print, do not write the results")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from specula.runtime.engine.llm_engine import LLMEngine
    from specula.runtime.engine.sampling_params import SamplingParams
    from specula.runtime.gpu.engine import GPULLMEngine
    from specula.runtime.spec_decode.metrics import SpecDecodingStats

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    target, head = find_demo_dir(args.demo_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    greedy = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(model_uri=f"file://{target}", served_model_name="demo", dtype="float32")

    runs: dict[str, dict] = {}
    for name, spec in (("target", None), ("eagle3", _spec_config(head, args.k))):
        cpu = LLMEngine(target, tokenizer, speculator_config=spec, device="cpu", **common)
        runs[f"cpu_{name}"] = _run(cpu, prompts, greedy)
        del cpu
        gpu = GPULLMEngine(
            target, tokenizer, speculator_config=spec, draft_dir=head if spec else None,
            max_num_seqs=args.max_num_seqs, device="cuda", **common,
        )
        _run(gpu, prompts, greedy)  # warm-up: Triton autotuning, allocator
        gpu.spec_decoding_stats = SpecDecodingStats(num_spec_tokens=gpu.max_num_speculative_tokens)
        runs[f"gpu_{name}"] = _run(gpu, prompts, greedy)
        del gpu
        torch.cuda.empty_cache()

    reference = runs["cpu_target"]["outputs"]
    section: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "software": software_versions(),
        "models": {"target": target.parent.name, "eagle3_head": head.parent.name},
        "workload": (
            f"{len(prompts)} demo prompts, greedy, {args.max_tokens} new tokens, float32, "
            f"k={args.k}"
        ),
        "tokens_identical": {},
        "first_divergence": {},
        "acceptance": {},
        "tokens_per_s": {},
    }
    for key, run in runs.items():
        same = run["outputs"] == reference
        section["tokens_identical"][key] = same
        if not same:
            section["first_divergence"][key] = _first_divergence(run["outputs"], reference)
        tokens = sum(len(o) for o in run["outputs"])
        if key.startswith("gpu"):
            section["tokens_per_s"][key] = round(tokens / run["seconds"], 1)
        if run["num_drafts"]:
            section["acceptance"][key] = {
                "per_position": run["acceptance_per_position"],
                "mean_acceptance_length": run["mean_acceptance_length"],
            }
    section["speedup_eagle3_vs_target_gpu"] = round(
        section["tokens_per_s"]["gpu_eagle3"] / section["tokens_per_s"]["gpu_target"], 3
    )

    # Continuous batching: more requests than max_num_seqs, mixed lengths, a KV pool
    # small enough to preempt; every output must still be its greedy reference.
    lengths = [8 + (i * 37) % (args.max_tokens - 7) for i in range(args.requests)]
    load_prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    load_params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [reference[i % len(prompts)][:n] for i, n in enumerate(lengths)]
    load: dict = {
        "requests": args.requests,
        "max_num_seqs": args.max_num_seqs,
        "num_gpu_blocks": args.num_gpu_blocks,
        "new_tokens": sum(lengths),
    }
    for name, spec in (("target", None), ("eagle3", _spec_config(head, args.k))):
        gpu = GPULLMEngine(
            target, tokenizer, speculator_config=spec, draft_dir=head if spec else None,
            max_num_seqs=args.max_num_seqs, device="cuda", num_gpu_blocks=args.num_gpu_blocks,
            **common,
        )
        _run(gpu, load_prompts[: args.max_num_seqs], load_params[: args.max_num_seqs])
        preempted_before = gpu.scheduler.num_preemptions
        run = _run(gpu, load_prompts, load_params)
        load[name] = {
            "tokens_per_s": round(sum(lengths) / run["seconds"], 1),
            "steps": run["steps"],
            "preemptions": gpu.scheduler.num_preemptions - preempted_before,
            "outputs_equal_greedy_reference": run["outputs"] == expected,
            "mean_acceptance_length": run["mean_acceptance_length"],
        }
        del gpu
        torch.cuda.empty_cache()
    load["speedup_eagle3_vs_target"] = round(
        load["eagle3"]["tokens_per_s"] / load["target"]["tokens_per_s"], 3
    )
    section["continuous_batching"] = load
    section["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(section, indent=2))
    if not args.dry_run:
        results = json.loads(args.output.read_text()) if args.output.exists() else {}
        results["real_text"] = section
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.output}")
    ok = all(section["tokens_identical"].values()) and all(
        load[n]["outputs_equal_greedy_reference"] for n in ("target", "eagle3")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
