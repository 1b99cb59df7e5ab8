"""Pure tuning steps of the operator: endpoints in, readings in, status out.

The kopf timer (:mod:`specula.operator.handlers`) calls :mod:`specula.operator.tuning`,
which does the I/O (EndpointSlices, pods' ``/metrics`` and admin API, status writes)
and hands plain data to the functions here:

- :func:`ready_endpoints`: the ready pods behind the resource's Service, with their
  ``http`` and ``metrics`` ports, from its EndpointSlices;
- :func:`evaluate`: one measurement window -> the window's counter increases (against
  the per-pod baselines stored on the object), a decision of
  :func:`specula.tuning.decide`, the pods that must be told the new k, and the status
  to write;
- :func:`finish`: the status patch once the pods have (or have not) accepted the k,
  with the ``Tuned`` condition and the events to post.

Everything the tuner remembers (the :class:`~specula.tuning.TuningState`, per-pod
counter baselines, the start of the current window, pods still to update) is in
``status.tuner``, so an operator restart continues where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from specula.api.models import (
    Condition,
    SpeculationStatus,
    SpeculativeModelSpec,
    SpeculativeModelStatus,
    TunerStatus,
    TuningHistoryEntry,
)
from specula.api.render import ADMIN_PORT
from specula.operator.status import TUNED, set_condition
from specula.tuning import (
    Decision,
    QueueGauges,
    RuntimeMetrics,
    TuningSettings,
    TuningState,
    decide,
    window_delta,
)
from specula.tuning.state import Schedule

HISTORY_LENGTH = 10
"""Entries kept in ``status.tuningHistory``."""

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""Label linking an EndpointSlice to its Service."""

# Reasons of the Tuned condition.
REASON_APPLIED = "Applied"
REASON_RECOMMENDED = "Recommended"
REASON_INSUFFICIENT_DATA = "InsufficientData"
REASON_NO_ENDPOINTS = "NoEndpoints"
REASON_SCRAPE_FAILED = "ScrapeFailed"
REASON_APPLY_FAILED = "ApplyFailed"
REASON_DISABLED = "Disabled"
REASON_RESTORED = "Restored"

# Policy reasons that change k (others keep it).
_CHANGE_REASONS = ("HigherGoodput", "Explore", "Revert", "Bounds")


@dataclass(frozen=True)
class Endpoint:
    """One ready pod behind the Service."""

    pod: str
    """Pod name (the endpoint's ``targetRef``), or its address when it has none."""
    address: str
    http_port: int | None
    """Port named ``http``: the OpenAI API."""
    metrics_port: int | None
    """Port named ``metrics``: ``/metrics`` alone."""
    admin_port: int | None = ADMIN_PORT
    """The admin API's port: a port named ``admin`` of the EndpointSlice if it has one,
    else the runtime's fixed :data:`~specula.api.render.ADMIN_PORT` (the Service, and
    so its EndpointSlices, never exposes it)."""

    def _base(self, port: int) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{port}"

    @property
    def metrics_url(self) -> str | None:
        """``/metrics`` on the metrics port, else on the http port."""
        port = self.metrics_port or self.http_port
        return None if port is None else f"{self._base(port)}/metrics"

    @property
    def admin_url(self) -> str | None:
        """``/v1/speculative_config`` on the admin port."""
        port = self.admin_port
        return None if port is None else f"{self._base(port)}/v1/speculative_config"


ADMIN_PORT_NAME = "admin"
"""EndpointSlice port name that, where present, gives the admin port."""


