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

from specula.tuning.acceptance import AcceptancePrior, position_observations
from specula.tuning.cost import DEFAULT_COST_PARAMS, CostObservation, CostParams
from specula.tuning.goodput import bucket_representatives
from specula.tuning.metrics import RuntimeMetrics

TuningMode = Literal["Off", "Recommend", "Auto"]

STATE_VERSION = 1


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
    big_gain: float = 0.20
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
    revert_tolerance: float = 0.05
    """Revert a change whose measured goodput falls this fraction below what the old
    k would have given over the same window."""
    blacklist_s: float = 600.0
    """A reverted-from k is not chosen again for this long (prevents flapping)."""
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
        }

    @classmethod
    def from_dict(cls, data: dict) -> TuningState:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: unknown version or missing ``numSpeculativeTokens``.
        """
        if data.get("version", STATE_VERSION) != STATE_VERSION:
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
        )

    def cost_observations(self) -> list[CostObservation]:
        """The decayed step-time evidence as fit inputs."""
        return [
            CostObservation(bucket=b, batch_size=bs / c, k=k, mean_s=s / c, count=c)
            for b, k, c, s, bs in self.step_times
            if c > 0
        ]


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
    fc = 0.5 ** (dt / settings.cost_half_life_s)
    cap = settings.max_effective_trials
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
        trials[j] *= fa
        accepted[j] *= fa
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
