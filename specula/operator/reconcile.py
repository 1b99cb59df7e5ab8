"""Reconcile one ``SpeculativeModel``: parse, build, apply, write status.

Framework-free (kopf lives in :mod:`specula.operator.handlers`); talks to the API
server only through :class:`specula.operator.kube.Kube`.

Three paths write a resource's status: :func:`reconcile` (after a spec change, through
kopf), :func:`refresh_status` (after its Deployment changed) and the tuner
(:mod:`specula.operator.tuning`).  All hold a per-resource lock (:func:`lock_for`) from
reading the object to writing its status, so a status computed from an older view can
never overwrite one computed from a newer one, and none drops the others' fields.  The
lock only orders this process: each write is also conditional on the
``resourceVersion`` of the read it was computed from (a merge patch carrying
``metadata.resourceVersion``), so a change by anyone else in between (another operator
replica, a user, kopf's own annotation patches) is a 409 Conflict, and the writer reads
the object again and recomputes (:func:`log_conflict` logs each), up to
``status_conflict_retries`` times.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from specula.api import capabilities
from specula.api.models import API_VERSION, KIND, SpeculativeModelSpec, SpeculativeModelStatus
from specula.api.render import ADMIN_TOKEN_KEY
from specula.api.render_vllm import VllmConfigError
from specula.operator.autoscaling import PROVIDER_KINDS, SCALED_OBJECT
from specula.operator.builders import (
    LABEL_INSTANCE,
    Owner,
    admin_secret_name,
    build_admin_secret,
    build_autoscaler,
    build_children,
    build_network_policy,
    selector_string,
)
from specula.operator.engine import pod_speculation
from specula.operator.kube import ApiException, Kube
from specula.operator.settings import OperatorSettings
from specula.operator.status import (
    REASON_APPLY_FAILED,
    REASON_DRAFT_MODEL_REQUIRED,
    REASON_INVALID_ENGINE_CONFIG,
    REASON_INVALID_SPEC,
    REASON_METHOD_NOT_SUPPORTED,
    Observation,
    Problem,
    compute_status,
    now_rfc3339,
    pod_failure,
)

log = logging.getLogger(__name__)


class RetryLater(Exception):
    """The reconcile failed for a reason that may pass (API error); retry after ``delay`` s."""

    def __init__(self, message: str, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def lock_for(namespace: str, name: str) -> threading.Lock:
    """The lock held by every writer of one resource's status (reconcile, status
    refresh, tuner) from reading the object to writing its status."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def _same_object(live: dict[str, Any] | None, body: dict[str, Any]) -> dict[str, Any]:
    """``live`` if it is the same object as ``body`` (same uid), else ``body``."""
    if live is not None and live["metadata"].get("uid") == body["metadata"].get("uid"):
        return live
    return body


def owner_of(body: dict[str, Any]) -> Owner:
    """The :class:`Owner` identity of a SpeculativeModel object."""
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def format_validation_error(error: ValidationError, prefix: str = "spec") -> str:
    """One line per problem, ``spec.speculator.numSpeculativeTokens: <msg>``."""
    parts = []
    for err in error.errors():
        loc = ".".join([prefix, *(str(p) for p in err["loc"])])
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def parse_spec(body: dict[str, Any]) -> tuple[SpeculativeModelSpec | None, Problem | None]:
    """The parsed spec, or the :class:`Problem` that stops it from being served."""
    try:
        spec = SpeculativeModelSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        return None, Problem(REASON_INVALID_SPEC, format_validation_error(e))
    method = spec.speculator.method
    # vLLM implements every method the API names; the runtime only some.
    if spec.engine == "specula" and not capabilities.is_method_implemented(method):
        implemented = ", ".join(sorted(capabilities.IMPLEMENTED_METHODS))
        return spec, Problem(
            REASON_METHOD_NOT_SUPPORTED,
            f"speculator.method {method!r} is not implemented by the runtime yet "
            f"(implemented: {implemented}); no runtime pods are created",
        )
    if (
        spec.engine == "specula"
        and spec.speculator.model is None
        and method not in capabilities.RUNTIME_METHODS_WITHOUT_DRAFT_MODEL
    ):
        return spec, Problem(
            REASON_DRAFT_MODEL_REQUIRED,
            f"speculator.method {method!r} needs speculator.model with engine specula "
            f"(a speculators-format checkpoint; only engine vllm reads MTP layers from the "
            f"target checkpoint); no runtime pods are created",
        )
    return spec, None


