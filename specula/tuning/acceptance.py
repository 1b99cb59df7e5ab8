"""Acceptance estimation from the runtime's speculative-decoding counters.

Counters (vLLM semantics, ``vllm/v1/spec_decode/metrics.py``; cumulative per pod):

- ``num_drafts``: draft rounds, one per request per step that drafted;
- ``num_draft_tokens``: sum of k over those drafts;
- ``num_accepted_tokens``: draft tokens the target accepted;
- ``num_accepted_tokens_per_pos[j]``: drafts whose position j was accepted, which
  implies positions < j were accepted too.

The conditional acceptance rate at position j (0-based) is
``alpha_j = a_j / a_{j-1}`` with ``a_{-1} = num_drafts``: a draft reaches position j
only if positions < j were accepted.  This holds exactly when every draft in the
window used the same k; positions >= k are not observed at all.  When drafts of one
window used several k (a per-batch-size schedule, or a change inside the window), the
step-time histogram's drafts per k correct the trials of the deeper positions
(:func:`position_observations_by_k`).

Each position gets a Beta posterior (the conjugate prior of a Bernoulli rate): a
Beta-Binomial model of accept/reject trials.  Unobserved positions keep their prior,
never a zero: the prior mean of position j is ``r`` times the posterior mean of
position j - 1, where ``r`` is the per-position trend of the observed positions
(geometric mean of the ratio of consecutive posterior means; ``depth_decay`` until two
positions are observed).  Conditional acceptance falls slowly and smoothly with depth
for EAGLE- and draft-model speculators, so a deeper position is expected to continue
the observed trend, with the wide uncertainty of a two-pseudo-trial prior.

Mean acceptance length (tokens per draft round, bonus/recovered token included) is
``E(k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i`` (1-based positions; Leviathan et al.,
arXiv 2211.17192, eq. 1 with per-position rates as in SmartSpec, arXiv 2406.14066).
vLLM reports the measured value as ``1 + num_accepted_tokens / num_drafts``.

Sources for the intervals: Wilson (1927), "Probable inference, the law of succession,
and statistical inference", JASA 22(158); the Beta credible interval inverts the
regularised incomplete beta function (continued fraction, Lentz's method).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specula.tuning._prom import Samples, parse_samples, total


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Cumulative speculative-decoding counters of one pod (or a sum or delta of them).

    Values are floats because Prometheus exposes floats; they hold whole numbers.
    """

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    num_accepted_tokens_per_pos: tuple[float, ...] = ()
    """Index j: drafts whose position j (0-based) was accepted; length = the pod's max k."""

    @classmethod
    def from_prometheus_text(cls, text: str) -> SpecDecodeCounters:
        """Counters from a ``/metrics`` body (``specula:`` or ``vllm:`` prefix).

        Series are summed over label sets other than ``position`` (``model_name``,
        ``engine``), so a pod serving several engines counts once per draft.

        Raises:
            ValueError: invalid exposition or a non-integer ``position`` label.
        """
        return cls.from_samples(parse_samples(text))

    @classmethod
    def from_samples(cls, samples: Samples) -> SpecDecodeCounters:
        """Counters from already-parsed samples (see :func:`_prom.parse_samples`)."""
        per_pos: dict[int, float] = {}
        for labels, value in samples.get("spec_decode_num_accepted_tokens_per_pos_total", ()):
            try:
                pos = int(labels["position"])
            except (KeyError, ValueError) as exc:
                raise ValueError(f"bad position label in {labels}") from exc
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        length = max(per_pos) + 1 if per_pos else 0
        return cls(
            num_drafts=total(samples, "spec_decode_num_drafts_total"),
            num_draft_tokens=total(samples, "spec_decode_num_draft_tokens_total"),
            num_accepted_tokens=total(samples, "spec_decode_num_accepted_tokens_total"),
            num_accepted_tokens_per_pos=tuple(per_pos.get(j, 0.0) for j in range(length)),
        )

    @property
    def mean_acceptance_length(self) -> float | None:
        """``1 + accepted / drafts`` (vLLM's definition); ``None`` without drafts."""
        if self.num_drafts <= 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> float | None:
        """``accepted / draft_tokens``; ``None`` without draft tokens."""
        if self.num_draft_tokens <= 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        n = max(len(self.num_accepted_tokens_per_pos), len(other.num_accepted_tokens_per_pos))
        a = _padded(self.num_accepted_tokens_per_pos, n)
        b = _padded(other.num_accepted_tokens_per_pos, n)
        return SpecDecodeCounters(
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            num_accepted_tokens_per_pos=tuple(x + y for x, y in zip(a, b, strict=True)),
        )

    def is_reset_from(self, prev: SpecDecodeCounters) -> bool:
        """True when any counter went down since ``prev``: the pod restarted."""
        n = max(len(self.num_accepted_tokens_per_pos), len(prev.num_accepted_tokens_per_pos))
        return (
            self.num_drafts < prev.num_drafts
            or self.num_draft_tokens < prev.num_draft_tokens
            or self.num_accepted_tokens < prev.num_accepted_tokens
            or any(
                c < p
                for c, p in zip(
                    _padded(self.num_accepted_tokens_per_pos, n),
                    _padded(prev.num_accepted_tokens_per_pos, n),
                    strict=True,
                )
            )
        )

    def to_dict(self) -> dict:
        return {
            "numDrafts": self.num_drafts,
            "numDraftTokens": self.num_draft_tokens,
            "numAcceptedTokens": self.num_accepted_tokens,
            "numAcceptedTokensPerPos": list(self.num_accepted_tokens_per_pos),
        }

    @classmethod
    def from_dict(cls, data: dict) -> SpecDecodeCounters:
        return cls(
            num_drafts=float(data.get("numDrafts", 0.0)),
            num_draft_tokens=float(data.get("numDraftTokens", 0.0)),
            num_accepted_tokens=float(data.get("numAcceptedTokens", 0.0)),
            num_accepted_tokens_per_pos=tuple(
                float(x) for x in data.get("numAcceptedTokensPerPos", ())
            ),
        )


