"""``spec.autoscaling`` and ``status.autoscaling``: replicas scaled on acceptance-adjusted load.

The operator measures each resource's utilization (demand over the capacity predicted
from the current acceptance and step-cost model, see
:mod:`specula.tuning.utilization`) and renders an autoscaler for it: a KEDA
``ScaledObject`` polling the operator's HTTP endpoint (``provider: keda``) or an
``autoscaling/v2`` HorizontalPodAutoscaler reading the operator's Prometheus gauge
through an adapter (``provider: hpa``).  Either writes ``spec.replicas`` through the
resource's ``scale`` subresource; the operator only carries it to the Deployment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from specula.api.base import ApiModel

AutoscalingProvider = Literal["keda", "hpa"]


class AutoscalingSpec(ApiModel):
    """Scale replicas so that utilization stays near ``targetUtilization``."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.minReplicas <= self.maxReplicas",
                    "message": "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
                    "fieldPath": ".minReplicas",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    min_replicas: int = Field(default=1, ge=1, le=1000)
    """Fewest replicas.  At least 1: demand is measured on running pods, so a resource
    scaled to zero could not see load arrive."""
    max_replicas: int = Field(ge=1, le=1000)
    """Most replicas."""
    target_utilization: float = Field(default=0.7, gt=0.0, le=1.0)
    """Utilization (demand / predicted capacity, a fraction) the autoscaler keeps the
    resource at: desired replicas = ceil(replicas * utilization / targetUtilization)."""
    provider: AutoscalingProvider = "keda"
    """``keda``: a KEDA ScaledObject with a ``metrics-api`` trigger on the operator's
    HTTP endpoint; ``hpa``: an ``autoscaling/v2`` HorizontalPodAutoscaler with an
    ``Object`` metric ``specula_operator_utilization`` (served by a Prometheus adapter)."""

    @model_validator(mode="after")
    def _min_le_max(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas ({self.min_replicas}) must not exceed "
                f"autoscaling.maxReplicas ({self.max_replicas})"
            )
        return self

    def clamp(self, replicas: int) -> int:
        """``replicas`` within ``[minReplicas, maxReplicas]``."""
        return min(max(replicas, self.min_replicas), self.max_replicas)


class AutoscalingStatus(ApiModel):
    """The last utilization measurement (written once per tuning interval)."""

    model_config = ConfigDict(extra="ignore")

    utilization: float | None = None
    """Demand over predicted capacity (fraction; above 1: overloaded)."""
    demand_tokens_per_second: float | None = None
    """Tokens generated per second over the window plus the rate the waiting requests
    would take at the current per-sequence speed (all pods)."""
    capacity_tokens_per_second: float | None = None
    """Tokens per second the ready pods can emit at their largest batch, predicted from
    the current acceptance estimate, k and the step-cost model."""
    current_replicas: int | None = None
    """Ready pods counted in the capacity."""
    desired_replicas: int | None = None
    """``ceil(currentReplicas * utilization / targetUtilization)`` within
    ``[minReplicas, maxReplicas]``: what the autoscaler is expected to ask for."""
    requests_waiting: float | None = None
    """Requests queued in the pods at the last scrape (sum)."""
    last_update_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    """RFC 3339 time of the measurement."""