def parse_status(body: dict[str, Any]) -> SpeculativeModelStatus | None:
    """The status on the object, or ``None`` when absent or unreadable."""
    raw = body.get("status")
    if not raw:
        return None
    try:
        return SpeculativeModelStatus.model_validate(raw)
    except ValidationError:
        return None


def _write_status(
    kube: Kube,
    body: dict[str, Any],
    status: SpeculativeModelStatus,
    *,
    conditional: bool = False,
) -> bool:
    """Write ``status`` unless the object already holds exactly it; True if written."""
    new = status.to_k8s()
    previous = parse_status(body)
    if previous is not None and previous.to_k8s() == new:
        return False
    meta = body["metadata"]
    kube.patch_status(
        meta["namespace"],
        meta["name"],
        new,
        resource_version=meta.get("resourceVersion") if conditional else None,
    )
    return True


def log_conflict(namespace: str, name: str, writer: str, attempt: int, attempts: int) -> None:
    """One line per 409 on a status write (the object changed since it was read)."""
    log.info(
        "status write of %s/%s by %s: 409 Conflict (attempt %d/%d); reading it again",
        namespace, name, writer, attempt, attempts,
    )


def _write_conditionally(
    kube: Kube,
    live: dict[str, Any],
    body: dict[str, Any],
    settings: OperatorSettings,
    build: Callable[[dict[str, Any]], SpeculativeModelStatus],
) -> SpeculativeModelStatus:
    """Write the status ``build`` makes from the object as read, conditional on that
    read's ``resourceVersion``; on 409 read it again and rebuild, up to
    ``settings.status_conflict_retries`` times.  Returns the status built last.

    Raises:
        RetryLater: still conflicting after the last attempt (kopf runs the reconcile
            again after ``retry_delay_s``).
        ApiException: any other refusal.
    """
    meta = body["metadata"]
    attempts = settings.status_conflict_retries
    for attempt in range(1, attempts + 1):
        status = build(live)
        try:
            _write_status(kube, live, status, conditional=True)
            return status
        except ApiException as e:
            if e.status != 409:
                raise
            log_conflict(meta["namespace"], meta["name"], "reconcile", attempt, attempts)
        live = _same_object(kube.get_speculative_model(meta["namespace"], meta["name"]), body)
    raise RetryLater(
        f"status kept changing under {attempts} conditional writes", settings.retry_delay_s
    )


class AutoscalerUnavailable(Exception):
    """The autoscaler's kind is not served by the API server (KEDA not installed)."""


class AdminSecretConflict(Exception):
    """A Secret of the admin token's name exists that the resource does not own."""


ADMIN_TOKEN_BYTES = 32
"""Random bytes of an admin token (``secrets.token_urlsafe``: 43 characters)."""


def admin_token(kube: Kube, owner: Owner) -> str:
    """The admin token of ``owner``'s runtime pods, from its Secret
    ``<name>-admin-token``; created with a fresh random token when absent (a first
    reconcile, or a Secret deleted by hand: the kubelet then refreshes the pods'
    mounted copy and the runtime reads it per request).

    Raises:
        AdminSecretConflict: the Secret exists but is not controlled by ``owner`` (a
            user's, or that of a deleted resource of the same name not yet collected).
        ApiException: the API server refused the read or the create.
    """
    name = admin_secret_name(owner.name)
    secret = kube.get_secret(owner.namespace, name)
    if secret is None:
        token = secrets.token_urlsafe(ADMIN_TOKEN_BYTES)
        try:
            secret = kube.create_secret(build_admin_secret(owner, token))
        except ApiException as e:
            if e.status != 409:
                raise
            secret = kube.get_secret(owner.namespace, name)  # created meanwhile
    ref = controller_owner(secret or {})
    if secret is None or ref is None or ref.get("uid") != owner.uid:
        raise AdminSecretConflict(
            f"Secret {name} exists and is not owned by this SpeculativeModel; the operator "
            f"keeps the runtime's admin token there (delete or rename it)"
        )
    try:
        return base64.b64decode((secret.get("data") or {})[ADMIN_TOKEN_KEY]).decode()
    except (KeyError, binascii.Error, UnicodeDecodeError) as e:
        raise AdminSecretConflict(f"Secret {name} has no readable key {ADMIN_TOKEN_KEY!r}") from e


