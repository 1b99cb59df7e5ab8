"""The tuner against a real runtime: the operator measures a live ``specula serve``,
decides k, applies it through the admin API (``Auto``) or only records it
(``Recommend``), and keeps its state on the object across an operator restart.

The server's admin API listens on a port of its own and checks the resource's token,
which the operator generates into the Secret ``<name>-admin-token``; the test hands
that Secret's token to the server as the kubelet would by mounting it.  Nothing the
operator writes or logs carries the token.

No kubelet runs pods here, so the test points the resource's Service at the server by
writing an EndpointSlice itself (the operator reads endpoints from EndpointSlices).
The tiny draft agrees with the target about half the time; the decisions come from
the tuning policy (the Auto test moves the bounds past the k in effect so that at
least one change is certain), the test only checks that they are taken, applied and
recorded.  With ``tuning.perBatchSize`` the operator sends a per-batch-size schedule
instead of one k, and sends one k again once it is turned off.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import pytest

from specula.devcluster.control_plane import wait_for

from .runtime_server import RuntimeServer, ServerNamespace, Traffic, build_tiny_checkpoints
from .sm_objects import (
    condition,
    create_sm,
    delete_sm,
    endpoint_slice_body,
    get_sm,
    patch_sm,
    sm_body,
)

pytestmark = pytest.mark.integration

SERVER_MAX_K = 4
"""k the server starts with: its bound, as the operator renders it in Auto mode
(``tuning.maxSpeculativeTokens``)."""


@pytest.fixture(scope="module")
def runtime_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeServer]:
    root = tmp_path_factory.mktemp("tuning-runtime")
    target, draft = build_tiny_checkpoints(root)
    test_host = ServerNamespace()
    server = RuntimeServer(
        target, draft, root, num_speculative_tokens=SERVER_MAX_K, test_host=test_host
    )
    try:
        test_host.create()
        server.start()
        yield server
    finally:
        server.stop()
        test_host.delete()


def _tuned_sm(name: str, mode: str, k: int, **tuning) -> dict:
    return sm_body(name, {
        "model": {"dtype": "float32", "maxModelLen": 128},
        "speculator": {"numSpeculativeTokens": k},
        "resources": {"gpu": {"count": 0}},
        "tuning": {
            "mode": mode,
            "minSpeculativeTokens": 0,
            "maxSpeculativeTokens": SERVER_MAX_K,
            "interval": "2s",
            "cooldown": "0s",
            "minGain": 0.01,
            **tuning,
        },
    })


def _mount_admin_token(core_v1, namespace: str, name: str, server: RuntimeServer) -> str:
    """The token of the operator's Secret for ``name``, put where the server reads it
    (the kubelet's job for a real pod); returns it."""
    secret = wait_for(
        lambda: next(iter(
            s for s in core_v1.list_namespaced_secret(namespace).items
            if s.metadata.name == f"{name}-admin-token"
        ), None),
        timeout=30, message=f"Secret {name}-admin-token",
    )
    (owner,) = secret.metadata.owner_references
    assert (owner.kind, owner.name, owner.controller) == ("SpeculativeModel", name, True)
    token = base64.b64decode(secret.data["token"]).decode()
    assert len(token) >= 32
    server.use_token(token)
    return token


def _assert_token_kept_secret(core_v1, apps_v1, namespace: str, token: str, *logs: str) -> None:
    """No ConfigMap, no pod template (env literals included) and no log line holds it."""
    for cm in core_v1.list_namespaced_config_map(namespace).items:
        assert token not in json.dumps(cm.data or {}), cm.metadata.name
    for dep in apps_v1.list_namespaced_deployment(namespace).items:
        assert token not in json.dumps(dep.to_dict(), default=str), dep.metadata.name
    for log in logs:
        assert token not in log


def _point_service_at(discovery_v1, namespace: str, name: str, server: RuntimeServer) -> None:
    discovery_v1.create_namespaced_endpoint_slice(
        namespace,
        endpoint_slice_body(
            name, server.host, {"http": server.port, "metrics": server.metrics_port}
        ),
    )


def _cleanup(custom_objects, discovery_v1, namespace: str, name: str) -> None:
    delete_sm(custom_objects, namespace, name)
    discovery_v1.delete_collection_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={name}"
    )


def _speculation(sm: dict) -> dict:
    return (sm.get("status") or {}).get("speculation") or {}


def _events(core_v1, namespace: str, name: str) -> list:
    events = core_v1.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}"
    ).items
    return [e for e in events if e.involved_object.kind == "SpeculativeModel"]


