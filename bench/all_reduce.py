"""The sum of a row-parallel layer's partials, its residual add and RMSNorm on two GPUs:
NCCL's all-reduce and the norm kernel, against the fused kernel over CUDA symmetric
memory (``specula.runtime.kernels.all_reduce``). Each is timed as 64 launches captured
in one CUDA graph (a decode step's count for a 32-layer model), per launch, at each row
count, on rank 0.

Run on a machine with two GPUs::

    PYTHONPATH=. python3 bench/all_reduce.py [--rows 1,32,160] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.engine import replay_ms

LAUNCHES = 64


def _time_graph(fn, reps: int = 50) -> float:
    """Microseconds a launch of ``fn`` takes, from a graph of :data:`LAUNCHES` of them."""
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fn()
    graph.replay()
    dist.barrier()
    return replay_ms(graph, reps) * 1000 / LAUNCHES


def _rank(rank: int, port: int, rows: list[int], hidden: int, queue) -> None:
    from specula.runtime.kernels.layernorm import fused_add_rms_norm
    from specula.runtime.worker.parallel import (
        all_reduce,
        destroy_parallel,
        fused_all_reduce_add_norm,
        init_parallel,
    )

    device = torch.device("cuda", rank)
    init_parallel(rank, 2, f"tcp://127.0.0.1:{port}", device)
    dtype = torch.bfloat16
    fused = fused_all_reduce_add_norm(hidden, dtype, device)
    weight = torch.ones(hidden, dtype=dtype, device=device)
    result = {}
    for n in rows:
        x = torch.randn(n, hidden, dtype=dtype, device=device)
        res = torch.randn(n, hidden, dtype=dtype, device=device)
        nccl = _time_graph(lambda x=x, res=res: fused_add_rms_norm(all_reduce(x.clone()), res, weight, 1e-5))
        copy = _time_graph(lambda x=x: x.clone())
        one = _time_graph(lambda x=x, res=res: fused(x, res, weight, 1e-5))
        result[f"rows{n}"] = {"nccl_and_norm_us": round(nccl - copy, 2),
                              "fused_us": round(one, 2)}
    if rank == 0:
        queue.put(result)
    destroy_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32,160")
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    rows = [int(r) for r in args.rows.split(",")]
    procs = [ctx.Process(target=_rank, args=(r, port, rows, args.hidden, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join()
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "hidden": args.hidden,
                      "launches_per_graph": LAUNCHES, "per_launch": result}, indent=1))


if __name__ == "__main__":
    main()
