"""The tuning part of ``specula demo``: the real tuner choosing k live as the workload switches
between Python code (what the demo models were trained on) and English prose (which they never
saw, so the draft agrees with the target less often).

One speculative server runs at a start k below its maximum.  Each interval sends a batch of
concurrent prompts of the phase's kind, scrapes ``/metrics``, hands the window's counter
increases to :func:`specula.tuning.decide` in ``Auto`` mode and applies its decision through
``PUT /v1/speculative_config``, as the operator does for a pod
(:mod:`specula.operator.tuning`).  k is never set here: every change is the policy's.

The tuner's durations are expressed in intervals: the clock passed to :func:`decide` advances
by ``interval_s`` per interval, so the decisions depend on the windows' counters and not on
how fast this machine happens to be.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from specula.demo.server_process import ServerProcess
from specula.operator.tuner import target_config
from specula.tuning import TuningSettings, TuningState, decide, window_delta

#: Plain English openings: far from the Python source the demo models were trained on.
PROSE_PROMPTS: tuple[str, ...] = (
    "The weather this morning was cold and grey, and the wind from the sea ",
    "To make a good loaf of bread at home, you first need to ",
    "In the summer of 1815 the armies of Europe gathered near a small town where ",
    "My grandmother kept a small garden behind the house, and every spring she ",
    "The old bridge over the river was built by farmers who ",
    "When the train finally arrived, the passengers were tired and hungry, so ",
    "Soup tastes better on the second day because the onions and the herbs ",
    "The history of the printing press begins with a goldsmith who ",
)

#: Nominal interval length in tuner seconds (the clock of :func:`decide`).
INTERVAL_S = 2.0
#: Concurrent batches sent per interval; two give the window enough engine steps to decide on.
BATCHES_PER_INTERVAL = 2
#: k the tuning server starts with, and the largest k its admin API accepts.
START_K = 3
MAX_K = 8


def phase_schedule(num_intervals: int) -> list[str]:
    """Workload of each interval: code, then prose, then code again, in three near-equal
    phases (the first phases get the extra intervals when ``num_intervals`` is not a multiple
    of 3).

    Raises:
        ValueError: ``num_intervals < 3`` (every phase needs at least one interval).
    """
    if num_intervals < 3:
        raise ValueError(f"need at least 3 tuning intervals (one per phase), got {num_intervals}")
    base, extra = divmod(num_intervals, 3)
    out: list[str] = []
    for i, workload in enumerate(("code", "prose", "code")):
        out.extend([workload] * (base + (1 if i < extra else 0)))
    return out


def demo_settings(interval_s: float = INTERVAL_S, max_k: int = MAX_K) -> TuningSettings:
    """Tuner settings for a demo of a few dozen intervals.

    The operator's defaults count in real seconds of 30 s intervals (half-lives of minutes,
    a ten-minute blacklist); here every duration is rescaled to intervals so the demo shows
    in about a minute what a pod would show in an hour: a cooldown of one interval,
    acceptance evidence halving every 3 intervals, a reverted k barred for 6.
    The data thresholds are lowered to what one interval of the demo produces (~50 engine
    steps, ~300 drafts at batch size 8).
    """
    return TuningSettings(
        mode="Auto",
        min_speculative_tokens=0,
        max_speculative_tokens=max_k,
        interval_s=interval_s,
        cooldown_s=interval_s,
        min_gain=0.03,
        acceptance_half_life_s=3 * interval_s,
        unobserved_half_life_s=6 * interval_s,
        blacklist_s=6 * interval_s,
        cost_half_life_s=60 * interval_s,
        min_steps=20.0,
        min_drafts=60.0,
    )


@dataclass
class IntervalRecord:
    """One tuning interval: what the window measured and what the tuner did."""

    interval: int
    """1-based."""
    workload: str
    """``code`` or ``prose``."""
    k_before: int
    """k in effect during the window."""
    k_after: int
    """k in effect after the decision (what the server reported after a PUT)."""
    applied: bool
    reason: str
    message: str
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    goodput_tokens_per_second: float | None
    """Window's generated tokens per second of engine-busy time."""
    predicted_gain: float | None
    wall_s: float
    """Wall time of the interval's batches, seconds."""
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


