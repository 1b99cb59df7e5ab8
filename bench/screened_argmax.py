"""The greedy draft's LM head with and without the 8-bit screen: the Llama-3.2-1B head
(128256 x 2048, bf16, random weights of std 0.02) at one and two rows, timed as
:func:`~specula.runtime.kernels.gemv.screened_argmax` (the int8 pass, the rescoring of the
candidates, the merge) at each int8 configuration and rescoring width against the engine's
bf16 GEMV with its argmax epilogue (:func:`~specula.runtime.kernels.gemv.linear_argmax`).
Each timing replays a CUDA graph over three heads (1.6 GB of bf16, more than the 50 MiB L2)
and reports microseconds per head; each configuration's tokens are first checked against
the first argmax of the float64 logits rounded to bf16, and the candidates a row leaves
are counted.

    PYTHONPATH=. python3 bench/screened_argmax.py [--rows 1,2] [--sweep] [--output FILE]

``--sweep`` first times the int8 pass alone over :func:`sweep_configs` (the grid that chose the
former :data:`~specula.runtime.kernels.gemv.SCREEN_CONFIG`, when the pass also summed the squares of
``x``; the present one is the best of :data:`SCREENS`) and prints the six fastest per row count.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import replay_ms  # noqa: E402
from specula.runtime.kernels import gemv as gemv_module  # noqa: E402
from specula.runtime.kernels.gemv import gemv, linear_argmax, screen_weight, screened_argmax  # noqa: E402

VOCAB, HIDDEN, COPIES = 128256, 2048, 3
SCREENS = ((256, 256, 8, 2), (128, 256, 4, 3), (128, 256, 4, 2), (128, 256, 8, 3))
COLUMNS = (256, 512, 1024, 2048)
"""The int8 pass's configurations and the rescoring's columns a program tried."""


def sweep_configs() -> list[tuple[int, int, int, int]]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` with 16K to 256K int8 weights a stage and at
    most 200 KiB of shared memory over the stages; 8 warps from 128 columns, 4 below 256."""
    grid = itertools.product((32, 64, 128, 256), (128, 256, 512, 1024), (4, 8), (2, 3, 4, 5))
    return [(n, k, w, s) for n, k, w, s in grid if s * (n * k + 32 * k) <= 200 << 10
            and 1 << 14 <= n * k <= 1 << 18 and (w == 4 or n >= 128) and (w == 8 or n < 256)]


def per_head_us(fn) -> float:
    """Microseconds per head: a CUDA graph of ``fn`` (:data:`COPIES` heads), replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return min(replay_ms(graph, 10) for _ in range(3)) * 1e3 / COPIES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2")
    parser.add_argument("--sweep", action="store_true", help="time the int8 pass over sweep_configs()")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    heads = [torch.randn(VOCAB, HIDDEN, device=dev, generator=gen).mul_(0.02).bfloat16()
             for _ in range(COPIES)]
    screens = [screen_weight(w) for w in heads]
    out = {"command": "PYTHONPATH=. python3 bench/screened_argmax.py", "gpu": torch.cuda.get_device_name(),
           "date": date.today().isoformat(), "software": {"torch": torch.__version__},
           "shape": [VOCAB, HIDDEN], "us": {}}
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, HIDDEN, device=dev, generator=gen).bfloat16()
        res = out["us"][f"rows_{rows}"] = {}
        res["bf16_gemv_argmax"] = round(per_head_us(lambda x=x: [linear_argmax(x, w) for w in heads]), 2)
        centre, top, top_bound = gemv(x, screens[0][0], gemv_module.SCREEN_CONFIG, screen=screens[0][1])
        norm = x.float().norm(dim=1, keepdim=True)
        thr = (top - norm * top_bound).amax(1, keepdim=True)  # the second pass's threshold
        res["candidates_per_row"] = ((centre + norm * screens[0][1][1]).bfloat16() >= thr.bfloat16()).sum(1).tolist()
        refs = [(x.double() @ w.double().T).bfloat16().argmax(-1) for w in heads]
        print(f"rows {rows}: bf16 {res['bf16_gemv_argmax']} us, candidates {res['candidates_per_row']}",
              flush=True)
        if args.sweep:
            swept = {cfg: per_head_us(lambda c=cfg, x=x: [gemv(x, q, c, screen=a) for q, a in screens])
                     for cfg in sweep_configs()}
            res["sweep_int8_pass"] = {str(c): round(t, 2) for c, t in sorted(swept.items(), key=lambda i: i[1])}
            print(f"  int8 pass, fastest: {list(res['sweep_int8_pass'].items())[:6]}", flush=True)
        default = gemv_module.SCREEN_CONFIG, gemv_module.RESCORE_COLUMNS
        try:
            for screen in SCREENS:
                res[f"screen_pass_{screen}"] = round(per_head_us(
                    lambda s=screen, x=x: [gemv(x, q, s, screen=a) for q, a in screens]), 2)
                for columns in COLUMNS:
                    gemv_module.SCREEN_CONFIG, gemv_module.RESCORE_COLUMNS = screen, columns
                    for w, sc, ref in zip(heads, screens, refs, strict=True):
                        assert torch.equal(screened_argmax(x, w, sc), ref), (screen, columns)
                    res[f"screened_{screen}_{columns}"] = us = round(per_head_us(
                        lambda x=x: [screened_argmax(x, w, sc) for w, sc in zip(heads, screens, strict=True)]), 2)
                    print(f"  screen {screen}, {columns} columns a rescoring program: {us} us "
                          f"(the int8 pass alone {res[f'screen_pass_{screen}']})", flush=True)
        finally:
            gemv_module.SCREEN_CONFIG, gemv_module.RESCORE_COLUMNS = default
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
