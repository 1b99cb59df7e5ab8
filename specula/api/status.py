"""Pydantic models of the ``SpeculativeModel`` status: conditions, the speculation in
effect and measured, the tuner's history and memory, and the autoscaling measurement.
Written by the operator only; see :mod:`specula.api.models` for the spec.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from specula.api.autoscaling import AutoscalingStatus
from specula.api.base import ApiModel, FreeForm

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """One aspect of the observed state (``metav1.Condition`` fields)."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(max_length=316)
    """``Ready``, ``Progressing``, ``Degraded`` or ``Tuned``."""
    status: ConditionStatus
    reason: str = Field(default="", max_length=1024)
    """CamelCase machine-readable cause of the last transition or update."""
    message: str = Field(default="", max_length=32768)
    """Human-readable details."""
    last_transition_time: str | None = Field(
        default=None, json_schema_extra={"format": "date-time"}
    )
    """RFC 3339 time at which ``status`` last changed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """``metadata.generation`` the condition was computed from."""


class SpeculationStatus(ApiModel):
    """Speculation in effect and what the tuner measured over its last window."""

    model_config = ConfigDict(extra="ignore")

    num_speculative_tokens: int | None = None
    """k in effect on the pods; under a per-batch-size schedule, its k at the batch
    size the last window mostly ran at."""
    num_speculative_tokens_per_batch_size: (
        list[Annotated[list[int], Field(min_length=3, max_length=3)]] | None
    ) = Field(default=None, max_length=32)
    """Per-batch-size schedule in effect on the pods, ``[[start, end, k], ...]``
    (inclusive ranges of the number of requests in a step, the first from 1; above the
    last range its k), as ``tuning.perBatchSize`` applies it; unset while one k is in
    effect."""
    recommended_num_speculative_tokens: int | None = None
    """k the tuner found best in its last decision (applied only in ``Auto`` mode)."""
    schedule: list[Annotated[list[int], Field(min_length=3, max_length=3)]] | None = Field(
        default=None, max_length=32
    )
    """Best per-batch-size k for the measured acceptance, ``[[start, end, k], ...]``
    (inclusive ranges of the number of requests in a step, the first from 1), in the
    form of the runtime's ``num_speculative_tokens_per_batch_size``; a recommendation
    (the schedule applied is ``numSpeculativeTokensPerBatchSize``)."""
    acceptance_rate: float | None = None
    """Accepted / proposed draft tokens over the last window with drafts (all pods)."""
    mean_acceptance_length: float | None = None
    """Tokens emitted per draft round, ``1 + accepted / drafts``, over that window."""
    per_position_acceptance_rate: list[float] | None = Field(default=None, max_length=16)
    """Posterior mean conditional acceptance rate of draft positions 0 .. k-1."""
    goodput_tokens_per_second: float | None = None
    """Measured tokens emitted per second of engine step time, summed over pods' steps."""
    predicted_goodput_tokens_per_second: float | None = None
    """Goodput the cost model predicts for the recommended k at the window's batch sizes."""
    sampled_drafts: int | None = None
    """Draft rounds behind the acceptance figures (that window, all pods)."""
    measured_pods: int | None = None
    """Pods scraped successfully in the last window."""
    last_update_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    """RFC 3339 time of the last measurement."""


class TuningHistoryEntry(ApiModel):
    """One change of k decided by the tuner (applied, or recommended)."""

    model_config = ConfigDict(extra="ignore")

    time: str = Field(json_schema_extra={"format": "date-time"})
    """RFC 3339 time of the decision."""
    from_: int = Field(alias="from", ge=0)
    """k before."""
    to: int = Field(ge=0)
    """k chosen."""
    reason: str = Field(max_length=64)
    """Policy reason: ``HigherGoodput``, ``Explore``, ``Revert`` or ``Bounds``."""
    predicted_gain: float | None = None
    """Predicted goodput gain of ``to`` over ``from`` (fraction; 0.1 is +10%)."""
    applied: bool = False
    """Whether the change was applied to the pods (``Auto``) or only recommended."""
    message: str = Field(default="", max_length=1024)


class TunerStatus(ApiModel):
    """The tuner's memory, kept on the object so an operator restart loses nothing.
    Internal to the operator; its content may change between versions."""

    model_config = ConfigDict(extra="ignore")

    state: FreeForm | None = None
    """The tuning policy's state as JSON (evidence, cooldown start, k before the last
    change, goodput before it, exploration budget, blacklist)."""
    baselines: FreeForm | None = None
    """Pod -> the counters of its last scrape, so the next window is their increase."""
    last_scrape_time: float | None = None
    """Unix seconds of the last scrape (start of the current window)."""
    pending_pods: list[str] = Field(default_factory=list, max_length=1024)
    """Ready pods that have not accepted the k in effect yet (retried every tick)."""

class SpeculativeModelStatus(ApiModel):
    """Observed state, written by the operator."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    """``metadata.generation`` of the spec the children were last built from."""
    replicas: int | None = None
    """Pods of the runtime Deployment (its ``status.replicas``)."""
    ready_replicas: int | None = None
    """Pods passing their readiness probe (the Deployment's ``status.readyReplicas``)."""
    selector: str | None = None
    """Label selector of the pods, for the ``scale`` subresource (and so for HPA)."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    """``Ready``, ``Progressing``, ``Degraded`` and ``Tuned``, one entry per type."""
    speculation: SpeculationStatus | None = None
    """Speculation in effect and the tuner's last measurement."""
    tuning_history: list[TuningHistoryEntry] | None = Field(default=None, max_length=10)
    """The last changes of k the tuner decided, oldest first."""
    tuner: TunerStatus | None = None
    """The tuner's state (operator-internal)."""
    autoscaling: AutoscalingStatus | None = None
    """Utilization measured for the autoscaler (while ``spec.autoscaling`` is set)."""
