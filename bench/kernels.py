"""Benchmark of the Triton kernels (``specula.runtime.kernels``) against torch.

Each kernel runs at Llama-3.1-8B shapes in bfloat16 (32 query / 8 KV heads, head_dim
128, hidden 4096, vocabulary 128256, KV block size 16) next to a torch implementation of
the same operation, timed with ``triton.testing.do_bench`` (median, CUDA events):

- paged attention: torch gathers each request's blocks through the block table and runs
  ``scaled_dot_product_attention`` with the causal-offset mask;
- cache write, RMSNorm, rotary: the module's torch reference;
- rejection sampling: the kernel's torch reference
  (``specula.runtime.kernels.rejection_sampler.rejection_sample_reference``, one request
  at a time on the host), each side doing the engine's verification work: the argmax of
  the raw logits and, for random requests, the processed probabilities and the seeded
  draws (``random_uniform``, ``random_exponential`` of the engine's sampler), so both
  sides see the same draws and must agree exactly;
- draft inputs: the module's reference, a host loop (what an implementation with
  ``.tolist()`` costs, synchronisation included).

For the memory-bound kernels it also reports achieved bandwidth and its fraction of the
measured device-to-device copy bandwidth. Results go to ``bench/results/kernels.json``
with the command, GPU, software versions and date.

Run on the GPU machine: ``python bench/kernels.py`` (about a minute). ``--dry-run`` runs
every case once at tiny shapes on the CPU in Triton's interpreter, checks the kernel
against the torch side, and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

DEFAULT_OUTPUT = HERE / "results" / "kernels.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on the CPU in Triton's interpreter; check results, write nothing",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="results JSON path")
    parser.add_argument(
        "--only", default="", help="comma-separated kernel names to run (default: all)"
    )
    return parser.parse_args(argv)


def _shapes(tiny: bool) -> dict:
    if tiny:
        return dict(
            heads=4, kv_heads=2, head_dim=16, block_size=4, hidden=64, vocab=300,
            decode=[(1, 40), (3, 20)], verify=[(2, 24)], tokens=[1, 7], spec_batches=[1, 3],
        )
    return dict(
        heads=32, kv_heads=8, head_dim=128, block_size=16, hidden=4096, vocab=128256,
        decode=[(1, 1024), (1, 4096), (1, 32768), (8, 1024), (8, 4096), (32, 1024),
                (32, 4096), (128, 1024), (128, 4096)],
        verify=[(1, 1024), (1, 4096), (32, 1024), (32, 4096)],
        tokens=[1, 32, 160, 2048],
        spec_batches=[1, 32, 128],
    )


def _torch_paged_attention(query, key_cache, value_cache, block_table, seq_lens, scale, q_len):
    import torch
    import torch.nn.functional as F

    num_reqs = block_table.shape[0]
    keys = key_cache[block_table.long()].flatten(1, 2)  # [num_reqs, ctx, kv_heads, head_dim]
    values = value_cache[block_table.long()].flatten(1, 2)
    q = query.view(num_reqs, q_len, *query.shape[1:]).transpose(1, 2)
    key_pos = torch.arange(keys.shape[1], device=query.device)
    query_pos = seq_lens[:, None] - q_len + torch.arange(q_len, device=query.device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [num_reqs, q_len, ctx]
    out = F.scaled_dot_product_attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None], scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(query.shape)


def _cases(device: str, tiny: bool) -> list[dict]:
    """Each case: name, params, the kernel call, the torch call, bytes the kernel must move
    (0 when not memory-bound), and ``verify``, which compares kernel and torch results on
    inputs of their own (in-place kernels and random draws would otherwise compare a
    tensor with itself or two different draws)."""
    import torch
    import triton

    from specula.runtime.engine.sampler import (
        STREAM_ACCEPT,
        STREAM_TARGET,
        SamplingMetadata,
        compute_probs,
        random_exponential,
        random_uniform,
    )
    from specula.runtime.engine.sampling_params import SamplingParams
    from specula.runtime.kernels import draft_inputs, layernorm, paged_attention, rotary
    from specula.runtime.kernels import rejection_sampler as rs
    from specula.runtime.kernels.reshape_and_cache import (
        reshape_and_cache,
        reshape_and_cache_reference,
    )
    from specula.runtime.models.layers import RotaryEmbedding

    s = _shapes(tiny)
    dtype = torch.float16 if tiny else torch.bfloat16  # the interpreter's bf16 dot is wrong
    elt = torch.finfo(dtype).bits // 8
    heads, kv_heads, head_dim, block_size = s["heads"], s["kv_heads"], s["head_dim"], s["block_size"]
    gen = torch.Generator(device).manual_seed(0)
    cases = []

    def close(fn_a, fn_b, atol):
        def verify():
            a, b = fn_a(), fn_b()
            for x, y in zip(_as_tuple(a), _as_tuple(b), strict=True):
                torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=0)

        return verify

    def exact(fn_a, fn_b):
        def verify():
            for x, y in zip(_as_tuple(fn_a()), _as_tuple(fn_b()), strict=True):
                assert torch.equal(x, y), "kernel and torch disagree"

        return verify

    for kind, q_len, grid in (("paged_decode", 1, s["decode"]), ("paged_verify", 5, s["verify"])):
        for num_reqs, ctx in grid:
            max_blocks = triton.cdiv(ctx, block_size)
            num_blocks = num_reqs * max_blocks
            shape = (num_blocks, block_size, kv_heads, head_dim)
            kc = torch.randn(shape, generator=gen, device=device).to(dtype)
            vc = torch.randn(shape, generator=gen, device=device).to(dtype)
            table = torch.randperm(num_blocks, generator=gen, device=device)
            table = table.view(num_reqs, max_blocks).to(torch.int32)
            lens = torch.full((num_reqs,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(num_reqs * q_len, heads, head_dim, generator=gen, device=device)
            q = q.to(dtype)
            scale = head_dim**-0.5
            args = (q, kc, vc, table, lens, scale, q_len)
            kernel = lambda a=args: paged_attention.paged_attention(*a)  # noqa: E731
            baseline = lambda a=args: _torch_paged_attention(*a)  # noqa: E731
            cases.append(dict(
                kernel=kind, params=dict(batch=num_reqs, context=ctx, q_len=q_len),
                triton=kernel, torch=baseline,
                bytes=2 * num_reqs * ctx * kv_heads * head_dim * elt + 2 * q.numel() * elt,
                verify=close(kernel, baseline, 3e-3 if tiny else 2e-2),
            ))

    rope = RotaryEmbedding(head_dim, 500000.0, None, torch.device(device))
    cos_sin = rotary.build_cos_sin_cache(rope.inv_freq, 8192)
    hidden = s["hidden"]
    for n in s["tokens"]:
        kc = torch.zeros(n + 64, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        key = torch.randn(n, kv_heads, head_dim, generator=gen, device=device).to(dtype)
        value = torch.randn_like(key)
        slots = torch.randperm(kc.shape[0] * block_size, generator=gen, device=device)[:n]

        def write(fn, caches, a=(key, value, slots)):
            fn(a[0], a[1], *caches, a[2])
            return caches

        torch_caches = (kc.clone(), vc.clone())
        cases.append(dict(
            kernel="reshape_and_cache", params=dict(tokens=n),
            triton=lambda w=write, c=(kc, vc): w(reshape_and_cache, c),
            torch=lambda w=write, c=torch_caches: w(reshape_and_cache_reference, c),
            bytes=4 * key.numel() * elt,
            verify=exact(lambda w=write, c=(kc, vc): w(reshape_and_cache, c),
                         lambda w=write, c=torch_caches: w(reshape_and_cache_reference, c)),
        ))
        x = torch.randn(n, hidden, generator=gen, device=device).to(dtype)
        res = torch.randn(n, hidden, generator=gen, device=device).to(dtype)
        w = torch.rand(hidden, generator=gen, device=device).to(dtype)
        kernel = lambda a=(x, res, w): layernorm.fused_add_rms_norm(*a, 1e-5)  # noqa: E731
        baseline = lambda a=(x, res, w): layernorm.rms_norm_reference(  # noqa: E731
            a[0], a[2], 1e-5, residual=a[1]
        )
        cases.append(dict(
            kernel="fused_add_rms_norm", params=dict(tokens=n, hidden=hidden),
            triton=kernel, torch=baseline, bytes=4 * x.numel() * elt,
            verify=close(kernel, baseline, 0.1),
        ))
        qk = torch.randn(n, heads + kv_heads, head_dim, generator=gen, device=device).to(dtype)
        pos = torch.randint(0, 8192, (n,), generator=gen, device=device)
        args = (pos, qk[:, :heads], qk[:, heads:], cos_sin)

        def rotate(a=args):
            rotary.rotary_embedding(*a)
            return a[1], a[2]

        def rotate_copy(a=args):
            fresh = a[1].clone(), a[2].clone()  # rotate once, leaving the inputs intact
            return rotate((a[0], *fresh, a[3]))

        baseline = lambda a=args: rotary.rotary_embedding_reference(*a)  # noqa: E731
        cases.append(dict(
            kernel="rotary_embedding", params=dict(tokens=n),
            triton=rotate, torch=baseline, bytes=2 * qk.numel() * elt,
            verify=close(rotate_copy, baseline, 0.05),
        ))

    vocab, k = s["vocab"], 4
    for num_reqs in s["spec_batches"]:
        logits = torch.randn(num_reqs, k + 1, vocab, generator=gen, device=device) * 3
        draft_probs = (logits[:, :k] + torch.randn(num_reqs, k, vocab, generator=gen,
                       device=device)).softmax(-1)
        drafts = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(num_reqs, k)
        cu = torch.arange(1, num_reqs + 1, dtype=torch.int32, device=device) * k
        # Draw keys as the engine's: the position of each request's first emittable token
        # (after a 128-token prompt); seeds are the request indices.
        keys = torch.full((num_reqs,), 128, dtype=torch.int64, device=device)
        for greedy in (True, False):
            params = [SamplingParams(temperature=0.0 if greedy else 1.0)] * num_reqs
            sampling = SamplingMetadata.from_params(params, list(range(num_reqs)), device)

            def verify_drafts(sampler, logits=logits, draft_probs=draft_probs, drafts=drafts,
                              cu=cu, keys=keys, sampling=sampling):
                # What LLMEngine._verify does around the sampler, ``sampler`` at the end.
                argmax = logits.argmax(-1).flatten()
                if sampling.all_greedy:
                    return sampler(drafts.flatten(), cu, argmax, k)
                return sampler(
                    drafts.flatten(), cu, argmax, k, is_greedy=sampling.is_greedy,
                    draft_probs=draft_probs.flatten(0, 1),
                    target_probs=compute_probs(logits, sampling).flatten(0, 1),
                    uniform_samples=random_uniform(
                        sampling.seeds, keys, STREAM_ACCEPT, k
                    ).view(-1),
                    exponential_noise=random_exponential(
                        sampling.seeds, keys, STREAM_TARGET, vocab
                    ),
                )

            kernel = lambda v=verify_drafts: v(rs.rejection_sample)  # noqa: E731
            baseline = lambda v=verify_drafts: v(rs.rejection_sample_reference)  # noqa: E731
            cases.append(dict(
                kernel="rejection_sample_" + ("greedy" if greedy else "random"),
                params=dict(batch=num_reqs, k=k, vocab=vocab),
                triton=kernel, torch=baseline, bytes=0, verify=exact(kernel, baseline),
            ))

        lens = torch.full((num_reqs,), k + 1, device=device)
        total = num_reqs * (k + 1)
        args = (
            torch.randint(0, vocab, (total,), generator=gen, device=device),
            torch.arange(total, device=device),
            torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32),
            cu,
            torch.randint(0, k + 1, (num_reqs,), generator=gen, device=device),
            torch.randint(0, vocab, (num_reqs,), generator=gen, device=device),
        )
        kernel = lambda a=args: draft_inputs.prepare_draft_inputs(*a)  # noqa: E731
        baseline = lambda a=args: draft_inputs.prepare_draft_inputs_reference(*a)  # noqa: E731
        cases.append(dict(
            kernel="prepare_draft_inputs", params=dict(batch=num_reqs, k=k),
            triton=kernel, torch=baseline, bytes=0, verify=exact(kernel, baseline),
        ))
    return cases


def _as_tuple(x):
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def _time_gpu(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # us


def _time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # Must precede the first triton import: @triton.jit reads it at definition time.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or use --dry-run", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)
    only = {name for name in args.only.split(",") if name}
    timer = _time_once if args.dry_run else _time_gpu

    copy_gbps = None
    if not args.dry_run:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_gbps = 2 * src.numel() / (_time_gpu(lambda: dst.copy_(src)) * 1e-6) / 1e9
        del src, dst

    rows = []
    for case in _cases(device, tiny=args.dry_run):
        if only and case["kernel"] not in only:
            continue
        case["verify"]()
        triton_us = timer(case["triton"])
        torch_us = timer(case["torch"])
        row = dict(kernel=case["kernel"], params=case["params"], triton_us=round(triton_us, 2),
                   torch_us=round(torch_us, 2), speedup=round(torch_us / triton_us, 3))
        if case["bytes"] and copy_gbps:
            gbps = case["bytes"] / (triton_us * 1e-6) / 1e9
            row["triton_gbps"] = round(gbps, 1)
            row["fraction_of_copy_bandwidth"] = round(gbps / copy_gbps, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)

    if args.dry_run:
        print(f"dry run: {len(rows)} cases ran and matched their torch side; nothing written")
        return 0
    result = dict(
        command=" ".join(["python bench/kernels.py", *(argv if argv is not None else sys.argv[1:])]),
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        dtype="bfloat16",
        copy_bandwidth_gbps=round(copy_gbps, 1),
        results=rows,
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