def ready_endpoints(
    slices: list[dict[str, Any]], http_port_name: str = "http", metrics_port_name: str = "metrics"
) -> list[Endpoint]:
    """Ready, not terminating endpoints of EndpointSlices (``discovery.k8s.io/v1``), one
    per pod, sorted by pod.

    A missing ``ready`` condition counts as ready, as the EndpointSlice API asks of
    consumers; the first address of an endpoint is used (all belong to one pod).
    """
    out: dict[str, Endpoint] = {}
    for es in slices:
        ports = {p.get("name"): p.get("port") for p in es.get("ports") or []}
        for ep in es.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            addresses = ep.get("addresses") or []
            if not addresses:
                continue
            ref = ep.get("targetRef") or {}
            pod = ref.get("name") or addresses[0]
            out.setdefault(pod, Endpoint(
                pod=pod,
                address=addresses[0],
                http_port=ports.get(http_port_name),
                metrics_port=ports.get(metrics_port_name),
                admin_port=ports.get(ADMIN_PORT_NAME, ADMIN_PORT),
            ))
    return [out[k] for k in sorted(out)]


@dataclass(frozen=True)
class PodReading:
    """What one pod answered: its ``/metrics`` and ``GET /v1/speculative_config``."""

    endpoint: Endpoint
    metrics: RuntimeMetrics | None = None
    speculative_config: dict[str, Any] | None = None
    queue: QueueGauges | None = None
    """Running and waiting requests at the scrape (read with ``metrics``)."""
    error: str | None = None
    """Why ``metrics`` (or the config) could not be read."""

    @property
    def num_speculative_tokens(self) -> int | None:
        """The single k the pod is configured with (``None``: unknown, or a schedule)."""
        cfg = self.speculative_config or {}
        k = cfg.get("num_speculative_tokens")
        return k if isinstance(k, int) and not cfg.get("num_speculative_tokens_per_batch_size") else None

    def runs(self, config: dict[str, Any]) -> bool:
        """Whether the pod is configured as ``config`` (a ``PUT`` body, see
        :func:`target_config`)."""
        if "num_speculative_tokens_per_batch_size" in config:
            have = (self.speculative_config or {}).get("num_speculative_tokens_per_batch_size")
            want = config["num_speculative_tokens_per_batch_size"]
            return have is not None and [list(r) for r in have] == want
        return self.num_speculative_tokens == config["num_speculative_tokens"]


def target_config(state: TuningState) -> dict[str, Any]:
    """The ``PUT /v1/speculative_config`` body for the configuration ``state`` is in:
    its per-batch-size schedule if it has one, else its single k."""
    if state.schedule is not None:
        return {"num_speculative_tokens_per_batch_size": [list(r) for r in state.schedule]}
    return {"num_speculative_tokens": state.num_speculative_tokens}


def tuning_settings(spec: SpeculativeModelSpec) -> TuningSettings:
    """The policy settings of a resource (its ``spec.tuning``; the rest stays default).

    Schedules (``spec.tuning.perBatchSize``) cover batch sizes up to the policy's
    default bound (256, the range of the tuning simulator's figures) or the pods'
    ``maxNumSeqs`` if that is larger; rows past a pod's largest step are never used."""
    t = spec.tuning
    return TuningSettings(
        mode=t.mode,
        min_speculative_tokens=t.min_speculative_tokens,
        max_speculative_tokens=spec.max_speculative_tokens,
        interval_s=t.interval_s,
        cooldown_s=t.cooldown_s,
        min_gain=t.min_gain,
        apply_schedule=t.per_batch_size,
        max_batch_size=max(spec.pod_max_num_seqs, TuningSettings.max_batch_size),
    )


def _uniform(k: int, max_batch_size: int) -> Schedule:
    """The schedule that drafts ``k`` at every batch size."""
    return ((1, max_batch_size, k),)


def _in_form(state: TuningState, spec: SpeculativeModelSpec) -> TuningState:
    """``state`` in the form ``spec.tuning.perBatchSize`` asks for, both the
    configuration in effect and the revert target: a single k becomes the schedule
    drafting it at every batch size, and a schedule becomes its k at the batch size the
    last window mostly ran at (``num_speculative_tokens``).  A change of form also
    ends the verification of the last change, which compared the old form."""
    per_batch = spec.tuning.per_batch_size
    if (state.schedule is not None) == per_batch:
        return state
    if not per_batch:
        return replace(state, schedule=None, previous_schedule=None, pending_verification=False)
    size = tuning_settings(spec).max_batch_size
    previous = state.previous_num_speculative_tokens
    return replace(
        state,
        schedule=_uniform(state.num_speculative_tokens, size),
        previous_schedule=None if previous is None else _uniform(previous, size),
        pending_verification=False,
    )