def _padded(values: Sequence[float], n: int) -> list[float]:
    return [*values, *([0.0] * (n - len(values)))]


def counter_delta(prev: SpecDecodeCounters | None, cur: SpecDecodeCounters) -> SpecDecodeCounters:
    """Increase of one pod's counters between two scrapes.

    A counter that went down means the pod restarted (Prometheus ``rate()`` semantics):
    everything counted since the restart is ``cur`` itself, so ``cur`` is the delta.
    A restart that already overtook the old values is indistinguishable from growth;
    this is the same limitation Prometheus has.  ``prev=None`` (first scrape of a pod)
    gives zero: counts since process start belong to no known window.
    """
    if prev is None:
        return SpecDecodeCounters(
            num_accepted_tokens_per_pos=(0.0,) * len(cur.num_accepted_tokens_per_pos)
        )
    if cur.is_reset_from(prev):
        return cur
    n = max(len(cur.num_accepted_tokens_per_pos), len(prev.num_accepted_tokens_per_pos))
    return SpecDecodeCounters(
        num_drafts=cur.num_drafts - prev.num_drafts,
        num_draft_tokens=cur.num_draft_tokens - prev.num_draft_tokens,
        num_accepted_tokens=cur.num_accepted_tokens - prev.num_accepted_tokens,
        num_accepted_tokens_per_pos=tuple(
            c - p
            for c, p in zip(
                _padded(cur.num_accepted_tokens_per_pos, n),
                _padded(prev.num_accepted_tokens_per_pos, n),
                strict=True,
            )
        ),
    )


def sum_counters(counters: Iterable[SpecDecodeCounters]) -> SpecDecodeCounters:
    """Sum over pods.  Rates are taken from the sum (ratio of sums), so a pod that
    drafted 10x more weighs 10x more; averaging per-pod ratios would not."""
    acc = SpecDecodeCounters()
    for c in counters:
        acc = acc + c
    return acc


