"""Small-batch projections on one GPU: ``specula.runtime.kernels.gemv`` against the
library GEMM (``F.linear``, cuBLAS) for the weight shapes of the benchmark models, at the
row counts of decode and verification at batch 1 (1, 5 and 8 rows).

Each timing replays a CUDA graph that applies the product to enough distinct copies of
the weight (>= 512 MiB in all) that none is served from the 50 MiB L2 cache, as a model's
layers are not; time per product = graph time / copies. A sweep over launch
configurations picks the best per shape; it prints a table and writes JSON.

    PYTHONPATH=. python3 bench/gemv.py [--output FILE] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {
    "8B qkv_proj": (6144, 4096),
    "8B o_proj": (4096, 4096),
    "8B gate_up_proj": (28672, 4096),
    "8B down_proj": (4096, 14336),
    "8B lm_head": (128256, 4096),
    "EAGLE-3 qkv (2H in)": (6144, 8192),
    "EAGLE-3 fc": (4096, 12288),
    "EAGLE-3 lm_head": (32000, 4096),
    "1B qkv_proj": (3072, 2048),
    "1B o_proj": (2048, 2048),
    "1B gate_up_proj": (16384, 2048),
    "1B down_proj": (2048, 8192),
}
ROWS = (1, 5, 8)


def time_products(fn, weights, x, reps: int = 5) -> float:
    """Microseconds per product: a graph of ``fn(x, w)`` over ``weights``, replayed."""
    import torch

    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(weights))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from specula.runtime.kernels.gemv import gemv

    configs = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5)))
    if args.quick:
        configs = [(32, 256, 4, 4), (64, 256, 4, 4), (16, 512, 4, 4)]
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    results = {}
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, math.ceil((512 << 20) / nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
                   for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x, weights[0]).float()
            lib = time_products(F.linear, weights, x)
            best = None
            for cfg in configs:
                try:
                    y = gemv(x, weights[0], cfg).float()
                except Exception as exc:  # noqa: BLE001 - a config that does not compile
                    print(f"{name} m={m} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                err = ((y - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (name, m, cfg, err)
                t = time_products(lambda a, b, cfg=cfg: gemv(a, b, cfg), weights, x)
                if best is None or t < best[1]:
                    best = (cfg, t)
            results[f"{name} m={m}"] = {
                "n": n, "k": k, "m": m, "library_us": round(lib, 2),
                "gemv_us": round(best[1], 2), "config": list(best[0]),
                "library_TBps": round(nbytes / lib / 1e6, 3),
                "gemv_TBps": round(nbytes / best[1] / 1e6, 3),
            }
            r = results[f"{name} m={m}"]
            print(f"{name:22s} m={m}: cuBLAS {r['library_us']:8.2f} us ({r['library_TBps']:.2f} TB/s)"
                  f"  gemv {r['gemv_us']:8.2f} us ({r['gemv_TBps']:.2f} TB/s) {best[0]}", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.output:
        args.output.write_text(json.dumps({
            "command": "PYTHONPATH=. python3 bench/gemv.py " + " ".join(argv or sys.argv[1:]),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "results": results,
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
