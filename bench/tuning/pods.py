"""Simulated runtime pods: cumulative counters rendered as Prometheus text.

Each interval a pod runs ``INTERVAL_S`` seconds of steps, each drafting the k in effect
for its batch size (one k, or a per-batch-size schedule as the runtime executes it); drafts
are accepted position by position (a_0 ~ Bin(drafts, alpha_0), a_j ~ Bin(a_{j-1},
alpha_j), the chain rule of speculative acceptance), and step times get 2 % noise.
The tuner reads only :meth:`SimPod.exposition`, exactly as it reads a real pod.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from .model import TableCost

INTERVAL_S = 30.0
STEP_NOISE_SD = 0.02
MAX_K = 8


def binomial(rng: random.Random, n: int, p: float) -> int:
    """Binomial draw: exact for small n, normal approximation above (n p (1-p) > 25)."""
    if n <= 0:
        return 0
    var = n * p * (1.0 - p)
    if var < 25.0:
        return sum(1 for _ in range(n) if rng.random() < p)
    return min(n, max(0, round(rng.gauss(n * p, math.sqrt(var)))))


def batch_bucket(batch_size: int) -> str:
    if batch_size <= 2:
        return str(batch_size)
    upper = 1 << (batch_size - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


def k_for_batch(schedule: tuple[tuple[int, int, int], ...], batch_size: int) -> int:
    """The runtime's rule: the range holding the batch size, else the last range's k."""
    for start, end, k in schedule:
        if start <= batch_size <= end:
            return k
    return schedule[-1][2]


@dataclass
class SimPod:
    name: str
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=lambda: [0] * MAX_K)
    generation_tokens: int = 0
    steps: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def restart(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = self.generation_tokens = 0
        self.per_pos = [0] * MAX_K
        self.steps = {}

    def run_interval(
        self,
        rng: random.Random,
        cost: TableCost,
        alphas: tuple[float, ...],
        batch_mix: tuple[tuple[int, float], ...],
        k: int,
        schedule: tuple[tuple[int, int, int], ...] | None = None,
    ) -> None:
        for b, frac in batch_mix:
            kb = k if schedule is None else k_for_batch(schedule, b)
            t = cost.step_s(b, kb)
            n_steps = round(frac * INTERVAL_S / t)
            key = (batch_bucket(b), kb)
            series = self.steps.setdefault(key, [0.0, 0.0])
            series[0] += n_steps
            series[1] += n_steps * t * (1.0 + rng.gauss(0.0, STEP_NOISE_SD))
            drafts = n_steps * b if kb > 0 else 0
            reached, accepted = drafts, 0
            for j in range(kb):
                reached = binomial(rng, reached, alphas[j])
                self.per_pos[j] += reached
                accepted += reached
            self.drafts += drafts
            self.draft_tokens += drafts * kb
            self.accepted += accepted
            # Every sequence emits its accepted draft tokens plus one bonus/recovered
            # token per step; at k = 0 that is one token per sequence per step.
            self.generation_tokens += n_steps * b + accepted

    def exposition(self, model: str = "sim") -> str:
        lab = f'model_name="{model}"'
        lines = []
        for name, value in (
            ("spec_decode_num_drafts", self.drafts),
            ("spec_decode_num_draft_tokens", self.draft_tokens),
            ("spec_decode_num_accepted_tokens", self.accepted),
            ("generation_tokens", self.generation_tokens),
        ):
            lines += [f"# TYPE specula:{name} counter", f"specula:{name}_total{{{lab}}} {float(value)}"]
        lines.append("# TYPE specula:spec_decode_num_accepted_tokens_per_pos counter")
        for j, v in enumerate(self.per_pos):
            lines.append(
                f'specula:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{j}"}} {float(v)}'
            )
        lines.append("# TYPE specula:step_duration_seconds histogram")
        for (bucket, k), (count, total) in sorted(self.steps.items()):
            sl = f'{lab},batch_bucket="{bucket}",num_speculative_tokens="{k}"'
            lines.append(f'specula:step_duration_seconds_bucket{{{sl},le="+Inf"}} {count}')
            lines.append(f"specula:step_duration_seconds_sum{{{sl}}} {total}")
            lines.append(f"specula:step_duration_seconds_count{{{sl}}} {count}")
        return "\n".join(lines) + "\n"