def load_state(spec: SpeculativeModelSpec, tuner: TunerStatus | None) -> TuningState:
    """The stored state, or a fresh one at the spec's k if there is none or it is
    unreadable (a newer format, or edited by hand); in ``Auto`` mode in the form of
    ``spec.tuning.perBatchSize`` (a schedule or one k), so that turning it on or off
    changes what the pods are sent at the next window, before any decision."""
    state = None
    if tuner is not None and tuner.state:
        try:
            state = TuningState.from_dict(tuner.state)
        except (ValueError, TypeError, KeyError):
            pass
    if state is None:
        state = TuningState.initial(spec.speculator.num_speculative_tokens, tuning_settings(spec))
    return _in_form(state, spec) if spec.tuning.mode == "Auto" else state


def is_due(tuner: TunerStatus | None, interval_s: float, tick_s: float, now: float) -> bool:
    """Whether a new window starts at ``now``: ``interval_s`` since the last scrape,
    less half a timer tick so that ticks do not drift a whole tick late."""
    if tuner is None or tuner.last_scrape_time is None:
        return True
    elapsed = now - tuner.last_scrape_time
    # A clock that jumped back must not stall the tuner.
    return elapsed < 0 or elapsed >= interval_s - tick_s / 2


@dataclass(frozen=True)
class Evaluation:
    """One window's outcome before the new k is applied."""

    tuner: TunerStatus
    speculation: SpeculationStatus | None
    history: list[TuningHistoryEntry] | None
    decision: Decision | None
    target_num_speculative_tokens: int | None
    """k every ready pod must run (``Auto``); ``None`` in ``Recommend``."""
    target_config: dict[str, Any] | None = None
    """``PUT /v1/speculative_config`` body of the target configuration (``Auto``)."""
    to_apply: list[Endpoint] = field(default_factory=list)
    """Pods configured otherwise than the target."""
    problem: tuple[str, str] | None = None
    """``(reason, message)`` when no decision could be taken."""
    scrape_errors: dict[str, str] = field(default_factory=dict)
    new_history_entry: TuningHistoryEntry | None = None
    window: RuntimeMetrics | None = None
    """Counter increases over the window, all measured pods."""
    window_seconds: float | None = None
    """Wall-clock length of the window (``None``: the first scrape)."""
    queue: QueueGauges = field(default_factory=QueueGauges)
    """Requests running and waiting at the window's end, on the ``window_pods``."""
    window_pods: int = 0
    """Pods whose whole window was measured (scraped now and at its start)."""


def _observed_k(readings: list[PodReading]) -> int | None:
    ks = {r.num_speculative_tokens for r in readings}
    return ks.pop() if len(ks) == 1 else None


def _observed_schedule(readings: list[PodReading]) -> list[list[int]] | None:
    """The schedule every pod reports, if they all report the same one."""
    found = {
        json.dumps((r.speculative_config or {}).get("num_speculative_tokens_per_batch_size"))
        for r in readings
    }
    return json.loads(found.pop()) if len(found) == 1 else None


