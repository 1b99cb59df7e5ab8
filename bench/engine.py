"""Engine benchmarks on the GPU path; phase ``decode`` is benchmark 1, target-only decode
(below); phase ``hf`` is benchmark 3 (Hugging Face ``transformers`` on the same GPU and
shape against our engine, ``bench/engine_hf.py``), run last, after our model is freed.
Speculative decoding end to end, every method, is ``bench/engine_e2e.py``.

A Llama-3.1-8B-shaped ``LlamaForCausalLM`` (our model class) with random bfloat16
weights, built on the GPU (meta device, ``to_empty``, normal initialisation: decode
speed does not depend on the values), runs through
:class:`specula.runtime.worker.model_runner.ModelRunner` over a paged KV cache:
a 128-token prompt per request (prefill), then greedy decode steps, each step's
metadata built on the host from the block manager and its input the previous step's
argmax on the device (no host synchronisation inside the timed loop). Timed with CUDA
events over ``--steps`` decode steps after ``--warmup`` steps, at batch 1, 8, 32 and 128,
with CUDA graphs (:class:`specula.runtime.worker.cudagraph.CUDAGraphManager`, default
capture sizes, its ``run`` replaying the graph a batch pads to) and eagerly (the
CUDA-graphs-vs-eager ablation).

``roofline_fraction_bs1`` = (weight bytes / measured device copy bandwidth) / measured
batch-1 step time; a step reads every weight once, and the copy bandwidth counts bytes
read plus written (``bench/hf_baseline.py``'s function). Also reported: the step time of
a CUDA graph holding only the batch-1 GEMMs (every weight matrix, lm_head included), to
separate the GEMV bandwidth from the cost of everything else in a step.

Run on the GPU machine (all phases; ``--phases decode`` alone takes about a minute)::

    PYTHONPATH=. python3 bench/engine.py

Merges its figures into ``bench/results/engine.json`` after each phase (keys
``target_decode`` and ``roofline_fraction_bs1``; ``vs_hf``; other keys are kept) with the
command, GPU, software versions and date.
``--dry-run`` runs every phase on a tiny model on the CPU with the Triton kernels in the
interpreter (eager only: CUDA graphs, the GEMM-only graph and the roofline are skipped)
to check the plumbing, and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
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
    # 4 layers: the EAGLE-3 head of the hf phase reads layers (2, L // 2, L - 3).
    num_hidden_layers=4,
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
    p.add_argument(
        "--phases",
        default="decode,hf",
        help="comma-separated: decode (benchmark 1), hf (3)",
    )
    g = p.add_argument_group("hf phase (bench/engine_hf.py)")
    g.add_argument("--hf-new-tokens", type=int, default=256)
    g.add_argument("--hf-assisted-new-tokens", type=int, default=128)
    g.add_argument("--hf-assistant-layers", type=int, default=2)
    g.add_argument(
        "--hf-acceptance",
        type=float,
        default=0.8,
        help="greedy agreement the HF target/assistant pair is calibrated to; ours runs at it",
    )
    g.add_argument("--hf-assisted-k", type=int, default=4, help="k of the like-for-like pair")
    g.add_argument(
        "--hf-acceptance-tolerance",
        type=float,
        default=0.03,
        help="re-measure ours at HF's measured agreement when it is off by more than this",
    )
    g.add_argument("--hf-assisted-prompts", type=int, default=3, help="timed assisted calls")
    g.add_argument("--hf-calibration-rollouts", type=int, default=3)
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


class DeviceTimer:
    """Seconds spent in a ``with`` block (:attr:`seconds`): CUDA events around it on a
    GPU (the device timeline; nothing inside the block synchronises), the host clock
    elsewhere (dry runs on the CPU)."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0

    def __enter__(self) -> DeviceTimer:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            self._end.record()
            torch.cuda.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0


