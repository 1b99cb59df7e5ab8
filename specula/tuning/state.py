"""Tuner settings and the state the tuner carries between decisions.

:class:`TuningState` is everything a decision depends on besides the current window:
the k in effect, cooldown start, pending verification of the last change, exploration
budget, temporary blacklist, and time-decayed evidence (per-position acceptance and
step times).  It round-trips through JSON (:meth:`TuningState.to_dict` /
:meth:`TuningState.from_dict`) so it can live on the resource (status or an annotation)
and an operator restart continues exactly where it stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from specula.tuning.acceptance import (
    AcceptancePrior,
    position_observations,
    position_observations_by_k,
)
from specula.tuning.cost import DEFAULT_COST_PARAMS, CostObservation, CostParams
from specula.tuning.goodput import bucket_representatives
from specula.tuning.metrics import RuntimeMetrics

TuningMode = Literal["Off", "Recommend", "Auto"]

STATE_VERSION = 2
"""Version 2 added ``schedule``, ``previousSchedule`` and ``probeFailures``; version-1
dicts are read with those absent (a single k, no failed probes)."""

Schedule = tuple[tuple[int, int, int], ...]
"""``num_speculative_tokens_per_batch_size`` as ``((start, end, k), ...)``."""


@dataclass(frozen=True)
class TuningSettings:
    """How the tuner decides.  Durations in seconds, gains as fractions."""

    mode: TuningMode = "Recommend"
    """``Off``: no recommendation; ``Recommend``: decide and report, never apply;
    ``Auto``: decisions are applied (and verified, reverted, explored)."""
    min_speculative_tokens: int = 0
    """Smallest k the tuner may choose; 0 allows turning speculation off."""
    max_speculative_tokens: int = 8
    """Largest k; must not exceed the k the pods were started with."""
    interval_s: float = 30.0
    """Time between decisions (one scrape window)."""
    cooldown_s: float = 60.0
    """No new change until this long after the last one: the window after a change
    verifies it, the next one gives a clean estimate at the new k."""
    min_gain: float = 0.05
    """Act only on a predicted goodput gain of at least this fraction (hysteresis)."""
    probability_threshold: float = 0.95
    """Required posterior probability that the gain exceeds ``min_gain``."""
    big_gain: float = 0.15
    """Predicted gain above which the tuner jumps straight to the best k instead of
    moving one step."""
    explore_budget: float = 0.1
    """Exploration moves earned per interval (0.1: at most one in ten intervals on
    average)."""
    explore_min_gain: float = 0.025
    """Predicted gain (posterior mean) that justifies exploring an unseen k; below
    ``min_gain`` because an exploration is checked by measurement and reverted."""
    explore_burst: float = 4.0
    """Cap of saved-up exploration moves, enough to climb a few steps in a row."""
    explore_cost_margin: float = 0.10
    """Right after the load moved to another batch bucket, a neighbouring k whose
    acceptance is known but whose step time there is unmeasured is probed once when its
    predicted goodput is within this fraction of the current k's: the step time of an
    unmeasured (bucket, k) is an extrapolation from the measured k of that bucket, whose
    error is the prior's error in the step-time ratio of neighbouring k.  On the H100 fit
    of the default prior that ratio is off by 1.6 % in the median, 6.9 % at the 90th
    percentile and over 10 % only in the two pairs around the off-trend B = 64, k = 6
    cell, of the 48 neighbouring pairs (``bench/results/tuning.json`` ``cost_fit.errors``).
    The margin halves with each probe in a row that did not pay (``probe_failures``, up
    to ``2 ** max_probe_backoff`` times): those probes showed the prediction right."""
    new_load_windows: float = 2.0
    """The load counts as new while the current k has at most this many windows' worth
    of steps measured on the window's main bucket."""
    revert_tolerance: float = 0.05
    """Revert a change whose measured goodput falls this fraction below what the old
    k would have given over the same window."""
    explore_revert_tolerance: float = 0.01
    """The same for a change made by exploration: it was taken without a probable gain
    (sometimes against a predicted loss, to measure a step time), so it is kept only if
    it does about as well as the k it left."""
    blacklist_s: float = 600.0
    """A reverted-from k is not chosen again for this long (prevents flapping).  After
    an exploration reverted while earlier ones had not paid either (``probe_failures``
    in a row), this doubles per failure, up to ``2 ** max_probe_backoff`` times: at a load
    where probes keep failing, the next one is a probable revert too.  A load move to
    another batch bucket drops the blacklist."""
    min_steps: float = 50.0
    """Fewer engine steps in a window: not enough data, no decision."""
    min_drafts: float = 100.0
    """Fewer drafts in a window (at k > 0): not enough data, no decision."""
    min_position_trials: float = 30.0
    """Effective trials for a position to count as observed."""
    acceptance_half_life_s: float = 120.0
    """Half-life of acceptance evidence; keeps positions no longer drafted informative
    for a few minutes, then lets them return to the prior."""
    cost_half_life_s: float = 1800.0
    """Half-life of step-time evidence; cost depends on the hardware, slowly on context."""
    max_effective_trials: float = 1000.0
    """Evidence cap per position (see ``AcceptanceEstimate.from_evidence``)."""
    shift_z: float = 4.0
    """A window whose observed rate differs from the posterior by more than this many
    standard deviations is a workload shift: evidence for positions the window did not
    observe is dropped, since it describes the old workload."""
    unobserved_half_life_s: float = 240.0
    """Half-life of the evidence of positions a window did not draft at all.  Nothing
    new is learnt about them, so this sets how soon the tuner probes them again (an
    ``Explore`` once the evidence has faded to the prior): longer than
    ``acceptance_half_life_s`` so that a k the tuner left because its deeper positions
    did not pay is not re-probed every few minutes."""
    max_probe_backoff: int = 3
    """After each probe that did not pay (reverted, or left again), the half-life above
    doubles, up to ``2 ** max_probe_backoff`` times, and so does the blacklist of the k
    it reverted (``blacklist_s``); a probe that paid resets it."""
    apply_schedule: bool = False
    """Decide a per-batch-size schedule (``num_speculative_tokens_per_batch_size``)
    instead of one k: each engine step then drafts the k of its batch size, so load
    changes are followed between decisions.  The caller must apply
    ``Decision.num_speculative_tokens_per_batch_size`` when it is set."""
    monte_carlo_samples: int = 256
    """Posterior draws for the probability of a gain."""
    seed: int = 0
    """Seed of the Monte Carlo draws (combined with the decision count)."""
    max_batch_size: int = 256
    """Largest batch size the recommended schedule covers."""
    prior: AcceptancePrior = field(default_factory=AcceptancePrior)
    cost_prior: CostParams = DEFAULT_COST_PARAMS
    """Step-time model used before (and shrunk towards while) data exists."""

    def __post_init__(self) -> None:
        if self.mode not in ("Off", "Recommend", "Auto"):
            raise ValueError(f"mode must be Off, Recommend or Auto, got {self.mode!r}")
        if not 0 <= self.min_speculative_tokens <= self.max_speculative_tokens:
            raise ValueError("need 0 <= min_speculative_tokens <= max_speculative_tokens")


