"""Trace-driven simulator of the speculation tuner.

Replays the workload traces of ``bench/tuning/traces.py`` against the documented
ground-truth cost curves of ``bench/tuning/model.py``: two simulated pods expose
Prometheus text every 30 s interval, the tuner (``specula.tuning``, ``Auto`` mode,
default settings) reads it and changes k; goodput of every interval is computed from
the true model.  Compares the tuner with static k = 3 and with the oracle-best fixed k
of each trace (the best static k in hindsight), and writes
``bench/results/tuning.json`` and the "Tuning simulator" section of
``bench/RESULTS.md``.

Run: ``.venv/bin/python bench/tuning_sim.py`` (pure Python, seeded; ~1 minute).
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from tuning.model import true_goodput  # noqa: E402
from tuning.pods import INTERVAL_S, MAX_K, SimPod  # noqa: E402
from tuning.traces import TRACES, Trace, expand  # noqa: E402

from specula.tuning import (  # noqa: E402
    RuntimeMetrics,
    TuningSettings,
    TuningState,
    decide,
    window_delta,
)

INITIAL_K = 3
CONVERGED_FRACTION = 0.95
GOALS = {
    "stationary_fraction_of_oracle": (">=", 0.95),
    "shifting_gain_over_best_static": (">=", 0.10),
    "k0_case_loss": ("<=", 0.02),
    "flaps": ("<=", 0),
    "intervals_to_converge": ("<=", 10),
}


def run_tuner(trace: Trace, settings: TuningSettings) -> tuple[list[int], list[dict]]:
    """k in effect per interval and the applied changes."""
    intervals = expand(trace)
    pods = [SimPod("pod-0"), SimPod("pod-1")]
    rng = random.Random(f"pods:{trace.name}:{trace.seed}")
    state = TuningState.initial(INITIAL_K, settings)
    t0 = 1_700_000_000.0
    prev = {p.name: RuntimeMetrics.from_prometheus_text(p.exposition()) for p in pods}
    ks, changes = [], []
    for t, iv in enumerate(intervals):
        k = state.num_speculative_tokens
        ks.append(k)
        for p in pods:
            if trace.restart_pod_at == t and p.name == "pod-1":
                p.restart()
            p.run_interval(rng, trace.cost, iv.alphas, iv.batch_mix, k)
        cur = {p.name: RuntimeMetrics.from_prometheus_text(p.exposition()) for p in pods}
        window = window_delta(prev, cur)
        prev = cur
        # A state that survives only as JSON, as on the resource.
        state = TuningState.from_dict(json.loads(json.dumps(state.to_dict())))
        decision = decide(state, window, settings, t0 + (t + 1) * INTERVAL_S)
        state = decision.state
        if decision.apply:
            changes.append(
                {"interval": t + 1, "from": k, "to": decision.num_speculative_tokens,
                 "reason": decision.reason,
                 "predicted_gain": round(decision.predicted_gain or 0.0, 4)}
            )
    return ks, changes


def count_flaps(changes: list[dict]) -> int:
    return sum(
        1 for a, b in zip(changes, changes[1:], strict=False)
        if a["from"] == b["to"] and a["to"] == b["from"]
    )


def evaluate(trace: Trace, settings: TuningSettings) -> dict:
    intervals = expand(trace)
    g = [
        [true_goodput(iv.alphas, trace.cost, iv.batch_mix, k) for k in range(MAX_K + 1)]
        for iv in intervals
    ]
    n = len(g)
    mean_k = [sum(row[k] for row in g) / n for k in range(MAX_K + 1)]
    oracle_k = max(range(MAX_K + 1), key=lambda k: mean_k[k])
    ks, changes = run_tuner(trace, settings)
    tuner = sum(row[k] for row, k in zip(g, ks, strict=True)) / n
    dynamic = sum(max(row) for row in g) / n
    # Per-interval (time-weighted) view: every interval counts the same, whatever its load.
    rel_tuner = sum(row[k] / max(row) for row, k in zip(g, ks, strict=True)) / n
    rel_static = [sum(row[k] / max(row) for row in g) / n for k in range(MAX_K + 1)]

    converge = []
    start = 0
    for i, phase in enumerate(trace.phases):
        idx = list(range(start, start + phase.intervals))
        start += phase.intervals
        phase_mean = [sum(g[j][k] for j in idx) / len(idx) for k in range(MAX_K + 1)]
        best = max(range(MAX_K + 1), key=lambda k: phase_mean[k])
        near = {k for k in range(MAX_K + 1) if phase_mean[k] >= CONVERGED_FRACTION * phase_mean[best]}
        # Converged: from this interval on, the k in effect stays among the k whose
        # phase-mean goodput is within 5 % of the phase's best.
        first = len(idx)
        for m in range(len(idx), 0, -1):
            if ks[idx[m - 1]] in near:
                first = m - 1
            else:
                break
        converge.append({"phase": i, "profile": phase.profile, "batch_size": phase.batch_size,
                         "best_k": best, "near_optimal_k": sorted(near),
                         "intervals_to_converge": first})
    return {
        "name": trace.name,
        "kind": trace.kind,
        "cost_curve": trace.cost_name,
        "phases": [asdict(p) for p in trace.phases],
        "intervals": n,
        "pod_restart_at": trace.restart_pod_at,
        "goodput_tokens_per_s": {
            "tuner": round(tuner, 1),
            "static_k3": round(mean_k[3], 1),
            "oracle_fixed": round(mean_k[oracle_k], 1),
            "no_speculation": round(mean_k[0], 1),
            "dynamic_oracle": round(dynamic, 1),
        },
        "oracle_fixed_k": oracle_k,
        "tuner_over_oracle_fixed": round(tuner / mean_k[oracle_k], 4),
        "tuner_over_static_k3": round(tuner / mean_k[3], 4),
        "tuner_over_no_speculation": round(tuner / mean_k[0], 4),
        "dynamic_oracle_over_oracle_fixed": round(dynamic / mean_k[oracle_k], 4),
        "per_interval_view": {
            "tuner_fraction_of_dynamic_oracle": round(rel_tuner, 4),
            "best_static_fraction_of_dynamic_oracle": round(max(rel_static), 4),
            "best_static_k": max(range(MAX_K + 1), key=lambda k: rel_static[k]),
        },
        "flaps": count_flaps(changes),
        "changes": changes,
        "k_trajectory": ks,
        "convergence": converge,
    }


def summarise(results: list[dict]) -> dict:
    def by(kind: str) -> list[dict]:
        return [r for r in results if r["kind"] == kind]

    return {
        "stationary_fraction_of_oracle": min(r["tuner_over_oracle_fixed"] for r in by("stationary")),
        "shifting_gain_over_best_static": round(
            min(r["tuner_over_oracle_fixed"] for r in by("shifting")) - 1.0, 4
        ),
        "k0_case_loss": round(max(1.0 - r["tuner_over_no_speculation"] for r in by("k0")), 4),
        "flaps": sum(r["flaps"] for r in by("stationary")),
        "intervals_to_converge": max(
            c["intervals_to_converge"] for r in results for c in r["convergence"]
        ),
        "intervals_to_converge_by_kind": {
            kind: max(c["intervals_to_converge"] for r in by(kind) for c in r["convergence"])
            for kind in ("stationary", "shifting", "k0")
        },
        "shifting_dynamic_oracle_headroom_min": round(
            min(r["dynamic_oracle_over_oracle_fixed"] for r in by("shifting")) - 1.0, 4
        ),
        "flaps_all_traces": sum(r["flaps"] for r in results),
        "shifting_gain_over_best_static_per_interval_view": round(
            min(
                r["per_interval_view"]["tuner_fraction_of_dynamic_oracle"]
                / r["per_interval_view"]["best_static_fraction_of_dynamic_oracle"]
                for r in by("shifting")
            ) - 1.0, 4
        ),
    }


def hardware() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "python": platform.python_version(), "platform": platform.platform()}


def met(value: float, goal: tuple[str, float]) -> bool:
    op, bound = goal
    return value >= bound if op == ">=" else value <= bound


def render_markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        "## Tuning simulator",
        "",
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}  ",
        f"Hardware: {report['hardware']['cpu']}, Python {report['hardware']['python']} "
        f"(pure Python, one core, {report['runtime_s']:.0f} s)",
        "",
        "Trace-driven simulation of `specula.tuning` in `Auto` mode with default settings "
        "(30 s interval, 60 s cooldown, 5 % minimum gain at P >= 0.95, k in [0, 8], start "
        "at k = 3), two pods exposing Prometheus text, binomial acceptance noise and "
        "window-to-window acceptance jitter.  **Cost curves are documented roofline "
        "defaults (`bench/tuning/model.py`), not GPU measurements**: the GPU engine's "
        "measured step-time curves do not exist yet.",
        "",
        "| figure | value | goal | met |",
        "|---|---|---|---|",
    ]
    for key, goal in GOALS.items():
        lines.append(
            f"| `{key}` | {s[key]} | {goal[0]} {goal[1]} | {'yes' if met(s[key], goal) else 'no'} |"
        )
    lines += [
        "",
        "| trace | kind | oracle k | tuner / oracle-fixed | tuner / static k=3 | "
        "tuner / no-spec | dynamic oracle / oracle-fixed | flaps | changes | max converge |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["traces"]:
        lines.append(
            f"| {r['name']} | {r['kind']} | {r['oracle_fixed_k']} | {r['tuner_over_oracle_fixed']:.3f} "
            f"| {r['tuner_over_static_k3']:.3f} | {r['tuner_over_no_speculation']:.3f} "
            f"| {r['dynamic_oracle_over_oracle_fixed']:.3f} | {r['flaps']} | {len(r['changes'])} "
            f"| {max(c['intervals_to_converge'] for c in r['convergence'])} |"
        )
    lines += ["", *report["notes"], ""]
    return "\n".join(lines)


def write_markdown_section(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    heading = "## Tuning simulator"
    if heading in text:
        before, rest = text.split(heading, 1)
        nxt = rest.find("\n## ")
        after = rest[nxt + 1 :] if nxt >= 0 else ""
        text = before + section + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def main() -> int:
    started = time.monotonic()
    settings = TuningSettings(mode="Auto")
    results = [evaluate(t, settings) for t in TRACES]
    summary = summarise(results)
    report = {
        "command": ".venv/bin/python bench/tuning_sim.py",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware(),
        "runtime_s": round(time.monotonic() - started, 1),
        "cost_curves": "documented roofline defaults (bench/tuning/model.py); GPU engine "
        "measurements do not exist yet",
        "settings": {k: v for k, v in asdict(settings).items() if not isinstance(v, dict)},
        "summary": summary,
        "goals": {k: {"op": op, "bound": b, "met": met(summary[k], (op, b))} for k, (op, b) in GOALS.items()},
        "notes": build_notes(summary, results),
        "traces": results,
    }
    out = HERE / "results" / "tuning.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    write_markdown_section(HERE / "RESULTS.md", render_markdown(report))
    print(json.dumps(summary, indent=1))
    for r in results:
        print(
            f"{r['name']:22s} {r['kind']:10s} oracle_k={r['oracle_fixed_k']} "
            f"tuner/oracle={r['tuner_over_oracle_fixed']:.3f} tuner/k3={r['tuner_over_static_k3']:.3f} "
            f"tuner/k0={r['tuner_over_no_speculation']:.3f} dyn/oracle={r['dynamic_oracle_over_oracle_fixed']:.3f} "
            f"flaps={r['flaps']} changes={len(r['changes'])} "
            f"conv={[c['intervals_to_converge'] for c in r['convergence']]}"
        )
    print(f"runtime {report['runtime_s']} s")
    return 0


def build_notes(summary: dict, results: list[dict]) -> list[str]:
    """Reading of the figures, computed from them so they cannot go stale."""
    shifting = [r for r in results if r["kind"] == "shifting"]
    gains = ", ".join(f"{r['name']} {r['tuner_over_oracle_fixed'] - 1:+.1%}" for r in shifting)
    headroom = ", ".join(
        f"{r['name']} {r['dynamic_oracle_over_oracle_fixed'] - 1:+.1%}" for r in shifting
    )
    return [
        "Reading:",
        "",
        f"- Tuner vs the best fixed k in hindsight on shifting traces: {gains}.",
        f"- Headroom: a per-interval oracle beats the best fixed k by only {headroom}. "
        "Goodput (tokens/s) is dominated by the high-load phases, and the best fixed k is "
        "the one that suits them, so on traces whose headroom is below 10 % no tuner can "
        "reach `shifting_gain_over_best_static` >= 0.10.",
        "- The largest remaining loss is the compute-bound knee of the step-time curve: after "
        "a switch from small batches to batch 96-128 the tuner moves down (e.g. k 7 -> 3) but "
        "the step time of the next-lower k at that load is an extrapolation from the default "
        "curve, which places the knee later than the simulated GPU, so k = 2 is not tried "
        "(see `code-prose-load`).  Measured GPU curves (or fitting the knee) should close it.",
        f"- Convergence (intervals until the k stays within 5 % of the phase's best fixed k): "
        f"stationary {summary['intervals_to_converge_by_kind']['stationary']}, shifting "
        f"{summary['intervals_to_converge_by_kind']['shifting']}, k=0 traces "
        f"{summary['intervals_to_converge_by_kind']['k0']}.  On k=0 traces the tuner probes "
        "k = 1 about every 30-40 intervals (when the stale acceptance evidence has decayed "
        "to the prior) so that it can leave k = 0 if the draft starts to land; these "
        "probes cost < 2 % in total and are the A->B->A pairs counted there.",
        f"- `flaps` counts A->B->A on stationary traces; over all traces it is "
        f"{summary['flaps_all_traces']} (exploration probes that were reverted, and moves "
        "back after a workload shift).",
        "- Per-interval view (every interval weighs the same, whatever its load): "
        f"tuner vs best static {summary['shifting_gain_over_best_static_per_interval_view']:+.1%} "
        "(minimum over shifting traces).",
    ]

if __name__ == "__main__":
    raise SystemExit(main())
