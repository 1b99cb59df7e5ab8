"""Step walls of two or more source trees side by side on one GPU: for each ``method:k``
and each tree, in turn and for ``--rounds`` rounds (alternating, so that drift of the
machine falls on every tree alike), a fresh process in that tree builds
``bench/engine_e2e.py``'s engine (8B-shaped target, random weights, synthetic acceptance
0.8, the tree's own code), admits ``--batch`` requests of 128 random prompt tokens, runs 12
warm-up steps, and times ``--steps`` engine steps with the host clock, synchronised at the
end. Step time, unlike decode tokens/s, does not depend on how many drafts a run's draws
accept, so a small change shows in a few steps. Prints milliseconds per step per tree
(each round's, and their mean) and the change of each tree's mean against the first tree's.

    PYTHONPATH=. python3 bench/ab_steps.py --trees base=DIR,new=. \\
        [--methods none:0,mtp:6,draft_model:4] [--rounds 2] [--steps 60] [--batch 1] \\
        [--output FILE] [--dry-run]

A tree is a directory holding ``specula`` and ``bench``, for example one commit's from
``git archive <commit> specula bench | tar -x -C DIR``. ``--dry-run`` runs the tiny
configurations on the CPU (a check of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

WARMUP_STEPS = 12


def worker(method: str, k: int, steps: int, batch: int, dry_run: bool) -> None:
    """In the tree of the current directory: time the steps, print ``{"ms_per_step": ...}``."""
    sys.path.insert(0, os.getcwd())
    import tempfile
    import time

    import torch

    from bench import engine_e2e as e2e
    from specula.runtime.engine.sampling_params import SamplingParams

    target, draft = (e2e.TINY, e2e.TINY_DRAFT) if dry_run else (e2e.LLAMA_8B, e2e.LLAMA_1B)
    dirs = e2e.write_checkpoints(Path(tempfile.mkdtemp()), target, draft)
    name = None if method == "none" else method
    batches = (batch, 2) if dry_run else (batch,)  # the CPU's cache is sized by the batches
    engine = e2e.make_engine(dirs, name, k, batches, "cpu" if dry_run else "cuda", e2e.ACCEPTANCE)
    sync = torch.cuda.synchronize if not dry_run else (lambda: None)
    params = SamplingParams(max_tokens=2 * (WARMUP_STEPS + steps) * (k + 1), ignore_eos=True)
    for i, prompt in enumerate(e2e.random_prompts(batch, target["vocab_size"], 128, seed=batch)):
        engine.add_request(f"ab-{i}", prompt, params)
    for _ in range(WARMUP_STEPS):
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    ms = (time.perf_counter() - start) / steps * 1e3
    import specula

    print(json.dumps({"ms_per_step": round(ms, 4), "specula": specula.__file__}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", required=True, help="name=DIR,... (the first is the baseline)")
    parser.add_argument("--methods", default="none:0,mtp:6,draft_model:4", help="method:k,...")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "K"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.steps, args.batch, args.dry_run)
        return 0
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    for name, tree in trees.items():
        if not (Path(tree) / "specula").is_dir() or not (Path(tree) / "bench").is_dir():
            parser.error(f"tree {name}={tree} holds no specula/ and bench/")
    methods = [(m, int(k)) for m, k in (item.split(":") for item in args.methods.split(","))]
    walls: dict[str, dict[str, list[float]]] = {f"{m}:{k}": {t: [] for t in trees} for m, k in methods}
    for _ in range(args.rounds):
        for method, k in methods:
            for name, tree in trees.items():
                tree = str(Path(tree).resolve())
                cmd = [sys.executable, str(Path(__file__).resolve()), "--trees", args.trees,
                       "--worker", method, str(k), "--steps", str(args.steps),
                       "--batch", str(args.batch)] + ["--dry-run"] * args.dry_run
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [tree, *filter(None, [os.environ.get("PYTHONPATH")])]))
                done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.stderr.write(done.stdout + done.stderr)
                    raise SystemExit(f"{name} {method}:{k} failed (exit {done.returncode})")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                assert Path(result["specula"]).resolve().is_relative_to(tree), (name, result)
                ms = result["ms_per_step"]
                walls[f"{method}:{k}"][name].append(ms)
                print(f"{method}:{k:<2d} {name:>10s}: {ms:8.3f} ms/step", flush=True)
    summary = {}
    base = next(iter(trees))
    for key, by_tree in walls.items():
        means = {t: sum(v) / len(v) for t, v in by_tree.items()}
        summary[key] = {t: {"runs_ms": v, "mean_ms": round(means[t], 4),
                            "change_vs_" + base: round(means[t] / means[base] - 1, 5)}
                        for t, v in by_tree.items()}
        print(f"{key}: " + ", ".join(f"{t} {means[t]:.3f} ms ({means[t] / means[base] - 1:+.2%})"
                                     for t in by_tree))
    if args.output:
        import torch

        sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # after any tree's
        from bench.engine import recorded_command

        # The trees by name (their directories are scratch paths of the machine).
        recorded = ["--trees", ",".join(trees), "--methods", args.methods, "--rounds",
                    str(args.rounds), "--steps", str(args.steps), "--batch", str(args.batch)]
        args.output.write_text(json.dumps({
            "command": recorded_command("bench/ab_steps.py", recorded + ["--dry-run"] * args.dry_run),
            "gpu": None if args.dry_run else torch.cuda.get_device_name(),
            "torch": torch.__version__, "steps": args.steps, "batch": args.batch,
            "walls": summary,
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
