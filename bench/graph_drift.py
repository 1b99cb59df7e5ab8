"""How much the same CUDA graph's time moves within one call: the 8B-shaped target's batch-1
decode graph (``bench/engine_e2e.py``'s workload) replayed back to back, three times per line,
in engines built one after another in one process: a target-only engine fresh and after 30
steps, a ``draft_model`` engine fresh and after 30 steps, with its screen, its draft graphs
and its speculator freed in turn, a target-only engine built after 3 GB were allocated, and
one built last. Why ``bench/engine_e2e.py --paired`` times target-only runs between a method's.

    PYTHONPATH=. python3 bench/graph_drift.py
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_e2e import (  # noqa: E402
    ACCEPTANCE,
    LLAMA_1B,
    LLAMA_8B,
    make_engine,
    random_prompts,
    release_memory,
    runner_tokens_per_s,
    write_checkpoints,
)


def main() -> int:
    import torch

    from specula.runtime.engine.sampling_params import SamplingParams

    dirs = write_checkpoints(Path(tempfile.mkdtemp()), LLAMA_8B, LLAMA_1B)

    def graph_ms(engine, label: str) -> None:
        ms = [round(1e3 / runner_tokens_per_s(engine, 1, reps=100), 4) for _ in range(3)]
        print(f"{label}: {ms} ms a replay", flush=True)

    def steps(engine, n: int = 30) -> None:
        prompt = random_prompts(1, LLAMA_8B["vocab_size"], 128, seed=1)[0]
        engine.add_request("r", prompt, SamplingParams(max_tokens=1000, ignore_eos=True))
        for _ in range(n):
            engine.step()
        engine.abort_request("r")
        while engine.has_unfinished_requests():
            engine.step()

    engine = make_engine(dirs, None, 4, (1,), "cuda", ACCEPTANCE)
    graph_ms(engine, "target-only engine, fresh")
    steps(engine)
    graph_ms(engine, "after 30 steps")
    del engine
    release_memory()
    engine = make_engine(dirs, "draft_model", 4, (1,), "cuda", ACCEPTANCE)
    graph_ms(engine, "draft_model engine, fresh")
    steps(engine)
    graph_ms(engine, "after 30 steps")
    spec = engine.speculator
    spec.model.lm_head_screen = None
    release_memory()
    graph_ms(engine, "its screen freed")
    spec.decode_graphs.clear()
    spec.prefill_graphs.clear()
    release_memory()
    graph_ms(engine, "its draft graphs freed")
    engine.speculator = None
    del spec
    gc.collect()
    release_memory()
    graph_ms(engine, "its speculator dropped")
    del engine
    release_memory()
    ballast = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
    engine = make_engine(dirs, None, 4, (1,), "cuda", ACCEPTANCE)
    graph_ms(engine, "target-only engine, 3 GB allocated first")
    del engine, ballast
    release_memory()
    engine = make_engine(dirs, None, 4, (1,), "cuda", ACCEPTANCE)
    graph_ms(engine, "target-only engine, last")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
