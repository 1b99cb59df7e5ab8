"""Step time T(B, k) of the engine on one GPU, for the tuner's cost model.

The engine as ``specula serve`` runs it (paged KV, CUDA graphs, asynchronous
scheduling) with a Llama-3.1-8B-shaped target in bfloat16 and a 1-layer EAGLE-3 head
(draft vocabulary 32000), random weights (``load_format: dummy``), synthetic acceptance
0.8 per position (vLLM's ``rejection_sample_method="synthetic"``).  For each batch size
B, B requests of 128 random prompt tokens are prefilled, then k is set through
``set_speculative_config`` (as ``PUT /v1/speculative_config`` does) to 0..8 in turn; at
each k the engine takes ``--warmup`` untimed and ``--steps`` timed decode steps.  Each
step is timed around ``LLMEngine.step()`` and recorded in the runtime's own step-time
histogram (:class:`specula.runtime.server.metrics.StepTimeStats`, labelled with the
step's batch and k, as the server's engine loop does), so the figures are those the
tuner scrapes as ``specula:step_duration_seconds``.

Run on the GPU machine::

    PYTHONPATH=. python3 bench/step_costs.py [--output bench/results/step_costs_h100.json]

``--dry-run`` runs tiny shapes on the CPU to check the plumbing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from engine_e2e import (  # noqa: E402 - after the path set-up
    LLAMA_8B,
    TINY,
    TINY_DRAFT,
    make_engine,
    random_prompts,
    write_checkpoints,
)

BATCHES = (1, 4, 16, 32, 64, 128)
KS = tuple(range(9))
PROMPT_LEN = 128
SYNTHETIC_ACCEPTANCE = 0.8


def measure(engine, batch: int, ks: tuple[int, ...], warmup: int, steps: int, vocab: int,
            seed: int, repeats: int = 1) -> dict:
    """Per k: the timed steps' durations (ms) at ``batch`` running requests.

    Each of ``repeats`` sweeps admits fresh requests and visits the k in its own
    shuffled order (the first in ascending order), so that a drift over the sweep
    (clocks, the KV context growing) does not fall on the same k every time."""
    import random

    from specula.runtime.engine.sampling_params import SamplingParams
    from specula.runtime.server.metrics import StepTimeStats

    stats = StepTimeStats()
    # Long enough that no request ends during one sweep (at most 9 tokens a step).
    max_tokens = engine.max_model_len - PROMPT_LEN
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    times: dict[int, list[float]] = {k: [] for k in ks}
    order = list(ks)
    for rep in range(repeats):
        tag = f"b{batch}-r{rep}"
        for i, prompt in enumerate(random_prompts(batch, vocab, PROMPT_LEN, seed + rep)):
            engine.add_request(f"{tag}-{i}", prompt, params)
        # Prefill (and the first decode rounds) until every request decodes in one step.
        while engine.last_step_num_reqs < batch:
            engine.step()
        for k in order:
            engine.set_speculative_config(num_speculative_tokens=k)
            for n in range(warmup + steps):
                t0 = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - t0
                assert engine.last_step_num_reqs == batch, "a request ended during the sweep"
                if n >= warmup:
                    stats.observe(batch, engine.last_step_num_speculative_tokens, elapsed)
                    times[k].append(elapsed * 1e3)
        for i in range(batch):
            engine.abort_request(f"{tag}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
        random.Random(seed * 1000 + rep).shuffle(order)
    out: dict[str, dict] = {}
    for k in ks:
        series = [s for (_, sk), s in stats.series.items() if sk == k]
        assert len(series) == 1 and series[0].count == steps * repeats
        out[str(k)] = {
            "mean_ms": round(series[0].sum_s / series[0].count * 1e3, 4),
            "median_ms": round(statistics.median(times[k]), 4),
            "min_ms": round(min(times[k]), 4),
            "max_ms": round(max(times[k]), 4),
            "steps": steps * repeats,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=HERE / "results" / "step_costs_h100.json")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per k and sweep")
    parser.add_argument("--repeats", type=int, default=1,
                        help="sweeps over k per batch size, each in a shuffled order")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    import torch

    device = "cpu" if args.dry_run else "cuda"
    batches = (1, 4) if args.dry_run else BATCHES
    target, draft = (TINY, TINY_DRAFT) if args.dry_run else (LLAMA_8B, LLAMA_8B)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_checkpoints(Path(tmp), target, draft)
        engine = make_engine(dirs, "eagle3", max(KS), batches, device, SYNTHETIC_ACCEPTANCE)
        startup_s = time.perf_counter() - t0
        table = {}
        for batch in batches:
            table[str(batch)] = measure(engine, batch, KS, args.warmup, args.steps,
                                        target["vocab_size"], seed=batch, repeats=args.repeats)
            row = " ".join(f"{table[str(batch)][str(k)]['median_ms']:7.2f}" for k in KS)
            print(f"B={batch:<4} median ms at k=0..8: {row}", flush=True)
    result = {
        "command": "python3 bench/step_costs.py" + " ".join(
            [""] + (["--dry-run"] if args.dry_run else [])
            + [f"--steps {args.steps}", f"--repeats {args.repeats}"]),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda},
        "model": "Llama-3.1-8B shape, bfloat16, random weights" if not args.dry_run
                 else "tiny Llama, float32",
        "speculator": "eagle3: 1 decoder layer, draft vocabulary 32000, aux layers (2, 16, 29)",
        "synthetic_acceptance_rate": SYNTHETIC_ACCEPTANCE,
        "prompt_len": PROMPT_LEN,
        "async_scheduling": bool(getattr(engine, "async_scheduling", False)),
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "repeats": args.repeats,
        "engine_startup_s": round(startup_s, 1),
        "step_ms": table,
        "note": "step_ms[B][k]: one engine step (verify k+1 tokens per request and draft k "
                "for the next step) with B requests decoding; k = 0 is target-only decoding",
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