@dataclass(frozen=True)
class TuningState:
    """What the tuner remembers; JSON-serialisable via :meth:`to_dict`."""

    num_speculative_tokens: int
    """k in effect on the pods."""
    last_decision_time: float | None = None
    """Unix seconds of the last :func:`decide` call."""
    last_change_time: float | None = None
    """Unix seconds of the last applied change: the cooldown start."""
    previous_num_speculative_tokens: int | None = None
    """k before the last change (the revert target)."""
    pending_verification: bool = False
    """The last change has not yet been checked against measured goodput."""
    pre_change_goodput: float | None = None
    """Measured tokens/s (per busy second) in the window before the last change."""
    pre_change_model_goodput: float | None = None
    """Model goodput of the previous k in that window (to adjust for load changes)."""
    explore_tokens: float = 1.0
    """Exploration moves available now."""
    blacklist: dict[int, float] = field(default_factory=dict)
    """k -> Unix seconds until which it is not chosen."""
    acceptance_trials: tuple[float, ...] = ()
    acceptance_accepted: tuple[float, ...] = ()
    """Time-decayed per-position evidence (effective trials, accepts)."""
    step_times: tuple[tuple[str, int, float, float, float], ...] = ()
    """Time-decayed step times: (batch bucket, k, count, seconds, count * batch size)."""
    evidence_time: float | None = None
    """Unix seconds the evidence was last decayed to."""
    decisions: int = 0
    """Number of decisions taken; seeds the Monte Carlo draws."""
    last_reason: str | None = None
    schedule: Schedule | None = None
    """Per-batch-size schedule in effect (``None``: the single k above is in effect;
    otherwise ``num_speculative_tokens`` is the schedule's k at the batch size the
    last window ran at)."""
    previous_schedule: Schedule | None = None
    """Schedule before the last change (the revert target; ``None``: a single k)."""
    probe_failures: int = 0
    """Probes in a row that did not pay (see ``TuningSettings.max_probe_backoff``)."""

    @classmethod
    def initial(cls, num_speculative_tokens: int, settings: TuningSettings) -> TuningState:
        """State of a resource the tuner has never seen (k from its spec)."""
        return cls(num_speculative_tokens=num_speculative_tokens, explore_tokens=settings.explore_burst)

    def to_dict(self) -> dict:
        """JSON-ready dict (camelCase keys, floats and lists only)."""
        return {
            "version": STATE_VERSION,
            "numSpeculativeTokens": self.num_speculative_tokens,
            "lastDecisionTime": self.last_decision_time,
            "lastChangeTime": self.last_change_time,
            "previousNumSpeculativeTokens": self.previous_num_speculative_tokens,
            "pendingVerification": self.pending_verification,
            "preChangeGoodput": self.pre_change_goodput,
            "preChangeModelGoodput": self.pre_change_model_goodput,
            "exploreTokens": self.explore_tokens,
            "blacklist": {str(k): t for k, t in sorted(self.blacklist.items())},
            "acceptanceTrials": list(self.acceptance_trials),
            "acceptanceAccepted": list(self.acceptance_accepted),
            "stepTimes": [list(row) for row in self.step_times],
            "evidenceTime": self.evidence_time,
            "decisions": self.decisions,
            "lastReason": self.last_reason,
            "schedule": _schedule_list(self.schedule),
            "previousSchedule": _schedule_list(self.previous_schedule),
            "probeFailures": self.probe_failures,
        }

    @classmethod
    def from_dict(cls, data: dict) -> TuningState:
        """Inverse of :meth:`to_dict`.

        Version-1 dicts (before schedules) are migrated: no schedule, no failed probes.

        Raises:
            ValueError: unknown version or missing ``numSpeculativeTokens``.
        """
        if data.get("version", STATE_VERSION) not in (1, STATE_VERSION):
            raise ValueError(f"unsupported tuning state version {data.get('version')}")
        if "numSpeculativeTokens" not in data:
            raise ValueError("tuning state lacks numSpeculativeTokens")
        return cls(
            num_speculative_tokens=int(data["numSpeculativeTokens"]),
            last_decision_time=data.get("lastDecisionTime"),
            last_change_time=data.get("lastChangeTime"),
            previous_num_speculative_tokens=data.get("previousNumSpeculativeTokens"),
            pending_verification=bool(data.get("pendingVerification", False)),
            pre_change_goodput=data.get("preChangeGoodput"),
            pre_change_model_goodput=data.get("preChangeModelGoodput"),
            explore_tokens=float(data.get("exploreTokens", 0.0)),
            blacklist={int(k): float(t) for k, t in data.get("blacklist", {}).items()},
            acceptance_trials=tuple(float(x) for x in data.get("acceptanceTrials", ())),
            acceptance_accepted=tuple(float(x) for x in data.get("acceptanceAccepted", ())),
            step_times=tuple(
                (str(b), int(k), float(c), float(s), float(bs))
                for b, k, c, s, bs in data.get("stepTimes", ())
            ),
            evidence_time=data.get("evidenceTime"),
            decisions=int(data.get("decisions", 0)),
            last_reason=data.get("lastReason"),
            schedule=_schedule_tuple(data.get("schedule")),
            previous_schedule=_schedule_tuple(data.get("previousSchedule")),
            probe_failures=int(data.get("probeFailures", 0)),
        )

    def cost_observations(self) -> list[CostObservation]:
        """The decayed step-time evidence as fit inputs."""
        return [
            CostObservation(bucket=b, batch_size=bs / c, k=k, mean_s=s / c, count=c)
            for b, k, c, s, bs in self.step_times
            if c > 0
        ]


