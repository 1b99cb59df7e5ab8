"""One tuning tick of one ``SpeculativeModel``: the I/O around :mod:`specula.operator.tuner`.

The kopf timer calls :func:`tune` every ``OperatorSettings.tuning_tick_s``; the
resource's own ``spec.tuning.interval`` is enforced here from ``status.tuner``
(kopf timers have one interval per handler).  A tick is one of:

- ``Off``: nothing, except putting ``speculator.numSpeculativeTokens`` back on the pods
  once if an earlier ``Auto`` may have changed it;
- between windows: re-send the k in effect to pods that refused it (``Auto``);
- a window: read the ready pods' ``/metrics`` and ``GET /v1/speculative_config``,
  decide, ``PUT`` the new k to the pods that need it (``Auto``), write status (with
  ``status.autoscaling`` when the resource autoscales), post Events.

Admin requests carry the resource's token from its Secret (:func:`reconcile.admin_token`).
``engine: vllm`` pods have no admin API: they are only scraped, and in ``Auto`` mode
the k decided goes into their pod template (:func:`reconcile.apply_children`), so the
Deployment rolls them; no window is taken while a rollout is in progress.

Status is written under the resource's lock (:func:`reconcile.lock_for`) on a fresh
copy of the object, conditional on its ``resourceVersion``, so the tuner and the
reconciler never undo each other's fields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from specula.api.autoscaling import AutoscalingStatus
from specula.api.models import SpeculativeModelSpec, SpeculativeModelStatus
from specula.api.render_vllm import VllmConfigError
from specula.operator import tuner as pure
from specula.operator.autoscaling import UtilizationSink, autoscaling_status
from specula.operator.engine import rollout_in_progress
from specula.operator.kube import ApiException, Kube
from specula.operator.reconcile import (
    AdminSecretConflict,
    AutoscalerUnavailable,
    admin_token,
    apply_children,
    lock_for,
    log_conflict,
    owner_of,
    parse_spec,
    parse_status,
)
from specula.operator.runtime_client import RuntimeClient
from specula.operator.settings import OperatorSettings

log = logging.getLogger(__name__)

_idle_until: dict[tuple[str, str], float] = {}
"""Resources whose Service had no ready endpoint: Unix time of the next look.  Only
saves API calls; losing it (a restart) costs one extra EndpointSlice list."""


def _rfc3339(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fresh(kube: Kube, body: dict[str, Any]) -> dict[str, Any] | None:
    """The object as stored now, if it is still the same live object."""
    meta = body["metadata"]
    live = kube.get_speculative_model(meta["namespace"], meta["name"])
    if live is None or live["metadata"].get("uid") != meta.get("uid"):
        return None
    if live["metadata"].get("deletionTimestamp"):
        return None
    return live


def _endpoints(kube: Kube, body: dict[str, Any]) -> list[pure.Endpoint]:
    meta = body["metadata"]
    return pure.ready_endpoints(kube.list_endpoint_slices(meta["namespace"], meta["name"]))


def _token(kube: Kube, body: dict[str, Any]) -> str | None:
    """The admin token of ``body``'s pods; ``None`` (the pods then refuse, and the
    readings say so) when its Secret belongs to someone else."""
    try:
        return admin_token(kube, owner_of(body))
    except AdminSecretConflict as e:
        log.warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], e)
        return None


def merge_patch(target: Any, patch: Any) -> Any:
    """``target`` after the JSON merge patch ``patch`` (RFC 7386), as the API server
    applies it: objects merge member by member at every depth, null removes a member,
    anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _unchanged(patch: dict[str, Any], status: SpeculativeModelStatus | None) -> bool:
    """Whether writing ``patch`` would leave ``status`` as it is (compared in the
    model's form, where an absent list and an empty one are the same)."""
    raw = status.to_k8s() if status is not None else {}
    try:
        after = SpeculativeModelStatus.model_validate(merge_patch(raw, patch)).to_k8s()
    except ValidationError:
        return False
    return after == raw


