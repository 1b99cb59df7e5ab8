"""Ground truth of the simulator: acceptance profiles and step-time curves.

Nothing here is visible to the tuner; it sees only the Prometheus text the simulated
pods expose.  The numbers are documented defaults, not GPU measurements: the GPU
engine's measured step-time curves do not exist yet.

Step time is a roofline, deliberately a different shape from the tuner's bilinear
model so the tuner's fit is tested under misspecification:

    T(B, k) = overhead + max(weights + B * kv, B * (k + 1) * flops_per_token)
              + k * (draft_overhead + max(draft_weights, B * draft_flops) + B * draft_kv)

``GPU_8B`` is an ~8B bf16 target on one H100-class GPU (16 GB of weights at ~2.5 TB/s
effective = 6.4 ms; ~1k tokens of context = 0.054 ms of KV reads per sequence; ~16
GFLOP per token at ~400 TFLOP/s = 0.04 ms) with a one-layer EAGLE-style draft head.
``GPU_8B_SLOW_DRAFT`` replaces the head by a separate ~1.5B draft model (3 GB of
weights per draft step), the case where drafting is expensive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RooflineCost:
    """True step time in seconds (see module docstring); all fields in milliseconds."""

    overhead_ms: float
    weights_ms: float
    kv_per_seq_ms: float
    per_token_ms: float
    draft_overhead_ms: float
    draft_weights_ms: float
    draft_per_token_ms: float
    draft_kv_per_seq_ms: float

    def step_s(self, batch_size: int, k: int) -> float:
        target = self.overhead_ms + max(
            self.weights_ms + batch_size * self.kv_per_seq_ms,
            batch_size * (k + 1) * self.per_token_ms,
        )
        draft = k * (
            self.draft_overhead_ms
            + max(self.draft_weights_ms, batch_size * self.draft_per_token_ms)
            + batch_size * self.draft_kv_per_seq_ms
        )
        return (target + draft) / 1000.0


GPU_8B = RooflineCost(
    overhead_ms=1.5, weights_ms=6.4, kv_per_seq_ms=0.054, per_token_ms=0.04,
    draft_overhead_ms=0.3, draft_weights_ms=0.25, draft_per_token_ms=0.0013,
    draft_kv_per_seq_ms=0.0017,
)
GPU_8B_SLOW_DRAFT = RooflineCost(
    overhead_ms=1.5, weights_ms=6.4, kv_per_seq_ms=0.054, per_token_ms=0.04,
    draft_overhead_ms=0.6, draft_weights_ms=1.2, draft_per_token_ms=0.008,
    draft_kv_per_seq_ms=0.01,
)


def linear_profile(first: float, step: float, floor: float, n: int = 16) -> tuple[float, ...]:
    """Conditional acceptance per position: ``first - step * j``, at least ``floor``."""
    return tuple(max(first - step * j, floor) for j in range(n))


PROFILES: dict[str, tuple[float, ...]] = {
    # Code: repetitive, highly predictable; EAGLE-class heads reach ~0.85-0.9 per position.
    "code": linear_profile(0.90, 0.006, 0.80),
    # Chat: in between.
    "chat": linear_profile(0.76, 0.010, 0.60),
    # Prose: open-ended text, ~0.5-0.6 per position.
    "prose": linear_profile(0.62, 0.012, 0.45),
    # A draft trained on another domain or language: speculation barely ever lands.
    "mismatch": linear_profile(0.16, 0.010, 0.05),
}


def jittered(profile: tuple[float, ...], logit_shift: float) -> tuple[float, ...]:
    """Profile moved by a common logit shift: window-to-window mix variation."""
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
    alphas: tuple[float, ...], cost: RooflineCost, batch_mix: tuple[tuple[int, float], ...], k: int
) -> float:
    """Tokens per busy second when a fraction ``f`` of the time runs at batch ``b``."""
    e = accepted_length(alphas, k)
    return sum(f * b * e / cost.step_s(b, k) for b, f in batch_mix)
