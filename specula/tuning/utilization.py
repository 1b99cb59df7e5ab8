"""Utilization on acceptance-adjusted load: demand over predicted capacity.

``utilization = demand / capacity``, both in tokens per second, for all ready pods of
one resource:

- **demand** = generated tokens per second over the window plus the queued work,
  ``waiting * r_seq``: the rate the waiting requests would take if they were being
  served at the per-sequence speed the running ones get now (``r_seq = generated
  tokens per second / running requests``; with nothing running, the model's speed of a
  lone sequence, ``E(k) / T(1, k)``).  A queue thus counts as the tokens per second it
  asks for, in the same unit as the generated tokens, without a guess at request
  lengths.
- **capacity** = ``ready_replicas * G(k; B_max)`` with ``G(k; B) = B * E(k) / T(B, k)``
  (:func:`specula.tuning.goodput.goodput`): what the pods emit at their largest batch
  ``B_max`` (``max_num_seqs``) given the current acceptance estimate ``E(k)``
  (:mod:`specula.tuning.acceptance`) and step-cost model ``T`` (:mod:`specula.tuning.cost`).

Capacity follows acceptance: when the draft starts missing (a new workload, a changed
model), ``E(k)`` falls, capacity falls with it and utilization rises at once, before
the longer decode times have filled the queues that a queue-length metric waits for.

The autoscaler keeps ``utilization`` near a target: desired replicas
``ceil(replicas * utilization / target)`` (the HPA algorithm for a ``Value`` metric).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specula.tuning._prom import Samples, parse_samples, total
from specula.tuning.acceptance import AcceptanceEstimate, expected_accepted_length
from specula.tuning.cost import StepCostModel
from specula.tuning.goodput import BatchDistribution, goodput, schedule_k
from specula.tuning.metrics import RuntimeMetrics
from specula.tuning.state import TuningSettings, TuningState


@dataclass(frozen=True)
class QueueGauges:
    """Requests in the pods' schedulers at a scrape (``num_requests_running`` and
    ``num_requests_waiting`` gauges, ``specula:`` or ``vllm:``), summed over pods."""

    requests_running: float = 0.0
    requests_waiting: float = 0.0

    @classmethod
    def from_prometheus_text(cls, text: str) -> QueueGauges:
        """Gauges of one ``/metrics`` body (summed over label sets such as ``engine``).

        Raises:
            ValueError: invalid exposition.
        """
        return cls.from_samples(parse_samples(text))

    @classmethod
    def from_samples(cls, samples: Samples) -> QueueGauges:
        return cls(
            requests_running=total(samples, "num_requests_running"),
            requests_waiting=total(samples, "num_requests_waiting"),
        )

    def __add__(self, other: QueueGauges) -> QueueGauges:
        return QueueGauges(
            self.requests_running + other.requests_running,
            self.requests_waiting + other.requests_waiting,
        )


@dataclass(frozen=True)
class Utilization:
    """One utilization measurement (all figures for all ready pods together)."""

    utilization: float
    """``demand / capacity``; above 1 the pods cannot keep up."""
    demand_tokens_per_second: float
    capacity_tokens_per_second: float
    generation_tokens_per_second: float
    """Tokens generated per second over the window."""
    per_sequence_tokens_per_second: float
    """``r_seq``: the speed a queued request is counted at."""


def _k_at(num_speculative_tokens: int, schedule: Sequence[Sequence[int]] | None, batch: int) -> int:
    return num_speculative_tokens if not schedule else schedule_k(schedule, batch)


def predicted_capacity(
    alphas: Sequence[float],
    num_speculative_tokens: int,
    cost: StepCostModel,
    max_num_seqs: int,
    ready_replicas: int,
    schedule: Sequence[Sequence[int]] | None = None,
) -> float:
    """Tokens per second ``ready_replicas`` pods emit at batch ``max_num_seqs``.

    Args:
        alphas: conditional acceptance rate per draft position (at least k of them).
        num_speculative_tokens: k in effect; with ``schedule`` (``[[start, end, k],
            ...]``) the schedule's k at ``max_num_seqs`` is used instead.
        cost: step-time model T(B, k) in seconds.

    Raises:
        ValueError: ``max_num_seqs`` < 1 or fewer alphas than k.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    k = _k_at(num_speculative_tokens, schedule, max_num_seqs)
    if len(alphas) < k:
        raise ValueError(f"{len(alphas)} acceptance rates for k={k}")
    return ready_replicas * goodput(k, alphas, cost, BatchDistribution.single(max_num_seqs))