def _write(
    kube: Kube,
    body: dict[str, Any],
    live: dict[str, Any],
    settings: OperatorSettings,
    build: Callable[[SpeculativeModelStatus | None, int | None], pure.StatusUpdate],
    now: float,
) -> pure.StatusUpdate | None:
    """Build the update on ``live`` (the object as read at the start of the tick) and
    write it if it changes anything.  The write is conditional on ``live``'s
    ``resourceVersion``, so a change since then is a conflict: the object is read again
    and the update rebuilt.  Events are posted once, after the write."""
    meta = body["metadata"]
    update: pure.StatusUpdate | None = None
    with lock_for(meta["namespace"], meta["name"]):
        for attempt in range(settings.status_conflict_retries):
            if attempt > 0:
                refreshed = _fresh(kube, body)
                if refreshed is None:
                    return None
                live = refreshed
            current = parse_status(live)
            update = build(current, live["metadata"].get("generation"))
            if _unchanged(update.patch, current):
                break
            try:
                kube.patch_status(
                    meta["namespace"], meta["name"], update.patch,
                    resource_version=live["metadata"].get("resourceVersion"),
                )
                break
            except ApiException as e:
                if e.status != 409:
                    raise
                log_conflict(
                    meta["namespace"], meta["name"], "tuner", attempt + 1,
                    settings.status_conflict_retries,
                )
    if update is not None:
        for event in update.events:
            try:
                kube.post_event(body, event.type, event.reason, event.message, _rfc3339(now))
            except ApiException as e:
                log.warning("cannot post event %s on %s: %s", event.reason, meta["name"], e.reason)
    return update


DEPLOYMENT_PENDING = "Deployment"
"""Name in ``status.tuner.pendingPods`` for an ``engine: vllm`` Deployment that could
not be re-rendered with the tuner's k (retried every tick like a pod)."""


def _roll(
    body: dict[str, Any],
    spec: SpeculativeModelSpec,
    status: SpeculativeModelStatus,
    kube: Kube,
    settings: OperatorSettings,
) -> dict[str, str]:
    """``engine: vllm``: re-apply the children at the k ``status`` puts in effect (a
    changed k changes the pod template, and the Deployment rolls the pods); returns
    ``{"Deployment": error}`` on failure, else ``{}``."""
    meta = body["metadata"]
    try:
        with lock_for(meta["namespace"], meta["name"]):
            apply_children(owner_of(body), spec, status, kube, settings)
    except (ApiException, VllmConfigError, AutoscalerUnavailable) as e:
        log.warning("%s/%s: cannot roll out the tuned k: %s", meta["namespace"], meta["name"], e)
        return {DEPLOYMENT_PENDING: str(getattr(e, "reason", None) or e)}
    return {}


def _with_autoscaling(
    update: pure.StatusUpdate, spec: SpeculativeModelSpec, measured: AutoscalingStatus | None
) -> pure.StatusUpdate:
    """``update`` with ``status.autoscaling``: the new measurement, nothing (the last
    one stays) when none was taken, or removed when autoscaling is off."""
    if spec.autoscaling is None:
        update.patch["autoscaling"] = None
    elif measured is not None:
        update.patch["autoscaling"] = measured.to_k8s()
    return update


