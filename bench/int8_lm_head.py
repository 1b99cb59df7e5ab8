"""A probe for an 8-bit screening pass of a draft's greedy LM head: the Llama-3.2-1B head
(128256 x 2048) as a GEMV over int8 weights with a float32 scale per row (the weight tile
and the activations converted to float16 in the kernel, float32 accumulation), against
the engine's bfloat16 GEMV with its argmax epilogue
(:func:`~specula.runtime.kernels.gemv.gemv`, ``with_argmax``). One row; each timing
replays a CUDA graph over three weight copies (1.6 GB of bf16, more than the 50 MiB L2)
and reports microseconds per product over six launch configurations.

Only the product is timed: an exact screened argmax would also need each row's
quantization error bound and the bf16 rescoring of the candidates it leaves (neither is
written here). Measured on an H100 (``bench/RESULTS.md``, ninth session).

    PYTHONPATH=. python3 bench/int8_lm_head.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import replay_ms  # noqa: E402
from specula.runtime.kernels.gemv import gemv  # noqa: E402

VOCAB, HIDDEN, COPIES = 128256, 2048, 3
CONFIGS = ((32, 512, 4, 4), (64, 256, 4, 4), (64, 512, 4, 3), (128, 256, 8, 3), (32, 1024, 4, 3),
           (64, 1024, 8, 3))
"""``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` tried."""


@triton.jit
def _int8_gemv(y_ptr, x_ptr, w_ptr, s_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """``y [M, N] float32 = (x [M, K] @ w [N, K].T) * s [N]``, ``w`` int8."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptrs, mask=offs_n[None, :] < N, other=0)
        acc = tl.dot(x.to(tl.float16), w.to(tl.float16), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def per_graph_us(fn) -> float:
    """Microseconds per product: a CUDA graph of ``fn`` (:data:`COPIES` products), replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return min(replay_ms(graph, 10) for _ in range(3)) * 1e3 / COPIES


def main() -> int:
    dev = torch.device("cuda")
    weights = [torch.randn(VOCAB, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    quantized = []
    for w in weights:
        scale = w.float().abs().amax(1) / 127
        quantized.append(((w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale))
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, VOCAB, device=dev, dtype=torch.float32)
    print(f"bf16 gemv+argmax: {per_graph_us(lambda: [gemv(x, w, with_argmax=True) for w in weights]):.1f} us")
    for bn, bk, warps, stages in CONFIGS:
        def run(bn=bn, bk=bk, warps=warps, stages=stages):
            for wq, scale in quantized:
                _int8_gemv[(triton.cdiv(VOCAB, bn),)](y, x, wq, scale, 1, VOCAB, HIDDEN, BLOCK_M=16,
                                                      BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                                      num_stages=stages)
        print(f"int8 ({bn},{bk},{warps},{stages}): {per_graph_us(run):.1f} us", flush=True)
    print(f"bytes: bf16 {VOCAB * HIDDEN * 2 / 1e6:.0f} MB, int8 {VOCAB * HIDDEN / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
