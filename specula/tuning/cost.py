"""Step-time model T(B, k): seconds per engine step at batch size B drafting k tokens.

Form (a roofline; linear in its coefficients, all >= 0, given the knee)::

    T(B, k) = fixed + per_draft_step * k + per_sequence * B + per_draft_token * B * k
              + per_verified_token * max(0, B * (k + 1) - knee(B))

- ``fixed``: reading the target's weights once per step plus launches — the
  memory-bound floor of decoding;
- ``per_draft_step``: one draft forward (its weights and launches), paid k times;
- ``per_sequence``: each sequence's KV-cache reads;
- ``per_draft_token``: drafting one token for one sequence (draft compute and KV);
- ``per_verified_token``: target compute per verified token once the step is
  compute-bound, i.e. once the ``B * (k + 1)`` tokens take longer to compute than the
  weights and KV take to read: ``knee(B) = s * kappa0 * (fixed0 + per_sequence0 * B) /
  per_verified_token0`` with the *prior* coefficients (subscript 0), the prior's
  ``knee_scale`` ``kappa0`` (measured steps turn compute-bound before the pure roofline
  says: 0.45 on an H100) and a fitted scale ``s`` (a roofline, Williams et al. 2009; the
  verification cost structure SmartSpec fits, arXiv 2406.14066 sec. 4).

Below the knee extra draft tokens are almost free; above it each one costs a full token
of target compute.  The knee matters most: without it a fit to small batches predicts
cheap speculation at batch 128 as well, and a knee taken from datasheet defaults puts
the switch to small k at the wrong load.  The fit is a profile least squares: for each
knee scale on a grid (log2 s in [-2, 2]) the coefficients are the non-negative
penalised least-squares solution, the scale is the grid point (refined by a parabola
through its neighbours) of least penalised loss, with a Gaussian prior on ``log s``
centred on the default so that data which cannot place the knee (every step far below
or far above it) leave it at the default.  Where a (batch bucket, k) pair has been
measured, the prediction is corrected to the measurement (ratio shrunk towards 1);
other k in a measured bucket take the nearest measured k's correction.

Observations come from the runtime's ``specula:step_duration_seconds`` histogram
labelled by ``batch_bucket`` (``"1"``, ``"2"``, ``"3-4"``, ``"5-8"``, ...) and
``num_speculative_tokens``; only ``_sum`` and ``_count`` are used (a mean per label pair).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from specula.tuning._prom import Samples, parse_samples


def batch_bucket(batch_size: int) -> str:
    """Power-of-two bucket label of a batch size, as the runtime labels steps.

    ``1 -> "1"``, ``2 -> "2"``, ``3..4 -> "3-4"``, ``5..8 -> "5-8"``, ...

    Raises:
        ValueError: ``batch_size`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size <= 2:
        return str(batch_size)
    upper = 1 << (batch_size - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


def bucket_range(label: str) -> tuple[int, int]:
    """Inclusive batch-size range of a bucket label (``"5-8" -> (5, 8)``).

    Raises:
        ValueError: not a ``"n"`` or ``"lo-hi"`` label.
    """
    try:
        if "-" in label:
            lo, hi = label.split("-", 1)
            return int(lo), int(hi)
        n = int(label)
        return n, n
    except ValueError as exc:
        raise ValueError(f"bad batch_bucket label {label!r}") from exc


@dataclass(frozen=True)
class StepTimeSeries:
    """Count and total seconds of the steps of one (batch bucket, k) label pair."""

    count: float = 0.0
    sum_s: float = 0.0

    @property
    def mean_s(self) -> float | None:
        return self.sum_s / self.count if self.count > 0 else None


@dataclass(frozen=True)
class StepTimeHistogram:
    """``specula:step_duration_seconds`` reduced to (count, sum) per (bucket, k)."""

    series: dict[tuple[str, int], StepTimeSeries] = field(default_factory=dict)

    @classmethod
    def from_prometheus_text(cls, text: str) -> StepTimeHistogram:
        """Histogram series from a ``/metrics`` body, summed over other labels.

        Raises:
            ValueError: invalid exposition or labels.
        """
        return cls.from_samples(parse_samples(text))

    @classmethod
    def from_samples(cls, samples: Samples) -> StepTimeHistogram:
        """Histogram from already-parsed samples (see :func:`_prom.parse_samples`)."""
        counts: dict[tuple[str, int], float] = {}
        sums: dict[tuple[str, int], float] = {}
        for name, target in (
            ("step_duration_seconds_count", counts),
            ("step_duration_seconds_sum", sums),
        ):
            for labels, value in samples.get(name, ()):
                try:
                    key = (labels["batch_bucket"], int(labels["num_speculative_tokens"]))
                except (KeyError, ValueError) as exc:
                    raise ValueError(f"bad step-time labels {labels}") from exc
                bucket_range(key[0])
                target[key] = target.get(key, 0.0) + value
        return cls(
            {k: StepTimeSeries(count=counts[k], sum_s=sums.get(k, 0.0)) for k in counts}
        )

    def __add__(self, other: StepTimeHistogram) -> StepTimeHistogram:
        out = dict(self.series)
        for key, s in other.series.items():
            o = out.get(key, StepTimeSeries())
            out[key] = StepTimeSeries(count=o.count + s.count, sum_s=o.sum_s + s.sum_s)
        return StepTimeHistogram(out)

    def is_reset_from(self, prev: StepTimeHistogram) -> bool:
        """True when a series disappeared or went down: the pod restarted."""
        for key, p in prev.series.items():
            c = self.series.get(key)
            if c is None or c.count < p.count or c.sum_s < p.sum_s:
                return True
        return False

    def delta(self, prev: StepTimeHistogram | None) -> StepTimeHistogram:
        """Increase since ``prev`` (``self`` after a reset, empty for ``prev=None``)."""
        if prev is None:
            return StepTimeHistogram()
        if self.is_reset_from(prev):
            return self
        out = {}
        for key, c in self.series.items():
            p = prev.series.get(key, StepTimeSeries())
            if c.count - p.count > 0:
                out[key] = StepTimeSeries(count=c.count - p.count, sum_s=c.sum_s - p.sum_s)
        return StepTimeHistogram(out)

    @property
    def total_count(self) -> float:
        return sum(s.count for s in self.series.values())

    @property
    def total_seconds(self) -> float:
        return sum(s.sum_s for s in self.series.values())

    def steps_by_bucket(self) -> dict[str, float]:
        """Number of steps per batch bucket, over all k."""
        out: dict[str, float] = {}
        for (bucket, _), s in self.series.items():
            out[bucket] = out.get(bucket, 0.0) + s.count
        return out

    def seconds_by_bucket(self) -> dict[str, float]:
        """Summed step seconds per batch bucket, over all k."""
        out: dict[str, float] = {}
        for (bucket, _), s in self.series.items():
            out[bucket] = out.get(bucket, 0.0) + s.sum_s
        return out

    def to_dict(self) -> list[list]:
        return [[b, k, s.count, s.sum_s] for (b, k), s in sorted(self.series.items())]

    @classmethod
    def from_dict(cls, rows: list[list]) -> StepTimeHistogram:
        return cls({(str(b), int(k)): StepTimeSeries(float(c), float(s)) for b, k, c, s in rows})


@dataclass(frozen=True)
class CostParams:
    """Coefficients of the step-time model, in seconds (see module docstring)."""

    fixed_s: float
    per_draft_step_s: float
    per_sequence_s: float
    per_draft_token_s: float
    per_verified_token_s: float
    knee_scale: float = 1.0
    """Knee over the roofline knee of these coefficients (dimensionless): measured steps
    turn compute-bound at ``knee_scale`` times the token count at which
    ``per_verified_token_s`` of compute per token equals the memory-bound floor."""

    def knee_tokens(self, batch_size: float) -> float:
        """Verified tokens per step at which the step turns compute-bound (these params):
        ``knee_scale * (fixed_s + per_sequence_s * B) / per_verified_token_s``."""
        return (
            self.knee_scale
            * (self.fixed_s + self.per_sequence_s * batch_size)
            / self.per_verified_token_s
        )

    def features(self, batch_size: float, k: int, knee_scale: float = 1.0) -> list[float]:
        """Regressors of each coefficient, with the knee taken from these params times
        ``knee_scale``."""
        knee = knee_scale * self.knee_tokens(batch_size)
        return [
            1.0,
            float(k),
            batch_size,
            batch_size * k,
            max(0.0, batch_size * (k + 1) - knee),
        ]

    def as_list(self) -> list[float]:
        """The five linear coefficients (seconds), in field order; not ``knee_scale``."""
        return [
            self.fixed_s,
            self.per_draft_step_s,
            self.per_sequence_s,
            self.per_draft_token_s,
            self.per_verified_token_s,
        ]


DEFAULT_COST_PARAMS = CostParams(
    fixed_s=6.39289e-3,
    per_draft_step_s=0.386491e-3,
    per_sequence_s=0.0229759e-3,
    per_draft_token_s=0.0159668e-3,
    per_verified_token_s=0.0118995e-3,
    knee_scale=0.448037,
)
"""The curve before a deployment's own steps are measured, and the prior the fit is shrunk
towards: fitted to the engine's step times measured on NVIDIA H100 80GB HBM3 GPUs in two
sessions on 2026-11-26 (``bench/results/step_costs_h100.json``, 20 timed steps a cell in
ascending k, and ``step_costs_h100_shuffled.json``, 3 sweeps of 20 in shuffled k, both
made by ``bench/step_costs.py``: a Llama-3.1-8B-shaped bfloat16 target with a 1-layer
EAGLE-3 head, B in {1, 4, 16, 32, 64, 128} x k in 0..8, through the runtime's step-time
histogram), by ``python3 bench/fit_costs.py`` (mean of the two sessions' per-cell medians,
Huber-weighted, iterated until these coefficients reproduce their own fit:
``StepCostModel()`` is that fit).  Knee at ~240 verified tokens per step at batch 1 and
~350 at batch 128.  Global-curve error over the 54 cells: median 1.5 %, maximum 19 % (B =
64, k = 6, a cell ~5 ms above its row's trend in both sessions), 7.6 % elsewhere;
``bench/RESULTS.md`` has the details.  Other GPUs and models differ: the fit replaces it
as soon as the histogram has data."""


@dataclass(frozen=True)
class CostObservation:
    """Mean step time of ``count`` steps at one (batch bucket, k)."""

    bucket: str
    batch_size: float
    """Representative (mean) batch size of those steps."""
    k: int
    mean_s: float
    count: float


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    # Gaussian elimination with partial pivoting; a is small and positive definite.
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[piv] = m[piv], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for j in range(c, n + 1):
                m[r][j] -= f * m[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][j] * x[j] for j in range(r + 1, n))) / m[r][r]
    return x


def _nonneg_quadratic_min(h: list[list[float]], g: list[float]) -> list[float]:
    """argmin of 0.5 u'Hu - g'u over u >= 0 for positive definite H.

    Lawson-Hanson active-set method (Lawson & Hanson 1974, "Solving Least Squares
    Problems", ch. 23) on the normal equations; exact in finitely many steps.
    """
    n = len(g)
    free: list[int] = []
    u = [0.0] * n
    for _ in range(4 * n + 4):
        grad = [g[p] - sum(h[p][q] * u[q] for q in range(n)) for p in range(n)]
        cand = [p for p in range(n) if p not in free and grad[p] > 1e-12]
        if not cand:
            break
        free.append(max(cand, key=lambda p: grad[p]))
        while True:
            z = [0.0] * n
            sol = _solve([[h[p][q] for q in free] for p in free], [g[p] for p in free])
            for p, v in zip(free, sol, strict=True):
                z[p] = v
            if all(z[p] > 0 for p in free):
                u = z
                break
            # Step from u towards z until a free coordinate hits zero, then drop it.
            t = min(u[p] / (u[p] - z[p]) for p in free if z[p] <= 0)
            u = [u[p] + t * (z[p] - u[p]) for p in range(n)]
            free = [p for p in free if u[p] > 1e-15]
            for p in range(n):
                if p not in free:
                    u[p] = 0.0
    return u


@dataclass(frozen=True)
class StepCostModel:
    """T(B, k) in seconds: the global fit, corrected where (bucket, k) was measured.

    Build with :meth:`fit`; ``StepCostModel()`` is the documented default curve.
    """

    params: CostParams = DEFAULT_COST_PARAMS
    prior: CostParams = DEFAULT_COST_PARAMS
    """Coefficients the knee is computed from."""
    knee_scale: float = 1.0
    """Fitted knee over the prior's knee (1: the default knee)."""
    corrections: dict[str, dict[int, float]] = field(default_factory=dict)
    """Bucket -> k -> measured / predicted step time (shrunk towards 1)."""

    @classmethod
    def fit(
        cls,
        observations: Iterable[CostObservation],
        prior: CostParams = DEFAULT_COST_PARAMS,
        prior_weight: float = 1.0,
        correction_prior_weight: float = 4.0,
        max_weight: float = 1000.0,
        knee_prior_weight: float = 2.0,
        fit_knee: bool = True,
    ) -> StepCostModel:
        """Fit the model to mean step times.

        Minimises relative squared error, ``sum_i w_i ((y_i - T_i) / y_i)^2`` with
        ``w_i = min(count_i, max_weight)``, plus ``prior_weight * sum_p ((c_p - c0_p) /
        c0_p)^2``, which pulls the coefficients the data cannot separate (with one k
        observed, the draft cost; below the knee, the compute cost) towards ``prior``,
        plus ``knee_prior_weight * (log2 s)^2`` for the knee scale ``s``; coefficients
        are non-negative.  Then each measured (bucket, k) gets the correction ``(sum w
        y/T + c) / (sum w + c)`` with ``c = correction_prior_weight``.  The fitted
        params carry ``knee_scale = prior.knee_scale * s``, so that, used as the next
        fit's prior, they start from this fit's knee.

        Args:
            fit_knee: ``False`` keeps the knee at the prior's (``s = 1``).
        """
        obs = [o for o in observations if o.count > 0 and o.mean_s > 0]
        if not obs:
            return cls(params=prior, prior=prior)
        scale = prior.as_list()
        weights = [min(o.count, max_weight) for o in obs]

        def solve(log_s: float) -> tuple[float, list[float]]:
            knee = 2.0**log_s
            n = len(scale)
            h = [[0.0] * n for _ in range(n)]
            g = [0.0] * n
            rows = []
            for o, w in zip(obs, weights, strict=True):
                x = prior.features(o.batch_size, o.k, knee)
                # Scaled unknowns u_p = c_p / c0_p, residual relative to y.
                row = [x[p] * scale[p] / o.mean_s for p in range(n)]
                rows.append(row)
                for p in range(n):
                    if row[p] == 0.0:
                        continue
                    g[p] += w * row[p]
                    for q in range(n):
                        h[p][q] += w * row[p] * row[q]
            for p in range(n):
                h[p][p] += prior_weight
                g[p] += prior_weight
            u = _nonneg_quadratic_min(h, g)
            loss = sum(
                w * (1.0 - sum(r * c for r, c in zip(row, u, strict=True))) ** 2
                for w, row in zip(weights, rows, strict=True)
            )
            loss += prior_weight * sum((c - 1.0) ** 2 for c in u)
            loss += knee_prior_weight * log_s * log_s
            return loss, u

        step = 0.5
        grid = [i * step for i in range(-4, 5)] if fit_knee else [0.0]
        fits = {x: solve(x) for x in grid}
        best = min(grid, key=lambda x: fits[x][0])
        log_s, (loss, u) = best, fits[best]
        if fit_knee and -2.0 < best < 2.0:
            # Parabola through the best grid point and its neighbours: the knee to a few %.
            lo, hi = fits[best - step][0], fits[best + step][0]
            curv = lo + hi - 2.0 * loss
            if curv > 0:
                x = best + 0.5 * step * (lo - hi) / curv
                fx = solve(x)
                if fx[0] < loss:
                    log_s, (loss, u) = x, fx
        model = cls(
            params=CostParams(
                *(u[p] * scale[p] for p in range(len(scale))),
                knee_scale=prior.knee_scale * 2.0**log_s,
            ),
            prior=prior,
            knee_scale=2.0**log_s,
        )

        sums: dict[str, dict[int, list[float]]] = {}
        for o, w in zip(obs, weights, strict=True):
            acc = sums.setdefault(o.bucket, {}).setdefault(o.k, [0.0, 0.0])
            acc[0] += w * o.mean_s / model._global(o.batch_size, o.k)
            acc[1] += w
        corrections = {
            b: {
                k: (num + correction_prior_weight) / (den + correction_prior_weight)
                for k, (num, den) in by_k.items()
            }
            for b, by_k in sums.items()
        }
        return replace(model, corrections=corrections)

    def _global(self, batch_size: float, k: int) -> float:
        x = self.prior.features(batch_size, k, self.knee_scale)
        return sum(c * f for c, f in zip(self.params.as_list(), x, strict=True))

    def predict(self, batch_size: float, k: int) -> float:
        """Seconds per step at ``batch_size`` (>= 1, may be fractional) and ``k``."""
        base = self._global(batch_size, k)
        by_k = self.corrections.get(batch_bucket(max(1, round(batch_size))))
        if not by_k:
            return base
        nearest = min(by_k, key=lambda m: (abs(m - k), m))
        return base * by_k[nearest]
