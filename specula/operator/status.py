"""Pure status computation: conditions ``Ready``/``Progressing``/``Degraded`` with
``observedGeneration``, following the Kubernetes API conventions for conditions
(``metav1.Condition``): ``lastTransitionTime`` changes only when a condition's
``status`` flips, so re-running a reconcile on an unchanged world writes nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from specula.api.models import Condition, SpeculationStatus, SpeculativeModelStatus

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
TUNED = "Tuned"
"""Written by the tuner (:mod:`specula.operator.tuner`), never by a reconcile."""
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED)

# Reasons.  A problem reason is used for all three conditions while it lasts.
REASON_INVALID_SPEC = "InvalidSpec"
REASON_METHOD_NOT_SUPPORTED = "MethodNotSupported"
REASON_DRAFT_MODEL_REQUIRED = "DraftModelRequired"
REASON_APPLY_FAILED = "ApplyFailed"
REASON_INVALID_ENGINE_CONFIG = "InvalidEngineConfig"
"""The spec (or the tuner's k) renders an engine configuration the engine would refuse."""
REASON_REPLICAS_READY = "ReplicasReady"
REASON_REPLICAS_NOT_READY = "ReplicasNotReady"
REASON_SCALED_TO_ZERO = "ScaledToZero"
REASON_ROLLING_OUT = "RollingOut"
REASON_ROLLOUT_COMPLETE = "RolloutComplete"
REASON_AS_EXPECTED = "AsExpected"
REASON_REPLICA_FAILURE = "ReplicaFailure"
REASON_PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
REASON_MODEL_DOWNLOAD_FAILED = "ModelDownloadFailed"
REASON_CONTAINER_FAILED = "ContainerFailed"
REASON_CONTAINER_RESTARTING = "ContainerRestarting"
"""A container restarted (its liveness probe failed, or it exited 0) and is not ready
again yet, or waits in ``CrashLoopBackOff``, with no failed exit to report."""
REASON_IMAGE_PULL_FAILED = "ImagePullFailed"
"""A container cannot start: its image cannot be pulled."""
_IMAGE_PULL_WAITING = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")
POD_MESSAGE_LIMIT = 1024
"""Characters of a container's termination message kept in a condition."""
_DOWNLOAD_CONTAINER = "download"


def now_rfc3339() -> str:
    """Current UTC time, second precision, as ``metav1.Time`` serialises it."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[Condition], new: Condition, now: str
) -> list[Condition]:
    """``conditions`` with ``new`` replacing the entry of the same type.

    ``lastTransitionTime`` is kept from the old entry when ``status`` is unchanged
    and set to ``now`` when it flips (or the type is new); reason, message and
    observedGeneration always take the new values.  Order: existing types keep their
    place, a new type is appended.
    """
    out: list[Condition] = []
    found = False
    for old in conditions:
        if old.type != new.type:
            out.append(old)
            continue
        found = True
        keep = old.status == new.status and old.last_transition_time is not None
        out.append(new.model_copy(update={
            "last_transition_time": old.last_transition_time if keep else now
        }))
    if not found:
        out.append(new.model_copy(update={"last_transition_time": now}))
    return out


def get_condition(conditions: list[Condition], type_: str) -> Condition | None:
    """The condition of type ``type_``, or ``None``."""
    return next((c for c in conditions if c.type == type_), None)


@dataclass(frozen=True)
class Problem:
    """Why the desired state cannot be realised (reported as ``Degraded=True``)."""

    reason: str
    message: str


@dataclass(frozen=True)
class Observation:
    """What one reconcile saw: inputs of :func:`compute_status`."""

    generation: int
    """``metadata.generation`` of the resource."""
    selector: str
    """Label selector of the pods."""
    desired_replicas: int | None = None
    """``spec.replicas``; ``None`` when the spec did not parse."""
    num_speculative_tokens: int | None = None
    """``spec.speculator.numSpeculativeTokens``; ``None`` when the spec did not parse."""
    deployment: dict[str, Any] | None = None
    """The runtime Deployment as the API server returned it; ``None`` if absent."""
    problem: Problem | None = None
    tuning_mode: str | None = None
    """``spec.tuning.mode``; ``None`` when the spec did not parse."""
    pod_problem: Problem | None = None
    """A runtime pod's failed container (:func:`pod_failure`), reported as ``Degraded``
    while fewer replicas than desired are ready."""


def _restarts(cs: dict[str, Any]) -> str:
    """`` (restarted N times, <waiting reason>)`` for a container that restarted."""
    count = int(cs.get("restartCount") or 0)
    if count == 0:
        return ""
    waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
    times = "1 time" if count == 1 else f"{count} times"
    return f" (restarted {times}{', ' + waiting if waiting else ''})"


def _cut(message: str) -> str:
    if len(message) > POD_MESSAGE_LIMIT:
        return message[: POD_MESSAGE_LIMIT - 3] + "..."
    return message


def pod_failure(pods: list[dict[str, Any]]) -> Problem | None:
    """The first problem among ``pods``' containers (init containers first), in order:

    1. one that exited non-zero, now or in its last run while it waits to restart:
       reason ``ModelDownloadFailed`` for the ``download`` init container (its message
       says why: missing repository, refused token, full disk), else
       ``ContainerFailed``; the message is the pod, container, exit code, restarts and
       the container's termination message (``FallbackToLogsOnError``: its last log
       lines when it wrote none);
    2. one that restarted and is not ready (its liveness probe failed and the kubelet
       stopped it, which a draining runtime survives with exit 0), or waits in
       ``CrashLoopBackOff``: ``ContainerRestarting``, with the restart count and how
       its last run ended;
    3. one that waits for an image that cannot be pulled: ``ImagePullFailed``.

    Messages are cut to :data:`POD_MESSAGE_LIMIT` characters.  A container starting
    for the first time (not ready, never restarted) is no problem: the rollout says it.
    """
    candidates: list[tuple[int, Problem]] = []
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        pod_name = (pod.get("metadata") or {}).get("name")
        status = pod.get("status") or {}
        for statuses in (status.get("initContainerStatuses"), status.get("containerStatuses")):
            for cs in statuses or []:
                name = cs.get("name", "")
                state = cs.get("state") or {}
                last = (cs.get("lastState") or {}).get("terminated")
                terminated = state.get("terminated")
                if not (terminated and terminated.get("exitCode")):
                    terminated = last
                    if not (terminated and terminated.get("exitCode")) or cs.get("ready"):
                        terminated = None
                if terminated is not None:
                    text = (terminated.get("message") or terminated.get("reason") or "").strip()
                    reason = (
                        REASON_MODEL_DOWNLOAD_FAILED if name == _DOWNLOAD_CONTAINER
                        else REASON_CONTAINER_FAILED
                    )
                    return Problem(reason, _cut(
                        f"pod {pod_name}: container {name} exited "
                        f"{terminated.get('exitCode')}{_restarts(cs)}: {text}"
                    ))
                if cs.get("ready"):
                    continue
                waiting = (state.get("waiting") or {})
                if int(cs.get("restartCount") or 0) > 0 or waiting.get("reason") == "CrashLoopBackOff":
                    ended = ""
                    if last:
                        how = (last.get("message") or last.get("reason") or "").strip()
                        ended = f"; last run exited {last.get('exitCode', 0)}"
                        ended += f": {how}" if how else ""
                    candidates.append((0, Problem(REASON_CONTAINER_RESTARTING, _cut(
                        f"pod {pod_name}: container {name} is not ready{_restarts(cs)}{ended}"
                    ))))
                elif waiting.get("reason") in _IMAGE_PULL_WAITING:
                    candidates.append((1, Problem(REASON_IMAGE_PULL_FAILED, _cut(
                        f"pod {pod_name}: container {name} {waiting['reason']}: "
                        f"{(waiting.get('message') or '').strip()}"
                    ))))
    if candidates:
        return min(candidates, key=lambda c: c[0])[1]
    return None


def _deployment_counts(deployment: dict[str, Any] | None) -> tuple[int, int]:
    status = (deployment or {}).get("status") or {}
    return int(status.get("replicas") or 0), int(status.get("readyReplicas") or 0)


def _deployment_failure(deployment: dict[str, Any]) -> Problem | None:
    """A Deployment controller condition that means the rollout is stuck."""
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return Problem(REASON_REPLICA_FAILURE, cond.get("message") or "pods cannot be created")
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Problem(
                REASON_PROGRESS_DEADLINE_EXCEEDED, cond.get("message") or "rollout stalled"
            )
    return None


def _rolling(deployment: dict[str, Any], desired: int, replicas: int, ready: int) -> bool:
    """Whether the Deployment has not yet converged on its current template and size.
    Fields the Deployment controller has not written yet are not held against it."""
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    if observed is not None and generation is not None and observed < generation:
        return True
    updated = status.get("updatedReplicas")
    if updated is not None and updated < desired:
        return True
    return ready < desired or replicas > desired


def _desired_conditions(obs: Observation) -> list[Condition]:
    gen = obs.generation

    def cond(type_: str, status: bool, reason: str, message: str) -> Condition:
        return Condition(
            type=type_,
            status="True" if status else "False",
            reason=reason,
            message=message,
            observed_generation=gen,
        )

    if obs.problem is not None:
        p = obs.problem
        return [
            cond(READY, False, p.reason, p.message),
            cond(PROGRESSING, False, p.reason, p.message),
            cond(DEGRADED, True, p.reason, p.message),
        ]

    desired = obs.desired_replicas or 0
    replicas, ready = _deployment_counts(obs.deployment)
    counts = f"{ready}/{desired} replicas ready"
    if desired == 0:
        ready_cond = cond(READY, False, REASON_SCALED_TO_ZERO, "spec.replicas is 0")
    elif ready >= desired:
        ready_cond = cond(READY, True, REASON_REPLICAS_READY, counts)
    else:
        ready_cond = cond(READY, False, REASON_REPLICAS_NOT_READY, counts)

    if obs.deployment is None:
        progressing = cond(PROGRESSING, True, REASON_ROLLING_OUT, "Deployment not created yet")
    elif _rolling(obs.deployment, desired, replicas, ready):
        progressing = cond(PROGRESSING, True, REASON_ROLLING_OUT, counts)
    else:
        progressing = cond(PROGRESSING, False, REASON_ROLLOUT_COMPLETE, counts)

    failure = _deployment_failure(obs.deployment) if obs.deployment is not None else None
    if failure is None and obs.pod_problem is not None and ready < desired:
        failure = obs.pod_problem
    if failure is not None:
        degraded = cond(DEGRADED, True, failure.reason, failure.message)
    else:
        degraded = cond(DEGRADED, False, REASON_AS_EXPECTED, "")
    return [ready_cond, progressing, degraded]


def compute_status(
    obs: Observation, previous: SpeculativeModelStatus | None, now: str
) -> SpeculativeModelStatus:
    """The status to write for ``obs``, given the status on the object.

    ``replicas``/``readyReplicas`` come from the Deployment's status (0 when it has
    none).  The tuner's fields (``speculation`` measurements, ``tuningHistory``,
    ``tuner``, the ``Tuned`` condition) are carried over unchanged.  While the tuner
    is not in charge (mode ``Off``, or it has not measured yet)
    ``speculation.numSpeculativeTokens`` is the spec's value, or the previous one while
    the spec does not parse; once it is, the tuner reports the k in effect.
    """
    previous = previous or SpeculativeModelStatus()
    conditions = list(previous.conditions)
    for new in _desired_conditions(obs):
        conditions = set_condition(conditions, new, now)

    replicas, ready = _deployment_counts(obs.deployment)
    speculation = previous.speculation
    tuner_in_charge = (
        obs.tuning_mode in ("Recommend", "Auto")
        and previous.tuner is not None
        and previous.tuner.state is not None
    )
    k = obs.num_speculative_tokens
    if k is not None and not tuner_in_charge:
        speculation = (speculation or SpeculationStatus()).model_copy(
            update={"num_speculative_tokens": k}
        )
    return SpeculativeModelStatus(
        observed_generation=obs.generation,
        replicas=replicas,
        ready_replicas=ready,
        selector=obs.selector,
        conditions=conditions,
        speculation=speculation,
        tuning_history=previous.tuning_history,
        tuner=previous.tuner,
        autoscaling=previous.autoscaling,
    )
