"""A decoder layer's four projections in one persistent launch, against the engine's four
GEMV launches: the design measured for the ``draft_model`` draft's per-launch cost, and not
adopted (``bench/RESULTS.md``, ninth session).

Llama-3.2-1B shapes (hidden 2048, intermediate 8192, qkv 3072), bfloat16, 1 or 2 rows (a
draft step's). The engine runs, after a layer's attention, ``o_proj`` with the residual add
and its sums of squares, ``gate_up_proj`` with the folded norm's 1/rms and SwiGLU,
``down_proj`` with the residual add, and the next layer's ``qkv_proj`` with its 1/rms:
four :func:`~specula.runtime.kernels.gemv.gemv` launches (here with and without their
weight prefetch into L2). The persistent kernel runs the four as phases of one launch of
one program per SM: each program takes every ``NUM_PROGS``-th column tile of a phase, asks
L2 for the first two 128-byte lines of each weight row of its tile of the next phase, and
waits at a grid-wide barrier (an arrival counter, release/acquire) before the next phase
reads what the whole grid wrote. Each variant's launch is first checked against the GEMVs;
each timing replays a CUDA graph over 16 layers of distinct weights (as a model's layers
evict L2) and reports microseconds per layer.

    PYTHONPATH=. python3 bench/persistent_layer.py [--rows 1,2] [--output FILE]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/persistent_layer.py --check

Variants with several programs an SM (and shallower pipelines) run only where every program
fits on the device at once (from the compiled kernel's shared memory and registers); a barrier
would wait forever otherwise.

``--check`` runs the phases one launch each (no barrier: the interpreter runs programs one
after another) at small shapes on the CPU and compares them with the GEMVs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import recorded_command, replay_ms  # noqa: E402
from specula.runtime.kernels.gemv import gemv  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, LAYERS = 2048, 8192, 3072, 16
CONFIGS = {  # (BLOCK_N, BLOCK_K) of o_proj, gate_up_proj, down_proj, qkv_proj; warps; stages
    "o16 g64 d16 q16, 4 warps": (16, 256, 64, 128, 16, 512, 16, 256, 4, 4),
    "o16 g64 d16 q32, 4 warps": (16, 256, 64, 128, 16, 512, 32, 256, 4, 4),
    "o16 g32 d16 q16, 4 warps": (16, 256, 32, 256, 16, 512, 16, 256, 4, 4),
    "longer K tiles, 3 stages": (16, 512, 64, 128, 16, 1024, 16, 512, 4, 3),
    "o16 g64 d16 q16, 8 warps": (16, 256, 64, 128, 16, 512, 16, 256, 8, 4),
}


@triton.jit
def _grid_barrier(count_ptr, target):
    """Arrive, then wait until ``target`` programs have arrived (the count only grows
    within a launch; the last program to leave resets it)."""
    tl.debug_barrier()  # every thread's stores issued before the release
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _phase(x_ptr, stride_x, w_ptr, y_ptr, stride_y, res_ptr, sq_out_ptr, sq_in_ptr, parts_in,
           M, N, K, up_offset, eps, pid, NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr, RES: tl.constexpr,
           RMS: tl.constexpr, BLOCK_P: tl.constexpr):
    """``y = x @ w.T`` over this program's column tiles, with ``gemv``'s epilogues (the
    same rounding): SwiGLU (``SILU``), the residual add and sums of squares per tile
    (``RES``), the 1/rms of ``x`` from the previous phase's sums (``RMS``)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, n_tiles, NUM_PROGS):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        x_ptrs = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
            acc = tl.dot(x, tl.load(w_ptrs), acc)
            if SILU:
                acc_up = tl.dot(x, tl.load(w_ptrs + up_offset), acc_up)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if RMS:
            offs_p = tl.arange(0, BLOCK_P)
            sums = tl.load(sq_in_ptr + offs_m[:, None] * parts_in + offs_p[None, :],
                           mask=(offs_m[:, None] < M) & (offs_p[None, :] < parts_in), other=0.0)
            rstd = tl.rsqrt(tl.sum(sums, axis=1) / K + eps)[:, None]
            acc *= rstd
            acc_up *= rstd
        dtype = y_ptr.dtype.element_ty
        y = acc.to(dtype)
        if SILU:
            g = y.to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            y = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype)
        y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if RES:
            r = tl.load(res_ptr + offs_m[:, None] * stride_y + offs_n[None, :], mask=y_mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
            yf = tl.where(y_mask, y.to(tl.float32), 0.0)
            tl.store(sq_out_ptr + offs_m * n_tiles + tile, tl.sum(yf * yf, axis=1), mask=offs_m < M)
        tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], y, mask=y_mask)


