"""A decode step's attention on one GPU, per layer: the rotary kernel (with the cache write)
then paged attention and its split merge, against paged attention that rotates and writes
the new keys itself (``new_kv``), at each split count.

Llama-3.1-8B heads (32 query, 8 KV, 128 wide), their TP=2 shard (16 and 4) and
Llama-3.2-1B's (32 and 8, 64 wide: the ``draft_model`` draft), every request at the same
context length, and at one query token attention alone (one split) with one or two KV heads
a program (``pack``). The first two take the engine's defaults: past four (request, KV head)
programs per SM (batch 128 of 8B heads) that is two KV heads a program, and ``new_kv`` runs the
rotary kernel first, so there both time the same path. Each timing replays a CUDA graph of at least 32
launches, one per layer, each over a cache of its own, and enough of them (>= 256 MiB of
caches in all) that a replay finds none in the 50 MiB L2, as a model's weights between
two layers evict it; it reports microseconds per launch.

    PYTHONPATH=. python3 bench/attention.py [--batches 1,32] [--context 256]
        [--splits 1,2,3,4,8,16] [--q-len 1] [--shapes 8B,8B/TP2,1B]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import replay_ms  # noqa: E402

LAYERS = 32
CACHE_BYTES = 256 << 20
"""Caches in one graph, in all: several times the L2 cache."""
HEADS = {"8B": (32, 8, 128), "8B/TP2": (16, 4, 128), "1B": (32, 8, 64)}
"""Query heads, KV heads and head size per shape."""
BLOCK_SIZE = 16


def time_layers(step, layers: int, reps: int = 20) -> float:
    """Microseconds per layer of ``step(layer)`` over ``layers`` layers in one graph."""
    import torch

    for layer in range(2):
        step(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            step(layer)
    graph.replay()
    return replay_ms(graph, reps) * 1e3 / layers


def case(name: str, batch: int, context: int, q_len: int, splits: list[int]) -> dict:
    """One shape's timings: ``{"rotary_then_attention": {splits: us}, "new_kv": ...}``."""
    import torch

    from specula.runtime.kernels.paged_attention import default_num_splits, paged_attention
    from specula.runtime.kernels.rotary import build_cos_sin_cache, rotary_embedding_and_cache

    heads, kv_heads, head_dim = HEADS[name]
    dev = torch.device("cuda")
    blocks_per_req = -(-(context + q_len) // BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    layer_bytes = 2 * num_blocks * BLOCK_SIZE * kv_heads * head_dim * 2
    layers = max(LAYERS, -(-CACHE_BYTES // layer_bytes))
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=dev,
                          dtype=torch.bfloat16) for _ in range(layers)]
    block_table = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context + q_len, dtype=torch.int32, device=dev)
    n = batch * q_len
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    positions = (context + torch.arange(q_len, device=dev)).repeat(batch)
    pos = positions.view(batch, q_len)
    slots = block_table.long().gather(1, pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE
    slot_mapping = slots.flatten().contiguous()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    cos_sin = build_cos_sin_cache(inv_freq, context + q_len + 1)
    scale = head_dim**-0.5

    def unfused(s):
        def step(layer):
            kc, vc = caches[layer]
            rotary_embedding_and_cache(positions, q, k, v, kc, vc, slot_mapping, cos_sin)
            paged_attention(q, kc, vc, block_table, seq_lens, scale, q_len, num_splits=s)
        return step

    def fused(s):
        def step(layer):
            kc, vc = caches[layer]
            paged_attention(q, kc, vc, block_table, seq_lens, scale, q_len, num_splits=s,
                            new_kv=(k, v, positions, slot_mapping, cos_sin))
        return step

    max_context = block_table.shape[1] * BLOCK_SIZE
    row_tiles = -(-(q_len * heads // kv_heads) // 64)
    default = default_num_splits(batch, kv_heads, row_tiles, max_context, dev)
    out: dict = {"default_splits": default, "programs": batch * kv_heads * row_tiles,
                 "layers": layers}
    def packed(p):  # attention alone, one split, ``p`` KV heads a program
        def step(layer):
            kc, vc = caches[layer]
            paged_attention(q, kc, vc, block_table, seq_lens, scale, 1, num_splits=1, pack=p)
        return step

    timings = [("rotary_then_attention", unfused, splits), ("new_kv", fused, splits)]
    timings += [("attention_by_pack", packed, (1, 2))] if q_len == 1 else []
    for label, make, values in timings:
        out[label] = {v: round(time_layers(make(v), layers), 2) for v in values}
    caches.clear()
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--splits", default="1,2,3,4,8,16")
    parser.add_argument("--shapes", default="8B,8B/TP2", help=f"comma-separated of {list(HEADS)}")
    args = parser.parse_args(argv)
    import torch

    splits = [int(s) for s in args.splits.split(",")]
    results = {"gpu": torch.cuda.get_device_name(), "context": args.context, "q_len": args.q_len}
    for name in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            r = results[f"{name} bs{batch}"] = case(name, batch, args.context, args.q_len, splits)
            print(f"{name:7s} bs{batch:<3d} programs {r['programs']:4d} default splits "
                  f"{r['default_splits']:2d} | rotary+attention "
                  + " ".join(f"{s}:{t}" for s, t in r["rotary_then_attention"].items())
                  + " | new_kv " + " ".join(f"{s}:{t}" for s, t in r["new_kv"].items())
                  + ("" if "attention_by_pack" not in r else " | attention alone by pack "
                     + " ".join(f"{p}:{t}" for p, t in r["attention_by_pack"].items())),
                  flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
