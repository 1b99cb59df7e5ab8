"""Trace-driven simulator of the speculation tuner.

Replays the workload traces of ``bench/tuning/traces.py`` against the documented
ground-truth cost curves of ``bench/tuning/model.py``: two simulated pods expose
Prometheus text every 30 s interval, the tuner (``specula.tuning``, ``Auto`` mode,
default settings, then again with per-batch-size schedules) reads it and changes k or
the schedule; goodput of every interval is computed from the true model.  Compares the tuner with static k = 3 and with the oracle-best fixed k
of each trace (the best static k in hindsight), and writes
``bench/results/tuning.json`` and the "Tuning simulator" section of
``bench/RESULTS.md``.

Run: ``.venv/bin/python bench/tuning_sim.py`` (pure Python, seeded, two processes;
~1-2 minutes).
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import random
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from tuning.model import true_goodput  # noqa: E402
from tuning.pods import INTERVAL_S, MAX_K, SimPod, k_for_batch  # noqa: E402
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


Config = tuple[int, tuple[tuple[int, int, int], ...] | None]
"""(k, schedule): a single k when the schedule is ``None``."""


def run_tuner(trace: Trace, settings: TuningSettings) -> tuple[list[Config], list[dict]]:
    """Configuration in effect per interval and the applied changes."""
    intervals = expand(trace)
    pods = [SimPod("pod-0"), SimPod("pod-1")]
    rng = random.Random(f"pods:{trace.name}:{trace.seed}")
    state = TuningState.initial(INITIAL_K, settings)
    t0 = 1_700_000_000.0
    prev = {p.name: RuntimeMetrics.from_prometheus_text(p.exposition()) for p in pods}
    ks, changes = [], []
    for t, iv in enumerate(intervals):
        k, schedule = state.num_speculative_tokens, state.schedule
        ks.append((k, schedule))
        for p in pods:
            if trace.restart_pod_at == t and p.name == "pod-1":
                p.restart()
            p.run_interval(rng, trace.cost, iv.alphas, iv.batch_mix, k, schedule)
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
                 "from_config": config_key((k, schedule)),
                 "to_config": config_key((decision.state.num_speculative_tokens, decision.state.schedule)),
                 "reason": decision.reason,
                 "predicted_gain": round(decision.predicted_gain or 0.0, 4),
                 **({"schedule": decision.num_speculative_tokens_per_batch_size}
                    if decision.num_speculative_tokens_per_batch_size is not None else {})}
            )
    return ks, changes


def config_key(config: Config) -> str:
    k, schedule = config
    return str(k) if schedule is None else str([list(r) for r in schedule])


def count_flaps(changes: list[dict]) -> int:
    """A -> B -> A pairs of consecutive changes (configurations compared whole)."""
    return sum(
        1 for a, b in zip(changes, changes[1:], strict=False)
        if a["from_config"] == b["to_config"] and a["to_config"] == b["from_config"]
    )


def config_goodput(iv, cost, config: Config) -> float:
    """True goodput of an interval when each batch size drafts the config's k."""
    k, schedule = config
    return sum(
        true_goodput(iv.alphas, cost, ((b, f),), k if schedule is None else k_for_batch(schedule, b))
        for b, f in iv.batch_mix
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
    configs, changes = run_tuner(trace, settings)
    ks = [k for k, _ in configs]
    got = [config_goodput(iv, trace.cost, cfg) for iv, cfg in zip(intervals, configs, strict=True)]
    tuner = sum(got) / n
    dynamic = sum(max(row) for row in g) / n
    # Per-step oracle: every batch size of every interval at its own best k (what a
    # perfect per-batch-size schedule, re-decided every interval, would reach).
    per_step = sum(
        sum(max(true_goodput(iv.alphas, trace.cost, ((b, f),), k) for k in range(MAX_K + 1))
            for b, f in iv.batch_mix)
        for iv in intervals
    ) / n
    # Per-interval (time-weighted) view: every interval counts the same, whatever its load.
    rel_tuner = sum(x / max(row) for row, x in zip(g, got, strict=True)) / n
    rel_static = [sum(row[k] / max(row) for row in g) / n for k in range(MAX_K + 1)]

    converge = []
    start = 0
    for i, phase in enumerate(trace.phases):
        idx = list(range(start, start + phase.intervals))
        start += phase.intervals
        phase_mean = [sum(g[j][k] for j in idx) / len(idx) for k in range(MAX_K + 1)]
        best = max(range(MAX_K + 1), key=lambda k: phase_mean[k])
        near = {k for k in range(MAX_K + 1) if phase_mean[k] >= CONVERGED_FRACTION * phase_mean[best]}
        cache: dict[Config, bool] = {}

        def is_near(cfg: Config, idx=idx, best_g=phase_mean[best], cache=cache) -> bool:
            # A configuration is near-optimal when its goodput over the whole phase is
            # within 5 % of the phase's best fixed k (for a single k: k in `near`).
            if cfg not in cache:
                mean = sum(config_goodput(intervals[j], trace.cost, cfg) for j in idx) / len(idx)
                cache[cfg] = mean >= CONVERGED_FRACTION * best_g
            return cache[cfg]

        # Converged: from this interval on, the configuration in effect stays near-optimal.
        first = len(idx)
        for m in range(len(idx), 0, -1):
            if is_near(configs[idx[m - 1]]):
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
            "per_step_oracle": round(per_step, 1),
        },
        "oracle_fixed_k": oracle_k,
        "tuner_over_oracle_fixed": round(tuner / mean_k[oracle_k], 4),
        "tuner_over_static_k3": round(tuner / mean_k[3], 4),
        "tuner_over_no_speculation": round(tuner / mean_k[0], 4),
        "dynamic_oracle_over_oracle_fixed": round(dynamic / mean_k[oracle_k], 4),
        "per_step_oracle_over_oracle_fixed": round(per_step / mean_k[oracle_k], 4),
        "tuner_over_per_step_oracle": round(tuner / per_step, 4),
        "per_interval_view": {
            "tuner_fraction_of_dynamic_oracle": round(rel_tuner, 4),
            "best_static_fraction_of_dynamic_oracle": round(max(rel_static), 4),
            "best_static_k": max(range(MAX_K + 1), key=lambda k: rel_static[k]),
        },
        "flaps": count_flaps(changes),
        "changes": changes,
        "k_trajectory": ks,
        "schedules_in_effect": sorted({str([list(r) for r in sc]) for _, sc in configs if sc}),
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
        f"(pure Python, two processes, {report['runtime_s']:.0f} s wall, "
        f"{report['cpu_s']:.0f} s CPU on a shared machine)",
        "",
        "Trace-driven simulation of `specula.tuning` in `Auto` mode with default settings "
        "(30 s interval, 60 s cooldown, 5 % minimum gain at P >= 0.95, k in [0, 8], start "
        "at k = 3), and again with per-batch-size schedules (`apply_schedule=True`; the "
        "simulated pods execute them step by step, each batch size at its own k), two pods "
        "exposing Prometheus text, binomial acceptance noise and "
        "window-to-window acceptance jitter.  **Cost curves are documented roofline "
        "defaults (`bench/tuning/model.py`), not GPU measurements**: the GPU engine's "
        "measured step-time curves do not exist yet.",
        "",
        "| figure | value | goal | met |",
        "|---|---|---|---|",
    ]
    s2 = report["summary_schedule"]
    lines[-2:] = [
        "| figure | one k (default) | goal | met | schedule (`apply_schedule`) | met |",
        "|---|---|---|---|---|---|",
    ]
    for key, goal in GOALS.items():
        lines.append(
            f"| `{key}` | {s[key]} | {goal[0]} {goal[1]} | {'yes' if met(s[key], goal) else 'no'} "
            f"| {s2[key]} | {'yes' if met(s2[key], goal) else 'no'} |"
        )
    lines += [
        "",
        "| trace | kind | oracle k | tuner / oracle-fixed | tuner / static k=3 | "
        "tuner / no-spec | per-interval oracle / oracle-fixed | per-step oracle / oracle-fixed "
        "| flaps | changes | max converge | schedule: tuner / oracle-fixed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, r2 in zip(report["traces"], report["traces_schedule"], strict=True):
        lines.append(
            f"| {r['name']} | {r['kind']} | {r['oracle_fixed_k']} | {r['tuner_over_oracle_fixed']:.3f} "
            f"| {r['tuner_over_static_k3']:.3f} | {r['tuner_over_no_speculation']:.3f} "
            f"| {r['dynamic_oracle_over_oracle_fixed']:.3f} | {r['per_step_oracle_over_oracle_fixed']:.3f} "
            f"| {r['flaps']} | {len(r['changes'])} "
            f"| {max(c['intervals_to_converge'] for c in r['convergence'])} "
            f"| {r2['tuner_over_oracle_fixed']:.3f} |"
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
    variants = {
        "single_k": TuningSettings(mode="Auto"),
        "schedule": TuningSettings(mode="Auto", apply_schedule=True),
    }
    jobs = [(name, t) for name in variants for t in TRACES]
    # Traces are independent and seeded: two processes halve the wall time.
    with ProcessPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(evaluate, [t for _, t in jobs], [variants[n] for n, _ in jobs]))
    runs = {name: [r for (n, _), r in zip(jobs, done, strict=True) if n == name] for name in variants}
    results = runs["single_k"]
    summary = summarise(results)
    summary_sched = summarise(runs["schedule"])
    report = {
        "command": ".venv/bin/python bench/tuning_sim.py",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware(),
        "runtime_s": None,
        "cpu_s": None,
        "cost_curves": "documented roofline defaults (bench/tuning/model.py); GPU engine "
        "measurements do not exist yet",
        "settings": {k: v for k, v in asdict(variants["single_k"]).items() if not isinstance(v, dict)},
        "summary": summary,
        "goals": {k: {"op": op, "bound": b, "met": met(summary[k], (op, b))} for k, (op, b) in GOALS.items()},
        "summary_schedule": summary_sched,
        "goals_schedule": {
            k: {"op": op, "bound": b, "met": met(summary_sched[k], (op, b))}
            for k, (op, b) in GOALS.items()
        },
        "notes": build_notes(summary, results, summary_sched, runs["schedule"]),
        "traces": results,
        "traces_schedule": runs["schedule"],
    }
    report["runtime_s"] = round(time.monotonic() - started, 1)
    usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    report["cpu_s"] = round(sum(u.ru_utime + u.ru_stime for u in usage), 1)
    out = HERE / "results" / "tuning.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    write_markdown_section(HERE / "RESULTS.md", render_markdown(report))
    print(json.dumps({"single_k": summary, "schedule": summary_sched}, indent=1))
    for name, rs in runs.items():
        print(f"-- {name}")
        for r in rs:
            print(
                f"{r['name']:22s} {r['kind']:10s} oracle_k={r['oracle_fixed_k']} "
                f"tuner/oracle={r['tuner_over_oracle_fixed']:.3f} tuner/k3={r['tuner_over_static_k3']:.3f} "
                f"tuner/k0={r['tuner_over_no_speculation']:.3f} dyn/oracle={r['dynamic_oracle_over_oracle_fixed']:.3f} "
                f"step/oracle={r['per_step_oracle_over_oracle_fixed']:.3f} "
                f"flaps={r['flaps']} changes={len(r['changes'])} "
                f"conv={[c['intervals_to_converge'] for c in r['convergence']]}"
            )
    print(f"runtime {report['runtime_s']} s, cpu {report['cpu_s']} s")
    return 0


def build_notes(
    summary: dict, results: list[dict], summary_sched: dict, results_sched: list[dict]
) -> list[str]:
    """Reading of the figures, computed from them so they cannot go stale."""
    shifting = [r for r in results if r["kind"] == "shifting"]
    gains = ", ".join(f"{r['name']} {r['tuner_over_oracle_fixed'] - 1:+.1%}" for r in shifting)
    headroom = ", ".join(
        f"{r['name']} {r['dynamic_oracle_over_oracle_fixed'] - 1:+.1%}" for r in shifting
    )
    step_headroom = ", ".join(
        f"{r['name']} {r['per_step_oracle_over_oracle_fixed'] - 1:+.1%}" for r in shifting
    )
    captured = ", ".join(
        f"{r['name']} {(r['tuner_over_oracle_fixed'] - 1) / max(r['dynamic_oracle_over_oracle_fixed'] - 1, 1e-9):.0%}"
        for r in shifting
    )
    slow = [
        f"{r['name']} phase {c['phase']} ({c['profile']}, batch {c['batch_size']}): {c['intervals_to_converge']}"
        for r in results for c in r["convergence"] if c["intervals_to_converge"] > 10
    ]
    sched_vs = ", ".join(
        f"{a['name']} {b['tuner_over_oracle_fixed'] / a['tuner_over_oracle_fixed'] - 1:+.1%}"
        for a, b in zip(results, results_sched, strict=True) if a["kind"] == "shifting"
    )
    return [
        "Reading (headline figures: default settings, one k per decision):",
        "",
        f"- Tuner vs the best fixed k in hindsight on shifting traces: {gains}.",
        f"- Headroom: a per-interval oracle (best k re-chosen every interval with perfect "
        f"knowledge) beats the best fixed k by only {headroom}; a per-step oracle (best k "
        f"for every batch size of every interval, i.e. a perfect schedule) by {step_headroom}. "
        "Goodput (tokens/s) is dominated by the high-load phases and the best fixed k is the "
        "one that suits them, so on traces whose headroom is below 10 % no tuner, single-k "
        "or schedule, can reach `shifting_gain_over_best_static` >= 0.10.  Share of the "
        f"per-interval headroom the tuner captures: {captured}.",
        "- The step-time knee is fitted (`StepCostModel.fit`: the knee scale by profile least "
        "squares with a prior on log scale, the slopes by non-negative least squares).  Steps "
        "at a high batch are all compute-bound, which does not show the memory-bound floor, "
        "so the step time of a lower k there stays an extrapolation; right after the load "
        "moves to another bucket the tuner therefore probes a neighbouring k whose predicted "
        "goodput is within `explore_cost_margin` (this found k = 2 at batch 96 on "
        "`code-prose-load`, which the previous tuner never tried).",
        "- Convergence (intervals until the configuration stays within 5 % of the phase's "
        f"best fixed k): stationary {summary['intervals_to_converge_by_kind']['stationary']}, "
        f"shifting {summary['intervals_to_converge_by_kind']['shifting']}, k=0 traces "
        f"{summary['intervals_to_converge_by_kind']['k0']}.  Phases above 10: "
        + ("; ".join(slow) if slow else "none") + ".",
        f"- `flaps` counts A->B->A on stationary traces; over all traces it is "
        f"{summary['flaps_all_traces']} (probes that were reverted, moves back after a "
        "workload shift).",
        "- Per-batch-size schedules (`apply_schedule=True`, second table): "
        f"stationary {summary_sched['stationary_fraction_of_oracle']}, shifting "
        f"{summary_sched['shifting_gain_over_best_static']:+.4f}, k=0 loss "
        f"{summary_sched['k0_case_loss']}, flaps {summary_sched['flaps']}, convergence "
        f"{summary_sched['intervals_to_converge']}; against one k per decision: {sched_vs}. "
        "In these traces a window's batch sizes span only 0.75x-1.25x of the phase's, so a "
        "schedule can gain little within a window (per-step oracle close to per-interval "
        "oracle); its promise is to be right at once when the load moves, but the parts of "
        "the schedule for batch sizes not in use are model extrapolations (acceptance and "
        "step time), and when they are wrong the tuner must first see the new load, as with "
        "one k.  It stays opt-in (off by default) until it wins on measured curves.",
        "- Per-interval view (every interval weighs the same, whatever its load): "
        f"tuner vs best static {summary['shifting_gain_over_best_static_per_interval_view']:+.1%} "
        "(minimum over shifting traces).",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