@triton.jit
def _prefetch_tile(w_ptr, K, N, pid, BLOCK_N: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for the first ``LINES`` 128-byte lines of each weight row of tile ``pid``."""
    if pid < tl.cdiv(N, BLOCK_N):
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        for i in tl.static_range(LINES):
            p = w_ptr.to(tl.pointer_type(tl.int8)) + rows.to(tl.int64) * (2 * K) + i * 128
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [p], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _layer_kernel(attn_ptr, res_ptr, h1_ptr, act_ptr, h2_ptr, qkv_ptr, sq1_ptr, sq2_ptr,
                  wo_ptr, wgu_ptr, wd_ptr, wq_ptr, count_ptr, M, H, KO, NI, NQ, stride_a, eps,
                  NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr, BN_O: tl.constexpr,
                  BK_O: tl.constexpr, BN_G: tl.constexpr, BK_G: tl.constexpr, BN_D: tl.constexpr,
                  BK_D: tl.constexpr, BN_Q: tl.constexpr, BK_Q: tl.constexpr, P_O: tl.constexpr,
                  P_D: tl.constexpr, LINES: tl.constexpr, PHASE: tl.constexpr):
    """The four phases (``PHASE`` -1) with a barrier between each, or phase ``PHASE`` alone."""
    pid = tl.program_id(0)
    if PHASE < 0 or PHASE == 0:  # o_proj + residual -> h1, its sums of squares
        _phase(attn_ptr, stride_a, wo_ptr, h1_ptr, H, res_ptr, sq1_ptr, sq1_ptr, 1, M, H, KO, 0, eps,
               pid, NUM_PROGS, BLOCK_M, BN_O, BK_O, False, True, False, 1)
    if PHASE < 0:
        _prefetch_tile(wgu_ptr, H, NI, pid, BN_G, LINES)
        _prefetch_tile(wgu_ptr + NI * H, H, NI, pid, BN_G, LINES)
        _grid_barrier(count_ptr, NUM_PROGS)
    if PHASE < 0 or PHASE == 1:  # gate_up_proj with 1/rms(h1), SwiGLU -> act
        _phase(h1_ptr, H, wgu_ptr, act_ptr, NI, h1_ptr, sq1_ptr, sq1_ptr, tl.cdiv(H, BN_O), M, NI,
               H, NI * H, eps, pid, NUM_PROGS, BLOCK_M, BN_G, BK_G, True, False, True, P_O)
    if PHASE < 0:
        _prefetch_tile(wd_ptr, NI, H, pid, BN_D, LINES)
        _grid_barrier(count_ptr, 2 * NUM_PROGS)
    if PHASE < 0 or PHASE == 2:  # down_proj + residual -> h2, its sums of squares
        _phase(act_ptr, NI, wd_ptr, h2_ptr, H, h1_ptr, sq2_ptr, sq2_ptr, 1, M, H, NI, 0, eps, pid,
               NUM_PROGS, BLOCK_M, BN_D, BK_D, False, True, False, 1)
    if PHASE < 0:
        _prefetch_tile(wq_ptr, H, NQ, pid, BN_Q, LINES)
        _grid_barrier(count_ptr, 3 * NUM_PROGS)
    if PHASE < 0 or PHASE == 3:  # the next layer's qkv_proj with 1/rms(h2)
        _phase(h2_ptr, H, wq_ptr, qkv_ptr, NQ, h2_ptr, sq2_ptr, sq2_ptr, tl.cdiv(H, BN_D), M, NQ,
               H, 0, eps, pid, NUM_PROGS, BLOCK_M, BN_Q, BK_Q, False, False, True, P_D)
    if PHASE < 0:  # the last program to leave resets both counters for the next launch
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + 1, 1, sem="acq_rel", scope="gpu") == NUM_PROGS - 1:
            tl.store(count_ptr, 0)
            tl.store(count_ptr + 1, 0)


def persistent_layer(attn, res, wo, wgu, wd, wq, counts, cfg, eps=1e-5, phases=False, lines=2,
                     num_progs=None):
    """``(next qkv [M, NQ], h2 [M, H], h2's sums of squares [M, tiles])`` of the four
    phases; ``counts``: [2] int32 zeros (zero again after the launch); ``phases``: one
    launch per phase."""
    m, ko = attn.shape
    assert m <= 16 and attn.stride(1) == 1 and res.is_contiguous(), "one 16-row tile; rows of res contiguous"
    h, i, nq = res.shape[1], wgu.shape[0] // 2, wq.shape[0]
    bn_o, bk_o, bn_g, bk_g, bn_d, bk_d, bn_q, bk_q, warps, stages = cfg
    new = lambda *shape, dtype=attn.dtype: torch.empty(*shape, dtype=dtype, device=attn.device)  # noqa: E731
    h1, act, h2, qkv = new(m, h), new(m, i), new(m, h), new(m, nq)
    sq1 = new(m, triton.cdiv(h, bn_o), dtype=torch.float32)
    sq2 = new(m, triton.cdiv(h, bn_d), dtype=torch.float32)
    progs = num_progs or (torch.cuda.get_device_properties(attn.device).multi_processor_count
                          if attn.is_cuda else 4)
    args = (attn, res, h1, act, h2, qkv, sq1, sq2, wo, wgu, wd, wq, counts, m, h, ko, i, nq,
            attn.stride(0), eps)
    kw = dict(NUM_PROGS=progs, BLOCK_M=16, BN_O=bn_o, BK_O=bk_o, BN_G=bn_g, BK_G=bk_g, BN_D=bn_d,
              BK_D=bk_d, BN_Q=bn_q, BK_Q=bk_q, P_O=triton.next_power_of_2(sq1.shape[1]),
              P_D=triton.next_power_of_2(sq2.shape[1]), LINES=lines, num_warps=warps,
              num_stages=stages)
    if not phases and attn.is_cuda:  # a barrier needs every program resident at once
        resident = _resident_programs(_layer_kernel.warmup(*args, PHASE=-1, grid=(progs,), **kw),
                                      warps, attn.device)
        if progs > resident:
            raise RuntimeError(f"{progs} programs cannot all be resident ({resident} can)")
    for phase in range(4) if phases else (-1,):
        _layer_kernel[(progs,)](*args, PHASE=phase, **kw)
    return qkv, h2, sq2


def _resident_programs(compiled, warps: int, device: torch.device) -> int:
    """How many programs of ``compiled`` fit on the device at once: per SM the fewest
    allowed by its shared memory (1 KiB more a program), registers and threads."""
    compiled._init_handles()
    props = torch.cuda.get_device_properties(device)
    smem = props.shared_memory_per_multiprocessor // (compiled.metadata.shared + 1024)
    regs = props.regs_per_multiprocessor // (-(-compiled.n_regs // 8) * 8 * 32 * warps)
    threads = props.max_threads_per_multi_processor // (32 * warps)
    return props.multi_processor_count * min(smem, regs, threads, 32)


def four_gemvs(attn, res, wo, wgu, wd, wq, eps=1e-5, prefetch=True, next_wo=None):
    """The engine's four launches (``ModelRunner.decoder`` with folded norms): each asks L2
    for the start of the weight after it (``next_wo``: the next layer's ``o_proj``)."""
    h1, sq1 = gemv(attn, wo, residual=res, prefetch=wgu if prefetch else None)
    act = gemv(h1, wgu, silu_mul=True, rms=(sq1, eps), prefetch=wd if prefetch else None)
    h2, sq2 = gemv(act, wd, residual=h1, prefetch=wq if prefetch else None)
    return gemv(h2, wq, rms=(sq2, eps), prefetch=next_wo if prefetch else None), h2, sq2


def check() -> None:
    """Small shapes, one launch per phase (the interpreter), against the GEMVs."""
    gen = torch.Generator().manual_seed(0)
    h, i, nq = 256, 512, 384
    weights = [torch.randn(*s, generator=gen).bfloat16() * 0.05
               for s in ((h, h), (2 * i, h), (h, i), (nq, h))]
    for m in (1, 2):
        attn = torch.randn(m, h, generator=gen).bfloat16()
        res = torch.randn(m, h, generator=gen).bfloat16()
        counts = torch.zeros(2, dtype=torch.int32)
        got = persistent_layer(attn, res, *weights, counts, (16, 128, 32, 128, 16, 256, 16, 128, 4, 2),
                               phases=True)
        want = four_gemvs(attn, res, *weights, prefetch=False)
        for name, a, b in (("qkv", got[0], want[0]), ("h2", got[1], want[1]),
                           ("sums of squares", got[2].sum(-1), want[2].sum(-1))):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2, msg=name)
    print("the phases match the GEMVs")


def time_layers(fn) -> float:
    """Microseconds per layer: a CUDA graph of ``fn`` (all layers), replayed."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return min(replay_ms(graph, 20) for _ in range(3)) * 1e3 / LAYERS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--check", action="store_true", help="interpreter check on the CPU")
    args = parser.parse_args(argv)
    if args.check:
        check()
        return 0
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers = [tuple(torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02 for s in (
        (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE), (QKV, HIDDEN)))
        for _ in range(LAYERS)]
    counts = torch.zeros(2, dtype=torch.int32, device=dev)
    results: dict[str, dict[str, float]] = {}
    for m in (int(r) for r in args.rows.split(",")):
        attn = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.2
        res = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)

        def chain(step, attn=attn, res=res):
            def fn():
                a, r = attn, res
                for j, w in enumerate(layers):
                    qkv, r, _ = step(a, r, w, layers[(j + 1) % LAYERS][0])
                    a = qkv[:, :HIDDEN]
            return fn

        variants = {
            "four GEMV launches, no prefetch": lambda a, r, w, nxt: four_gemvs(a, r, *w, prefetch=False),
            "four GEMV launches (the engine's)": lambda a, r, w, nxt: four_gemvs(a, r, *w, next_wo=nxt)}
        for name, cfg in CONFIGS.items():
            variants[f"persistent, {name}"] = (
                lambda a, r, w, nxt, cfg=cfg: persistent_layer(a, r, *w, counts, cfg))
        first = next(iter(CONFIGS.values()))
        variants["persistent, first config, no L2 requests"] = (
            lambda a, r, w, nxt, cfg=first: persistent_layer(a, r, *w, counts, cfg, lines=0))
        variants["persistent, first config, 128 programs"] = (
            lambda a, r, w, nxt, cfg=first: persistent_layer(a, r, *w, counts, cfg, num_progs=128))
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        for per_sm, stages in ((1, 2), (2, 2), (2, 3), (3, 2)):
            cfg = (*first[:-1], stages)
            variants[f"persistent, first config, {stages} stages, {per_sm} programs an SM"] = (
                lambda a, r, w, nxt, cfg=cfg, n=per_sm * sms: persistent_layer(
                    a, r, *w, counts, cfg, num_progs=n))
        want = four_gemvs(attn, res, *layers[0], prefetch=False)
        for name, step in list(variants.items()):  # each variant's launch checked before timing
            try:
                got = step(attn, res, layers[0], layers[1][0])
            except RuntimeError as e:  # too many programs to be resident: not launched
                print(f"rows {m}: {name}: skipped, {e}", flush=True)
                del variants[name]
                continue
            for a, b in ((got[0], want[0]), (got[1], want[1]), (got[2].sum(-1), want[2].sum(-1))):
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)
        results[f"rows {m}"] = row = {}
        for name, step in variants.items():
            row[name] = round(time_layers(chain(step)), 2)
            print(f"rows {m}: {name}: {row[name]:.2f} us a layer", flush=True)
        assert counts.tolist() == [0, 0], "the barrier counters were not reset"
    record = {"command": recorded_command("bench/persistent_layer.py", sys.argv[1:]),
              "gpu": torch.cuda.get_device_name(), "date": dt.date.today().isoformat(),
              "software": {"torch": torch.__version__, "triton": triton.__version__},
              "weight_mb_per_layer": round(2 * (HIDDEN * HIDDEN + 3 * INTERMEDIATE * HIDDEN
                                                + QKV * HIDDEN) / 1e6, 1),
              "us_per_layer": results}
    print(json.dumps(record, indent=1))
    if args.output:
        args.output.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