def _speculation(
    previous: SpeculationStatus | None,
    decision: Decision,
    k_in_effect: int,
    schedule_in_effect: list[list[int]] | None,
    measured_pods: int,
    now_rfc3339: str,
) -> SpeculationStatus:
    prev = previous or SpeculationStatus()
    recommended = (
        decision.num_speculative_tokens
        if decision.num_speculative_tokens is not None
        else decision.current_num_speculative_tokens
    )
    update: dict[str, Any] = {
        "num_speculative_tokens": k_in_effect,
        "num_speculative_tokens_per_batch_size": schedule_in_effect,
        "recommended_num_speculative_tokens": recommended,
        "measured_pods": measured_pods,
    }
    if decision.schedule is not None:
        update["schedule"] = [list(row) for row in decision.schedule]
    if decision.predicted_goodput_tokens_per_second is not None:
        update["predicted_goodput_tokens_per_second"] = round(
            decision.predicted_goodput_tokens_per_second, 3
        )
    # Measurements only from windows that drafted; an idle window keeps the last ones
    # (lastUpdateTime says how old they are).
    if decision.sampled_drafts > 0:
        update.update(
            acceptance_rate=_round(decision.acceptance_rate),
            mean_acceptance_length=_round(decision.mean_acceptance_length),
            per_position_acceptance_rate=decision.per_position_acceptance_rate,
            goodput_tokens_per_second=_round(decision.goodput_tokens_per_second, 3),
            sampled_drafts=int(round(decision.sampled_drafts)),
            last_update_time=now_rfc3339,
        )
    return prev.model_copy(update=update)


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def _history(
    previous: list[TuningHistoryEntry] | None,
    decision: Decision,
    now_rfc3339: str,
) -> tuple[list[TuningHistoryEntry] | None, TuningHistoryEntry | None]:
    """History with the decision appended when it changes k (applied or recommended);
    a recommendation equal to the last recorded one is not repeated."""
    new_k = decision.num_speculative_tokens
    old_k = decision.current_num_speculative_tokens
    if new_k is None or new_k == old_k or decision.reason not in _CHANGE_REASONS:
        return previous, None
    entries = list(previous or [])
    last = entries[-1] if entries else None
    if (
        not decision.apply
        and last is not None
        and not last.applied
        and (last.from_, last.to) == (old_k, new_k)
    ):
        return previous, None
    entry = TuningHistoryEntry(
        time=now_rfc3339,
        from_=old_k,
        to=new_k,
        reason=decision.reason,
        predicted_gain=_round(decision.predicted_gain),
        applied=decision.apply,
        message=decision.message[:1024],
    )
    return [*entries, entry][-HISTORY_LENGTH:], entry


def _load_baselines(raw: dict[str, Any] | None) -> dict[str, RuntimeMetrics]:
    """Stored per-pod baselines; an unreadable one is dropped (that pod's next window
    is empty, as for a new pod)."""
    out: dict[str, RuntimeMetrics] = {}
    for pod, data in (raw or {}).items():
        try:
            out[pod] = RuntimeMetrics.from_dict(data)
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return out


