"""Where an engine step's time goes on the GPU: the torch profiler over a few steps of
``bench/engine_e2e.py``'s workload (8B-shaped target, random weights, synthetic
acceptance 0.8), printing per batch size the step's wall time, the GPU's busy time in
it, and the top kernels and host functions.

    PYTHONPATH=. python3 bench/profile_engine.py [--method eagle3] [--batches 1,32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_e2e import LLAMA_1B, LLAMA_8B, make_engine, random_prompts, write_checkpoints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="eagle3", help="'none' for target-only")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specula.runtime.engine.sampling_params import SamplingParams

    batches = tuple(int(b) for b in args.batches.split(","))
    dirs = write_checkpoints(Path(tempfile.mkdtemp()), LLAMA_8B, LLAMA_1B)
    method = None if args.method == "none" else args.method
    engine = make_engine(dirs, method, args.k, batches, "cuda", 0.8)
    for b in batches:
        for i, p in enumerate(random_prompts(b, LLAMA_8B["vocab_size"], 128, seed=b)):
            engine.add_request(f"b{b}-{i}", p, SamplingParams(max_tokens=1800, ignore_eos=True))
        for _ in range(10):  # prefill and warm-up
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e3  # ms
        print(f"\n=== {args.method} batch {b}: {1e3 * wall / args.steps:.2f} ms/step wall, "
              f"GPU busy {gpu / args.steps:.2f} ms/step ({gpu / (1e3 * wall):.0%})")
        print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
        print(events.table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
        for i in range(b):
            engine.abort_request(f"b{b}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
