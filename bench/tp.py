"""Tensor parallelism on one host: decode speed at TP=2 against TP=1, and whether greedy
output at TP=2 equals TP=1 token for token.

Speed: the workload of ``bench/engine_e2e.py`` (Llama-3.1-8B shape, bfloat16, random
weights, 128-token prompts, 256 greedy tokens, decode tokens/s end to end), target only,
at each batch size, the mean of ``--repeats`` timed runs after a warm-up run; each
degree in a process of its own (``--worker``), so neither holds the other's memory.

Greedy identity: the demo models (``make demo``'s trained Llama target and its EAGLE-3
head; ``--demo-dir``), 16 prompts, 48 greedy tokens each, target alone and with EAGLE-3
(k = 4), in float32 and in bfloat16; each degree again in a process of its own.

Run on a machine with two GPUs::

    PYTHONPATH=. python3 bench/tp.py [--batches 1,32] [--repeats 3]
        [--demo-dir DIR] [--output bench/results/serving.json]

Writes ``tp2_vs_tp1`` (``bs1``, ``bs32``: TP=2 tokens/s / TP=1 tokens/s),
``tp2_greedy_identical`` and the rows behind them into the output under their keys.
``--dry-run`` runs tiny shapes on the CPU over gloo to check the plumbing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import engine_e2e  # noqa: E402

from bench.engine import recorded_command  # noqa: E402

DEFAULT_OUTPUT = HERE / "results" / "serving.json"
DEMO_TOKENS = 48


def build_bench(dirs: dict, batches: tuple[int, ...], tp: int, device):
    """The benchmark's target-only engine on ``device`` (rank ``device``'s shard)."""
    return engine_e2e.make_engine(
        dirs, None, 0, batches, str(device), None, tensor_parallel_size=tp
    )


def build_demo(target: str, head: str | None, dtype: str, tp: int, device):
    from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine

    spec = None if head is None else SpeculatorRuntimeConfig(
        method="eagle3", model=f"file://{head}", num_speculative_tokens=4
    )
    config = RuntimeConfig(model=f"file://{target}", dtype=dtype, max_num_seqs=16,
                           speculator=spec, tensor_parallel_size=tp,
                           gpu_memory_utilization=0.5)
    return LLMEngine.from_config(config, device)


def start(tp: int, device_type: str, build):
    """Rank 0's engine of ``build`` at degree ``tp`` (the others spawned)."""
    import torch

    from specula.runtime.engine.distributed import start_ranks

    if tp == 1:
        return build(torch.device("cuda:0" if device_type == "cuda" else "cpu"))
    return start_ranks(tp, device_type, build)


def worker(args) -> dict:
    """One degree's figures (``--worker``): speed rows and greedy outputs."""
    device_type = "cpu" if args.dry_run else "cuda"
    out: dict = {}
    if args.phase == "speed":
        target = engine_e2e.TINY if args.dry_run else engine_e2e.LLAMA_8B
        batches = tuple(int(b) for b in args.batches.split(","))
        max_tokens = 16 if args.dry_run else 256
        dirs = engine_e2e.write_checkpoints(Path(tempfile.mkdtemp()), target, engine_e2e.TINY_DRAFT)
        engine = start(args.tp, device_type, partial(build_bench, dirs, batches, args.tp))
        for b in batches:
            prompts = engine_e2e.random_prompts(b, target["vocab_size"], 128, seed=b)
            engine_e2e.timed_run(engine, prompts, max_tokens)  # warm-up
            runs = [engine_e2e.timed_run(engine, prompts, max_tokens) for _ in range(args.repeats)]
            out[f"bs{b}"] = engine_e2e.mean_of_runs(runs)
            print(f"tp{args.tp} bs{b}: {out[f'bs{b}']}", flush=True)
        engine.shutdown()
        return out
    from transformers import AutoTokenizer

    from specula.demo.prompts import PROMPTS
    from specula.runtime.engine.sampling_params import SamplingParams

    demo = Path(args.demo_dir)
    target = demo / "target"
    head = sorted(demo.glob("heads-*/eagle3"))[-1]
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS][:16]
    params = SamplingParams(max_tokens=DEMO_TOKENS, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        for name, h in (("target_only", None), ("eagle3", head)):
            engine = start(args.tp, device_type, partial(build_demo, str(target),
                                                         None if h is None else str(h), dtype, args.tp))
            out[f"{name}_{dtype}"] = engine.generate(prompts, params)
            engine.shutdown()
            del engine
            engine_e2e.release_memory()
    return out


def run_worker(phase: str, tp: int, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--worker", "--phase", phase, "--tp", str(tp),
               "--batches", args.batches, "--repeats", str(args.repeats),
               "--worker-output", f.name]
        if args.demo_dir:
            cmd += ["--demo-dir", args.demo_dir]
        if args.dry_run:
            cmd.append("--dry-run")
        subprocess.run(cmd, check=True)
        return json.loads(Path(f.name).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--demo-dir", default=None)
    parser.add_argument("--phases", default="speed,greedy")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="speed", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.worker_output.write_text(json.dumps(worker(args)))
        return 0
    import torch

    phases = args.phases.split(",")
    speed = {tp: run_worker("speed", tp, args) for tp in (1, 2)} if "speed" in phases else {}
    ratio = {b: round(speed[2][b]["decode_tokens_per_s"] / speed[1][b]["decode_tokens_per_s"], 3)
             for b in speed.get(1, {})}
    record: dict = {
        "command": recorded_command("bench/tp.py", argv or sys.argv[1:]),
        "gpu": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
        if torch.cuda.is_available() else platform.node(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    if speed:
        record["speed"] = {f"tp{tp}": rows for tp, rows in speed.items()}
    result = {"tp2_vs_tp1": ratio} if ratio else {}
    if args.demo_dir and "greedy" in phases:
        greedy = {tp: run_worker("greedy", tp, args) for tp in (1, 2)}
        same = {case: greedy[1][case] == greedy[2][case] for case in greedy[1]}
        tokens = {case: sum(a == b for x, y in zip(greedy[1][case], greedy[2][case], strict=True)
                            for a, b in zip(x, y, strict=True)) for case in greedy[1]}
        record["greedy"] = {"identical": same, "equal_tokens": tokens,
                            "tokens": len(greedy[1]["target_only_float32"]) * DEMO_TOKENS}
        result["tp2_greedy_identical"] = all(same[c] for c in same if c.endswith("float32"))
    print(json.dumps(result | record, indent=1))
    if not args.dry_run:
        data = json.loads(args.output.read_text()) if args.output.is_file() else {}
        data.update(result)
        data["tensor_parallel"] = record  # the last run's rows, under its own provenance
        args.output.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