def apply_children(
    owner: Owner,
    spec: SpeculativeModelSpec,
    status: SpeculativeModelStatus | None,
    kube: Kube,
    settings: OperatorSettings,
) -> dict[str, Any]:
    """Apply the ConfigMap, Deployment and Service of ``spec`` (for ``engine: vllm``
    at the k the stored ``status`` puts in effect), with ``settings.network_policy``
    its NetworkPolicy, and its autoscaler; remove an autoscaler of the other provider,
    or both when autoscaling is off.  ``engine: specula`` pods mount the admin-token
    Secret, which is created first (:func:`admin_token`).  Returns the live Deployment.

    Raises:
        VllmConfigError: the vLLM arguments would be refused by vLLM.
        AutoscalerUnavailable: ``provider: keda`` without KEDA's CRD.
        AdminSecretConflict: see :func:`admin_token`.
        ApiException: the API server refused a write.
    """
    children = build_children(
        owner,
        spec,
        default_image=settings.runtime_image,
        vllm_image=settings.vllm_image,
        speculation=pod_speculation(spec, status),
    )
    if spec.engine == "specula":
        admin_token(kube, owner)
    if settings.network_policy:
        children.append(build_network_policy(
            owner, spec.engine, settings.namespace, settings.operator_pod_labels,
            settings.metrics_namespaces,
        ))
    applied = [kube.apply(child) for child in children]
    deployment = next(obj for obj in applied if obj.get("kind") == "Deployment")
    wanted = build_autoscaler(owner, spec, settings.utilization_url_base)
    keep = None
    if wanted is not None:
        keep = (wanted["apiVersion"], wanted["kind"])
        try:
            kube.apply(wanted)
        except ApiException as e:
            if e.status == 404 and keep == SCALED_OBJECT:
                raise AutoscalerUnavailable(
                    "autoscaling.provider is keda but the API server does not serve "
                    "keda.sh/v1alpha1 ScaledObjects (install KEDA, or use provider hpa)"
                ) from e
            raise
    for kind in PROVIDER_KINDS.values():
        if kind == keep:
            continue
        existing = kube.get_autoscaler(kind, owner.namespace, owner.name)
        ref = controller_owner(existing) if existing is not None else None
        # Only the operator's own: an autoscaler someone else made is left alone.
        if existing is not None and ref is not None and ref.get("uid") == owner.uid:
            kube.delete_autoscaler(
                kind, owner.namespace, owner.name, existing["metadata"]["uid"]
            )
    return deployment


def reconcile(
    body: dict[str, Any],
    kube: Kube,
    settings: OperatorSettings,
    now: Callable[[], str] = now_rfc3339,
) -> SpeculativeModelStatus:
    """Bring the children of ``body`` in line with its spec and write its status.

    An invalid spec (``InvalidSpec``) or a method the runtime lacks
    (``MethodNotSupported``) is reported as ``Degraded=True`` and leaves the children
    as they are: nothing is created, and pods of an earlier, supported spec keep
    serving it.

    Raises:
        RetryLater: applying the children failed (status says ``ApplyFailed``).
    """
    owner = owner_of(body)
    generation = int(body["metadata"].get("generation") or 0)
    selector = selector_string(owner.name)
    with lock_for(owner.namespace, owner.name):
        # The status is built on the object as stored now, not as kopf delivered it:
        # the tuner writes status too (under this lock), and an older copy would undo it.
        live = _same_object(kube.get_speculative_model(owner.namespace, owner.name), body)
        spec, problem = parse_spec(body)
        deployment: dict[str, Any] | None = None
        apply_error: Exception | None = None
        if problem is None:
            assert spec is not None
            try:
                deployment = apply_children(owner, spec, parse_status(live), kube, settings)
            except VllmConfigError as e:
                problem = Problem(REASON_INVALID_ENGINE_CONFIG, f"vLLM --speculative-config: {e}")
            except (AutoscalerUnavailable, AdminSecretConflict) as e:
                apply_error = e
                problem = Problem(REASON_APPLY_FAILED, str(e))
            except ApiException as e:
                apply_error = e
                problem = Problem(REASON_APPLY_FAILED, f"{e.status} {e.reason}: {_api_message(e)}")
        if problem is not None:
            deployment = kube.get_deployment(owner.namespace, owner.name)
        pod_problem = None
        if problem is None and spec is not None:
            pod_problem = _pod_problem(
                kube, owner.namespace, selector, deployment, spec.desired_replicas
            )

        observation = Observation(
            generation=generation,
            selector=selector,
            desired_replicas=spec.desired_replicas if spec is not None else None,
            num_speculative_tokens=(
                spec.speculator.num_speculative_tokens if spec is not None else None
            ),
            deployment=deployment,
            problem=problem,
            tuning_mode=spec.tuning.mode if spec is not None else None,
            pod_problem=pod_problem,
        )
        status = _write_conditionally(
            kube, live, body, settings,
            lambda current: compute_status(observation, parse_status(current), now()),
        )
    if apply_error is not None:
        reason = getattr(apply_error, "reason", None) or str(apply_error)
        raise RetryLater(f"applying children failed: {reason}", settings.retry_delay_s)
    return status