def compute_utilization(
    *,
    generation_tokens: float,
    window_seconds: float,
    queue: QueueGauges,
    alphas: Sequence[float],
    num_speculative_tokens: int,
    cost: StepCostModel,
    max_num_seqs: int,
    ready_replicas: int,
    schedule: Sequence[Sequence[int]] | None = None,
) -> Utilization:
    """Utilization of one resource over one window (see the module docstring).

    Args:
        generation_tokens: tokens generated in the window, all pods.
        window_seconds: wall-clock length of the window.
        queue: running and waiting requests at the window's end, all pods.
        alphas, num_speculative_tokens, cost, max_num_seqs, schedule: see
            :func:`predicted_capacity`.
        ready_replicas: pods serving (>= 1).

    Raises:
        ValueError: ``window_seconds`` <= 0, ``ready_replicas`` < 1, or as
            :func:`predicted_capacity`.
    """
    if window_seconds <= 0:
        raise ValueError(f"window_seconds must be > 0, got {window_seconds}")
    if ready_replicas < 1:
        raise ValueError(f"ready_replicas must be >= 1, got {ready_replicas}")
    capacity = predicted_capacity(
        alphas, num_speculative_tokens, cost, max_num_seqs, ready_replicas, schedule
    )
    rate = max(generation_tokens, 0.0) / window_seconds
    if queue.requests_running >= 1:
        per_sequence = rate / queue.requests_running
    else:
        k1 = _k_at(num_speculative_tokens, schedule, 1)
        per_sequence = expected_accepted_length(alphas, k1) / cost.predict(1, k1)
    demand = rate + max(queue.requests_waiting, 0.0) * per_sequence
    return Utilization(
        utilization=demand / capacity,
        demand_tokens_per_second=demand,
        capacity_tokens_per_second=capacity,
        generation_tokens_per_second=rate,
        per_sequence_tokens_per_second=per_sequence,
    )


def utilization_from_state(
    state: TuningState,
    settings: TuningSettings,
    window: RuntimeMetrics,
    window_seconds: float,
    queue: QueueGauges,
    max_num_seqs: int,
    ready_replicas: int,
) -> Utilization:
    """:func:`compute_utilization` with acceptance and cost from the tuner's state
    (after :func:`~specula.tuning.policy.decide` took ``window``): the posterior-mean
    acceptance of each position and the step-cost model fitted to the decayed step
    times, at the state's k (or schedule).

    Raises:
        ValueError: as :func:`compute_utilization`.
    """
    schedule = [list(r) for r in state.schedule] if state.schedule else None
    k_max = max(
        [state.num_speculative_tokens, settings.max_speculative_tokens,
         *(r[2] for r in schedule or ())]
    )
    estimate = AcceptanceEstimate.from_evidence(
        state.acceptance_trials,
        state.acceptance_accepted,
        k_max,
        settings.prior,
        settings.max_effective_trials,
    )
    cost = StepCostModel.fit(state.cost_observations(), prior=settings.cost_prior)
    return compute_utilization(
        generation_tokens=window.generation_tokens,
        window_seconds=window_seconds,
        queue=queue,
        alphas=estimate.means,
        num_speculative_tokens=state.num_speculative_tokens,
        cost=cost,
        max_num_seqs=max_num_seqs,
        ready_replicas=ready_replicas,
        schedule=schedule,
    )
