"""The decision policy: when to change num_speculative_tokens, and to what.

Each interval :func:`decide` takes the window of counters (summed over pods), updates
the evidence, and:

1. **Verifies** the last change: the measured goodput of the window after it is compared
   with what the previous k would have given over the same window — the goodput
   measured before the change, scaled by the model's ratio of the previous k's goodput
   now and then (which removes load and acceptance drift common to both).  Worse by more
   than ``revert_tolerance`` -> ``Revert``, and the abandoned k is blacklisted for
   ``blacklist_s`` so the tuner cannot flap back to it.
2. Respects the **cooldown** after a change.
3. Moves to a k whose goodput beats the current one by ``min_gain`` with posterior
   probability >= ``probability_threshold`` (Monte Carlo over the per-position Beta
   posteriors, cost model held at its fit) — ``HigherGoodput``.  Only k whose positions
   are observed are candidates.  One step at a time unless the predicted gain of the best
   k is >= ``big_gain``.
4. Otherwise **explores** one step (k + 1 or k - 1) towards the k that the posterior
   mean model says beats the current one by ``explore_min_gain``, when that step has
   never been seen: its position was not drafted (acceptance is only the prior) or its
   step time was not measured at the current load (cost is extrapolated).  Paid from a
   token bucket refilled at ``explore_budget`` per interval — ``Explore``.

Goodput is SmartSpec's objective (arXiv 2406.14066); the acceptance model is
Leviathan et al.'s (arXiv 2211.17192) with per-position rates.  The state is returned
with the decision and must be stored (``TuningState.to_dict``); the function itself is
pure and deterministic given (state, window, settings, now).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from specula.tuning.acceptance import AcceptanceEstimate, expected_accepted_length
from specula.tuning.cost import StepCostModel
from specula.tuning.goodput import BatchDistribution, goodput, optimal_schedule
from specula.tuning.metrics import RuntimeMetrics
from specula.tuning.state import TuningSettings, TuningState, with_window


@dataclass(frozen=True)
class Decision:
    """Outcome of one tuning interval.

    ``num_speculative_tokens`` is the k to move to (``None``: keep the current one).
    ``apply`` is true only in ``Auto`` mode; in ``Recommend`` the k is a recommendation.
    """

    num_speculative_tokens: int | None
    apply: bool
    reason: str
    """``HigherGoodput``, ``Explore``, ``Revert``, ``Bounds``, ``Cooldown``,
    ``InsufficientData``, ``NoGain`` or ``Disabled``."""
    message: str
    current_num_speculative_tokens: int
    """k in effect during the window."""
    state: TuningState
    """State to store for the next decision."""
    predicted_gain: float | None = None
    """Predicted goodput of the new k over the current one, minus 1 (posterior mean)."""
    probability: float | None = None
    """Posterior probability that the gain exceeds ``min_gain``."""
    schedule: list[list[int]] | None = None
    """Recommended ``num_speculative_tokens_per_batch_size``, ``[[start, end, k], ...]``."""
    acceptance_rate: float | None = None
    """Window's accepted / draft tokens."""
    mean_acceptance_length: float | None = None
    """Window's ``1 + accepted / drafts``."""
    per_position_acceptance_rate: list[float] | None = None
    """Posterior mean conditional acceptance of positions 0 .. k-1."""
    goodput_tokens_per_second: float | None = None
    """Window's measured tokens per busy second."""
    predicted_goodput_tokens_per_second: float | None = None
    """Model goodput of the k chosen (or kept), over the window's batch sizes."""
    sampled_drafts: float = 0.0
    """Drafts in the window."""


class TuningPolicy:
    """:func:`decide` bound to settings: ``TuningPolicy(settings).decide(state, window, now)``."""

    def __init__(self, settings: TuningSettings) -> None:
        self.settings = settings

    def decide(self, state: TuningState, window: RuntimeMetrics, now: float) -> Decision:
        return decide(state, window, self.settings, now)


