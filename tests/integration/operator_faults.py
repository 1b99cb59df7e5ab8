"""Kill the operator at chosen points of its work, restart it, and check it converges.

Used by ``tests/integration/test_operator_faults.py`` (a few points) and by
``bench/faults_operator.py`` (all 20).  A kill point is an *event* the operator
causes, never a sleep:

- a line of its log: a write the API server accepted (``wrote ConfigMap ns/name``,
  logged by :mod:`specula.operator.kube` at DEBUG), or kopf's ``Handler ... is
  invoked`` / ``succeeded``, or the tuner's decision line (``k=1 -> 4, applied``);
- a request it makes to the stand-in pod: a ``GET /metrics`` (a tuning window
  starts) or a ``PUT /v1/speculative_config`` (the pod got the new k; its status has
  not been written yet);
- a change of the resource's status the API server shows (the tuned k recorded).

The operator is ``SIGKILL``ed as soon as the watcher sees the event (it polls every
few milliseconds), so it dies between two of its own steps: a child applied and the
next not, k applied to the pod and not recorded, status written and kopf's own
bookkeeping not, ...  Points are drawn from a seeded ``random.Random``, so a run is
reproducible up to the few milliseconds the operator moves on before the signal.

Convergence, after the restart (:meth:`KillHarness.problems`), for every resource:

- exactly one ConfigMap, Deployment, Service, Secret and NetworkPolicy controlled by
  it (owner reference: its uid, ``controller: true``), the ConfigMap and the pod
  template's annotations as the builders render the current spec;
- ``status.observedGeneration`` and every condition's ``observedGeneration`` equal to
  ``metadata.generation``, ``Ready=True`` and ``Degraded=False`` (the harness plays
  the Deployment controller: no kubelet runs pods in this tier);
- for the tuned resource: the k the tuner was forced to (``tuning.min = max``) is
  the k in ``status.speculation``, in ``status.tuner.state`` and on the stand-in pod,
  no pod is pending, and the tuner's memory is kept: its decision count and history
  length never go back, and the acceptance estimates stay in status.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client.rest import ApiException

from specula.api.models import SpeculativeModelSpec
from specula.devcluster.control_plane import wait_for
from specula.operator.builders import Owner, build_children
from specula.operator.engine import pod_speculation
from specula.operator.reconcile import parse_status

from .operator_process import OperatorProcess
from .sm_objects import condition, create_sm, endpoint_slice_body, get_sm, patch_sm, sm_body
from .stand_in_pod import StandInPod

SEED = 14
"""Seed of the kill points (issue 14)."""
POINTS = 20
TUNED = "tuned"
"""The resource the tuning points work on (Auto mode, one stand-in pod)."""
ALPHAS = (0.8, 0.6, 0.4, 0.2)
"""The stand-in's per-position acceptance; k up to 4."""
CONVERGE_TIMEOUT_S = 60.0
TRIGGER_TIMEOUT_S = 30.0

# What each phase does before the kill, and the events that can stop it.
RECONCILE_CREATE = "reconcile-create"
"""A new resource is created (children do not exist yet)."""
RECONCILE_UPDATE = "reconcile-update"
"""The tuned resource's ``model.maxModelLen`` changes (ConfigMap, Deployment roll)."""
TUNING = "tuning"
"""The tuned resource's bounds force another k (``tuning.min = max = k``; the spec's
k moves with them, as the CRD wants it within the bounds)."""

TRIGGERS: dict[str, list[tuple[str, int]]] = {
    # (trigger, how many occurrences it may wait for)
    RECONCILE_CREATE: [("write", 6), ("handler-invoked", 1), ("handler-succeeded", 1)],
    RECONCILE_UPDATE: [("write", 5), ("handler-invoked", 1), ("handler-succeeded", 1)],
    TUNING: [("scrape", 2), ("put", 1), ("decision-log", 1), ("status-k", 1)],
}