def tune(
    body: dict[str, Any],
    kube: Kube,
    client: RuntimeClient,
    settings: OperatorSettings,
    clock: Callable[[], float] = time.time,
    utilization: UtilizationSink | None = None,
) -> pure.StatusUpdate | None:
    """One timer tick for resource ``body``; returns what was written, if anything.

    Resources whose spec does not parse or whose method the runtime lacks are left
    alone (their pods are not running).  ``engine: vllm`` pods are read without the
    admin API, and a new k reaches them by a rollout (the pod template carries it);
    no window is taken while a rollout is in progress.  With ``spec.autoscaling``,
    each window also records the utilization in ``status.autoscaling`` and hands it
    to ``utilization`` (the operator's HTTP server and gauge).

    Raises:
        ApiException: reading the object or its EndpointSlices, or writing status failed.
    """
    spec, problem = parse_spec(body)
    if spec is None or problem is not None:
        return None
    live = _fresh(kube, body)
    if live is None:
        return None
    current = parse_status(live)
    now = clock()
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    if utilization is not None and spec.autoscaling is None:
        utilization.discard(*key)
    if spec.tuning.mode == "Off":
        _idle_until.pop(key, None)
        return _off(body, live, spec, current, kube, client, settings, now)
    tuner_status = current.tuner if current is not None else None
    if not pure.is_due(tuner_status, spec.tuning.interval_s, settings.tuning_tick_s, now):
        return _retry_pending(body, live, spec, current, kube, client, settings, now)
    if _idle_until.get(key, 0.0) > now:
        return None
    vllm = spec.engine == "vllm"
    if vllm and rollout_in_progress(kube.get_deployment(*key)):
        # Old and new pods run different k: their counters would mix in one window.
        return None
    endpoints = _endpoints(kube, body)
    if not endpoints:
        _idle_until[key] = now + spec.tuning.interval_s
    else:
        _idle_until.pop(key, None)
    token = _token(kube, body) if endpoints and not vllm else None
    readings = client.read_all(endpoints, admin_api=not vllm, token=token)
    evaluation = pure.evaluate(spec, current, readings, now, _rfc3339(now), in_place=not vllm)
    failures: dict[str, str] = {}
    if evaluation.to_apply and evaluation.target_config is not None:
        failures = client.put_all(evaluation.to_apply, evaluation.target_config, token)
    if vllm and spec.tuning.mode == "Auto" and evaluation.decision is not None:
        # Every window, not only on a change: a reconcile that read the status just
        # before this window's write may have rendered the previous k; re-applying
        # unchanged children is a no-op on the API server.
        failures = _roll(body, spec, SpeculativeModelStatus(tuner=evaluation.tuner), kube, settings)
    measured = None
    if spec.autoscaling is not None and evaluation.decision is not None:
        measured = autoscaling_status(
            spec.autoscaling,
            evaluation.decision.state,
            pure.tuning_settings(spec),
            evaluation.window,
            evaluation.window_seconds,
            evaluation.queue,
            evaluation.window_pods,
            spec.pod_max_num_seqs,
            _rfc3339(now),
        )
    if evaluation.decision is not None:
        d = evaluation.decision
        changed = d.num_speculative_tokens not in (None, d.current_num_speculative_tokens)
        log.log(
            logging.INFO if changed or failures else logging.DEBUG,
            "%s/%s: %s (k=%s -> %s, applied to %d pod(s), %d failed)",
            key[0], key[1], d.reason, d.current_num_speculative_tokens,
            d.num_speculative_tokens, len(evaluation.to_apply) - len(failures), len(failures),
        )
    update = _write(
        kube, body, live, settings,
        lambda cur, gen: _with_autoscaling(
            pure.finish(evaluation, failures, cur, gen, _rfc3339(now)), spec, measured
        ),
        now,
    )
    if utilization is not None and measured is not None and measured.utilization is not None:
        utilization.record(key[0], key[1], measured.utilization, now)
    return update


def _retry_pending(
    body: dict[str, Any],
    live: dict[str, Any],
    spec: SpeculativeModelSpec,
    current: SpeculativeModelStatus | None,
    kube: Kube,
    client: RuntimeClient,
    settings: OperatorSettings,
    now: float,
) -> pure.StatusUpdate | None:
    """Between windows in ``Auto`` mode: re-send the k in effect to pending pods."""
    if spec.tuning.mode != "Auto" or current is None or current.tuner is None:
        return None
    pending = set(current.tuner.pending_pods)
    if not pending:
        return None
    state = pure.load_state(spec, current.tuner)
    config = pure.target_config(state)
    target = state.num_speculative_tokens if state.schedule is None else (
        f"schedule {config['num_speculative_tokens_per_batch_size']}"
    )
    if spec.engine == "vllm":
        failures = _roll(body, spec, current, kube, settings)
        retried = [DEPLOYMENT_PENDING]
    else:
        endpoints = [e for e in _endpoints(kube, body) if e.pod in pending]
        failures = client.put_all(endpoints, config, _token(kube, body) if endpoints else None)
        retried = [e.pod for e in endpoints]
    return _write(
        kube, body, live, settings,
        lambda cur, gen: pure.after_retry(
            target, retried, failures, cur or SpeculativeModelStatus(), gen, _rfc3339(now)
        ),
        now,
    )


def _off(
    body: dict[str, Any],
    live: dict[str, Any],
    spec: SpeculativeModelSpec,
    current: SpeculativeModelStatus | None,
    kube: Kube,
    client: RuntimeClient,
    settings: OperatorSettings,
    now: float,
) -> pure.StatusUpdate | None:
    """``Off``: put the spec's k back once after tuning ran, then stay quiet."""
    failures: dict[str, str] | None = None
    if pure.needs_restore(spec, current):
        if spec.engine == "vllm":
            # In Off mode the children render the spec's k.
            failures = _roll(body, spec, current or SpeculativeModelStatus(), kube, settings)
        else:
            endpoints = _endpoints(kube, body)
            failures = client.put_all(
                endpoints,
                {"num_speculative_tokens": spec.speculator.num_speculative_tokens},
                _token(kube, body) if endpoints else None,
            )
    return _write(
        kube, body, live, settings,
        lambda cur, gen: _with_autoscaling(
            pure.disabled(spec, cur or SpeculativeModelStatus(), failures, gen, _rfc3339(now)),
            spec,
            None,
        ),
        now,
    )
