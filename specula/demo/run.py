"""``specula demo``: speculative decoding of real Python code on CPU, measured against the target
alone.

1. Train (first run) or load from the cache the demo target and draft
   (:func:`specula.demo.train.ensure_models`), and the EAGLE-3 and MTP heads on that target
   (:func:`specula.demo.train_heads.ensure_heads`). With ``--compare``, the rest is replaced by
   :mod:`specula.demo.compare`: every method served in turn and compared.
2. Serve the target with its EAGLE-3 head as the speculator (``eagle3``, ``k`` speculative
   tokens; one decoder layer on three of the target's hidden states, so a draft step costs a
   fraction of a target step, as in a deployment), send a batch of Python prompts
   concurrently at temperature 0, and read the speculative-decoding counters from
   ``/metrics``.
3. Serve the target alone, send the same prompts, and compare: greedy speculative decoding must
   reproduce the target's greedy output exactly (Leviathan et al., arXiv 2211.17192), so any
   difference is a bug and fails the demo.
4. Unless ``--no-tune``: serve the pair again at a start k below its maximum and let the tuner
   (:mod:`specula.tuning`) choose k, interval by interval, while the prompts switch from code
   to prose and back (:mod:`specula.demo.tuning`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from specula.demo.measure import BatchResult, per_position_acceptance
from specula.demo.prompts import PROMPTS
from specula.demo.server_process import ServerError, ServerProcess
from specula.tuning import SpecDecodeCounters

#: Timed batches per server; each sends every prompt once. More rounds average out the noise of
#: a shared CPU.
TIMED_ROUNDS = 3
#: Tokens per prompt of the untimed warm-up batch (first calls pay one-time costs).
WARMUP_TOKENS = 8
#: The demo's speculator: the EAGLE-3 head trained on the demo target.
DEMO_METHOD = "eagle3"
#: The demo's k: where the head's goodput peaks on a 2-core CPU (k = 2..4 are within a few %).
DEMO_NUM_SPECULATIVE_TOKENS = 3
#: k of ``--compare``: four positions of acceptance per method.
COMPARE_NUM_SPECULATIVE_TOKENS = 4


@dataclass
class ServedRun:
    """What one server produced for the prompt batch."""

    label: str
    model_name: str
    speculative_config: dict | None
    completions: list[str]
    completion_tokens: int
    wall_s: float
    counters: SpecDecodeCounters
    """Increase of the speculative-decoding counters over the timed rounds."""
    generation_tokens: float
    """Increase of ``generation_tokens`` over the timed rounds."""

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


def measure_servers(servers: dict[str, ServerProcess], max_tokens: int) -> dict[str, ServedRun]:
    """Warm up every server, then send the prompt batch to each in turn, ``TIMED_ROUNDS``
    times. Alternating between servers round by round spreads any drift in the machine's load
    (other processes on a shared CPU) evenly over both configurations."""
    prompts = list(PROMPTS)
    clients = {label: s.client() for label, s in servers.items()}
    try:
        names = {label: c.model_name() for label, c in clients.items()}
        configs: dict[str, dict | None] = {}
        for label, c in clients.items():
            try:
                configs[label] = c.speculative_config()
            except httpx.HTTPError:
                configs[label] = None
            c.run_batch(names[label], prompts, WARMUP_TOKENS)
        before = {label: c.metrics() for label, c in clients.items()}
        rounds: dict[str, list[BatchResult]] = {label: [] for label in clients}
        for _ in range(TIMED_ROUNDS):
            for label, c in clients.items():
                rounds[label].append(c.run_batch(names[label], prompts, max_tokens))
        after = {label: c.metrics() for label, c in clients.items()}
    finally:
        for c in clients.values():
            c.close()
    runs = {}
    for label, results in rounds.items():
        window = after[label].delta(before[label])
        texts = [c.text for c in results[0].completions]
        if any([c.text for c in r.completions] != texts for r in results[1:]):
            print(f"WARNING: {label}: greedy completions differ between identical rounds")
        runs[label] = ServedRun(
            label=label, model_name=names[label], speculative_config=configs[label],
            completions=texts, completion_tokens=sum(r.completion_tokens for r in results),
            wall_s=sum(r.wall_s for r in results), counters=window.counters,
            generation_tokens=window.generation_tokens,
        )
    return runs


def _print_training(model_dir: Path, report: dict, trained_now: bool) -> None:
    p, w = report["params"], report["wall_s"]
    rs = report["recipe"]
    t, d = rs["target"], rs["draft"]
    print(f"models: {model_dir}")
    print(f"  target: {t['num_hidden_layers']} layers x {t['hidden_size']} wide, "
          f"{p['target'] / 1e6:.2f}M params, val loss {report['target_val_loss']:.3f} nats/token")
    print(f"  draft:  {d['num_hidden_layers']} layer  x {d['hidden_size']} wide, "
          f"{p['draft'] / 1e6:.2f}M params, val loss {report['draft_val_loss']:.3f} nats/token")
    print(f"  vocab {report['vocab_size']} (byte-level BPE); teacher-forced greedy agreement "
          f"draft/target {report['greedy_agreement']:.3f}")
    state = "trained now" if trained_now else "cached"
    cpu = f", {report['cpu_s']:.0f} CPU-s" if "cpu_s" in report else ""
    print(f"  training wall time {w['total']:.0f}s on {report['num_threads']} threads{cpu} ({state})")


def _print_heads(heads_dir: Path, report: dict, trained_now: bool) -> None:
    tf, w = report["teacher_forced"], report["wall_s"]
    state = "trained now" if trained_now else "cached"
    print(f"heads: {heads_dir} ({state}, {w['total']:.0f}s on {report['device']})")
    for name, label in (("eagle3", "EAGLE-3"), ("mtp", "MTP")):
        accept = " ".join(f"{a:.2f}" for a in tf[name]["acceptance_per_position"])
        print(f"  {label + ':':<9}{report['params'][name] / 1e6:.2f}M trained params, "
              f"teacher-forced acceptance per position {accept}")


def _print_completions(run: ServedRun) -> None:
    print(f"\ncompletions (greedy, {run.label}):")
    for i, (prompt, text) in enumerate(zip(PROMPTS, run.completions, strict=True), 1):
        print(f"--- [{i}] prompt {prompt!r}")
        print(prompt + text)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def _summary(spec: ServedRun, base: ServedRun, k: int, identical: bool) -> dict:
    c = spec.counters
    return {
        "num_speculative_tokens": k,
        "num_prompts": len(PROMPTS),
        "timed_rounds": TIMED_ROUNDS,
        "tokens_per_s": {"speculative": spec.tokens_per_s, "target_only": base.tokens_per_s},
        "speedup": spec.tokens_per_s / base.tokens_per_s if base.tokens_per_s else None,
        "completion_tokens": {"speculative": spec.completion_tokens,
                              "target_only": base.completion_tokens},
        "wall_s": {"speculative": spec.wall_s, "target_only": base.wall_s},
        "num_drafts": c.num_drafts,
        "num_draft_tokens": c.num_draft_tokens,
        "num_accepted_tokens": c.num_accepted_tokens,
        "acceptance_rate": c.acceptance_rate,
        "mean_acceptance_length": c.mean_acceptance_length,
        "per_position_acceptance_rate": per_position_acceptance(c),
        "greedy_outputs_identical": identical,
    }


def _print_table(s: dict) -> None:
    k = s["num_speculative_tokens"]
    rows = [
        ("", f"speculative (k={k})", "target only"),
        ("tokens/s", _fmt(s["tokens_per_s"]["speculative"], ".1f"),
         _fmt(s["tokens_per_s"]["target_only"], ".1f")),
        ("completion tokens", str(s["completion_tokens"]["speculative"]),
         str(s["completion_tokens"]["target_only"])),
        ("wall time (s)", _fmt(s["wall_s"]["speculative"], ".2f"),
         _fmt(s["wall_s"]["target_only"], ".2f")),
        ("speedup", _fmt(s["speedup"], ".2f") + "x", ""),
        ("acceptance rate", _fmt(s["acceptance_rate"]), ""),
        ("mean acceptance length", _fmt(s["mean_acceptance_length"], ".2f"), ""),
        ("per-position acceptance",
         " ".join(_fmt(x, ".2f") for x in s["per_position_acceptance_rate"]) or "n/a", ""),
        ("greedy outputs identical", "yes" if s["greedy_outputs_identical"] else "NO", ""),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print("\nsummary")
    for a, b, c in rows:
        print(f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip())


def run_demo(args: argparse.Namespace) -> int:
    """Entry point of ``specula demo``.

    Returns:
        0 on success; 1 when a server fails or greedy outputs differ; 2 for bad arguments;
        130 on Ctrl-C. Servers started here are stopped on every path.
    """
    from specula.demo.train import COMPLETE_MARKER, ensure_models
    from specula.demo.train_heads import ensure_heads

    k, max_tokens = args.num_speculative_tokens, args.max_tokens
    if k is None:
        k = COMPARE_NUM_SPECULATIVE_TOKENS if getattr(args, "compare", False) \
            else DEMO_NUM_SPECULATIVE_TOKENS
    tune = getattr(args, "tune", True)
    tune_intervals = getattr(args, "tune_intervals", 18)
    if k < 1 or max_tokens < 1:
        print("specula demo: --num-speculative-tokens and --max-tokens must be >= 1")
        return 2
    if tune and tune_intervals < 3:
        print("specula demo: --tune-intervals must be >= 3 (one per phase)")
        return 2
    stage = ""  # prefixes error messages with the phase that failed
    try:
        model_dir, report, trained_now = ensure_models(retrain=args.retrain)
        _print_training(model_dir, report, trained_now)
        heads_dir, heads_report, heads_trained_now = ensure_heads(model_dir)
        _print_heads(heads_dir, heads_report, heads_trained_now)
        if getattr(args, "compare", False):
            from specula.demo.compare import compare_main

            stage = "compare: "
            return compare_main(model_dir, heads_dir, k, max_tokens, args.port)

        target_uri = f"file://{model_dir / 'target'}"
        head_uri = f"file://{heads_dir / DEMO_METHOD}"
        logs = model_dir / "logs"
        spec_args = ["--model", target_uri, "--speculator-method", DEMO_METHOD,
                     "--speculator-model", head_uri, "--num-speculative-tokens", str(k)]
        spec_port = args.port
        base_port = args.port + 1 if args.port else 0
        print(f"\nstarting two servers on the same target: one with its EAGLE-3 head as "
              f"speculator (k={k}), one without; logs in {logs}")
        spec_server = ServerProcess(spec_args, logs / "serve-speculative.log", spec_port)
        base_server = ServerProcess(["--model", target_uri], logs / "serve-target.log", base_port)
        with contextlib.ExitStack() as stack:
            # Start both before waiting so that their model loading overlaps.
            for server in (spec_server, base_server):
                stack.callback(server.stop)
                server.start()
            for server in (spec_server, base_server):
                server.wait_healthy()
            print(f"sending {len(PROMPTS)} prompts concurrently, greedy, max_tokens={max_tokens}, "
                  f"{TIMED_ROUNDS} timed rounds per server (alternating)")
            runs = measure_servers({"speculative": spec_server, "target only": base_server},
                                   max_tokens)
        spec, base = runs["speculative"], runs["target only"]

        _print_completions(spec)
        mismatches = [i for i, (a, b) in enumerate(zip(spec.completions, base.completions,
                                                       strict=True)) if a != b]
        summary = _summary(spec, base, k, identical=not mismatches)
        _print_table(summary)
        tuning = None
        if tune:
            from specula.demo.tuning import run_tuning

            stage = "tuning: "
            tuning = run_tuning(model_dir, list(PROMPTS), tune_intervals, max_tokens, args.port,
                                speculator=(DEMO_METHOD, heads_dir / DEMO_METHOD))
    except ServerError as exc:
        print(f"specula demo: {stage}{exc}")
        return 1
    except httpx.HTTPError as exc:
        print(f"specula demo: {stage}request failed: {exc}")
        return 1
    except KeyboardInterrupt:
        print("\nspecula demo: interrupted; servers stopped")
        return 130
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "command": {"num_speculative_tokens": k, "max_tokens": max_tokens, "tune": tune,
                    "tune_intervals": tune_intervals if tune else None},
        "model_dir": str(model_dir),
        "training": {key: report[key] for key in ("params", "target_val_loss", "draft_val_loss",
                                                   "greedy_agreement", "wall_s")},
        "summary": summary,
        "runs": [asdict(spec), asdict(base)],
        "prompts": list(PROMPTS),
        "tuning": tuning,
    }
    out = model_dir / "demo-results.json"
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nfigures written to {out} (training report: {model_dir / COMPLETE_MARKER})")
    if mismatches:
        for i in mismatches:
            print(f"\nMISMATCH on prompt {i + 1} {PROMPTS[i]!r}:\n"
                  f"  speculative: {spec.completions[i]!r}\n  target only: {base.completions[i]!r}")
        print(f"\nERROR: greedy speculative decoding differs from the target's greedy output on "
              f"{len(mismatches)}/{len(PROMPTS)} prompts")
        return 1
    return 0