def evaluate(
    spec: SpeculativeModelSpec,
    previous: SpeculativeModelStatus | None,
    readings: list[PodReading],
    now: float,
    now_rfc3339: str,
    in_place: bool = True,
) -> Evaluation:
    """One measurement window (``Recommend`` or ``Auto`` mode).

    Args:
        spec: the resource's parsed spec.
        previous: its status as stored (``status.tuner`` holds the state).
        readings: one per ready pod (failed scrapes carry ``error``).
        now: Unix seconds; ``now_rfc3339`` the same instant for status timestamps.
        in_place: whether the pods take a new k through their admin API (``engine:
            specula``); otherwise (``vllm``) no pod is listed to apply to, and the
            caller rolls the pods to the new configuration.

    Returns:
        the new tuner state and status fields; in ``Auto`` mode the pods to set to the
        target k (:func:`finish` completes it with the outcome).
    """
    previous = previous or SpeculativeModelStatus()
    tuner = previous.tuner or TunerStatus()
    settings = tuning_settings(spec)
    auto = settings.mode == "Auto"
    state = load_state(spec, tuner)
    ok = [r for r in readings if r.metrics is not None]
    errors = {r.endpoint.pod: r.error or "no metrics" for r in readings if r.metrics is None}
    baselines_in = _load_baselines(tuner.baselines)

    if not readings or not ok:
        problem = (
            (REASON_NO_ENDPOINTS, "no ready endpoints in the Service's EndpointSlices")
            if not readings
            else (
                REASON_SCRAPE_FAILED,
                _detail(errors),
            )
        )
        # Pods that are gone take their baselines with them; unreachable ones keep
        # theirs so their next window spans the gap.
        kept = {
            pod: m.to_dict()
            for pod, m in baselines_in.items()
            if pod in {r.endpoint.pod for r in readings}
        }
        return Evaluation(
            # Nothing measured: the state stays as it was (a resource never measured
            # keeps none), and without pods the window does not advance, so an idle
            # resource is not rewritten every interval.
            tuner=tuner.model_copy(update={
                "baselines": kept or None,
                "last_scrape_time": now if readings else tuner.last_scrape_time,
                "pending_pods": [],
            }),
            speculation=previous.speculation,
            history=previous.tuning_history,
            decision=None,
            target_num_speculative_tokens=None,
            problem=problem,
            scrape_errors=errors,
        )

    current = {r.endpoint.pod: r.metrics for r in ok if r.metrics is not None}
    window = window_delta(baselines_in, current)
    observed = _observed_k(ok)
    if not auto and observed is not None:
        # Recommend mode changes nothing, so the k the pods report is the k in effect.
        state = replace(state, num_speculative_tokens=observed)
    decision = decide(state, window, settings, now)
    new_state = decision.state
    target = new_state.num_speculative_tokens if auto else None
    config = target_config(new_state) if auto else None
    to_apply = [
        r.endpoint for r in ok if in_place and config is not None and not r.runs(config)
    ]

    baselines = {pod: m.to_dict() for pod, m in baselines_in.items() if pod in errors}
    baselines.update({pod: m.to_dict() for pod, m in current.items()})
    history, entry = _history(previous.tuning_history, decision, now_rfc3339)
    k_in_effect = target if auto else (observed if observed is not None else new_state.num_speculative_tokens)
    if auto:
        schedule_in_effect = config.get("num_speculative_tokens_per_batch_size") if config else None
    else:
        schedule_in_effect = _observed_schedule(ok)
    problem = None
    if decision.reason == "InsufficientData":
        problem = (REASON_INSUFFICIENT_DATA, decision.message)
    return Evaluation(
        tuner=tuner.model_copy(update={
            "state": new_state.to_dict(),
            "baselines": baselines,
            "last_scrape_time": now,
            "pending_pods": [e.pod for e in to_apply],
        }),
        speculation=_speculation(
            previous.speculation, decision, k_in_effect, schedule_in_effect, len(ok), now_rfc3339
        ),
        history=history,
        decision=decision,
        target_num_speculative_tokens=target,
        target_config=config,
        to_apply=to_apply,
        problem=problem,
        scrape_errors=errors,
        new_history_entry=entry,
        window=window,
        window_seconds=None if tuner.last_scrape_time is None else now - tuner.last_scrape_time,
        queue=sum(
            (r.queue for r in ok if r.queue is not None and r.endpoint.pod in baselines_in),
            QueueGauges(),
        ),
        window_pods=sum(1 for r in ok if r.endpoint.pod in baselines_in),
    )


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the resource."""

    type: str
    """``Normal`` or ``Warning``."""
    reason: str
    message: str


@dataclass(frozen=True)
class StatusUpdate:
    """Fields of ``status`` the tuner writes (a merge patch) and the events to post."""

    patch: dict[str, Any]
    conditions: list[Condition]
    events: list[Event]


def _tuned(
    status: bool, reason: str, message: str, generation: int | None
) -> Condition:
    return Condition(
        type=TUNED,
        status="True" if status else "False",
        reason=reason,
        message=message[:32768],
        observed_generation=generation,
    )


def _tuner_json(tuner: TunerStatus | None) -> dict[str, Any] | None:
    raw = tuner.to_k8s() if tuner is not None else {}
    if not raw.get("pendingPods"):
        raw.pop("pendingPods", None)
    return raw or None


def replacing(old: Any, new: Any) -> Any:
    """A JSON merge patch (RFC 7386) that turns ``old`` into ``new``: ``new`` with an
    explicit null for every member of ``old`` it lacks, at every depth.  A merge
    patch keeps the members it does not name, so without these nulls a pod that left
    ``pendingPods``, a gone pod's baseline or an expired blacklist entry would stay in
    the stored status forever."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out = {key: replacing(old.get(key), value) for key, value in new.items()}
    for key in old:
        if key not in new:
            out[key] = None
    return out