def _api_message(error: ApiException) -> str:
    """The API server's ``Status.message`` if the body carries one."""
    try:
        return json.loads(error.body or "{}").get("message") or ""
    except (ValueError, AttributeError):
        return ""


def _pod_problem(
    kube: Kube, namespace: str, selector: str, deployment: dict[str, Any] | None, desired: int
) -> Problem | None:
    """A failed runtime container, looked for only while fewer pods than desired are
    ready (a serving resource costs no pod list)."""
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    if deployment is None or ready >= desired:
        return None
    return pod_failure(kube.list_pods(namespace, selector))


def controller_owner(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The SpeculativeModel ownerReference marked ``controller`` on a child, if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion") == API_VERSION and ref.get("controller"):
            return ref
    return None


def _live_owner(kube: Kube, child: dict[str, Any]) -> dict[str, Any] | None:
    """The live, not-deleting SpeculativeModel that controls ``child``, if any."""
    ref = controller_owner(child)
    if ref is None:
        return None
    namespace = child["metadata"]["namespace"]
    body = kube.get_speculative_model(namespace, ref["name"])
    if body is None or body["metadata"].get("uid") != ref.get("uid"):
        return None
    if body["metadata"].get("deletionTimestamp"):
        return None
    return body


def repair_after_child_deleted(
    child: dict[str, Any], kube: Kube, settings: OperatorSettings
) -> SpeculativeModelStatus | None:
    """Recreate the children of the owner of a child that was deleted by hand.

    Raises:
        RetryLater: as :func:`reconcile`.
    """
    body = _live_owner(kube, child)
    if body is None:
        return None
    return reconcile(body, kube, settings)


def refresh_status_for_pod(
    pod: dict[str, Any],
    kube: Kube,
    settings: OperatorSettings,
    now: Callable[[], str] = now_rfc3339,
) -> SpeculativeModelStatus | None:
    """:func:`refresh_status` after a runtime pod changed (a container failing shows
    only there): its owner is the resource its ``app.kubernetes.io/instance`` label
    names, through that resource's Deployment."""
    meta = pod.get("metadata") or {}
    name = (meta.get("labels") or {}).get(LABEL_INSTANCE)
    if not name:
        return None
    deployment = kube.get_deployment(meta.get("namespace", ""), name)
    if deployment is None:
        return None
    return refresh_status(deployment, kube, settings, now)


def refresh_status(
    deployment: dict[str, Any],
    kube: Kube,
    settings: OperatorSettings,
    now: Callable[[], str] = now_rfc3339,
) -> SpeculativeModelStatus | None:
    """Recompute the owner's ``replicas``, ``readyReplicas`` and conditions after its
    Deployment (or one of its pods) changed; children are not touched.  A failed
    container of a pod (:func:`~specula.operator.status.pod_failure`) makes it
    ``Degraded`` while fewer replicas than desired are ready.

    The status keeps the ``observedGeneration`` of the last :func:`reconcile`, and
    nothing is written before the first one or while the spec has a problem (those
    conditions do not depend on the Deployment).  The Deployment is read again under
    the lock rather than taken from the event, and the write is conditional on the
    owner's ``resourceVersion``, retried on conflict.
    """
    ref = controller_owner(deployment)
    if ref is None:
        return None
    namespace = deployment["metadata"]["namespace"]
    with lock_for(namespace, ref["name"]):
        for attempt in range(1, settings.status_conflict_retries + 1):
            body = _live_owner(kube, deployment)
            if body is None:
                return None
            previous = parse_status(body)
            if previous is None or previous.observed_generation is None:
                return None
            spec, problem = parse_spec(body)
            if problem is not None or spec is None:
                return None
            live = kube.get_deployment(namespace, ref["name"])
            selector = selector_string(ref["name"])
            status = compute_status(
                Observation(
                    generation=previous.observed_generation,
                    selector=selector,
                    desired_replicas=spec.desired_replicas,
                    num_speculative_tokens=spec.speculator.num_speculative_tokens,
                    deployment=live,
                    tuning_mode=spec.tuning.mode,
                    pod_problem=_pod_problem(
                        kube, namespace, selector, live, spec.desired_replicas
                    ),
                ),
                previous,
                now(),
            )
            try:
                _write_status(kube, body, status, conditional=True)
                return status
            except ApiException as e:
                if e.status != 409:
                    raise
                log_conflict(
                    namespace, ref["name"], "status refresh", attempt,
                    settings.status_conflict_retries,
                )
    return None