def test_recommend_mode_measures_and_records_without_applying(
    operator, custom_objects, core_v1, discovery_v1, namespace, runtime_server
):
    name = "tuned-recommend"
    k = 3
    runtime_server.set_num_speculative_tokens(k)
    create_sm(custom_objects, namespace, _tuned_sm(name, "Recommend", k))
    _mount_admin_token(core_v1, namespace, name, runtime_server)
    _point_service_at(discovery_v1, namespace, name, runtime_server)
    try:
        with Traffic(runtime_server) as traffic:

            def recommended() -> dict | None:
                sm = get_sm(custom_objects, namespace, name)
                tuned = condition(sm, "Tuned")
                spec = _speculation(sm)
                if tuned and tuned["status"] == "True" and spec.get("sampledDrafts"):
                    return sm
                return None

            sm = wait_for(recommended, timeout=60, interval=0.5, message=(
                f"{name}: Tuned=True with a measurement"
            ))
            assert not traffic.errors, traffic.errors[:3]

        tuned = condition(sm, "Tuned")
        assert tuned["reason"] == "Recommended", tuned
        spec = _speculation(sm)
        assert spec["numSpeculativeTokens"] == k
        assert 0 <= spec["recommendedNumSpeculativeTokens"] <= SERVER_MAX_K
        assert 0.0 < spec["acceptanceRate"] < 1.0
        assert 1.0 < spec["meanAcceptanceLength"] <= k + 1
        assert len(spec["perPositionAcceptanceRate"]) == k
        assert spec["goodputTokensPerSecond"] > 0
        assert spec["schedule"][0][0] == 1
        assert spec["measuredPods"] == 1
        assert sm["status"]["tuner"]["state"]["numSpeculativeTokens"] == k
        # Recommendations are recorded, never applied: the server's k is untouched.
        assert all(not e["applied"] for e in sm["status"].get("tuningHistory") or [])
        assert runtime_server.speculative_config()["num_speculative_tokens"] == k
    finally:
        _cleanup(custom_objects, discovery_v1, namespace, name)


def test_auto_mode_applies_decisions_and_keeps_state_across_restart(
    operator, custom_objects, core_v1, apps_v1, discovery_v1, namespace, runtime_server
):
    name = "tuned-auto"
    start_k = 2
    runtime_server.set_num_speculative_tokens(SERVER_MAX_K)
    create_sm(custom_objects, namespace, _tuned_sm(name, "Auto", start_k))
    # Auto mode: the pods start at the spec's k, bounded by maxSpeculativeTokens.
    config = wait_for(
        lambda: next(iter(
            cm for cm in core_v1.list_namespaced_config_map(namespace).items
            if cm.metadata.name == name
        ), None),
        timeout=30,
        message=f"ConfigMap {name}",
    )
    rendered = json.loads(config.data["runtime.json"])["speculator"]
    assert rendered["num_speculative_tokens"] == start_k
    assert rendered["max_num_speculative_tokens"] == SERVER_MAX_K
    token = _mount_admin_token(core_v1, namespace, name, runtime_server)
    _point_service_at(discovery_v1, namespace, name, runtime_server)
    try:
        with Traffic(runtime_server) as traffic:
            # First the operator brings the pod, which runs another k (as a pod restarted
            # by hand or left over from an earlier spec would), to the spec's k.
            wait_for(
                lambda: runtime_server.speculative_config()["num_speculative_tokens"] == start_k,
                timeout=30, interval=0.3, message=f"server k set to {start_k}",
            )

            def measured() -> dict | None:
                sm = get_sm(custom_objects, namespace, name)
                return sm if _speculation(sm).get("sampledDrafts") else None

            sm = wait_for(measured, timeout=60, interval=0.5, message=f"{name} measured")
            # Whatever the policy does on its own, moving the bounds past the k in
            # effect makes it move k (reason Bounds) without rolling the pods (the
            # pods' bound, maxSpeculativeTokens, stays).
            k_now = _speculation(sm)["numSpeculativeTokens"]
            if k_now < SERVER_MAX_K:
                bounds = {"minSpeculativeTokens": k_now + 1}
                k_spec = max(sm["spec"]["speculator"]["numSpeculativeTokens"], k_now + 1)
            else:
                bounds = {"minSpeculativeTokens": 0, "maxSpeculativeTokens": k_now - 1}
                k_spec = min(sm["spec"]["speculator"]["numSpeculativeTokens"], k_now - 1)
            patch_sm(custom_objects, namespace, name, {"spec": {
                "speculator": {"numSpeculativeTokens": k_spec}, "tuning": bounds,
            }})

            def decided() -> dict | None:
                sm = get_sm(custom_objects, namespace, name)
                history = (sm.get("status") or {}).get("tuningHistory") or []
                applied = [e for e in history if e["applied"]]
                if not applied:
                    return None
                # Status is written after the PUT; a later decision may move k again, so
                # wait for a moment where server, status and history agree.
                server_k = runtime_server.speculative_config()["num_speculative_tokens"]
                last = applied[-1]
                tuned = condition(sm, "Tuned")
                if (
                    server_k == last["to"] == _speculation(sm).get("numSpeculativeTokens")
                    and tuned is not None
                    and tuned["reason"] in ("Applied", "InsufficientData")
                ):
                    return sm
                return None

            sm = wait_for(decided, timeout=60, interval=0.5, message=(
                f"{name}: an applied decision recorded in status and in effect on the server"
            ))
            first = next(e for e in sm["status"]["tuningHistory"] if e["applied"])
            assert first["from"] != first["to"]
            assert first["reason"] in ("HigherGoodput", "Explore", "Revert", "Bounds")
            assert first["time"].endswith("Z")
            assert sm["status"]["tuner"]["state"]["decisions"] >= 2

            # The tuner's state lives on the object: a restarted operator continues it
            # (a lost state would start counting decisions from 1 again).
            operator.stop()
            decisions = get_sm(custom_objects, namespace, name)["status"]["tuner"]["state"][
                "decisions"
            ]
            operator.start()

            def decisions_now() -> int | None:
                n = get_sm(custom_objects, namespace, name)["status"]["tuner"]["state"][
                    "decisions"
                ]
                return n if n != decisions else None

            assert wait_for(
                decisions_now, timeout=30, interval=0.3, message="a decision after the restart"
            ) == decisions + 1
            sm = get_sm(custom_objects, namespace, name)
            assert sm["status"]["tuningHistory"][0] == first
            assert not traffic.errors, traffic.errors[:3]

        # The token reached the pod only through the Secret.
        _assert_token_kept_secret(
            core_v1, apps_v1, namespace, token, operator.log_path.read_text(errors="replace"),
            runtime_server.log_path.read_text(errors="replace"),
        )
        reasons = {e.reason for e in _events(core_v1, namespace, name)}
        assert first["reason"] in reasons, reasons
        tuned = condition(get_sm(custom_objects, namespace, name), "Tuned")
        assert tuned is not None and tuned["reason"] in ("Applied", "InsufficientData"), tuned
    finally:
        _cleanup(custom_objects, discovery_v1, namespace, name)