HEADER = (f"{'#':>3}  {'workload':<8} {'accept':>6} {'len':>5} {'goodput':>8}  "
          f"{'k':>7}  reason")


def format_interval(r: IntervalRecord) -> str:
    """One table row: interval, workload, window acceptance rate, mean acceptance length,
    goodput (tok/s), ``k before -> k after`` and the policy's reason."""
    move = f"{r.k_before} -> {r.k_after}" if r.k_after != r.k_before else f"{r.k_before}"
    return (f"{r.interval:>3}  {r.workload:<8} {_fmt(r.acceptance_rate, '.3f'):>6} "
            f"{_fmt(r.mean_acceptance_length, '.2f'):>5} "
            f"{_fmt(r.goodput_tokens_per_second, '.0f'):>8}  {move:>7}  {r.reason}")


def summarize_phases(records: list[IntervalRecord]) -> list[dict]:
    """Group consecutive intervals of one workload into phases.

    Acceptance is the ratio of sums over the phase (accepted / draft tokens; mean acceptance
    length 1 + accepted / drafts), never an average of per-interval ratios.

    Returns:
        one dict per phase: ``phase`` (1-based), ``workload``, ``intervals`` (first, last),
        ``k_start`` (in effect at its first window), ``k_end`` (after its last decision),
        ``k_visited`` (distinct k in effect, in order), ``changes``, ``acceptance_rate``,
        ``mean_acceptance_length``.
    """
    phases: list[list[IntervalRecord]] = []
    for r in records:
        if phases and phases[-1][0].workload == r.workload:
            phases[-1].append(r)
        else:
            phases.append([r])
    out = []
    for i, rows in enumerate(phases, 1):
        visited: list[int] = []
        for r in rows:
            for k in (r.k_before, r.k_after):
                if not visited or visited[-1] != k:
                    visited.append(k)
        drafts = sum(r.num_drafts for r in rows)
        draft_tokens = sum(r.num_draft_tokens for r in rows)
        accepted = sum(r.num_accepted_tokens for r in rows)
        out.append({
            "phase": i,
            "workload": rows[0].workload,
            "intervals": [rows[0].interval, rows[-1].interval],
            "k_start": rows[0].k_before,
            "k_end": rows[-1].k_after,
            "k_visited": visited,
            "changes": sum(1 for r in rows if r.k_after != r.k_before),
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        })
    return out


def format_phase(p: dict) -> str:
    path = " -> ".join(str(k) for k in p["k_visited"])
    first, last = p["intervals"]
    return (f"  phase {p['phase']} ({p['workload']}, intervals {first}-{last}): acceptance "
            f"{_fmt(p['acceptance_rate'], '.3f')}, mean acceptance length "
            f"{_fmt(p['mean_acceptance_length'], '.2f')}; k {path} (ends at {p['k_end']})")


