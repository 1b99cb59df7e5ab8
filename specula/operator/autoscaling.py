"""Pure autoscaling steps of the operator: a tuning window in, ``status.autoscaling`` out.

Each tuning window (:mod:`specula.operator.tuning`) that measured pods also yields the
resource's utilization (:func:`specula.tuning.utilization.utilization_from_state`),
recorded in ``status.autoscaling`` and served to the autoscalers: over HTTP at
:func:`utilization_path` for KEDA's ``metrics-api`` scaler, and as the Prometheus gauge
:data:`UTILIZATION_METRIC` for an HPA behind a Prometheus adapter
(:mod:`specula.operator.http_server`).
"""

from __future__ import annotations

import math
from typing import Protocol

from specula.api.autoscaling import AutoscalingSpec, AutoscalingStatus
from specula.api.models import GROUP, PLURAL, VERSION
from specula.tuning import QueueGauges, RuntimeMetrics, TuningSettings, TuningState
from specula.tuning.utilization import utilization_from_state

SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject")
HPA = ("autoscaling/v2", "HorizontalPodAutoscaler")
PROVIDER_KINDS = {"keda": SCALED_OBJECT, "hpa": HPA}
"""(apiVersion, kind) of the autoscaler object the operator renders for each provider."""

UTILIZATION_METRIC = "specula_operator_utilization"
"""Gauge the operator exports per resource (labels ``namespace``, ``name``), and the
``Object`` metric name the rendered HPAs ask for."""


class UtilizationSink(Protocol):
    """Where the tuner hands each new utilization (the operator's HTTP server)."""

    def record(self, namespace: str, name: str, utilization: float, time: float) -> None:
        """A resource's utilization measured at Unix ``time``."""

    def discard(self, namespace: str, name: str) -> None:
        """The resource is gone or no longer autoscaled."""


def utilization_path(namespace: str, name: str) -> str:
    """Path of a resource's utilization on the operator's HTTP server, shaped like the
    resource's own API path: ``/apis/specula.dev/v1alpha1/namespaces/<ns>/
    speculativemodels/<name>/utilization``.  The answer is JSON, ``{"utilization": x,
    ...}``."""
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/utilization"


def desired_replicas(
    autoscaling: AutoscalingSpec, current_replicas: int, utilization: float
) -> int:
    """``ceil(current * utilization / target)`` within the bounds: the HPA algorithm for
    a ``Value`` target (``pkg/controller/podautoscaler/replica_calculator.go``, without
    its 10% tolerance band)."""
    wanted = math.ceil(current_replicas * utilization / autoscaling.target_utilization - 1e-9)
    return autoscaling.clamp(wanted)


def autoscaling_status(
    autoscaling: AutoscalingSpec,
    state: TuningState,
    settings: TuningSettings,
    window: RuntimeMetrics,
    window_seconds: float | None,
    queue: QueueGauges,
    window_pods: int,
    max_num_seqs: int,
    now_rfc3339: str,
) -> AutoscalingStatus | None:
    """``status.autoscaling`` after one window, or ``None`` when no pod was measured
    over the whole window (the first scrape of a resource or of its only pods).

    Args:
        state: the tuner's state after the window's decision.
        window: counter increases over the window, all pods.
        window_seconds: wall-clock length of the window.
        queue: running and waiting requests at the window's end, on ``window_pods``.
        window_pods: ready pods measured over the whole window (the replicas counted
            in the capacity; a pod first seen now has added no tokens yet).
        max_num_seqs: the pods' largest batch.
    """
    if window_pods < 1 or window_seconds is None or window_seconds <= 0:
        return None
    u = utilization_from_state(
        state, settings, window, window_seconds, queue, max_num_seqs, window_pods
    )
    return AutoscalingStatus(
        utilization=round(u.utilization, 6),
        demand_tokens_per_second=round(u.demand_tokens_per_second, 3),
        capacity_tokens_per_second=round(u.capacity_tokens_per_second, 3),
        current_replicas=window_pods,
        desired_replicas=desired_replicas(autoscaling, window_pods, u.utilization),
        requests_waiting=queue.requests_waiting,
        last_update_time=now_rfc3339,
    )
