"""The decoder layers of one forward on one GPU, as the engine's CUDA graph runs them, under
one setting of the GEMV's weight prefetch (``specula.runtime.kernels.gemv``:
``PREFETCH_MAX_BYTES`` and ``PREFETCH_SHARE``, set here before capture).

A Llama-3.2-1B and a Llama-3.1-8B shape with random bfloat16 weights
(``bench/engine.py``'s ``build_random_model``) run through
:class:`~specula.runtime.worker.model_runner.ModelRunner` and
:class:`~specula.runtime.worker.cudagraph.CUDAGraphManager`: one request of 1 and of 5
query tokens (decode, verification at k = 4) and 32 requests of one, each at 300 tokens of
context. The forward's graph (embedding, layers, final norm) and the LM head's (the GEMV
with its argmax) are replayed 100 times a round, seven rounds; the medians are reported in
microseconds.

Each setting runs in a process of its own (a first script that captured several settings'
graphs in one process ended in an illegal memory access, not investigated)::

    PYTHONPATH=. python3 bench/layer_graphs.py --max-mb 0        # no prefetch
    PYTHONPATH=. python3 bench/layer_graphs.py --max-mb 6 --share 3

Prints one JSON object (``--output`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import build_random_model, recorded_command, replay_ms  # noqa: E402
from bench.engine_e2e import LLAMA_1B, LLAMA_8B  # noqa: E402

SHAPES = {"1B": LLAMA_1B, "8B": LLAMA_8B}
BATCHES = ((1, 1), (1, 5), (32, 1))
"""``(requests, query tokens each)``."""
CONTEXT = 300
BLOCK_SIZE = 16


def time_shape(name: str, rounds: int = 7) -> dict:
    """``{"r{requests}_q{tokens}": {"layers_us", "per_layer_us", "lm_head_us"}}`` of one shape."""
    import torch

    from specula.runtime.kernels.gemv import linear_argmax
    from specula.runtime.worker.cudagraph import CUDAGraphManager, capture_graph
    from specula.runtime.worker.model_runner import ModelRunner
    from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache, build_attention_metadata

    dev = torch.device("cuda")
    model = build_random_model(SHAPES[name], torch.bfloat16, dev)
    blocks = -(-CONTEXT // BLOCK_SIZE)
    spec = KVCacheSpec.from_model_config(model.config, torch.bfloat16, BLOCK_SIZE)
    cache = PagedKVCache(spec, max(r for r, _ in BATCHES) * blocks, dev)
    runner = ModelRunner(model, cache, 1024)
    out = {}
    for r, q in BATCHES:
        graphs = CUDAGraphManager(runner, max_num_reqs=r, uniform_query_lens=(q,), capture_sizes=[r])
        graphs.capture()
        tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(r)]
        metadata, positions = build_attention_metadata(
            tables, [CONTEXT] * r, [q] * r, BLOCK_SIZE, runner.max_blocks_per_req, dev)
        ids = torch.zeros(r * q, dtype=torch.int64, device=dev)
        d = graphs.run(ids, positions, metadata)[2]  # the batch into the graph's buffers
        assert d is not None, "the batch did not replay the captured graph"
        hidden = graphs.states[d].hidden_states
        head = capture_graph(lambda h=hidden: linear_argmax(h, model.lm_head_weight), graphs.pool)
        times: tuple[list, list] = ([], [])
        for _ in range(rounds):
            for graph, t in zip((graphs.graphs[d], head), times, strict=True):
                graph.replay()
                t.append(replay_ms(graph, 100) * 1e3)
        layers_us, head_us = (statistics.median(t) for t in times)
        out[f"r{r}_q{q}"] = {"layers_us": round(layers_us, 1),
                             "per_layer_us": round(layers_us / model.config.num_hidden_layers, 2),
                             "lm_head_us": round(head_us, 1)}
        print(name, r, q, out[f"r{r}_q{q}"], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-mb", type=float, default=6.0, help="PREFETCH_MAX_BYTES in MiB; 0: off")
    p.add_argument("--share", type=int, default=3, help="PREFETCH_SHARE (1: up to the own bytes)")
    p.add_argument("--shapes", default="1B,8B")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    if args.share < 1:
        p.error("--share must be >= 1")
    import torch

    from specula.runtime.kernels import gemv

    gemv.PREFETCH_MAX_BYTES = int(args.max_mb * (1 << 20))
    gemv.PREFETCH_SHARE = args.share
    result = {"gpu": torch.cuda.get_device_name(), "max_mb": args.max_mb, "share": args.share,
              "command": recorded_command("bench/layer_graphs.py", argv or sys.argv[1:])}
    for name in args.shapes.split(","):
        result[name] = time_shape(name)
    print(json.dumps(result, indent=1))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