def run_tuning(
    model_dir: Path, code_prompts: list[str], num_intervals: int, max_tokens: int, port: int = 0,
    speculator: tuple[str, Path] | None = None,
) -> dict:
    """Serve the demo target with ``speculator`` (method and checkpoint directory; default
    the draft model) at k = ``START_K`` (bound ``MAX_K``) and let the tuner drive k
    through the code -> prose -> code phases of :func:`phase_schedule`, printing one line per
    interval and a per-phase summary.

    Returns:
        JSON-ready results: settings, the per-interval trajectory and the phase summary.

    Raises:
        ServerError: the server failed to start.
        httpx.HTTPError: a request, scrape or PUT failed.
        ValueError: ``num_intervals < 3``.
    """
    schedule = phase_schedule(num_intervals)
    settings = demo_settings()
    method, checkpoint = speculator or ("draft_model", model_dir / "draft")
    serve_args = ["--model", f"file://{model_dir / 'target'}",
                  "--speculator-method", method, "--speculator-model", f"file://{checkpoint}",
                  "--num-speculative-tokens", str(START_K),
                  "--max-num-speculative-tokens", str(MAX_K)]
    prompts = {"code": list(code_prompts), "prose": list(PROSE_PROMPTS)}
    print(f"\ntuning: one speculative server (start k={START_K}, max k={MAX_K}); "
          f"{num_intervals} intervals of {BATCHES_PER_INTERVAL}x{len(code_prompts)} concurrent "
          f"prompts (max_tokens={max_tokens}), code -> prose -> code; the tuner "
          f"(Auto, min gain {settings.min_gain:.0%}, cooldown 1 interval) applies k via "
          f"PUT /v1/speculative_config")
    # One intra-op thread: the 2-core machine also runs the client threads.
    server = ServerProcess(serve_args, model_dir / "logs" / "serve-tuning.log", port,
                           env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    records: list[IntervalRecord] = []
    with server:
        client = server.client()
        try:
            name = client.model_name()
            for kind in ("code", "prose"):  # untimed: first calls pay one-time costs
                client.run_batch(name, prompts[kind], 8)
            k = int(client.speculative_config()["num_speculative_tokens"])
            state = TuningState.initial(k, settings)
            prev = {"demo": client.metrics()}
            print(f"\n{HEADER}")
            for i, workload in enumerate(schedule, 1):
                wall = sum(client.run_batch(name, prompts[workload], max_tokens).wall_s
                           for _ in range(BATCHES_PER_INTERVAL))
                cur = {"demo": client.metrics()}
                window = window_delta(prev, cur)
                prev = cur
                decision = decide(state, window, settings, now=i * settings.interval_s)
                k_after = k
                if decision.apply:
                    # The configuration the applied state is in: its schedule, else its k.
                    k_after = client.put_speculative_config(target_config(decision.state))
                state = decision.state
                c = window.counters
                rec = IntervalRecord(
                    interval=i, workload=workload, k_before=k, k_after=k_after,
                    applied=decision.apply, reason=decision.reason, message=decision.message,
                    acceptance_rate=decision.acceptance_rate,
                    mean_acceptance_length=decision.mean_acceptance_length,
                    goodput_tokens_per_second=decision.goodput_tokens_per_second,
                    predicted_gain=decision.predicted_gain, wall_s=wall,
                    num_drafts=c.num_drafts, num_draft_tokens=c.num_draft_tokens,
                    num_accepted_tokens=c.num_accepted_tokens,
                )
                records.append(rec)
                print(format_interval(rec), flush=True)
                k = k_after
        finally:
            client.close()
    phases = summarize_phases(records)
    print("\ntuning summary (k chosen by the tuner in each phase):")
    for p in phases:
        print(format_phase(p))
    # Acceptance rate falls with k, so code and prose are compared at equal k only.
    pairs = [(k, _pooled_acceptance(records, "code", k), _pooled_acceptance(records, "prose", k))
             for k in sorted({r.k_before for r in records})]
    pairs = [(k, c, p) for k, c, p in pairs if c is not None and p is not None]
    if pairs:
        lower = sum(1 for _, c, p in pairs if p < c)
        print("  acceptance rate at equal k, code vs prose: " + ", ".join(
            f"k={k} {c:.3f} vs {p:.3f}" for k, c, p in pairs)
            + f" (prose lower at {lower} of {len(pairs)} k)")
    return {
        "start_num_speculative_tokens": START_K,
        "max_num_speculative_tokens": MAX_K,
        "num_intervals": num_intervals,
        "batches_per_interval": BATCHES_PER_INTERVAL,
        "max_tokens": max_tokens,
        "settings": {key: value for key, value in asdict(settings).items()
                     if isinstance(value, (int, float, str, bool))},
        "prose_prompts": list(PROSE_PROMPTS),
        "trajectory": [asdict(r) for r in records],
        "phases": phases,
    }


def _pooled_acceptance(records: list[IntervalRecord], workload: str, k: int) -> float | None:
    rows = [r for r in records if r.workload == workload and r.k_before == k]
    draft_tokens = sum(r.num_draft_tokens for r in rows)
    return sum(r.num_accepted_tokens for r in rows) / draft_tokens if draft_tokens else None