def decide(
    state: TuningState, window: RuntimeMetrics, settings: TuningSettings, now: float
) -> Decision:
    """One tuning decision.

    Args:
        state: the stored state (``TuningState.initial(k)`` the first time).
        window: counter increases since the previous call, summed over pods
            (:func:`specula.tuning.metrics.window_delta`).
        settings: see :class:`TuningSettings`.
        now: Unix seconds.

    Returns:
        the decision, whose ``state`` replaces ``state``.
    """
    s = settings
    k_cur = state.num_speculative_tokens
    auto = s.mode == "Auto"
    dt = 0.0 if state.last_decision_time is None else max(now - state.last_decision_time, 0.0)
    tokens = min(s.explore_burst, state.explore_tokens + s.explore_budget * dt / s.interval_s)
    state, shift = with_window(state, window, s, now)
    state = replace(
        state,
        explore_tokens=tokens,
        last_decision_time=now,
        decisions=state.decisions + 1,
        blacklist={k: t for k, t in state.blacklist.items() if t > now},
    )
    c = window.counters
    k_max = max(s.max_speculative_tokens, k_cur)
    estimate = AcceptanceEstimate.from_evidence(
        state.acceptance_trials, state.acceptance_accepted, k_max, s.prior, s.max_effective_trials
    )
    means = estimate.means
    measured = window.measured_goodput
    base = dict(
        current_num_speculative_tokens=k_cur,
        acceptance_rate=c.acceptance_rate,
        mean_acceptance_length=c.mean_acceptance_length,
        per_position_acceptance_rate=[round(m, 6) for m in means[:k_cur]],
        goodput_tokens_per_second=measured,
        sampled_drafts=c.num_drafts,
    )

    def out(reason: str, message: str, new_k: int | None = None, **kw) -> Decision:
        st = state
        apply = auto and new_k is not None and new_k != k_cur
        if apply:
            st = replace(
                st,
                num_speculative_tokens=new_k,
                previous_num_speculative_tokens=k_cur,
                last_change_time=now,
                pending_verification=reason != "Revert",
                pre_change_goodput=measured,
                pre_change_model_goodput=kw.pop("model_cur", None),
            )
        kw.pop("model_cur", None)
        st = replace(st, last_reason=reason)
        return Decision(
            num_speculative_tokens=new_k, apply=apply, reason=reason, message=message,
            state=st, **base, **kw,
        )

    if s.mode == "Off":
        return out("Disabled", "tuning mode is Off")
    if not s.min_speculative_tokens <= k_cur <= s.max_speculative_tokens:
        new_k = min(max(k_cur, s.min_speculative_tokens), s.max_speculative_tokens)
        return out("Bounds", f"k={k_cur} outside [{s.min_speculative_tokens}, {s.max_speculative_tokens}]", new_k)
    steps = window.step_times.total_count
    if steps < s.min_steps or measured is None or (k_cur > 0 and c.num_drafts < s.min_drafts):
        return out(
            "InsufficientData",
            f"window has {steps:.0f} steps and {c.num_drafts:.0f} drafts "
            f"(need {s.min_steps:.0f} and {s.min_drafts:.0f})",
        )

    cost = StepCostModel.fit(state.cost_observations(), prior=s.cost_prior)
    batches = BatchDistribution.from_bucket_steps(
        window.step_times.steps_by_bucket(), window.mean_batch_size
    )
    allowed = [
        k for k in range(s.min_speculative_tokens, s.max_speculative_tokens + 1)
        if k == k_cur or k not in state.blacklist
    ]
    depth = estimate.observed_depth(s.min_position_trials)
    known = [k for k in allowed if k <= max(k_cur, depth)]
    g_mean = {k: goodput(k, means, cost, batches) for k in allowed}
    schedule = optimal_schedule(means, cost, known, s.max_batch_size)

    # Revert check: is the new k worse than the old one would have been over this window?
    if auto and state.pending_verification and state.last_change_time is not None and (
        now - state.last_change_time >= 0.9 * s.interval_s
    ):
        prev_k = state.previous_num_speculative_tokens
        state = replace(state, pending_verification=False)
        if (
            prev_k is not None
            and state.pre_change_goodput
            and state.pre_change_model_goodput
            and s.min_speculative_tokens <= prev_k <= s.max_speculative_tokens
        ):
            g_prev_now = goodput(prev_k, means, cost, batches)
            expected = state.pre_change_goodput * g_prev_now / state.pre_change_model_goodput
            if measured < (1.0 - s.revert_tolerance) * expected:
                state = replace(
                    state, blacklist={**state.blacklist, k_cur: now + s.blacklist_s}
                )
                return out(
                    "Revert",
                    f"measured {measured:.0f} tok/s at k={k_cur} < {1 - s.revert_tolerance:.2f} x "
                    f"{expected:.0f} tok/s expected at k={prev_k}",
                    prev_k,
                    predicted_gain=expected / measured - 1.0,
                    schedule=schedule,
                    predicted_goodput_tokens_per_second=g_prev_now,
                )

    if auto and state.last_change_time is not None and now - state.last_change_time < s.cooldown_s:
        return out(
            "Cooldown",
            f"last change {now - state.last_change_time:.0f}s ago (cooldown {s.cooldown_s:.0f}s)",
            schedule=schedule,
            predicted_goodput_tokens_per_second=g_mean[k_cur],
        )

    # Probability of beating the current k by min_gain, over posterior draws.
    rng = random.Random(s.seed * 1_000_003 + state.decisions)
    tokens_per_step = sum(w * b for b, w in batches.points)
    seconds = {k: sum(w * cost.predict(b, k) for b, w in batches.points) for k in known}
    wins = dict.fromkeys(known, 0)
    for _ in range(s.monte_carlo_samples):
        alphas = estimate.sample(rng, max(known))
        g = {k: tokens_per_step * expected_accepted_length(alphas, k) / seconds[k] for k in known}
        bar = (1.0 + s.min_gain) * g[k_cur]
        for k in known:
            if g[k] > bar:
                wins[k] += 1
    prob = {k: wins[k] / s.monte_carlo_samples for k in known}
    winners = [k for k in known if k != k_cur and prob[k] >= s.probability_threshold]
    if winners:
        target = max(winners, key=lambda k: (g_mean[k], -k))
        gain = g_mean[target] / g_mean[k_cur] - 1.0
        if abs(target - k_cur) > 1 and gain < s.big_gain:
            target = k_cur + (1 if target > k_cur else -1)
            gain = g_mean[target] / g_mean[k_cur] - 1.0
        return out(
            "HigherGoodput",
            f"k {k_cur}->{target}: predicted {gain:+.1%} goodput "
            f"(P(gain > {s.min_gain:.0%}) = {prob.get(target, 0.0):.2f})",
            target,
            predicted_gain=gain,
            probability=prob.get(target),
            schedule=schedule,
            predicted_goodput_tokens_per_second=g_mean[target],
            model_cur=g_mean[k_cur],
        )

    # Explore: one step towards the best k under the posterior mean, when that step has
    # never been seen — its position undrafted (acceptance is the prior) or its step time
    # unmeasured at this load (cost is an extrapolation) — so no amount of waiting would
    # make the gain probable.
    main_bucket = max(window.step_times.steps_by_bucket().items(), key=lambda kv: kv[1])[0]
    measured_k = {
        k for b, k, c, _, _ in state.step_times if b == main_bucket and c >= s.min_steps / 5
    }
    for direction in (1, -1):
        nxt = k_cur + direction
        side = [k for k in allowed if (k - k_cur) * direction > 0]
        if not auto or nxt not in allowed or not side or state.explore_tokens < 1.0:
            continue
        unseen = nxt > depth or nxt not in measured_k
        target = max(side, key=lambda k: (g_mean[k], -k))
        if unseen and g_mean[target] >= (1.0 + s.explore_min_gain) * g_mean[k_cur]:
            state = replace(state, explore_tokens=state.explore_tokens - 1.0)
            what = f"position {k_cur} undrafted" if nxt > depth else f"k={nxt} unmeasured at batch {main_bucket}"
            return out(
                "Explore",
                f"k {k_cur}->{nxt}: {what}; the model predicts "
                f"{g_mean[target] / g_mean[k_cur] - 1.0:+.1%} at k={target}"
                + (" (after a workload shift)" if shift else ""),
                nxt,
                predicted_gain=g_mean[nxt] / g_mean[k_cur] - 1.0,
                schedule=schedule,
                predicted_goodput_tokens_per_second=g_mean[nxt],
                model_cur=g_mean[k_cur],
            )
    best = max(known, key=lambda k: (prob.get(k, 0.0), g_mean[k]))
    return out(
        "NoGain",
        f"no k beats k={k_cur} by {s.min_gain:.0%} with P >= {s.probability_threshold} "
        f"(best k={best}, P={prob.get(best, 0.0):.2f})",
        schedule=schedule,
        predicted_goodput_tokens_per_second=g_mean[k_cur],
    )
