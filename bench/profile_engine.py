"""Where an engine step's time goes on the GPU: a few steps of ``bench/engine_e2e.py``'s
workload (8B-shaped target, random weights, synthetic acceptance 0.8), printing per
method and batch size:

- the step's wall time without any profiler (host clock around ``step()``, synchronised
  at the end), and the target graph's replay time at that batch, for comparison;
- the host functions that took the time (``cProfile``, sorted by own time): what the
  Python side does per step;
- the GPU's busy time per step and the top kernels (``torch.profiler``): busy well under
  wall means the device waits for the host.

    PYTHONPATH=. python3 bench/profile_engine.py [--methods none,eagle3] [--batches 1,32]
        [--tensor-parallel-size 2] [--chrome-trace DIR]

``--paired`` keeps a target-only engine loaded beside each method's (both with
``bench/engine_e2e.py``'s ``PAIRED_NUM_GPU_BLOCKS``) and profiles it again right after the method,
so that both are profiled on the GPU in the same state (the same graph runs about 1 % slower a
minute into a call, ``bench/graph_drift.py``).

``--chrome-trace DIR`` also writes each profiled run's ``torch.profiler`` trace to
``DIR/<method>-bs<batch>.json`` (Chrome trace format; kernels in CUDA graphs included),
for ordering a step's kernels and finding the ones launched from the host.

With ``--tensor-parallel-size`` N > 1 the engine runs on N GPUs (rank 0 here, the others
spawned, as ``bench/tp.py`` starts them) and rank 0 is profiled; the target graph's
replay alone is not timed there (its collectives need every rank).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_e2e import (  # noqa: E402
    ACCEPTANCE,
    LLAMA_1B,
    LLAMA_8B,
    PAIRED_NUM_GPU_BLOCKS,
    make_engine,
    random_prompts,
    release_memory,
    runner_tokens_per_s,
    write_checkpoints,
)


def profile_batch(
    engine, label: str, batch: int, steps: int, torch_profile: bool, time_graph: bool = True,
    trace_dir: str | None = None,
) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specula.runtime.engine.sampling_params import SamplingParams

    for i, p in enumerate(random_prompts(batch, LLAMA_8B["vocab_size"], 128, seed=batch)):
        engine.add_request(f"b{batch}-{i}", p, SamplingParams(max_tokens=1800, ignore_eos=True))
    for _ in range(12):  # prefill and warm-up
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    graph = (f"; target decode graph alone {batch / runner_tokens_per_s(engine, batch) * 1e3:.3f} ms"
             if time_graph else "")
    print(f"\n=== {label} batch {batch}: {1e3 * wall:.3f} ms/step wall (no profiler){graph}",
          flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(28)
    print(f"--- host functions over {steps} steps (cProfile, by own time)")
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(lines[start:]), flush=True)
    if torch_profile:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            twall = time.perf_counter() - start
        if trace_dir:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            tprof.export_chrome_trace(str(Path(trace_dir) / f"{label}-bs{batch}.json"))
        events = tprof.key_averages()
        device = [e for e in tprof.events() if e.device_type.name == "CUDA"]
        gpu = sum(e.time_range.elapsed_us() for e in device) / 1e3  # ms, kernels and copies
        print(f"--- torch.profiler: {1e3 * twall / steps:.2f} ms/step wall (profiled), GPU busy "
              f"{gpu / steps:.3f} ms/step ({gpu / (1e3 * twall):.0%}), "
              f"{len(device) / steps:.0f} device events/step")
        print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    while engine.has_unfinished_requests():
        engine.step()


def _build(dirs, method, k, batches, max_num_batched_tokens, tp, device, **engine_kw):
    """One rank's engine (module-level, so that spawned ranks can unpickle it)."""
    return make_engine(
        dirs, method, k, batches, str(device), ACCEPTANCE,
        max_num_batched_tokens=max_num_batched_tokens, tensor_parallel_size=tp, **engine_kw,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="none,eagle3", help="'none' for target-only")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-torch-profile", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--chrome-trace", default=None, metavar="DIR")
    parser.add_argument("--paired", action="store_true",
                        help="one GPU: a target-only engine stays loaded and is profiled again after "
                             "each method, as 'none-after-<method>'")
    args = parser.parse_args(argv)
    import torch

    from specula.runtime.engine.distributed import start_ranks

    batches = tuple(int(b) for b in args.batches.split(","))
    dirs = write_checkpoints(Path(tempfile.mkdtemp()), LLAMA_8B, LLAMA_1B)
    tp = args.tensor_parallel_size
    assert not (args.paired and tp > 1), "--paired: one GPU"
    blocks = {"num_gpu_blocks": PAIRED_NUM_GPU_BLOCKS} if args.paired else {}
    base = (_build(dirs, None, args.k, batches, args.max_num_batched_tokens, 1, torch.device("cuda:0"),
                   **blocks) if args.paired else None)
    for name in args.methods.split(","):
        method = None if name == "none" else name
        build = partial(
            _build, dirs, method, args.k, batches, args.max_num_batched_tokens, tp, **blocks
        )
        engine = build(torch.device("cuda:0")) if tp == 1 else start_ranks(tp, "cuda", build)
        for b in batches:
            profile_batch(engine, name, b, args.steps, not args.no_torch_profile, tp == 1,
                          args.chrome_trace)
            if base is not None:  # the target alone again, on the GPU as the method left it
                profile_batch(base, f"none-after-{name}", b, args.steps, not args.no_torch_profile,
                              True, args.chrome_trace)
        engine.shutdown()
        del engine
        release_memory()
    if base is not None:
        base.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
