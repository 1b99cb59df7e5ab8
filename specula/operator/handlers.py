"""kopf wiring: thin handlers that hand plain dicts to :mod:`specula.operator.reconcile`.

- ``SpeculativeModel`` create / update / resume -> :func:`reconcile.reconcile`.
- Events of owned Deployments -> :func:`reconcile.refresh_status`, so ``readyReplicas``
  and ``Ready`` follow the pods without waiting for a spec change.
- Events of runtime pods -> :func:`reconcile.refresh_status_for_pod`, so a failed
  container (a model download, a crash) shows as ``Degraded`` with its reason.
- Deletion of an owned ConfigMap, Deployment or Service -> reconcile the owner again.
- A timer every ``tuning_tick_s`` -> :func:`tuning.tune` (measure, decide, apply k,
  record utilization).
- Startup / cleanup -> the HTTP server of :mod:`specula.operator.http_server`
  (utilization for KEDA, the Prometheus gauge for an HPA).

Children are garbage-collected through their owner references; the only deletion
handler (optional, so it adds no finalizer) drops the resource's utilization.  kopf
puts its finalizer on the resources only so that it can stop their tuning timer
before they go.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

import kopf
import urllib3
from pydantic import ValidationError

from specula.api.autoscaling import AutoscalingStatus
from specula.api.models import GROUP, PLURAL, VERSION
from specula.operator.builders import (
    COMPONENT_RUNTIME,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)
from specula.operator.http_server import HttpServer, UtilizationRegistry, make_app
from specula.operator.kube import ApiException, Kube
from specula.operator.reconcile import (
    RetryLater,
    reconcile,
    refresh_status,
    refresh_status_for_pod,
    repair_after_child_deleted,
)
from specula.operator.runtime_client import RuntimeClient
from specula.operator.settings import OperatorSettings
from specula.operator.tuning import tune

_OWNED = {LABEL_MANAGED_BY: MANAGED_BY}
_RUNTIME_PODS = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_COMPONENT: COMPONENT_RUNTIME}


def _plain(body: Any) -> dict[str, Any]:
    """A deep plain-dict copy of a kopf body view."""
    return copy.deepcopy(dict(body))


class LazyKube:
    """One :class:`Kube` for the whole process, created on first use: kopf logs in
    (filling the client's default configuration) only after startup handlers ran.
    Held in kopf's memo, which kopf copies shallowly per object, so all share it."""

    def __init__(self, field_manager: str) -> None:
        self._field_manager = field_manager
        self._kube: Kube | None = None
        self._guard = threading.Lock()

    def get(self) -> Kube:
        with self._guard:
            if self._kube is None:
                self._kube = Kube(field_manager=self._field_manager)
            return self._kube


def make_memo(settings: OperatorSettings) -> kopf.Memo:
    """The memo :func:`build_registry`'s handlers expect."""
    return kopf.Memo(
        settings=settings,
        kube=LazyKube(settings.field_manager),
        runtime_client=RuntimeClient(settings.scrape_timeout_s),
        utilization=UtilizationRegistry(),
        http_server=[],
    )


def _kube(memo: Any) -> Kube:
    return memo["kube"].get()


def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Startup: kopf's bookkeeping under Specula's annotation prefix, no per-run events."""
    ours: OperatorSettings = memo["settings"]
    prefix = ours.annotation_prefix
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{prefix}/finalizer"
    settings.posting.enabled = ours.post_events
    settings.posting.level = logging.WARNING
    # A deleted resource keeps its finalizer until its tuning timer has stopped; kopf
    # checks again only every `cancellation_polling` seconds (default 60) when a tick is
    # still running, which held deletions for a minute.
    settings.background.cancellation_polling = 1.0
    for image in ours.unpinned_images:
        logging.getLogger(__name__).warning(
            "default image %s is not pinned by digest (@sha256:...)", image
        )


def _status_lookup(memo: Any):
    def lookup(namespace: str, name: str) -> AutoscalingStatus | None:
        body = _kube(memo).get_speculative_model(namespace, name)
        raw = ((body or {}).get("status") or {}).get("autoscaling")
        try:
            return AutoscalingStatus.model_validate(raw) if raw else None
        except ValidationError:
            return None

    return lookup


async def start_http_server(memo: Any, **_: Any) -> None:
    """Startup: serve utilization and metrics (unless ``http_port`` is 0)."""
    ours: OperatorSettings = memo["settings"]
    if ours.http_port == 0:
        return
    server = HttpServer(make_app(memo["utilization"], _status_lookup(memo)))
    await server.start(ours.http_host, ours.http_port)
    memo["http_server"].append(server)


async def stop_http_server(memo: Any, **_: Any) -> None:
    """Cleanup: close the HTTP server."""
    while memo["http_server"]:
        await memo["http_server"].pop().stop()


def on_deleted(body: kopf.Body, memo: Any, **_: Any) -> None:
    """The resource is going: drop its utilization and gauge series."""
    memo["utilization"].discard(body["metadata"]["namespace"], body["metadata"]["name"])


def login(**kwargs: Any) -> Any:
    """In-cluster service account first, then ``$KUBECONFIG``; also configures the
    ``kubernetes`` client that applies the children."""
    return kopf.login_via_client(**kwargs)


TRANSIENT = (ApiException, urllib3.exceptions.HTTPError, OSError)
"""Errors of a call to the API server that may pass: a refusal (5xx, 409, ...) or no
answer at all (the API server restarting: ``MaxRetryError``, connection refused).
Left to kopf, any of them would hold a handler back for its default 60 s."""


def _brief(error: BaseException) -> str:
    if isinstance(error, ApiException):
        return f"{error.status} {error.reason}"
    return f"{type(error).__name__}: {str(error)[:300]}"


def on_speculative_model(body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    """Create, update, resume: reconcile the whole resource.  A failed API call is
    retried after ``retry_delay_s``."""
    try:
        status = reconcile(_plain(body), _kube(memo), memo["settings"])
    except RetryLater as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from e
    except TRANSIENT as e:
        delay = memo["settings"].retry_delay_s
        raise kopf.TemporaryError(
            f"reconcile failed, retrying in {delay:g} s: {_brief(e)}", delay=delay
        ) from e
    ready = next((c for c in status.conditions if c.type == "Ready"), None)
    if ready is not None:
        logger.info("reconciled: Ready=%s (%s)", ready.status, ready.reason)


def on_deployment_event(event: dict[str, Any], body: kopf.Body, memo: Any, **_: Any) -> None:
    """An owned Deployment changed: refresh the owner's status; recreate it if deleted."""
    plain = _plain(body)
    if event.get("type") == "DELETED":
        _repair(plain, memo)
    else:
        refresh_status(plain, _kube(memo), memo["settings"])


def on_pod_event(event: dict[str, Any], body: kopf.Body, memo: Any, **_: Any) -> None:
    """A runtime pod changed: refresh its owner's status (a failed container, such as a
    model download, is reported as ``Degraded``)."""
    if event.get("type") != "DELETED":
        refresh_status_for_pod(_plain(body), _kube(memo), memo["settings"])


def on_tuning_tick(body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    """Timer: one tuning tick (see :mod:`specula.operator.tuning`).  A failed API call
    ends the tick with a warning; the next tick comes at the usual period (the state
    is on the object, so nothing is lost)."""
    try:
        update = tune(
            _plain(body), _kube(memo), memo["runtime_client"], memo["settings"],
            utilization=memo["utilization"],
        )
    except TRANSIENT as e:
        logger.warning(
            "tuning tick failed, next tick in %g s: %s", memo["settings"].tuning_tick_s,
            _brief(e),
        )
        return
    if update is not None:
        tuned = next((c for c in update.conditions if c.type == "Tuned"), None)
        if tuned is not None:
            logger.debug("tuning: Tuned=%s (%s)", tuned.status, tuned.reason)


def _is_deletion(event: dict[str, Any], **_: Any) -> bool:
    return event.get("type") == "DELETED"


def on_child_deleted(body: kopf.Body, memo: Any, **_: Any) -> None:
    """An owned ConfigMap or Service was deleted: recreate it."""
    _repair(_plain(body), memo)


def _repair(child: dict[str, Any], memo: Any) -> None:
    try:
        repair_after_child_deleted(child, _kube(memo), memo["settings"])
    except RetryLater as e:
        # Event handlers are not retried by kopf; the owner's own retry covers it.
        logging.getLogger(__name__).warning("%s", e)


def build_registry(settings: OperatorSettings | None = None) -> kopf.OperatorRegistry:
    """A fresh registry holding the operator's handlers (``settings`` gives the tuning
    timer's period)."""
    settings = settings or OperatorSettings()
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.startup(registry=registry)(start_http_server)
    kopf.on.cleanup(registry=registry)(stop_http_server)
    kopf.on.login(registry=registry)(login)
    resource = {"group": GROUP, "version": VERSION, "plural": PLURAL}
    kopf.on.delete(**resource, optional=True, registry=registry)(on_deleted)
    kopf.on.resume(**resource, registry=registry)(on_speculative_model)
    kopf.on.create(**resource, registry=registry)(on_speculative_model)
    kopf.on.update(**resource, registry=registry)(on_speculative_model)
    kopf.timer(**resource, interval=settings.tuning_tick_s, registry=registry)(on_tuning_tick)
    kopf.on.event("apps", "v1", "deployments", labels=_OWNED, registry=registry)(
        on_deployment_event
    )
    kopf.on.event("v1", "pods", labels=_RUNTIME_PODS, registry=registry)(on_pod_event)
    for plural in ("configmaps", "services"):
        kopf.on.event("v1", plural, labels=_OWNED, when=_is_deletion, registry=registry)(
            on_child_deleted
        )
    return registry