def position_observations(
    delta: SpecDecodeCounters, num_speculative_tokens: int
) -> list[tuple[float, float]]:
    """Per-position ``(trials, accepted)`` of one window drafted with k tokens.

    ``trials_0 = num_drafts``, ``trials_j = a_{j-1}``, ``accepted_j = a_j`` for
    j < k; positions >= k are not observed and are not returned.  Accepted counts are
    clipped to the trials so a scrape that raced a step cannot give a rate above 1.

    Returns:
        list of length ``min(k, len(num_accepted_tokens_per_pos))``.
    """
    out: list[tuple[float, float]] = []
    trials = max(delta.num_drafts, 0.0)
    for j in range(min(num_speculative_tokens, len(delta.num_accepted_tokens_per_pos))):
        accepted = min(max(delta.num_accepted_tokens_per_pos[j], 0.0), trials)
        out.append((trials, accepted))
        trials = accepted
    return out


def position_observations_by_k(
    delta: SpecDecodeCounters, drafts_by_k: dict[int, float]
) -> list[tuple[float, float]]:
    """Per-position ``(trials, accepted)`` of a window whose drafts used several k.

    Under a per-batch-size schedule each step drafts the k of its batch size, so the
    drafts that reached position j - 1 include some that stopped there (k = j): the
    trials of position j are ``a_{j-1}`` times the fraction of those drafts that had
    k > j.  That fraction is estimated from the step-time histogram's drafts per k
    (``drafts_by_k``: steps times the bucket's representative batch size) as
    ``D(k > j) / D(k > j - 1)``.  This assumes that whether a draft's prefix was
    accepted does not depend on its k (i.e. on the batch size it ran at); it is exact
    when one k was used, and otherwise biased only as far as acceptance differs between
    the batch sizes of one window and the representative batch sizes are off.
    ``trials_0 = num_drafts`` is exact.

    Args:
        delta: the window's counter increases.
        drafts_by_k: k -> drafts drafted with k (k = 0 entries are ignored).

    Returns:
        ``(trials, accepted)`` for positions 0 .. (largest k drafted) - 1, capped at the
        length of ``num_accepted_tokens_per_pos``; accepted counts clipped to the trials.
    """
    ks = {k: d for k, d in drafts_by_k.items() if k > 0 and d > 0}
    if not ks:
        return []
    out: list[tuple[float, float]] = []
    trials = max(delta.num_drafts, 0.0)
    reach_prev = sum(ks.values())
    for j in range(min(max(ks), len(delta.num_accepted_tokens_per_pos))):
        reach = sum(d for k, d in ks.items() if k > j)
        if j > 0:
            trials *= reach / reach_prev
        accepted = min(max(delta.num_accepted_tokens_per_pos[j], 0.0), trials)
        out.append((trials, accepted))
        trials, reach_prev = accepted, reach
    return out


def expected_accepted_length(alphas: Sequence[float], k: int) -> float:
    """``E(k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i``: tokens per draft round.

    Args:
        alphas: conditional acceptance rate per position (0-based), at least k long.
        k: num_speculative_tokens; ``E(0) = 1`` (plain decoding).

    Raises:
        ValueError: fewer than k rates.
    """
    if k > len(alphas):
        raise ValueError(f"need {k} acceptance rates, got {len(alphas)}")
    e, prod = 1.0, 1.0
    for j in range(k):
        prod *= alphas[j]
        e += prod
    return e


def wilson_interval(successes: float, trials: float, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927); (0, 1) without trials."""
    if trials <= 0:
        return (0.0, 1.0)
    p = successes / trials
    denom = 1.0 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def _betacf(a: float, b: float, x: float) -> float:
    # Continued fraction of the incomplete beta function, modified Lentz's method.
    tiny, eps = 1e-300, 1e-14
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def beta_cdf(x: float, a: float, b: float) -> float:
    """Regularised incomplete beta ``I_x(a, b)``: the Beta(a, b) CDF at x."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
        + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def beta_quantile(q: float, a: float, b: float) -> float:
    """Inverse of :func:`beta_cdf` by bisection (60 halvings: ~1e-18 absolute)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if beta_cdf(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class AcceptancePrior:
    """Beta prior of the per-position conditional acceptance rates."""

    strength: float = 2.0
    """Pseudo-trials of every position's prior; 2 with mean 0.5 is the uniform Beta(1, 1)."""
    first_position_mean: float = 0.5
    """Prior mean of position 0: nothing is known about a draft before it drafts."""
    depth_decay: float = 0.95
    """Ratio of consecutive positions' prior means before a trend is observed."""
    min_trend_decay: float = 0.8
    """Lower clamp of the observed trend ratio (upper clamp: 1)."""
    trend_min_trials: float = 30.0
    """Effective trials for a position to enter the trend."""