def _schedule_list(schedule: Schedule | None) -> list[list[int]] | None:
    return None if schedule is None else [list(r) for r in schedule]


def _schedule_tuple(rows: list | None) -> Schedule | None:
    if rows is None:
        return None
    return tuple((int(a), int(b), int(k)) for a, b, k in rows)


def with_window(
    state: TuningState, window: RuntimeMetrics, settings: TuningSettings, now: float
) -> tuple[TuningState, bool]:
    """Decay the evidence to ``now`` and add one window observed at the state's k.

    Returns:
        the new state and whether a workload shift was detected (see
        ``TuningSettings.shift_z``).
    """
    dt = settings.interval_s if state.evidence_time is None else max(now - state.evidence_time, 0.0)
    fa = 0.5 ** (dt / settings.acceptance_half_life_s)
    backoff = 2 ** min(state.probe_failures, settings.max_probe_backoff)
    fu = 0.5 ** (dt / (settings.unobserved_half_life_s * backoff))
    fc = 0.5 ** (dt / settings.cost_half_life_s)
    cap = settings.max_effective_trials
    drafts_by_k = window.drafts_by_k()
    if drafts_by_k:
        obs = position_observations_by_k(window.counters, drafts_by_k)
    else:
        obs = position_observations(window.counters, state.num_speculative_tokens)
    n_pos = max(len(state.acceptance_trials), len(obs), settings.max_speculative_tokens)
    trials = [*state.acceptance_trials, *([0.0] * (n_pos - len(state.acceptance_trials)))]
    accepted = [*state.acceptance_accepted, *([0.0] * (n_pos - len(state.acceptance_accepted)))]

    shift = False
    for j, (n, s) in enumerate(obs):
        n_old = trials[j]
        if n < settings.min_position_trials or n_old < settings.min_position_trials:
            continue
        m_old = accepted[j] / n_old
        n_new = min(n, cap)
        var = max(m_old * (1 - m_old), 1e-4) * (1.0 / n_new + 1.0 / n_old)
        if abs(s / n - m_old) > settings.shift_z * math.sqrt(var):
            shift = True
    for j in range(n_pos):
        if shift and j >= len(obs):
            trials[j], accepted[j] = 0.0, 0.0
            continue
        f = fa if j < len(obs) else fu
        trials[j] *= f
        accepted[j] *= f
        if j < len(obs):
            trials[j] += obs[j][0]
            accepted[j] += obs[j][1]
        if trials[j] > cap:
            accepted[j] *= cap / trials[j]
            trials[j] = cap

    cost: dict[tuple[str, int], list[float]] = {
        (b, k): [c * fc, s * fc, bs * fc] for b, k, c, s, bs in state.step_times
    }
    steps = window.step_times.steps_by_bucket()
    if steps:
        rep = bucket_representatives(steps, window.mean_batch_size)
        for (bucket, k), series in window.step_times.series.items():
            row = cost.setdefault((bucket, k), [0.0, 0.0, 0.0])
            row[0] += series.count
            row[1] += series.sum_s
            row[2] += series.count * rep[bucket]
    step_rows = tuple(
        (b, k, c, s, bs)
        for (b, k), (c, s, bs) in sorted(cost.items(), key=lambda kv: (_bucket_lo(kv[0][0]), kv[0][1]))
        if c >= 1e-3
    )
    return (
        replace(
            state,
            acceptance_trials=tuple(trials),
            acceptance_accepted=tuple(accepted),
            step_times=step_rows,
            evidence_time=now,
        ),
        shift,
    )


def _bucket_lo(label: str) -> int:
    return int(label.split("-", 1)[0])
