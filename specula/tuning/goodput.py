"""Goodput and the choice of num_speculative_tokens.

Goodput at batch size B: ``G(k; B) = B * E(k) / T(B, k)`` tokens per second, where
``E(k)`` is the mean acceptance length (tokens per sequence per step, bonus or
recovered token included) and ``T(B, k)`` the step time (Leviathan et al., arXiv
2211.17192, sec. 3.4 "walltime improvement"; SmartSpec, arXiv 2406.14066, eq. 3, whose
goodput is per batch).  ``k = 0`` is plain decoding: ``E(0) = 1`` and ``T(B, 0)`` the
step without a draft.

Over a window whose steps have varying batch sizes, goodput is total tokens over total
busy time, with the time at each batch size held by the workload, not by the engine:

- the batch size at any moment is the number of requests the clients keep in flight,
  which the step time does not change (to first order), so a window of ``W`` busy
  seconds spends ``tau_b * W`` of them at batch ``b`` whatever k the engine drafts
  (``tau_b``: the fraction of busy time at ``b``, measured as the step-time histogram's
  seconds per batch bucket, at whatever k ran);
- at a candidate k a step at ``b`` takes ``T(b, k)``, so the window runs ``n_b(k) =
  tau_b * W / T(b, k)`` steps there, emitting ``n_b(k) * b * E(k)`` tokens in
  ``n_b(k) * T(b, k) = tau_b * W`` seconds;
- hence ``G(k) = sum_b n_b(k) b E(k) / sum_b n_b(k) T(b, k) = sum_b tau_b * b * E(k) /
  T(b, k) / sum_b tau_b``: the busy-time-weighted mean of the per-batch goodputs.

Each batch size's steps are thus weighted by the time they take at the candidate k
(``n_b(k)`` above), not by the steps counted at the k that ran: holding step counts
fixed (``sum_b w_b b E(k) / sum_b w_b T(b, k)``) assumes the slower steps of a larger k
buy more steps at the batch sizes where they are slowest, and with half the time at
batch 8 and half at batch 128 it prefers a k about 2 larger than the one of best goodput.
A per-batch-size schedule drafting ``k_b`` at ``b`` is the same sum with ``E(k_b)`` and
``T(b, k_b)`` (:func:`ks_goodput`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specula.tuning.acceptance import expected_accepted_length
from specula.tuning.cost import StepCostModel, bucket_range


@dataclass(frozen=True)
class BatchDistribution:
    """Fractions of engine-busy time by batch size: ``((batch_size, weight), ...)``.

    Weights need not sum to one; batch sizes may be fractional (bucket means).  The
    weights are shares of time, which the workload fixes, not of steps, which depend on
    k (module docstring).
    """

    points: tuple[tuple[float, float], ...]

    @classmethod
    def single(cls, batch_size: float) -> BatchDistribution:
        return cls(((float(batch_size), 1.0),))

    @classmethod
    def from_buckets(
        cls,
        steps_by_bucket: dict[str, float],
        seconds_by_bucket: dict[str, float],
        mean_batch_size: float | None = None,
    ) -> BatchDistribution:
        """Distribution of one window: each runtime batch bucket weighted by its busy
        seconds, at the batch size :func:`bucket_representatives` gives it (from the
        step counts).

        Args:
            steps_by_bucket: steps per bucket label in the window.
            seconds_by_bucket: summed step seconds per bucket label in the window.
            mean_batch_size: the window's mean batch size (steps-weighted), if known.

        Raises:
            ValueError: no steps.
        """
        reps = bucket_representatives(steps_by_bucket, mean_batch_size)
        return cls(tuple(sorted(
            (reps[b], max(seconds_by_bucket.get(b, 0.0), 0.0))
            for b, n in steps_by_bucket.items() if n > 0
        )))

    @property
    def mean(self) -> float:
        """Time-weighted mean batch size."""
        wsum = sum(w for _, w in self.points)
        return sum(b * w for b, w in self.points) / wsum


def bucket_representatives(
    steps_by_bucket: dict[str, float], mean_batch_size: float | None = None
) -> dict[str, float]:
    """A batch size standing for each bucket that has steps.

    Each bucket is represented by its midpoint; when the window's mean batch size is
    known (``generation_tokens / (steps * mean acceptance length)``) the midpoints are
    scaled by one common factor to match it, each clamped to its bucket's range, so a
    window of batch-128 steps is costed at 128, not at the "65-128" midpoint.

    Raises:
        ValueError: no steps.
    """
    rows = [(b, *bucket_range(b), n) for b, n in steps_by_bucket.items() if n > 0]
    if not rows:
        raise ValueError("no steps in the window")
    factor = 1.0
    if mean_batch_size is not None and mean_batch_size > 0:
        nsum = sum(n for *_, n in rows)
        mid_mean = sum((lo + hi) / 2.0 * n for _, lo, hi, n in rows) / nsum
        factor = mean_batch_size / mid_mean
    return {b: min(max((lo + hi) / 2.0 * factor, lo), hi) for b, lo, hi, _ in rows}


def goodput(
    k: int, alphas: Sequence[float], cost: StepCostModel, batches: BatchDistribution
) -> float:
    """Tokens per second of a workload whose busy time is distributed as ``batches``,
    every step drafting k tokens: ``sum_b tau_b b E(k) / T(b, k) / sum_b tau_b`` (module
    docstring).

    Args:
        alphas: conditional acceptance per position (at least k of them).

    Raises:
        ZeroDivisionError: all weights are zero.
    """
    return ks_goodput((k,) * len(batches.points), alphas, cost, batches)


def best_k(
    alphas: Sequence[float],
    cost: StepCostModel,
    batches: BatchDistribution,
    candidates: Sequence[int],
) -> tuple[int, float]:
    """The candidate k of highest goodput (the smallest on ties) and that goodput.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("no candidate k")
    best, best_g = None, -1.0
    for k in sorted(candidates):
        g = goodput(k, alphas, cost, batches)
        if g > best_g * (1.0 + 1e-9):
            best, best_g = k, g
    assert best is not None
    return best, best_g