@dataclass(frozen=True)
class KillPoint:
    index: int
    phase: str
    trigger: str
    nth: int
    k: int = 0
    """``TUNING``: the k forced; ``RECONCILE_UPDATE``: unused."""
    max_model_len: int = 0
    """``RECONCILE_UPDATE``: the new ``model.maxModelLen``."""

    def describe(self) -> str:
        what = {
            "write": f"after write #{self.nth} the operator logs for the resource",
            "handler-invoked": "when kopf logs the reconcile handler invoked",
            "handler-succeeded": "when kopf logs the reconcile handler succeeded (before "
                                 "its progress annotations are written)",
            "scrape": f"at GET /metrics #{self.nth} on the pod (a tuning window)",
            "put": "when the pod receives PUT /v1/speculative_config (k applied, status "
                   "not yet written)",
            "decision-log": "when the tuner logs its decision (k applied, status not yet "
                            "written)",
            "status-k": "when the API server shows the new k in status.speculation",
        }[self.trigger]
        extra = f" (k -> {self.k})" if self.phase == TUNING else ""
        return f"#{self.index} {self.phase}{extra}: {what}"


def kill_points(seed: int = SEED, count: int = POINTS) -> list[KillPoint]:
    """``count`` points, reconcile and tuning alternating, triggers drawn by ``seed``."""
    rng = random.Random(seed)
    phases = [RECONCILE_CREATE, TUNING, RECONCILE_UPDATE, TUNING]
    out: list[KillPoint] = []
    k = 2
    length = 2048
    for i in range(count):
        phase = phases[i % len(phases)]
        trigger, most = rng.choice(TRIGGERS[phase])
        nth = rng.randint(1, most)
        if phase == TUNING:
            k = rng.choice([v for v in range(1, len(ALPHAS) + 1) if v != k])
        if phase == RECONCILE_UPDATE:
            length = 1024 if length != 1024 else 2048
            length += 128 * rng.randint(0, 3)
        out.append(KillPoint(i, phase, trigger, nth, k=k, max_model_len=length))
    return out


def covering(points: list[KillPoint]) -> list[KillPoint]:
    """The first point of each phase: what the quick test runs."""
    seen: dict[str, KillPoint] = {}
    for p in points:
        seen.setdefault(p.phase, p)
    return list(seen.values())


class DeploymentController(threading.Thread):
    """Plays the Deployment controller and kubelet: every Deployment of the namespace
    is reported rolled out and ready (status ``observedGeneration`` = generation, all
    replicas ready), whether the operator runs or not."""

    def __init__(self, apps_v1, namespace: str) -> None:
        super().__init__(daemon=True, name="fake-deployment-controller")
        self.apps_v1 = apps_v1
        self.namespace = namespace
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.2):
            try:
                for dep in self.apps_v1.list_namespaced_deployment(self.namespace).items:
                    want = dep.spec.replicas or 0
                    st = dep.status
                    if (st.observed_generation == dep.metadata.generation
                            and (st.ready_replicas or 0) == want
                            and (st.replicas or 0) == want):
                        continue
                    self.apps_v1.patch_namespaced_deployment_status(
                        dep.metadata.name, self.namespace, {"status": {
                            "observedGeneration": dep.metadata.generation,
                            "replicas": want, "readyReplicas": want,
                            "updatedReplicas": want, "availableReplicas": want,
                        }},
                    )
            except Exception:  # noqa: BLE001 - the API server may be away; try again
                continue

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)