@dataclass(frozen=True)
class PositionPosterior:
    """Beta(alpha, beta) posterior of one position's conditional acceptance rate."""

    alpha: float
    beta: float
    trials: float
    """Effective trials behind it (0 for an unobserved position)."""

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def credible_interval(self, level: float = 0.95) -> tuple[float, float]:
        """Equal-tailed Bayesian credible interval of the rate."""
        tail = (1.0 - level) / 2.0
        return (
            beta_quantile(tail, self.alpha, self.beta),
            beta_quantile(1.0 - tail, self.alpha, self.beta),
        )


@dataclass(frozen=True)
class AcceptanceEstimate:
    """Posterior of the per-position conditional acceptance rates.

    Build it with :meth:`from_evidence`; ``positions[j]`` is position j (0-based).
    """

    positions: tuple[PositionPosterior, ...]
    prior: AcceptancePrior = field(default_factory=AcceptancePrior)

    @classmethod
    def from_evidence(
        cls,
        trials: Sequence[float],
        accepted: Sequence[float],
        num_positions: int,
        prior: AcceptancePrior | None = None,
        max_effective_trials: float = 1000.0,
    ) -> AcceptanceEstimate:
        """Posterior from per-position (possibly time-decayed) trial and accept counts.

        Args:
            trials, accepted: evidence per position; missing entries mean unobserved.
            num_positions: positions to estimate (the largest k the tuner may choose).
            prior: see :class:`AcceptancePrior`.
            max_effective_trials: cap on the evidence of one position.  Acceptance varies
                between requests and over time (a Beta-Binomial with over-dispersion),
                so 10^5 drafts do not pin a rate to +-0.002 the way an i.i.d. binomial
                would; capping the effective sample size keeps the posterior as wide as
                the window-to-window variation (intra-class correlation ~ 1/cap).
        """
        prior = prior or AcceptancePrior()
        evidence = []
        for j in range(num_positions):
            n = trials[j] if j < len(trials) else 0.0
            s = accepted[j] if j < len(accepted) else 0.0
            n, s = max(n, 0.0), min(max(s, 0.0), max(n, 0.0))
            if n > max_effective_trials:
                s, n = s * max_effective_trials / n, max_effective_trials
            evidence.append((n, s))
        # Trend of the observed leading positions (their posteriors barely depend on it).
        observed = []
        for n, s in evidence:
            if n < prior.trend_min_trials:
                break
            observed.append((s + 1.0) / (n + 2.0))
        decay = prior.depth_decay
        if len(observed) >= 2:
            decay = (observed[-1] / observed[0]) ** (1.0 / (len(observed) - 1))
            decay = min(max(decay, prior.min_trend_decay), 1.0)
        out: list[PositionPosterior] = []
        prev_mean = None
        for n, s in evidence:
            m = prior.first_position_mean if prev_mean is None else decay * prev_mean
            m = min(max(m, 1e-3), 1.0 - 1e-3)
            post = PositionPosterior(
                alpha=m * prior.strength + s, beta=(1.0 - m) * prior.strength + (n - s), trials=n
            )
            out.append(post)
            prev_mean = post.mean
        return cls(positions=tuple(out), prior=prior)

    @property
    def means(self) -> list[float]:
        """Posterior mean of each position's conditional acceptance rate."""
        return [p.mean for p in self.positions]

    def observed_depth(self, min_trials: float) -> int:
        """Number of leading positions with at least ``min_trials`` effective trials."""
        depth = 0
        for p in self.positions:
            if p.trials < min_trials:
                break
            depth += 1
        return depth

    def expected_accepted_length(self, k: int) -> float:
        """Posterior mean of E(k).  Positions are independent a posteriori, so the mean
        of the product is the product of the means."""
        return expected_accepted_length(self.means, k)

    def sample(self, rng: random.Random, num_positions: int | None = None) -> list[float]:
        """One draw of the first ``num_positions`` (default: all) rates from their
        posteriors, for Monte Carlo."""
        return [rng.betavariate(p.alpha, p.beta) for p in self.positions[:num_positions]]
