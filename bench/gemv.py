"""Small-batch projections on one GPU: ``specula.runtime.kernels.gemv`` against the
library GEMM (``F.linear``, cuBLAS) for the weight shapes of the benchmark models, at the
row counts of decode and verification (1 to 160 rows).

Each timing replays a CUDA graph that applies the product to enough distinct copies of
the weight (>= 512 MiB in all) that none is served from the 50 MiB L2 cache, as a model's
layers are not; time per product = graph time / copies. A sweep over launch
configurations picks the best per shape; it prints a table and writes JSON.

    PYTHONPATH=. python3 bench/gemv.py [--output FILE] [--quick] [--shapes 1B,8B]
        [--rows 1,5] [--split-k 1,2,4] [--epilogues]
    PYTHONPATH=. python3 bench/gemv.py --libraries --shapes '8B qkv_proj,8B o_proj,8B gate_up_proj,8B down_proj,1B down_proj,8B/TP2 down_proj' --rows 32,64,96,128,160,192,256,512,2048

``--libraries`` times only the library GEMM, through cuBLAS and through cuBLASLt (torch's
``preferred_blas_library``), and proposes ``LT_ROWS``: the first to the last row count the GEMV
does not take (no ``CONFIGS`` row tile) where cuBLASLt is more than 3 % faster.

``--epilogues`` times each shape with the epilogue the engine runs it with (:data:`EPILOGUES`:
an LM head's argmax, ``o_proj``'s and ``down_proj``'s residual add, ``gate_up_proj``'s
SwiGLU, MTP's ``eh_proj``'s sums of squares) instead of the plain product, and the library
GEMM with nothing (it has no such epilogue). With row 1 among ``--rows``, the table gives a
one-row entry (key 1) where the best configuration at one row beats the row tile's by 1 %.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import recorded_command, replay_ms  # noqa: E402

SHAPES = {
    "8B qkv_proj": (6144, 4096),
    "8B o_proj": (4096, 4096),
    "8B gate_up_proj": (28672, 4096),
    "8B down_proj": (4096, 14336),
    "8B lm_head": (128256, 4096),
    "EAGLE-3 qkv (2H in)": (6144, 8192),
    "EAGLE-3 fc": (4096, 12288),
    "EAGLE-3 lm_head": (32000, 4096),
    "MTP eh_proj (2H in)": (4096, 8192),
    "1B qkv_proj": (3072, 2048),
    "1B o_proj": (2048, 2048),
    "1B gate_up_proj": (16384, 2048),
    "1B down_proj": (2048, 8192),
    "1B lm_head": (128256, 2048),
    "8B/TP2 qkv_proj": (3072, 4096),
    "8B/TP2 o_proj": (4096, 2048),
    "8B/TP2 gate_up_proj": (14336, 4096),
    "8B/TP2 down_proj": (4096, 7168),
    "8B/TP2 lm_head": (64128, 4096),
}
ROWS = (1, 5, 8, 16, 32, 64, 128, 160)
EPILOGUES = {"lm_head": "argmax", "o_proj": "residual", "down_proj": "residual",
             "gate_up_proj": "silu_mul", "eh_proj": "squares"}
"""``--epilogues``: the epilogue of the shapes whose name holds the key (:func:`gemv`'s)."""


def with_epilogue(name: str, m: int, n: int, device, gen):
    """``(fn(x, w, cfg), output columns)`` running :func:`gemv` with ``name``'s epilogue."""
    import torch

    from specula.runtime.kernels.gemv import gemv

    kind = next((v for key, v in EPILOGUES.items() if key in name), None)
    if kind == "residual":
        res = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)
        return lambda x, w, cfg: gemv(x, w, cfg, residual=res)[0]
    kw = {"argmax": {"with_argmax": True}, "silu_mul": {"silu_mul": True},
          "squares": {"sums_of_squares": True}}.get(kind, {})
    return lambda x, w, cfg: (lambda y: y[0] if isinstance(y, tuple) else y)(gemv(x, w, cfg, **kw))