class _Tail:
    """New lines of a growing file since construction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = ""

    def lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        text = self.partial + data.decode(errors="replace")
        *done, self.partial = text.split("\n")
        return done


@dataclass
class Outcome:
    point: KillPoint
    survived: bool
    killed: bool
    problems: list[str] = field(default_factory=list)
    seconds_to_converge: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "point": self.point.describe(),
            "survived": self.survived,
            "killed_at_trigger": self.killed,
            "seconds_to_converge": (
                None if self.seconds_to_converge is None else round(self.seconds_to_converge, 2)
            ),
            "problems": self.problems,
        }


@dataclass
class KillHarness:
    operator: OperatorProcess
    pod: StandInPod
    custom_objects: Any
    core_v1: Any
    apps_v1: Any
    networking_v1: Any
    discovery_v1: Any
    namespace: str
    resources: list[str] = field(default_factory=list)
    tuned_k: int = 2
    decisions_seen: int = 0
    history_seen: int = 0

    # -- setup ---------------------------------------------------------------------

    def tuned_body(self, k: int, max_model_len: int = 2048) -> dict[str, Any]:
        return sm_body(TUNED, {
            "model": {"maxModelLen": max_model_len},
            "resources": {"gpu": {"count": 0}},
            "speculator": {"numSpeculativeTokens": k},
            "tuning": {
                "mode": "Auto", "interval": "2s", "cooldown": "0s", "minGain": 0.01,
                "minSpeculativeTokens": k, "maxSpeculativeTokens": k,
            },
        })

    def set_up(self) -> None:
        """The tuned resource, its stand-in pod behind its Service, tuned to k=2."""
        create_sm(self.custom_objects, self.namespace, self.tuned_body(self.tuned_k))
        self.resources.append(TUNED)
        self.discovery_v1.create_namespaced_endpoint_slice(self.namespace, endpoint_slice_body(
            TUNED, self.pod.address,
            {"http": self.pod.port, "metrics": self.pod.port, "admin": self.pod.port},
        ))
        secret = wait_for(
            lambda: self._secret(f"{TUNED}-admin-token"), timeout=30,
            message="the tuned resource's admin-token Secret",
        )
        import base64

        self.pod.use_token(base64.b64decode(secret.data["token"]).decode())
        self.wait_converged(CONVERGE_TIMEOUT_S)

    def _secret(self, name: str):
        try:
            return self.core_v1.read_namespaced_secret(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # -- one point -----------------------------------------------------------------

    def run(self, point: KillPoint) -> Outcome:
        """Act, kill at the trigger, restart, wait for convergence."""
        log = _Tail(self.operator.log_path)
        pod_log = _Tail(self.pod.requests_log)
        name = TUNED
        if point.phase == RECONCILE_CREATE:
            name = f"kill-{point.index:02d}"
            create_sm(self.custom_objects, self.namespace, sm_body(name, {
                "resources": {"gpu": {"count": 0}}, "tuning": {"mode": "Off"},
            }))
            self.resources.append(name)
        elif point.phase == RECONCILE_UPDATE:
            patch_sm(self.custom_objects, self.namespace, TUNED,
                     {"spec": {"model": {"maxModelLen": point.max_model_len}}})
        else:
            self.tuned_k = point.k
            patch_sm(self.custom_objects, self.namespace, TUNED, {"spec": {
                "speculator": {"numSpeculativeTokens": point.k},
                "tuning": {"minSpeculativeTokens": point.k, "maxSpeculativeTokens": point.k},
            }})
        killed = self._kill_on(point, name, log, pod_log)
        if self.operator.proc is not None and self.operator.proc.poll() is None:
            self.operator.proc.kill()
        self.operator.proc.wait(10)
        self.operator.start()
        t0 = time.monotonic()
        problems = self.wait_converged(CONVERGE_TIMEOUT_S, raise_=False)
        return Outcome(
            point, survived=not problems, killed=killed, problems=problems,
            seconds_to_converge=None if problems else time.monotonic() - t0,
        )

    def _kill_on(self, point: KillPoint, name: str, log: _Tail, pod_log: _Tail) -> bool:
        """Poll the event sources; SIGKILL the operator at the point's event.  False if
        the event did not come in time (the operator is killed all the same)."""
        ns = self.namespace
        write = re.compile(rf"wrote [A-Za-z ]+ {re.escape(ns)}/{re.escape(name)}(-admin-token)? \(")
        invoked = re.compile(rf"\[{re.escape(ns)}/{re.escape(name)}\] Handler 'on_speculative_model' is invoked")
        succeeded = re.compile(rf"\[{re.escape(ns)}/{re.escape(name)}\] Handler 'on_speculative_model' succeeded")
        decision = re.compile(rf"{re.escape(ns)}/{re.escape(name)}: \w+ \(k=\d+ -> {point.k}, applied")
        count = 0
        deadline = time.monotonic() + TRIGGER_TIMEOUT_S
        last_status_check = 0.0
        while time.monotonic() < deadline:
            if point.trigger in ("write", "handler-invoked", "handler-succeeded", "decision-log"):
                pattern = {"write": write, "handler-invoked": invoked,
                           "handler-succeeded": succeeded, "decision-log": decision}[point.trigger]
                count += sum(1 for line in log.lines() if pattern.search(line))
            elif point.trigger == "scrape":
                count += sum(1 for line in pod_log.lines() if line.startswith("GET /metrics"))
            elif point.trigger == "put":
                count += sum(
                    1 for line in pod_log.lines()
                    if line.startswith("PUT /v1/speculative_config k=")
                )
            elif point.trigger == "status-k" and time.monotonic() - last_status_check > 0.02:
                last_status_check = time.monotonic()
                sm = get_sm(self.custom_objects, ns, name)
                spec_k = ((sm.get("status") or {}).get("speculation") or {}).get(
                    "numSpeculativeTokens")
                count = 1 if spec_k == point.k else 0
            if count >= point.nth:
                self.operator.proc.kill()
                return True
            time.sleep(0.003)
        return False

    # -- convergence ---------------------------------------------------------------

    def wait_converged(self, timeout: float, raise_: bool = True) -> list[str]:
        deadline = time.monotonic() + timeout
        problems: list[str] = []
        while time.monotonic() < deadline:
            try:
                problems = self.problems()
            except ApiException as exc:
                problems = [f"API error {exc.status}"]
            if not problems:
                return []
            time.sleep(0.5)
        if raise_:
            raise AssertionError(f"did not converge in {timeout:.0f}s: {problems}")
        return problems

    def problems(self) -> list[str]:
        out: list[str] = []
        for name in self.resources:
            out += [f"{name}: {p}" for p in self._resource_problems(name)]
        return out

    def _resource_problems(self, name: str) -> list[str]:
        ns = self.namespace
        sm = get_sm(self.custom_objects, ns, name)
        uid, gen = sm["metadata"]["uid"], sm["metadata"]["generation"]
        problems: list[str] = []
        kinds: dict[str, Callable[[], list]] = {
            "ConfigMap": lambda: self.core_v1.list_namespaced_config_map(ns).items,
            "Deployment": lambda: self.apps_v1.list_namespaced_deployment(ns).items,
            "Service": lambda: self.core_v1.list_namespaced_service(ns).items,
            "Secret": lambda: self.core_v1.list_namespaced_secret(ns).items,
            "NetworkPolicy": lambda: self.networking_v1.list_namespaced_network_policy(ns).items,
        }
        owned: dict[str, Any] = {}
        for kind, list_ in kinds.items():
            mine = []
            for obj in list_():
                refs = [r for r in obj.metadata.owner_references or [] if r.uid == uid]
                if not refs:
                    continue
                mine.append(obj)
                ref = refs[0]
                if not (ref.controller and ref.kind == "SpeculativeModel" and ref.name == name):
                    problems.append(f"{kind} {obj.metadata.name}: owner reference {ref}")
            if len(mine) != 1:
                problems.append(f"{len(mine)} {kind}s owned (want 1)")
            else:
                owned[kind] = mine[0]
        status = sm.get("status") or {}
        if status.get("observedGeneration") != gen:
            problems.append(f"observedGeneration {status.get('observedGeneration')} != {gen}")
        for type_, want in (("Ready", "True"), ("Progressing", "False"), ("Degraded", "False")):
            cond = condition(sm, type_)
            if cond is None:
                problems.append(f"no {type_} condition")
                continue
            if cond.get("status") != want:
                problems.append(f"{type_}={cond.get('status')} ({cond.get('reason')}), want {want}")
            if cond.get("observedGeneration") != gen:
                problems.append(f"{type_}.observedGeneration {cond.get('observedGeneration')}")
        if "ConfigMap" in owned and "Deployment" in owned:
            problems += self._children_current(sm, owned["ConfigMap"], owned["Deployment"])
        if name == TUNED:
            problems += self._tuning_problems(sm)
        return problems

    def _children_current(self, sm: dict[str, Any], cm, dep) -> list[str]:
        """The ConfigMap's data and the pod template's annotations as the builders render
        the stored spec and status (what the operator must have applied last)."""
        meta = sm["metadata"]
        spec = SpeculativeModelSpec.model_validate(sm["spec"])
        want = build_children(
            Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"]), spec,
            speculation=pod_speculation(spec, parse_status(sm)),
        )
        want_cm = next(c for c in want if c["kind"] == "ConfigMap")
        want_dep = next(c for c in want if c["kind"] == "Deployment")
        problems = []
        if (cm.data or {}) != want_cm.get("data", {}):
            problems.append("ConfigMap data is not the current spec's")
        have = dep.spec.template.metadata.annotations or {}
        for key, value in (want_dep["spec"]["template"]["metadata"].get("annotations") or {}).items():
            if have.get(key) != value:
                problems.append(f"Deployment pod annotation {key}={have.get(key)!r}, want {value!r}")
        return problems

    def _tuning_problems(self, sm: dict[str, Any]) -> list[str]:
        status = sm.get("status") or {}
        speculation = status.get("speculation") or {}
        tuner = status.get("tuner") or {}
        state = tuner.get("state") or {}
        problems = []
        k = self.tuned_k
        if speculation.get("numSpeculativeTokens") != k:
            problems.append(f"status k {speculation.get('numSpeculativeTokens')} != {k}")
        if state.get("numSpeculativeTokens") != k:
            problems.append(f"tuner state k {state.get('numSpeculativeTokens')} != {k}")
        pod_k = self.pod.current_k()
        if pod_k != k:
            problems.append(f"pod runs k={pod_k}, want {k}")
        if tuner.get("pendingPods"):
            tuned = condition(sm, "Tuned") or {}
            problems.append(
                f"pods pending: {tuner.get('pendingPods')} (Tuned: {tuned.get('message')}; "
                f"pod's last requests {self.pod.requests()[-3:]})"
            )
        if speculation.get("acceptanceRate") is None or not speculation.get(
                "perPositionAcceptanceRate"):
            problems.append("acceptance estimates missing from status")
        decisions = int(state.get("decisions") or 0)
        history = len(status.get("tuningHistory") or [])
        if decisions < self.decisions_seen:
            problems.append(f"tuner decisions went back: {decisions} < {self.decisions_seen}")
        if history < self.history_seen:
            problems.append(f"tuning history went back: {history} < {self.history_seen}")
        if not problems:
            self.decisions_seen, self.history_seen = decisions, history
        return problems


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    return {
        "operator_kills_survived": sum(o.survived for o in outcomes),
        "operator_kills_tried": len(outcomes),
        "points": [o.to_dict() for o in outcomes],
    }


def write_report(path: Path, outcomes: list[Outcome], **extra: Any) -> None:
    path.write_text(json.dumps({**summary(outcomes), **extra}, indent=2) + "\n")


def restart_apiserver(cp, operator: OperatorProcess, down_until: Callable[[], bool]) -> float:
    """Stop the control plane's kube-apiserver (SIGTERM, as a rolling restart of a
    static pod does), keep it down until ``down_until()`` is true (the operator has
    noticed), start it again on the same port and etcd, and wait for ``/readyz``.
    Returns the seconds it was down."""
    component = next(c for c in cp.components if c.name == "kube-apiserver")
    component.stop()
    t0 = time.monotonic()
    try:
        wait_for(down_until, timeout=60, interval=0.1, message="the operator to notice")
    finally:
        component.start()
        wait_for(cp._apiserver_ready, timeout=120, interval=0.3, message="kube-apiserver /readyz")
    down = time.monotonic() - t0
    cp.check_alive()  # etcd and kube-controller-manager kept running
    operator.check_alive()
    return down