def _wide_column(control_plane, namespace: str, name: str, column: str) -> str:
    """``column`` of ``kubectl get sm -o wide`` (blank when the field is unset)."""
    out = control_plane.run_kubectl("-n", namespace, "get", "sm", name, "-o", "wide").stdout
    header, row = out.rstrip("\n").splitlines()
    columns = header.split()
    starts = [header.index(c) for c in columns]
    ends = [*starts[1:], None]
    values = {c: row[a:b].strip() for c, a, b in zip(columns, starts, ends, strict=True)}
    return values[column]


def test_per_batch_size_puts_a_schedule_and_one_k_once_turned_off(
    operator, control_plane, custom_objects, core_v1, discovery_v1, namespace, runtime_server
):
    name = "tuned-per-batch"
    start_k = 2
    runtime_server.set_num_speculative_tokens(SERVER_MAX_K)
    create_sm(custom_objects, namespace, _tuned_sm(name, "Auto", start_k, perBatchSize=True))
    _mount_admin_token(core_v1, namespace, name, runtime_server)
    _point_service_at(discovery_v1, namespace, name, runtime_server)
    try:
        with Traffic(runtime_server) as traffic:

            def scheduled() -> tuple[dict, list] | None:
                # The operator PUTs a schedule (at first the spec's k at every batch
                # size up to 256; later whatever the
                # policy decides), and status shows the one the server runs.
                server = runtime_server.speculative_config()
                schedule = server.get("num_speculative_tokens_per_batch_size")
                sm = get_sm(custom_objects, namespace, name)
                shown = _speculation(sm).get("numSpeculativeTokensPerBatchSize")
                if schedule and shown == schedule:
                    return sm, schedule
                return None

            sm, schedule = wait_for(scheduled, timeout=60, interval=0.3, message=(
                f"{name}: a schedule in effect on the server and in status"
            ))
            assert schedule[0][0] == 1 and schedule[-1][1] == 256, schedule
            assert all(0 <= k <= SERVER_MAX_K for _, _, k in schedule), schedule
            assert sm["status"]["tuner"]["state"].get("schedule") == schedule
            column = _wide_column(control_plane, namespace, name, "K-PER-BATCH")
            # The API server prints the list as JSON (the policy may have moved on since).
            assert column.startswith("[[1,") and json.loads(column)[-1][1] == 256, column

            patch_sm(custom_objects, namespace, name, {"spec": {"tuning": {"perBatchSize": False}}})

            def single_k() -> tuple[dict, int] | None:
                server = runtime_server.speculative_config()
                sm = get_sm(custom_objects, namespace, name)
                spec = _speculation(sm)
                k = server.get("num_speculative_tokens")
                if (
                    server.get("num_speculative_tokens_per_batch_size") is None
                    and isinstance(k, int)
                    and "numSpeculativeTokensPerBatchSize" not in spec
                    and spec.get("numSpeculativeTokens") == k
                ):
                    return sm, k
                return None

            sm, k = wait_for(single_k, timeout=60, interval=0.3, message=(
                f"{name}: one k in effect on the server and in status after perBatchSize: false"
            ))
            assert 0 <= k <= SERVER_MAX_K
            assert sm["status"]["tuner"]["state"].get("schedule") is None
            assert _wide_column(control_plane, namespace, name, "K-PER-BATCH") == ""
            assert not traffic.errors, traffic.errors[:3]
    finally:
        _cleanup(custom_objects, discovery_v1, namespace, name)
