"""Workload traces: phases of acceptance profile x load, one interval = one scrape window.

Every trace starts at the operator's default k = 3.  Per interval the acceptance
profile gets a common logit shift ~ N(0, 0.15) (window-to-window variation of the
request mix), and each pod's time is split 25/50/25 over 0.75x / 1x / 1.25x the
phase's batch size, so no window is perfectly clean.  The random draws of a trace are
made once and shared by every strategy, so comparisons are paired.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tuning.model import GPU_8B, GPU_8B_SLOW_DRAFT, PROFILES, RooflineCost, jittered

MAX_BATCH = 128
LOGIT_JITTER_SD = 0.15


@dataclass(frozen=True)
class Phase:
    profile: str
    batch_size: int
    intervals: int


@dataclass(frozen=True)
class Trace:
    name: str
    kind: str
    """``stationary``, ``shifting`` or ``k0`` (no speculation is the best fixed k)."""
    phases: tuple[Phase, ...]
    cost: RooflineCost = GPU_8B
    cost_name: str = "GPU_8B"
    restart_pod_at: int | None = None
    """Interval at which pod 1 restarts (its counters reset to zero)."""
    seed: int = 0


@dataclass(frozen=True)
class Interval:
    phase: int
    profile: str
    alphas: tuple[float, ...]
    batch_mix: tuple[tuple[int, float], ...]
    """(batch size, fraction of busy time)."""


def batch_mix(batch_size: int) -> tuple[tuple[int, float], ...]:
    sizes = [max(1, min(MAX_BATCH, round(batch_size * f))) for f in (0.75, 1.0, 1.25)]
    mix: dict[int, float] = {}
    for b, w in zip(sizes, (0.25, 0.5, 0.25), strict=True):
        mix[b] = mix.get(b, 0.0) + w
    return tuple(sorted(mix.items()))


def expand(trace: Trace) -> list[Interval]:
    rng = random.Random(f"trace:{trace.name}:{trace.seed}")
    out = []
    for i, phase in enumerate(trace.phases):
        for _ in range(phase.intervals):
            shift = rng.gauss(0.0, LOGIT_JITTER_SD)
            out.append(
                Interval(
                    phase=i,
                    profile=phase.profile,
                    alphas=jittered(PROFILES[phase.profile], shift),
                    batch_mix=batch_mix(phase.batch_size),
                )
            )
    return out


def _p(profile: str, batch: int, n: int) -> Phase:
    return Phase(profile, batch, n)


TRACES: tuple[Trace, ...] = (
    # Stationary: one workload for the whole trace (120 intervals = 1 h at 30 s).
    Trace("code-b1", "stationary", (_p("code", 1, 120),)),
    Trace("code-b32", "stationary", (_p("code", 32, 120),)),
    Trace("chat-b16-restart", "stationary", (_p("chat", 16, 120),), restart_pod_at=60),
    Trace("prose-b8", "stationary", (_p("prose", 8, 120),)),
    Trace("prose-b128", "stationary", (_p("prose", 128, 120),)),
    # Shifting: content and load phases of 30-60 intervals.
    Trace(
        "diurnal-code", "shifting",
        (_p("code", 2, 40), _p("code", 32, 30), _p("code", 128, 50), _p("code", 32, 30),
         _p("code", 2, 40)),
    ),
    Trace(
        "code-prose-load", "shifting",
        (_p("code", 2, 40), _p("prose", 96, 40), _p("code", 4, 40), _p("prose", 128, 40)),
    ),
    Trace(
        "mixed-day", "shifting",
        (_p("prose", 1, 30), _p("code", 8, 45), _p("chat", 64, 45), _p("prose", 128, 30),
         _p("code", 16, 45), _p("chat", 2, 30)),
        restart_pod_at=100,
    ),
    Trace(
        "code-prose-b8", "shifting",
        (_p("code", 8, 45), _p("prose", 8, 45), _p("code", 8, 45), _p("prose", 8, 45)),
    ),
    Trace(
        "code-translate", "shifting",
        (_p("code", 16, 50), _p("mismatch", 64, 50), _p("code", 16, 50)),
    ),
    # Speculation does not pay: a draft from another domain with an expensive draft model.
    Trace(
        "mismatch-slow-b32", "k0", (_p("mismatch", 32, 120),),
        cost=GPU_8B_SLOW_DRAFT, cost_name="GPU_8B_SLOW_DRAFT",
    ),
    Trace(
        "mismatch-slow-load", "k0",
        (_p("mismatch", 8, 40), _p("mismatch", 128, 40), _p("mismatch", 2, 40)),
        cost=GPU_8B_SLOW_DRAFT, cost_name="GPU_8B_SLOW_DRAFT",
    ),
)