def build_schedule(
    choose: Callable[[int], int], max_batch_size: int, breakpoints: Sequence[int] = ()
) -> list[list[int]]:
    """``[[start, end, k], ...]`` covering batch sizes 1..max_batch_size.

    ``choose(B)`` gives the k for batch size B.  Between consecutive ``breakpoints``
    (first batch sizes of segments where the cost model is smooth) the chosen k is
    assumed monotone in B — larger batches favour smaller k — so a segment whose ends
    agree is filled without evaluating its interior, and one whose ends differ is
    bisected: O(log B) evaluations per switch instead of one per batch size.  Equal
    neighbours are merged, so ranges start at 1, are contiguous, inclusive and
    non-overlapping — the shape of the runtime's ``num_speculative_tokens_per_batch_size``.

    Raises:
        ValueError: ``max_batch_size`` < 1.
    """
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be >= 1")
    cache: dict[int, int] = {}

    def at(b: int) -> int:
        if b not in cache:
            cache[b] = choose(b)
        return cache[b]

    ks = [0] * (max_batch_size + 1)

    def fill(lo: int, hi: int) -> None:
        if at(lo) == at(hi):
            for b in range(lo, hi + 1):
                ks[b] = at(lo)
        elif hi - lo <= 1:
            ks[lo], ks[hi] = at(lo), at(hi)
        else:
            mid = (lo + hi) // 2
            fill(lo, mid)
            fill(mid, hi)

    starts = sorted({1, *(b for b in breakpoints if 1 < b <= max_batch_size)})
    for i, lo in enumerate(starts):
        hi = starts[i + 1] - 1 if i + 1 < len(starts) else max_batch_size
        fill(lo, hi)
    out: list[list[int]] = []
    for b in range(1, max_batch_size + 1):
        if out and out[-1][2] == ks[b]:
            out[-1][1] = b
        else:
            out.append([b, b, ks[b]])
    return out


def optimal_schedule(
    alphas: Sequence[float],
    cost: StepCostModel,
    candidates: Sequence[int],
    max_batch_size: int,
) -> list[list[int]]:
    """Per-batch-size best k as a schedule (see :func:`build_schedule`); the runtime's
    batch buckets (1, 2, 3, 5, 9, 17, ...) are the breakpoints, since the cost model's
    per-bucket corrections may jump there."""
    breakpoints = schedule_breakpoints(max_batch_size)
    return build_schedule(
        lambda b: best_k(alphas, cost, BatchDistribution.single(b), candidates)[0],
        max_batch_size,
        breakpoints,
    )


def schedule_k(schedule: Sequence[Sequence[int]], batch_size: int) -> int:
    """The k a schedule gives a batch size (the last range's k above its end).

    Raises:
        ValueError: empty schedule or batch size below the first range.
    """
    if not schedule or batch_size < schedule[0][0]:
        raise ValueError(f"batch size {batch_size} not covered by {schedule}")
    for start, end, k in schedule:
        if start <= batch_size <= end:
            return k
    return schedule[-1][2]


def ks_goodput(
    ks: Sequence[int], alphas: Sequence[float], cost: StepCostModel, batches: BatchDistribution
) -> float:
    """Tokens per second when the steps at ``batches.points[i]`` draft ``ks[i]`` tokens
    (a per-batch-size schedule evaluated on a batch distribution): the busy-time-weighted
    mean of ``b * E(k_b) / T(b, k_b)`` (module docstring).

    Raises:
        ValueError: ``ks`` and the points differ in length.
        ZeroDivisionError: all weights are zero.
    """
    if len(ks) != len(batches.points):
        raise ValueError(f"{len(ks)} k for {len(batches.points)} batch sizes")
    total = sum(w for _, w in batches.points)
    return sum(
        w * b * expected_accepted_length(alphas, k) / cost.predict(b, k)
        for (b, w), k in zip(batches.points, ks, strict=True)
    ) / total


def schedule_breakpoints(max_batch_size: int) -> list[int]:
    """First batch sizes of the runtime's batch buckets (1, 2, 3, 5, 9, 17, ...): where the
    cost model's per-bucket corrections may make the best k jump."""
    return [1, 2, *(2**i + 1 for i in range(1, max_batch_size.bit_length() + 1))]
