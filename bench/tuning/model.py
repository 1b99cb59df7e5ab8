"""Ground truth of the simulator: acceptance profiles and the measured step-time table.

Nothing here is visible to the tuner; it sees only the Prometheus text the simulated
pods expose.  Step time is the engine's, measured on an H100 (``bench/step_costs.py``:
a Llama-3.1-8B-shaped bfloat16 target with a 1-layer EAGLE-3 head, B in {1, 4, 16, 32,
64, 128} x k in 0..8, two sessions), as the mean of the two sessions' per-cell medians
(the cells ``bench/fit_costs.py`` fits), interpolated linearly in B between measured
batch sizes.  Off-trend cells (B = 64, k = 6: ~5 ms above its row) are kept: the tuner
starts from the smooth fitted prior (``specula.tuning.DEFAULT_COST_PARAMS``), so the
prior's error is part of what the simulation tests.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
MEASUREMENTS = ("step_costs_h100.json", "step_costs_h100_shuffled.json")


@dataclass(frozen=True)
class TableCost:
    """Step time from a table ``ms[(B, k)]``, linear in B between its batch sizes.

    Below the smallest or above the largest measured batch size the nearest segment is
    extended linearly (step time is close to affine in B at fixed k).
    """

    ms: dict[tuple[int, int], float]
    name: str = "table"

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({b for b, _ in self.ms})

    def step_s(self, batch_size: float, k: int) -> float:
        """Seconds per step at ``batch_size`` (>= 1) drafting k tokens.

        Raises:
            KeyError: k not in the table.
        """
        bs = self.batch_sizes
        if len(bs) == 1:
            return self.ms[bs[0], k] / 1000.0
        i = min(max(bisect.bisect_right(bs, batch_size) - 1, 0), len(bs) - 2)
        lo, hi = bs[i], bs[i + 1]
        f = (batch_size - lo) / (hi - lo)
        return (self.ms[lo, k] + f * (self.ms[hi, k] - self.ms[lo, k])) / 1000.0


def measured_h100(paths: tuple[Path, ...] | None = None) -> TableCost:
    """The H100 table: per (B, k) the mean over the sessions of their median step time."""
    paths = paths or tuple(RESULTS / p for p in MEASUREMENTS)
    grids = [json.loads(p.read_text())["step_ms"] for p in paths]
    ms = {
        (int(b), int(k)): sum(g[b][k]["median_ms"] for g in grids) / len(grids)
        for b in grids[0] for k in grids[0][b]
    }
    return TableCost(ms, name="H100 measured (mean of 2 sessions' medians)")


def linear_profile(first: float, step: float, floor: float, n: int = 16) -> tuple[float, ...]:
    """Conditional acceptance per position: ``first - step * j``, at least ``floor``."""
    return tuple(max(first - step * j, floor) for j in range(n))


def flat_profile(alpha: float, n: int = 16) -> tuple[float, ...]:
    """The same conditional acceptance at every position."""
    return (alpha,) * n


PROFILES: dict[str, tuple[float, ...]] = {
    # Code: repetitive, highly predictable; EAGLE-class heads reach ~0.85-0.9 per position.
    "code": linear_profile(0.90, 0.006, 0.80),
    # Chat: in between.
    "chat": linear_profile(0.76, 0.010, 0.60),
    # Prose: open-ended text, ~0.5-0.6 per position.
    "prose": linear_profile(0.62, 0.012, 0.45),
    # A draft trained on another domain or language: speculation rarely lands.
    "mismatch": linear_profile(0.16, 0.010, 0.05),
    # The same, worse: with the measured EAGLE-3 step times, k = 0 wins at every batch
    # size above a few (one draft step costs 6-15 % of a target step there).
    "foreign": linear_profile(0.10, 0.005, 0.05),
    # Flat profiles of the daily-cycle trace (acceptance 0.85 at night, 0.5 at the peak).
    "a85": flat_profile(0.85),
    "a75": flat_profile(0.75),
    "a65": flat_profile(0.65),
    "a50": flat_profile(0.50),
}


def jittered(profile: tuple[float, ...], logit_shift: float) -> tuple[float, ...]:
    """Profile moved by a common logit shift: window-to-window mix variation."""
    if logit_shift == 0.0:
        return profile
    out = []
    for a in profile:
        z = math.log(a / (1.0 - a)) + logit_shift
        out.append(1.0 / (1.0 + math.exp(-z)))
    return tuple(out)


def accepted_length(alphas: tuple[float, ...], k: int) -> float:
    """Mean tokens per draft round, E(k) = 1 + sum_j prod_{i<=j} alpha_i."""
    e, prod = 1.0, 1.0
    for j in range(k):
        prod *= alphas[j]
        e += prod
    return e


def true_goodput(
    alphas: tuple[float, ...], cost: TableCost, batch_mix: tuple[tuple[int, float], ...], k: int
) -> float:
    """Tokens per busy second when a fraction ``f`` of the time runs at batch ``b``."""
    e = accepted_length(alphas, k)
    return sum(f * b * e / cost.step_s(b, k) for b, f in batch_mix)