def decode_run(runner, manager, forward, batch_size: int, args, device) -> dict:
    """Prefill ``batch_size`` random prompts, then ``warmup + steps`` greedy decode steps
    through ``forward(input_ids, positions, metadata) -> hidden``; returns the timed
    steps' figures. Frees the requests' blocks at the end."""
    import torch

    from specula.runtime.worker.paged_kv import build_attention_metadata

    def metadata_from_block_manager(manager, ids, query_lens, max_blocks, device):
        return build_attention_metadata(
            [manager.block_table(r) for r in ids], [manager.num_tokens(r) for r in ids],
            query_lens, manager.block_size, max_blocks, device,
        )

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
        hidden = forward(next_ids, positions, metadata)  # [batch_size, hidden_size]
        return runner.compute_logits(hidden).argmax(-1)  # [batch_size]

    for _ in range(args.warmup):
        next_ids = step(next_ids)
    with DeviceTimer(device) as timer:
        for _ in range(args.steps):
            next_ids = step(next_ids)
    assert next_ids.shape == (batch_size,)
    for r in ids:
        manager.free(r)
    step_s = timer.seconds / args.steps
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
        return replay_ms(graph, reps)


def recorded_command(script: str, argv: list[str]) -> str:
    """The command line to record with results: ``script`` and its arguments, an absolute
    path (a scratch output on the GPU machine) kept to its file name."""
    args = [Path(a).name if os.path.isabs(a) else a for a in argv]
    return f"PYTHONPATH=. python3 {script} {shlex.join(args)}".rstrip()


def replay_ms(graph, reps: int) -> float:
    """Milliseconds per replay of a captured CUDA graph: CUDA events around ``reps``
    replays, after the device has drained."""
    import torch

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

    from specula.runtime.worker.cudagraph import CUDAGraphManager
    from specula.runtime.worker.model_runner import ModelRunner
    from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    phases = set(args.phases.split(","))
    if not phases <= {"decode", "hf"}:
        raise SystemExit(f"unknown phases in {args.phases!r}")
    if args.dry_run:
        torch.set_num_threads(1)
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY
        batch_sizes = [b for b in batch_sizes if b <= 2] or [1]
        args.prompt_len, args.steps, args.warmup = 8, 3, 1
        args.block_size, args.max_model_len = 4, 48
        args.hf_new_tokens, args.hf_assisted_new_tokens, args.hf_assistant_layers = 4, 16, 2
        # Tolerance 0, so that ours is measured at HF's measured agreement (the path a
        # real run takes when the agreement is off).
        args.hf_assisted_k, args.hf_acceptance_tolerance = 2, 0.0
        args.hf_assisted_prompts, args.hf_calibration_rollouts = 2, 2
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
    num_blocks = max_bs * blocks_per_req + 8
    cache = PagedKVCache(spec, num_blocks, device)
    runner = ModelRunner(model, cache, args.max_model_len, attn_num_splits=args.attn_num_splits)
    manager = cache.block_manager(watermark=0.0)

    graphs = None
    if device.type == "cuda" and "decode" in phases:
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

        def replay(input_ids, positions, metadata):
            return graphs.run(input_ids, positions, metadata)[0]  # (hidden, aux, descriptor)

        for bs in batch_sizes:
            res = decode_run(runner, manager, replay, bs, args, device)
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

    if not args.skip_eager and "decode" in phases:
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
    if "decode" in phases:
        print(json.dumps(section, indent=2))
        print(markdown_table(section))
    results = (
        json.loads(args.output.read_text()) if args.output.exists() and not args.dry_run else {}
    )

    def save() -> None:
        # After every phase, so that a later phase's failure keeps the earlier figures.
        if not args.dry_run:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(results, indent=2) + "\n")
            print(f"wrote {args.output}", flush=True)

    if "decode" in phases:
        results["target_decode"] = section
        results["roofline_fraction_bs1"] = section.get("roofline_fraction_bs1")
        save()

    if "hf" in phases:
        import gc

        from bench.engine_hf import engine_spec_point, run_hf_phase, vs_hf_section

        # Every reference to our model goes, so that its memory is free for theirs.
        del graphs, runner, cache, manager, model, eager
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf = run_hf_phase(shape, dtype, device, args)
        hf.update(command=section["command"], date=section["date"], gpu=section["gpu"])
        vs_hf = vs_hf_section(
            results,
            hf,
            args,
            lambda rate, k: engine_spec_point(shape, dtype, device, args, rate, k),
        )
        print(json.dumps(vs_hf, indent=2), flush=True)
        results["vs_hf"] = vs_hf
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