def _detail(errors: dict[str, str]) -> str:
    """``pod: error; ...`` in pod order."""
    return "; ".join(f"{pod}: {err}" for pod, err in sorted(errors.items()))


_CLEARABLE_SPECULATION = ("numSpeculativeTokensPerBatchSize", "recommendedNumSpeculativeTokens")
"""``status.speculation`` fields that the tuner unsets (the schedule when one k is in
effect again, the recommendation when tuning is ``Off``): a merge patch keeps a field
it does not name, so these are sent as explicit nulls."""


def _speculation_json(speculation: SpeculationStatus | None) -> dict[str, Any] | None:
    if speculation is None:
        return None
    raw: dict[str, Any] = speculation.to_k8s()
    for key in _CLEARABLE_SPECULATION:
        raw.setdefault(key, None)
    return raw


def _update(
    current: SpeculativeModelStatus,
    cond: Condition,
    tuner: TunerStatus | None,
    speculation: SpeculationStatus | None,
    history: list[TuningHistoryEntry] | None,
    events: list[Event],
    now_rfc3339: str,
) -> StatusUpdate:
    """``cond`` set among ``current``'s conditions, and the merge patch of the tuner's
    fields."""
    conditions = set_condition(list(current.conditions), cond, now_rfc3339)
    new_tuner = _tuner_json(tuner)
    patch = {
        # An explicit null removes the field (JSON merge patch); the tuner's members
        # that are gone are nulled one by one (`replacing`).
        "tuner": None if new_tuner is None else replacing(_tuner_json(current.tuner), new_tuner),
        "speculation": _speculation_json(speculation),
        "tuningHistory": [e.to_k8s() for e in history] if history else None,
        "conditions": [c.to_k8s() for c in conditions],
    }
    return StatusUpdate(patch=patch, conditions=conditions, events=events)


def finish(
    evaluation: Evaluation,
    failures: dict[str, str],
    current: SpeculativeModelStatus | None,
    generation: int | None,
    now_rfc3339: str,
) -> StatusUpdate:
    """The status to write after a window and its apply round.

    Args:
        evaluation: :func:`evaluate`'s result.
        failures: pod -> error, for the pods of ``evaluation.to_apply`` that refused
            or could not be reached (retried on the next timer tick).
        current: the status as stored now (conditions of other writers are kept).
        generation: ``metadata.generation`` for the condition.
    """
    current = current or SpeculativeModelStatus()
    d = evaluation.decision
    events: list[Event] = []
    tuner = evaluation.tuner.model_copy(update={"pending_pods": sorted(failures)})
    if evaluation.problem is not None and d is None:
        reason, message = evaluation.problem
        cond = _tuned(False, reason, message, generation)
    elif failures:
        config = evaluation.target_config or {}
        target = (
            f"schedule {config['num_speculative_tokens_per_batch_size']}"
            if "num_speculative_tokens_per_batch_size" in config
            else f"k={evaluation.target_num_speculative_tokens}"
        )
        message = f"{len(failures)} pod(s) did not accept {target}: {_detail(failures)}"
        cond = _tuned(False, REASON_APPLY_FAILED, message, generation)
        # One warning per new set of failing pods, not one per window.
        before = current.tuner.pending_pods if current.tuner is not None else []
        if sorted(failures) != sorted(before):
            events.append(Event("Warning", REASON_APPLY_FAILED, message[:1024]))
    elif evaluation.problem is not None:
        reason, message = evaluation.problem
        cond = _tuned(False, reason, message, generation)
    else:
        assert d is not None
        auto = evaluation.target_num_speculative_tokens is not None
        reason = REASON_APPLIED if auto else REASON_RECOMMENDED
        cond = _tuned(True, reason, f"{d.reason}: {d.message}", generation)
    entry = evaluation.new_history_entry
    if entry is not None:
        verb = "applied" if entry.applied and not failures else "recommended"
        if entry.applied and failures:
            verb = "applying"
        events.append(Event("Normal", entry.reason, f"k {entry.from_}->{entry.to} {verb}: {entry.message}"[:1024]))
    if evaluation.scrape_errors and d is not None:
        events.append(Event("Warning", REASON_SCRAPE_FAILED, _detail(evaluation.scrape_errors)[:1024]))
    return _update(
        current, cond, tuner, evaluation.speculation, evaluation.history, events, now_rfc3339
    )


