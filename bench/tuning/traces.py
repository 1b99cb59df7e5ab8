"""Workload traces: phases of acceptance profile x load, one interval = one scrape window.

Every trace starts at the CRD's default k = 3.  Per interval the acceptance profile gets a
common logit shift ~ N(0, ``Trace.jitter_sd``) (window-to-window variation of the request
mix), and each pod's busy time is split over batch sizes around the phase's: by default
25/50/25 % over 0.75x / 1x / 1.25x, so no window is perfectly clean; a ``bursty`` phase
splits it 50/50 between 1/16 of its batch size and the whole of it (requests arriving in
bursts: the batch varies within an interval).  The random draws of a trace are made once
and shared by every strategy, so comparisons are paired.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .model import PROFILES, TableCost, jittered, measured_h100

MAX_BATCH = 128
LOGIT_JITTER_SD = 0.15
AROUND = ((0.75, 0.25), (1.0, 0.5), (1.25, 0.25))
"""Default spread of a window's busy time over batch sizes: (factor, time fraction)."""
BURSTY = ((1 / 16, 0.5), (1.0, 0.5))
"""Half the time at 1/16 of the phase's batch size, half at all of it."""
H100 = measured_h100()


@dataclass(frozen=True)
class Phase:
    profile: str
    batch_size: int
    intervals: int
    spread: tuple[tuple[float, float], ...] = AROUND
    """(factor of ``batch_size``, fraction of busy time) of every interval."""


@dataclass(frozen=True)
class Trace:
    name: str
    kind: str
    """``stationary``, ``shifting`` or ``k0`` (no speculation is the best fixed k)."""
    phases: tuple[Phase, ...]
    cost: TableCost = field(default=H100, repr=False)
    restart_pod_at: int | None = None
    """Interval at which pod 1 restarts (its counters reset to zero)."""
    seed: int = 0
    jitter_sd: float = LOGIT_JITTER_SD
    profiles: dict[str, tuple[float, ...]] = field(default_factory=lambda: PROFILES, repr=False)

    @property
    def phase_lengths(self) -> list[int]:
        return [p.intervals for p in self.phases]


@dataclass(frozen=True)
class Interval:
    phase: int
    profile: str
    alphas: tuple[float, ...]
    batch_mix: tuple[tuple[int, float], ...]
    """(batch size, fraction of busy time)."""


def batch_mix(batch_size: int, spread: tuple[tuple[float, float], ...] = AROUND) -> tuple[tuple[int, float], ...]:
    mix: dict[int, float] = {}
    for f, w in spread:
        b = max(1, min(MAX_BATCH, round(batch_size * f)))
        mix[b] = mix.get(b, 0.0) + w
    return tuple(sorted(mix.items()))


def expand(trace: Trace) -> list[Interval]:
    rng = random.Random(f"trace:{trace.name}:{trace.seed}")
    out = []
    for i, phase in enumerate(trace.phases):
        for _ in range(phase.intervals):
            shift = rng.gauss(0.0, trace.jitter_sd) if trace.jitter_sd > 0 else 0.0
            out.append(
                Interval(
                    phase=i,
                    profile=phase.profile,
                    alphas=jittered(trace.profiles[phase.profile], shift),
                    batch_mix=batch_mix(phase.batch_size, phase.spread),
                )
            )
    return out


def _p(profile: str, batch: int, n: int, spread: tuple[tuple[float, float], ...] = AROUND) -> Phase:
    return Phase(profile, batch, n, spread)


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
    # Daily cycle: batch 1 -> 64 -> 1 while acceptance falls 0.85 -> 0.5 at the peak (the
    # daytime mix is broader) and comes back.
    Trace(
        "daily-cycle", "shifting",
        (_p("a85", 1, 30), _p("a75", 8, 20), _p("a65", 32, 20), _p("a50", 64, 40),
         _p("a65", 32, 20), _p("a75", 8, 20), _p("a85", 1, 30)),
    ),
    # Mismatched domain: at low load the users the draft was trained for; the load peaks
    # come from another domain where acceptance collapses.
    Trace(
        "mismatched-domain", "shifting",
        (_p("code", 4, 40), _p("mismatch", 64, 40), _p("code", 8, 40), _p("mismatch", 128, 40)),
    ),
    # Speculation does not pay: a draft from another domain.
    Trace("foreign-b32", "k0", (_p("foreign", 32, 120),)),
    Trace(
        "foreign-load", "k0",
        (_p("foreign", 16, 40), _p("foreign", 128, 40), _p("foreign", 32, 40)),
    ),
    # Batch varying within every interval (bursty arrivals): where per-batch-size
    # schedules can win, since one k must serve batch 4-8 and batch 64-128 at once.
    Trace("bursty-code", "stationary", (_p("code", 128, 120, BURSTY),)),
    Trace(
        "bursty-shift", "shifting",
        (_p("chat", 64, 40, BURSTY), _p("code", 128, 40, BURSTY), _p("prose", 128, 40, BURSTY)),
    ),
)