def cublaslt_products(weights, x) -> float:
    """:func:`time_products` of the library GEMM with torch's preference on cuBLASLt (restored)."""
    import torch
    import torch.nn.functional as F

    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return time_products(F.linear, weights, x)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


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
    return replay_ms(graph, reps) * 1e3 / len(weights)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    parser.add_argument("--shapes", default="", help="comma-separated name prefixes (default: all)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts to time")
    parser.add_argument("--tuned-candidates", action="store_true",
                        help="try only the configurations already tuned for other shapes")
    parser.add_argument("--split-k", default="1",
                        help="comma-separated SPLIT_K values to try with each configuration")
    parser.add_argument("--epilogues", action="store_true",
                        help="time each shape with the engine's epilogue (EPILOGUES)")
    parser.add_argument("--libraries", action="store_true", help="cuBLAS against cuBLASLt only")
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from specula.runtime.kernels.gemv import CONFIGS, block_m, gemv

    configs = list(itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8), (3, 5)))
    if args.quick:
        configs = [(32, 256, 4, 4), (64, 256, 4, 4), (64, 128, 8, 3)]
    if args.tuned_candidates:
        configs = sorted({c[:4] for by_bm in CONFIGS.values() for c in by_bm.values()})
    splits = [int(v) for v in args.split_k.split(",")]
    configs = [] if args.libraries else [c if s == 1 else (*c, s) for c in configs for s in splits]
    rows = tuple(int(m) for m in args.rows.split(","))
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    results, table, libraries, lt_rows = {}, {}, {}, {}
    prefixes = tuple(p for p in args.shapes.split(",") if p)
    for name, (n, k) in SHAPES.items():
        if prefixes and not name.startswith(prefixes):
            continue
        nbytes = n * k * 2
        copies = max(2, math.ceil((512 << 20) / nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
                   for _ in range(copies)]
        times: dict[int, dict] = {}
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x.float(), weights[0].float())
            times[m] = {"library": time_products(F.linear, weights, x)}
            if args.libraries:  # the library GEMM through cuBLASLt instead of the kernel
                lt = cublaslt_products(weights, x)
                r = libraries.setdefault(name, {})[m] = {
                    "cublas_us": round(times[m]["library"], 2), "cublaslt_us": round(lt, 2),
                    "ratio": round(lt / times[m]["library"], 3)}
                print(f"{name:22s} m={m:4d}: cuBLAS {r['cublas_us']:8.2f} us  cuBLASLt "
                      f"{r['cublaslt_us']:8.2f} us ({r['ratio']})", flush=True)
                continue
            run = (with_epilogue(name, m, n, dev, gen) if args.epilogues
                   else lambda a, b, cfg: gemv(a, b, cfg))
            for cfg in configs:
                try:
                    y = gemv(x, weights[0], cfg).float()
                    if args.epilogues:  # the epilogue's variant fits too
                        run(x, weights[0], cfg)
                except Exception:  # noqa: BLE001 - a config that does not fit the SM
                    continue
                err = ((y - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (name, m, cfg, err)
                times[m][cfg] = time_products(lambda a, b, cfg=cfg, run=run: run(a, b, cfg), weights, x)
            best = min((c for c in times[m] if c != "library"), key=times[m].get)
            r = results[f"{name} m={m}"] = {
                "n": n, "k": k, "m": m, "library_us": round(times[m]["library"], 2),
                "gemv_us": round(times[m][best], 2), "config": list(best),
                "library_TBps": round(nbytes / times[m]["library"] / 1e6, 3),
                "gemv_TBps": round(nbytes / times[m][best] / 1e6, 3),
            }
            print(f"{name:22s} m={m:3d}: cuBLAS {r['library_us']:8.2f} us ({r['library_TBps']:.2f} "
                  f"TB/s)  gemv {r['gemv_us']:8.2f} us ({r['gemv_TBps']:.2f} TB/s) {best}", flush=True)
        # LT_ROWS: the first to the last row count past the GEMV's row tiles where cuBLASLt won by 3 %
        faster = [m for m, r in libraries.get(name, {}).items()
                  if r["ratio"] < 0.97 and block_m(m) not in CONFIGS.get((n, k), {})]
        if faster:
            lt_rows[(n, k)] = (min(faster), max(faster))
        for bm in sorted({block_m(m) for m in rows} if not args.libraries else ()):
            ms = [m for m in rows if block_m(m) == bm]
            common = set.intersection(*(set(times[m]) - {"library"} for m in ms))
            if not common:
                continue
            cfg = min(common, key=lambda c: sum(times[m][c] for m in ms))
            if sum(times[m][cfg] for m in ms) < 0.99 * sum(times[m]["library"] for m in ms):
                table.setdefault((n, k), {})[bm] = cfg
                if bm == 16 and 1 in times:  # a one-row entry where one row's best is faster
                    one = min((c for c in times[1] if c != "library"), key=times[1].get)
                    if times[1][one] < 0.99 * times[1][cfg]:
                        table[(n, k)] = {1: one, **table[(n, k)]}
        del weights
        torch.cuda.empty_cache()
    if args.libraries:
        print(f"LT_ROWS = {lt_rows}")
    else:
        print("CONFIGS = {")
        for (n, k), by_bm in table.items():
            print(f"    ({n}, {k}): {{{', '.join(f'{bm}: {cfg}' for bm, cfg in by_bm.items())}}},")
        print("}")
    if args.output:
        record = {"blas_library": libraries, "lt_rows": {f"{n}x{k}": list(v) for (n, k), v in lt_rows.items()}}
        if not args.libraries:
            record = {"results": results, "configs": {f"{n}x{k}": {str(bm): list(c) for bm, c in v.items()}
                                                      for (n, k), v in table.items()}}
        args.output.write_text(json.dumps({
            "command": recorded_command("bench/gemv.py", argv or sys.argv[1:]),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": dt.date.today().isoformat(), **record,
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