def after_retry(
    target: int | str,
    retried: list[str],
    failures: dict[str, str],
    current: SpeculativeModelStatus,
    generation: int | None,
    now_rfc3339: str,
) -> StatusUpdate:
    """Status after re-sending the k in effect to the pods of ``status.tuner.pendingPods``
    between windows; ``failures`` are those that still refused.  ``target`` is that k,
    or a text naming the schedule in effect."""
    what = f"k={target}" if isinstance(target, int) else target
    tuner = (current.tuner or TunerStatus()).model_copy(update={"pending_pods": sorted(failures)})
    events: list[Event] = []
    if failures:
        cond = _tuned(
            False, REASON_APPLY_FAILED,
            f"{len(failures)} pod(s) did not accept {what}: {_detail(failures)}", generation,
        )
    else:
        cond = _tuned(
            True, REASON_APPLIED, f"{what} applied to {', '.join(sorted(retried))} on retry",
            generation,
        )
        events.append(Event("Normal", REASON_APPLIED, cond.message[:1024]))
    return _update(
        current, cond, tuner, current.speculation, current.tuning_history, events, now_rfc3339
    )


def disabled(
    spec: SpeculativeModelSpec,
    current: SpeculativeModelStatus,
    restore_failures: dict[str, str] | None,
    generation: int | None,
    now_rfc3339: str,
) -> StatusUpdate:
    """Status in ``Off`` mode.

    ``restore_failures`` is ``None`` when nothing had to be restored; otherwise the
    pods that did not take ``speculator.numSpeculativeTokens`` back (empty: all did,
    and the tuner's state is dropped).
    """
    k = spec.speculator.num_speculative_tokens
    events: list[Event] = []
    tuner = current.tuner
    speculation = current.speculation
    if restore_failures:
        cond = _tuned(
            False, REASON_APPLY_FAILED,
            f"tuning is Off; {len(restore_failures)} pod(s) did not take k={k} back: "
            f"{_detail(restore_failures)}",
            generation,
        )
    else:
        cond = _tuned(False, REASON_DISABLED, "spec.tuning.mode is Off", generation)
        if restore_failures is not None:
            events.append(Event("Normal", REASON_RESTORED, f"tuning is Off: k={k} restored on all pods"))
        tuner = None
        speculation = (speculation or SpeculationStatus()).model_copy(
            update={
                "num_speculative_tokens": k,
                "num_speculative_tokens_per_batch_size": None,
                "recommended_num_speculative_tokens": None,
            }
        )
    return _update(current, cond, tuner, speculation, current.tuning_history, events, now_rfc3339)


def needs_restore(spec: SpeculativeModelSpec, current: SpeculativeModelStatus | None) -> bool:
    """In ``Off`` mode: whether a tuner state exists, so pods may run a tuned k."""
    return current is not None and current.tuner is not None and current.tuner.state is not None and (
        spec.tuning.mode == "Off"
    )
