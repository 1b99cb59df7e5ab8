"""The simulator's figures, as open issue 13 defines them, on plain tables.

Inputs, per trace: ``g[i][k]``, the true goodput (tokens per busy second) of interval i at
fixed k; ``got[i]``, the tuner's true goodput in interval i (the configuration in effect
during it); the phase lengths; and the applied changes ``(interval, from, to, reason)``
with configurations compared whole (a k or a schedule).  Every function is pure, so the
definitions can be checked on hand-made tables (``tests/unit/test_tuning_sim_metrics.py``).

- **Best fixed k** (throughput-weighted): the k of highest mean goodput over the trace.
  Intervals have equal length, so mean goodput is total tokens over total busy time.
- **Headroom**: the per-interval oracle (best k re-chosen every interval with perfect
  knowledge) over the best fixed k, minus 1.
- **Headroom captured**, throughput-weighted: ``(mean(got) - mean(g[:, k*])) /
  (mean(oracle) - mean(g[:, k*]))``.  Per interval: every interval weighs the same,
  through its fraction of the oracle, ``f(x) = mean_i(x_i / oracle_i)``:
  ``(f(got) - max_k f(g[:, k])) / (1 - max_k f(g[:, k]))``.
- **Convergence** in a phase: interval i is near-optimal when ``got[i] >= 0.95 *
  g[i][k_p]``, ``k_p`` the phase's best fixed k; the phase converges at the first
  near-optimal interval (0 = the phase's first interval, the one right after the shift),
  and afterwards counts the share of near-optimal intervals among those that follow it.
- **Flap**: two consecutive changes ``A -> B`` at interval t1 and ``B -> A`` at t2 with
  ``t2 - t1 <= 10``; reported per 100 intervals.
- **Probes**: changes made by exploration, per interval.
- **Loss against k = 0**: ``1 - mean(got) / mean(g[:, 0])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NEAR_OPTIMAL = 0.95
FLAP_WINDOW = 10


@dataclass(frozen=True)
class Change:
    interval: int
    """First interval the new configuration is in effect."""
    before: str
    after: str
    reason: str


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def column_means(g: Sequence[Sequence[float]]) -> list[float]:
    return [_mean([row[k] for row in g]) for k in range(len(g[0]))]


def best_fixed_k(g: Sequence[Sequence[float]]) -> int:
    """k of highest mean goodput (the smallest on ties)."""
    means = column_means(g)
    return max(range(len(means)), key=lambda k: (means[k], -k))


def oracle_mean(g: Sequence[Sequence[float]]) -> float:
    return _mean([max(row) for row in g])


def headroom(g: Sequence[Sequence[float]]) -> float:
    """Per-interval oracle over the best fixed k, minus 1."""
    return oracle_mean(g) / column_means(g)[best_fixed_k(g)] - 1.0


def fraction_of_best_fixed(got: Sequence[float], g: Sequence[Sequence[float]]) -> float:
    return _mean(got) / column_means(g)[best_fixed_k(g)]


def captured_throughput(got: Sequence[float], g: Sequence[Sequence[float]]) -> float | None:
    """Share of the headroom captured, throughput-weighted (``None``: no headroom)."""
    fixed = column_means(g)[best_fixed_k(g)]
    top = oracle_mean(g)
    if top <= fixed:
        return None
    return (_mean(got) - fixed) / (top - fixed)


def per_interval_fraction(xs: Sequence[float], g: Sequence[Sequence[float]]) -> float:
    """``mean_i(xs[i] / max_k g[i][k])``."""
    return _mean([x / max(row) for x, row in zip(xs, g, strict=True)])


def best_static_per_interval(g: Sequence[Sequence[float]]) -> tuple[int, float]:
    """The fixed k of highest per-interval fraction, and that fraction."""
    fr = [per_interval_fraction([row[k] for row in g], g) for k in range(len(g[0]))]
    k = max(range(len(fr)), key=lambda j: (fr[j], -j))
    return k, fr[k]


def captured_per_interval(got: Sequence[float], g: Sequence[Sequence[float]]) -> float | None:
    """Share of the headroom captured with every interval weighing the same."""
    _, static = best_static_per_interval(g)
    if static >= 1.0:
        return None
    return (per_interval_fraction(got, g) - static) / (1.0 - static)


def convergence(
    got: Sequence[float], g: Sequence[Sequence[float]], phase_lengths: Sequence[int]
) -> list[dict]:
    """Per phase: its best fixed k, the intervals until the first near-optimal one (the
    phase's length if none) and the share of near-optimal intervals after it (``None``
    when none follow)."""
    out, start = [], 0
    for n in phase_lengths:
        rows = range(start, start + n)
        k_p = best_fixed_k([g[i] for i in rows])
        near = [got[i] >= NEAR_OPTIMAL * g[i][k_p] for i in rows]
        first = next((j for j, ok in enumerate(near) if ok), n)
        after = near[first + 1:]
        out.append({
            "best_k": k_p,
            "intervals_to_converge": first,
            "near_optimal_after": (sum(after) / len(after)) if after else None,
        })
        start += n
    return out


def count_flaps(changes: Sequence[Change], window: int = FLAP_WINDOW) -> int:
    """Consecutive changes ``A -> B``, ``B -> A`` at most ``window`` intervals apart."""
    return sum(
        1 for a, b in zip(changes, changes[1:], strict=False)
        if a.before == b.after and a.after == b.before and b.interval - a.interval <= window
    )


def probes(changes: Sequence[Change]) -> int:
    return sum(1 for c in changes if c.reason == "Explore")


def loss_against_k0(got: Sequence[float], g: Sequence[Sequence[float]]) -> float:
    return 1.0 - _mean(got) / column_means(g)[0]
