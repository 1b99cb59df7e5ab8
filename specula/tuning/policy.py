"""The decision policy: when to change num_speculative_tokens, and to what.

Each interval :func:`decide` takes the window of counters (summed over pods), updates
the evidence, and:

1. **Verifies** the last change: the measured goodput of the window after it is compared
   with what the previous k would have given over the same window — the goodput
   measured before the change, scaled by the model's ratio of the previous k's goodput
   now and then (which removes load and acceptance drift common to both).  Worse by more
   than ``revert_tolerance`` -> ``Revert``, and the abandoned k is blacklisted for
   ``blacklist_s`` so the tuner cannot flap back to it (doubled per exploration in a row
   that did not pay, up to ``2 ** max_probe_backoff`` times).
2. Respects the **cooldown** after a change.
3. Moves to a k whose goodput beats the current one by ``min_gain`` with posterior
   probability >= ``probability_threshold`` (Monte Carlo over the per-position Beta
   posteriors, cost model held at its fit) — ``HigherGoodput``.  Only k whose positions
   are observed are candidates.  One step at a time unless the predicted gain of the best
   k is >= ``big_gain``.
4. Otherwise **explores** towards the k that the posterior mean model says beats the
   current one by ``explore_min_gain``, when the next k has never been seen: its
   position was not drafted (acceptance is only the prior) or its step time was not
   measured at the current load (cost is extrapolated).  Downwards one step; upwards
   into undrafted positions the step doubles k (1, 2, 4, 8; never past the model's
   best), since each verified probe observes all positions up to the new k.  Paid from
   a token bucket refilled at ``explore_budget`` per interval — ``Explore``.

A change that the next window **confirms** (measured goodput at least what the
previous configuration would have given) ends the cooldown at once and, if it was an
exploration, gives its token back: a confirmed improvement needs no second window of
caution, so a climb of several steps takes one interval per step, not two.  A confirmed
one-step ``HigherGoodput`` move **continues** in its direction while the next k beats the
current one at all with probability >= ``probability_threshold`` (the hysteresis was paid
by the decision to move; otherwise the walk stops one step short wherever the last step
gains less than ``min_gain``), and the next k that way, if its step time is unmeasured
at this load, may be probed as after a load move.  A load move to another batch bucket
drops the blacklist of reverted k (their verdicts were measured at the old load).

**Schedules** (``TuningSettings.apply_schedule``): the configuration is a per-batch-size
schedule ``[[start, end, k], ...]`` and each step drafts the k of its batch size.  The
candidate schedule takes, at every batch size, the k of best posterior-mean goodput
(``optimal_schedule``): among the k whose positions are observed for the batch sizes
the window ran at, among all allowed k elsewhere (those parts are not in use; when the
load moves there the next windows verify them as any other k).  At the window's batch
sizes it moves one step from the schedule in effect unless its gain is >= ``big_gain``;
it is applied under the same probability, ``min_gain``, cooldown, verification and
revert rules, all evaluated on the window's batch-size distribution.  Explorations set
the next k on the window's batch-size ranges.  ``num_speculative_tokens`` then names
the k at the batch size of most of the window's busy time (for history and status).

Goodput is SmartSpec's objective (arXiv 2406.14066), over the window's busy time by batch
size (each batch size weighted by the time its steps take at the candidate k, see
:mod:`specula.tuning.goodput`); the acceptance model is Leviathan et al.'s (arXiv
2211.17192) with per-position rates.  The state is returned with the decision and must
be stored (``TuningState.to_dict``); the function itself is
pure and deterministic given (state, window, settings, now).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from specula.tuning.acceptance import AcceptanceEstimate
from specula.tuning.cost import StepCostModel, bucket_range
from specula.tuning.goodput import (
    BatchDistribution,
    best_k,
    build_schedule,
    goodput,
    ks_goodput,
    optimal_schedule,
    schedule_breakpoints,
    schedule_k,
)
from specula.tuning.metrics import RuntimeMetrics
from specula.tuning.state import Schedule, TuningSettings, TuningState, with_window


@dataclass(frozen=True)
class Decision:
    """Outcome of one tuning interval.

    How a caller applies it (``apply`` is true only in ``Auto`` mode, and only when the
    configuration changes):

    - ``apply`` and ``num_speculative_tokens_per_batch_size`` is not ``None``: send
      ``{"num_speculative_tokens_per_batch_size": <it>}`` to every pod
      (``num_speculative_tokens`` is then the schedule's k at the batch size of most
      of the window's busy time, for history and status only);
    - ``apply`` and ``num_speculative_tokens_per_batch_size`` is ``None``: send
      ``{"num_speculative_tokens": num_speculative_tokens}``;
    - not ``apply``: send nothing.  ``num_speculative_tokens`` (and, with schedules,
      ``num_speculative_tokens_per_batch_size``) is a recommendation or ``None``.

    After a successful apply, ``state.schedule`` (or, when it is ``None``,
    ``state.num_speculative_tokens``) is the configuration the pods must run, e.g. to
    retry pods that refused.
    """

    num_speculative_tokens: int | None
    apply: bool
    reason: str
    """``HigherGoodput``, ``Explore``, ``Revert``, ``Bounds``, ``Cooldown``,
    ``InsufficientData``, ``NoGain`` or ``Disabled``."""
    message: str
    current_num_speculative_tokens: int
    """k in effect during the window (under a schedule: its k at the window's most
    frequent batch size)."""
    state: TuningState
    """State to store for the next decision."""
    predicted_gain: float | None = None
    """Predicted goodput of the new configuration over the current one, minus 1
    (posterior mean)."""
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
    """Model goodput of the configuration chosen (or kept), over the window's batch sizes."""
    sampled_drafts: float = 0.0
    """Drafts in the window."""
    num_speculative_tokens_per_batch_size: list[list[int]] | None = None
    """Schedule to move to (``apply_schedule`` settings only; see the class docstring)."""
    current_num_speculative_tokens_per_batch_size: list[list[int]] | None = None
    """Schedule in effect during the window (``None``: a single k)."""


class TuningPolicy:
    """:func:`decide` bound to settings: ``TuningPolicy(settings).decide(state, window, now)``."""

    def __init__(self, settings: TuningSettings) -> None:
        self.settings = settings

    def decide(self, state: TuningState, window: RuntimeMetrics, now: float) -> Decision:
        return decide(state, window, self.settings, now)


def _k_at(schedule: Schedule | None, k: int, batch_size: float) -> int:
    return k if schedule is None else schedule_k(schedule, max(1, round(batch_size)))


def _as_schedule(rows: list[list[int]]) -> Schedule:
    return tuple((int(a), int(b), int(k)) for a, b, k in rows)


def _as_list(schedule: Schedule | None) -> list[list[int]] | None:
    return None if schedule is None else [list(r) for r in schedule]


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
    auto = s.mode == "Auto"
    sched_cur = state.schedule
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
    steps_by_bucket = window.step_times.steps_by_bucket()
    batches = (
        BatchDistribution.from_buckets(
            steps_by_bucket, window.step_times.seconds_by_bucket(), window.mean_batch_size
        )
        if steps_by_bucket else None
    )
    dom = (
        max(range(len(batches.points)), key=lambda i: batches.points[i][1])
        if batches is not None else None
    )
    if sched_cur is not None and batches is not None and dom is not None:
        # Under a schedule the headline k is the one the window mostly ran at.
        state = replace(
            state,
            num_speculative_tokens=_k_at(sched_cur, state.num_speculative_tokens, batches.points[dom][0]),
        )
    k_cur = state.num_speculative_tokens
    k_max = max([s.max_speculative_tokens, k_cur, *(r[2] for r in sched_cur or ())])
    estimate = AcceptanceEstimate.from_evidence(
        state.acceptance_trials, state.acceptance_accepted, k_max, s.prior, s.max_effective_trials
    )
    means = estimate.means
    measured = window.measured_goodput
    c = window.counters
    shown = max([k_cur, *(r[2] for r in sched_cur or ())])
    base = dict(
        current_num_speculative_tokens=k_cur,
        acceptance_rate=c.acceptance_rate,
        mean_acceptance_length=c.mean_acceptance_length,
        per_position_acceptance_rate=[round(m, 6) for m in means[:shown]],
        goodput_tokens_per_second=measured,
        sampled_drafts=c.num_drafts,
        current_num_speculative_tokens_per_batch_size=_as_list(sched_cur),
    )

    def out(
        reason: str,
        message: str,
        new_k: int | None = None,
        new_sched: Schedule | None = None,
        **kw,
    ) -> Decision:
        st = state
        changed = new_k is not None and (new_k != k_cur or new_sched != sched_cur)
        apply = auto and changed
        model_cur = kw.pop("model_cur", None)
        if apply:
            st = replace(
                st,
                num_speculative_tokens=new_k,
                schedule=new_sched,
                previous_num_speculative_tokens=k_cur,
                previous_schedule=sched_cur,
                last_change_time=now,
                pending_verification=reason != "Revert",
                pre_change_goodput=measured,
                pre_change_model_goodput=model_cur,
            )
        st = replace(st, last_reason=reason)
        return Decision(
            num_speculative_tokens=new_k, apply=apply, reason=reason, message=message,
            state=st, num_speculative_tokens_per_batch_size=_as_list(new_sched), **base, **kw,
        )

    if s.mode == "Off":
        return out("Disabled", "tuning mode is Off")
    lo_k, hi_k = s.min_speculative_tokens, s.max_speculative_tokens
    in_effect = {k_cur, *(r[2] for r in sched_cur or ())}
    if not all(lo_k <= k <= hi_k for k in in_effect):
        clamp = lambda k: min(max(k, lo_k), hi_k)  # noqa: E731
        new_sched = None if sched_cur is None else tuple((a, b, clamp(k)) for a, b, k in sched_cur)
        return out("Bounds", f"k={sorted(in_effect)} outside [{lo_k}, {hi_k}]", clamp(k_cur), new_sched)
    steps = window.step_times.total_count
    if (
        batches is None or dom is None or steps < s.min_steps or measured is None
        or (max(in_effect) > 0 and c.num_drafts < s.min_drafts and k_cur > 0)
    ):
        return out(
            "InsufficientData",
            f"window has {steps:.0f} steps and {c.num_drafts:.0f} drafts "
            f"(need {s.min_steps:.0f} and {s.min_drafts:.0f})",
        )

    # The load has just moved to another batch bucket (evidence from buckets this window
    # did not run in, few windows at the current k on this one): the verdicts of reverted
    # k were measured at the old load, so they are dropped.
    main_bucket = max(steps_by_bucket.items(), key=lambda kv: kv[1])[0]
    here = sum(n for b, k, n, _, _ in state.step_times if b == main_bucket and k == k_cur)
    moved = any(b not in steps_by_bucket and n >= s.min_steps for b, _, n, _, _ in state.step_times)
    new_load = moved and here <= s.new_load_windows * steps_by_bucket[main_bucket]
    if new_load and state.blacklist:
        state = replace(state, blacklist={})

    cost = StepCostModel.fit(state.cost_observations(), prior=s.cost_prior)
    points = batches.points
    allowed = [k for k in range(lo_k, hi_k + 1) if k == k_cur or k not in state.blacklist]
    depth = estimate.observed_depth(s.min_position_trials)
    known = [k for k in allowed if k <= max(k_cur, depth)]
    g_mean = {k: goodput(k, means, cost, batches) for k in allowed}
    cur_ks = tuple(_k_at(sched_cur, k_cur, b) for b, _ in points)
    g_cur = ks_goodput(cur_ks, means, cost, batches)

    # The window's batch-size ranges (the runtime's buckets it ran in).
    ranges = [bucket_range(b) for b, n in steps_by_bucket.items() if n > 0]

    def in_window(b: int) -> bool:
        return any(lo <= b <= hi for lo, hi in ranges)

    breaks = sorted({*schedule_breakpoints(s.max_batch_size), *(x for lo, hi in ranges for x in (lo, hi + 1))})
    best_cache: dict[tuple[int, bool], int] = {}

    def best_at(b: int) -> int:
        key = (b, in_window(b))
        if key not in best_cache:
            cands = known if key[1] else allowed
            best_cache[key] = best_k(means, cost, BatchDistribution.single(b), cands)[0]
        return best_cache[key]

    if s.apply_schedule:
        sched_best = _as_schedule(build_schedule(best_at, s.max_batch_size, breaks))
        recommended = _as_list(sched_best)
    else:
        sched_best = None
        recommended = optimal_schedule(means, cost, known, s.max_batch_size)

    # Revert check: is the new configuration worse than the old one would have been
    # over this window?
    confirmed = False
    if auto and state.pending_verification and state.last_change_time is not None and (
        now - state.last_change_time >= 0.9 * s.interval_s
    ):
        prev_k = state.previous_num_speculative_tokens
        prev_sched = state.previous_schedule
        state = replace(state, pending_verification=False)
        explored = state.last_reason == "Explore"
        if (
            prev_k is not None
            and state.pre_change_goodput
            and state.pre_change_model_goodput
            and all(lo_k <= k <= hi_k for k in {prev_k, *(r[2] for r in prev_sched or ())})
        ):
            prev_ks = tuple(_k_at(prev_sched, prev_k, b) for b, _ in points)
            g_prev_now = ks_goodput(prev_ks, means, cost, batches)
            expected = state.pre_change_goodput * g_prev_now / state.pre_change_model_goodput
            tolerance = s.explore_revert_tolerance if explored else s.revert_tolerance
            if measured < (1.0 - tolerance) * expected:
                bad = cur_ks[dom] if cur_ks[dom] != prev_ks[dom] else None
                # Failed probes in a row back off: each doubles how long the k stays out.
                backoff = 2 ** min(state.probe_failures if explored else 0, s.max_probe_backoff)
                state = replace(
                    state,
                    blacklist={
                        **state.blacklist,
                        **({bad: now + s.blacklist_s * backoff} if bad is not None else {}),
                    },
                    probe_failures=state.probe_failures + (1 if explored else 0),
                )
                return out(
                    "Revert",
                    f"measured {measured:.0f} tok/s at k={k_cur} < {1 - tolerance:.2f} x "
                    f"{expected:.0f} tok/s expected at k={prev_ks[dom]}",
                    prev_ks[dom] if prev_sched is not None else prev_k,
                    prev_sched,
                    predicted_gain=expected / measured - 1.0,
                    schedule=recommended,
                    predicted_goodput_tokens_per_second=g_prev_now,
                )
            if measured >= expected:
                confirmed = True
                if explored:
                    state = replace(
                        state,
                        explore_tokens=min(s.explore_burst, state.explore_tokens + 1.0),
                        probe_failures=0,
                    )

    if (
        auto and not confirmed and state.last_change_time is not None
        and now - state.last_change_time < s.cooldown_s
    ):
        return out(
            "Cooldown",
            f"last change {now - state.last_change_time:.0f}s ago (cooldown {s.cooldown_s:.0f}s)",
            schedule=recommended,
            predicted_goodput_tokens_per_second=g_cur,
        )

    # Candidate configurations as the k each batch point of the window would draft.
    cands: dict[object, tuple[int, ...]] = {}
    if sched_best is None:
        for k in known:
            cands[k] = (k,) * len(points)
    else:
        big = tuple(schedule_k(sched_best, max(1, round(b))) for b, _ in points)
        step = tuple(min(max(kb, kc - 1), kc + 1) for kb, kc in zip(big, cur_ks, strict=True))
        cands["big"], cands["step"] = big, step
    cands["cur"] = cur_ks

    # Probability of beating the current configuration by min_gain, over posterior draws.
    rng = random.Random(s.seed * 1_000_003 + state.decisions)
    # Goodput of candidate ks over the window is sum_i tau_i b_i E(k_i) / T(b_i, k_i) /
    # sum tau (busy-time weights, see specula.tuning.goodput): only E varies between
    # posterior draws, so each point's tau_i b_i / T(b_i, k_i) is computed once.
    total_time = sum(w for _, w in points)
    rates = {
        key: [w * b / cost.predict(b, k) / total_time for (b, w), k in zip(points, ks, strict=True)]
        for key, ks in cands.items()
    }
    flat = {key: sum(r) for key, r in rates.items() if len(set(cands[key])) == 1}
    k_top = max(max(ks) for ks in cands.values())
    wins = dict.fromkeys(cands, 0)
    wins_any = dict.fromkeys(cands, 0)
    for _ in range(s.monte_carlo_samples):
        alphas = estimate.sample(rng, k_top)
        e, prod, lengths = 1.0, 1.0, [1.0]
        for a in alphas:
            prod *= a
            e += prod
            lengths.append(e)
        g = {
            key: (
                flat[key] * lengths[ks[0]] if key in flat
                else sum(r * lengths[k] for r, k in zip(rates[key], ks, strict=True))
            )
            for key, ks in cands.items()
        }
        bar = (1.0 + s.min_gain) * g["cur"]
        for key in cands:
            if g[key] > bar:
                wins[key] += 1
            if g[key] > g["cur"]:
                wins_any[key] += 1
    prob = {key: wins[key] / s.monte_carlo_samples for key in cands}
    prob_any = {key: wins_any[key] / s.monte_carlo_samples for key in cands}
    g_cand = {key: ks_goodput(ks, means, cost, batches) for key, ks in cands.items()}

    if sched_best is None:
        winners = [k for k in known if k != k_cur and prob[k] >= s.probability_threshold]
        prev_k = state.previous_num_speculative_tokens
        if not winners and confirmed and state.last_reason == "HigherGoodput" and prev_k is not None:
            # A move that went one step because its gain was small continues in the same
            # direction while the next k is a probable improvement at all: the hysteresis
            # was paid by the decision to move, and the measured step confirmed it.
            # Without this the walk stops one step short wherever the last step gains
            # less than min_gain.
            nxt = k_cur + (1 if k_cur > prev_k else -1)
            if nxt in known and prob_any[nxt] >= s.probability_threshold:
                gain = g_mean[nxt] / g_cur - 1.0
                return out(
                    "HigherGoodput",
                    f"k {k_cur}->{nxt}: continues the confirmed move from k={prev_k}, "
                    f"predicted {gain:+.1%} goodput (P(gain > 0) = {prob_any[nxt]:.2f})",
                    nxt,
                    predicted_gain=gain,
                    probability=prob_any[nxt],
                    schedule=recommended,
                    predicted_goodput_tokens_per_second=g_mean[nxt],
                    model_cur=g_cur,
                )
        if winners:
            target = max(winners, key=lambda k: (g_mean[k], -k))
            gain = g_mean[target] / g_cur - 1.0
            if abs(target - k_cur) > 1 and gain < s.big_gain:
                # Small gains move one step at a time: to the nearest k towards the
                # target that is itself a probable winner, so the move never goes to a
                # k predicted worse, nor to one disallowed (blacklisted after a revert).
                up = target > k_cur
                target = min(
                    (k for k in winners if (k > k_cur) == up), key=lambda k: abs(k - k_cur)
                )
                gain = g_mean[target] / g_cur - 1.0
            return out(
                "HigherGoodput",
                f"k {k_cur}->{target}: predicted {gain:+.1%} goodput "
                f"(P(gain > {s.min_gain:.0%}) = {prob.get(target, 0.0):.2f})",
                target,
                predicted_gain=gain,
                probability=prob.get(target),
                schedule=recommended,
                predicted_goodput_tokens_per_second=g_mean[target],
                model_cur=g_cur,
            )
    else:
        pick = None
        if prob["big"] >= s.probability_threshold and g_cand["big"] >= (1.0 + s.big_gain) * g_cur:
            pick = "big"
        elif prob["step"] >= s.probability_threshold and cands["step"] != cur_ks:
            pick = "step"
        if pick is not None:
            if pick == "big":
                new_sched = sched_best
            else:
                new_sched = _as_schedule(build_schedule(
                    lambda b: min(max(best_at(b), _k_at(sched_cur, k_cur, b) - 1), _k_at(sched_cur, k_cur, b) + 1)
                    if in_window(b) else best_at(b),
                    s.max_batch_size, breaks,
                ))
            target = cands[pick][dom]
            gain = g_cand[pick] / g_cur - 1.0
            return out(
                "HigherGoodput",
                f"schedule {_as_list(new_sched)} (k {k_cur}->{target} at batch "
                f"{points[dom][0]:.0f}): predicted {gain:+.1%} goodput "
                f"(P(gain > {s.min_gain:.0%}) = {prob[pick]:.2f})",
                target,
                new_sched,
                predicted_gain=gain,
                probability=prob[pick],
                schedule=recommended,
                predicted_goodput_tokens_per_second=g_cand[pick],
                model_cur=g_cur,
            )

    # Explore towards the best k under the posterior mean, when the next k has never
    # been seen — its position undrafted (acceptance is the prior) or its step time
    # unmeasured at this load (cost is an extrapolation) — so no amount of waiting
    # would make the gain probable.
    measured_k = {
        k for b, k, n, _, _ in state.step_times if b == main_bucket and n >= s.min_steps / 5
    }
    # Right after the load moved (``new_load`` above) the neighbours' step times are
    # extrapolations; a fresh tuner does not probe k it predicts worse, except past a
    # move the last window confirmed (below).
    # The direction of a model-driven move the last window confirmed: the optimum may
    # lie further that way, where the prior (off by up to ~7 % between neighbouring k on
    # the machine it was fitted to, bench/fit_costs.py) sees none.
    prev_k = state.previous_num_speculative_tokens
    onward = (
        (1 if k_cur > prev_k else -1)
        if confirmed and state.last_reason == "HigherGoodput" and prev_k is not None
        and prev_k != k_cur else 0
    )
    # Each probe in a row that did not pay showed the model's "worse" right: the margin
    # within which a predicted loss is still probed halves with each (the same back-off
    # as the blacklist's), and a probe that pays restores it.
    margin = s.explore_cost_margin / 2 ** min(state.probe_failures, s.max_probe_backoff)
    for direction in (1, -1):
        side = [k for k in allowed if (k - k_cur) * direction > 0]
        if not auto or not side or state.explore_tokens < 1.0:
            continue
        target = max(side, key=lambda k: (g_mean[k], -k))
        nxt = k_cur + direction
        if g_mean[target] < (1.0 + s.explore_min_gain) * g_cur:
            # At a new load a neighbour of known acceptance but unmeasured step time
            # is probed if the model puts it within its extrapolation error.
            if not (
                (new_load or direction == onward) and nxt in allowed and nxt <= depth
                and nxt not in measured_k
                and g_mean[nxt] >= (1.0 - margin) * g_cur
            ):
                continue
            target = nxt
        if direction > 0 and target > depth:
            # Each probe into undrafted depth observes every position up to its k:
            # doubling reaches the model's best k in log2 steps.
            far = min(target, max(k_cur + 1, 2 * k_cur))
            nxt = far if far in allowed else nxt
        if nxt not in allowed or (onward and nxt == prev_k):
            # Never straight back to the k a model-driven move just left: the window
            # has just measured the move beating it, and a probe back would be judged
            # by the same comparison (a revert, i.e. a flap, unless that window was the
            # outlier).
            continue
        if not (nxt > depth or nxt not in measured_k):
            continue
        state = replace(state, explore_tokens=state.explore_tokens - 1.0)
        what = (
            f"positions {k_cur}..{nxt - 1} undrafted" if nxt > depth
            else f"k={nxt} unmeasured at batch {main_bucket}"
        )
        new_sched = None
        if sched_best is not None:
            new_sched = _as_schedule(build_schedule(
                lambda b, k=nxt: k if in_window(b) else best_at(b), s.max_batch_size, breaks
            ))
        ks_new = tuple(_k_at(new_sched, nxt, b) for b, _ in points)
        g_new = ks_goodput(ks_new, means, cost, batches)
        return out(
            "Explore",
            f"k {k_cur}->{nxt}: {what}; the model predicts "
            f"{g_mean[target] / g_cur - 1.0:+.1%} at k={target}"
            + (" (after a workload shift)" if shift else ""),
            nxt,
            new_sched,
            predicted_gain=g_new / g_cur - 1.0,
            schedule=recommended,
            predicted_goodput_tokens_per_second=g_new,
            model_cur=g_cur,
        )
    best = max(cands, key=lambda key: (prob.get(key, 0.0), g_cand[key]))
    return out(
        "NoGain",
        f"no configuration beats k={k_cur} by {s.min_gain:.0%} with P >= "
        f"{s.probability_threshold} (best {best}, P={prob.get(best, 0.0):.2f})",
        schedule=recommended,
        predicted_goodput_tokens_per_second=g_cur,
    )
