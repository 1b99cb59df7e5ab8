"""The Helm chart rendered by the real Helm CLI: lint, template for each values file
under charts/specula/ci, and checks on the rendered objects (kinds, RBAC scope and
rules, labels and selectors, the CRD, operator arguments and settings, monitoring);
values.schema.json against bad values.  No cluster needed."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import specula
from specula.cli import build_parser
from specula.devcluster.control_plane import REPO_ROOT
from specula.operator.builders import (
    LABEL_INSTANCE,
    METRICS_PORT_NAME,
    RUN_AS_USER,
    labels,
)
from specula.operator.settings import OperatorSettings
from specula.runtime.server.metrics import RuntimeProm, RuntimeSnapshot
from specula.runtime.spec_decode.metrics import SpecDecodingStats
from specula.runtime.spec_decode.metrics_prom import SpecDecodingProm

from .helm_cli import (
    CHART,
    CI_VALUES,
    CRD_WATCH,
    NAMESPACE_WATCH,
    OPERATOR_RULES,
    RELEASE,
    RELEASE_NAMESPACE,
    Helm,
    find,
    one,
    rules_table,
)

pytestmark = pytest.mark.integration

VALUES_FILES = sorted(CI_VALUES.glob("*-values.yaml"))
CRD_SOURCE = REPO_ROOT / "crds" / "speculativemodel.yaml"
DASHBOARD = CHART / "files" / "dashboards" / "speculative-decoding.json"


@pytest.fixture(scope="module")
def rendered(helm: Helm) -> dict[str, list[dict]]:
    """Each ci values file, rendered once."""
    return {path.name: helm.template(path) for path in VALUES_FILES}


def values_file(name: str) -> Path:
    return CI_VALUES / name


def container(objects: list[dict]) -> dict:
    deployment = one(objects, "Deployment")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def operator_env(objects: list[dict]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(objects)["env"] if "value" in e}


def test_values_files_cover_the_modes():
    assert {p.name for p in VALUES_FILES} >= {
        "default-values.yaml",
        "namespaced-values.yaml",
        "monitoring-values.yaml",
        "crds-disabled-values.yaml",
        "custom-values.yaml",
    }


@pytest.mark.parametrize("path", VALUES_FILES, ids=lambda p: p.name)
def test_lint_strict(helm: Helm, path: Path):
    proc = helm.run("lint", str(CHART), "--strict", "--values", str(path))
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


def test_chart_versions_follow_the_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == chart["appVersion"] == specula.__version__


def test_default_render_is_a_cluster_wide_operator(rendered):
    objects = rendered["default-values.yaml"]
    assert sorted(o["kind"] for o in objects) == sorted([
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
        "CustomResourceDefinition",
    ])
    role = one(objects, "ClusterRole")
    assert rules_table(role["rules"]) == OPERATOR_RULES | CRD_WATCH
    binding = one(objects, "ClusterRoleBinding")
    sa = one(objects, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{
        "kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": RELEASE_NAMESPACE,
    }]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    args = build_parser().parse_args(container(objects)["args"])
    assert args.command == "operator" and args.all_namespaces and not args.namespace


def test_namespaced_render_grants_only_the_watched_namespaces(rendered):
    objects = rendered["namespaced-values.yaml"]
    watched = yaml.safe_load(values_file("namespaced-values.yaml").read_text())["watchNamespaces"]
    roles = find(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(watched)
    for role in roles:
        assert rules_table(role["rules"]) == OPERATOR_RULES
    bindings = find(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(watched)
    sa_name = one(objects, "ServiceAccount")["metadata"]["name"]
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role"
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": sa_name, "namespace": RELEASE_NAMESPACE}
        ]
    # Cluster scope keeps only what kopf needs to discover resources and namespaces.
    cluster_role = one(objects, "ClusterRole")
    assert rules_table(cluster_role["rules"]) == CRD_WATCH | NAMESPACE_WATCH
    one(objects, "ClusterRoleBinding")
    args = build_parser().parse_args(container(objects)["args"])
    assert args.namespace == watched and not args.all_namespaces


def test_every_object_carries_the_standard_labels(rendered):
    for name, objects in rendered.items():
        for obj in objects:
            got = obj["metadata"].get("labels") or {}
            where = f"{name}: {obj['kind']} {obj['metadata']['name']}"
            assert got.get("app.kubernetes.io/name") == "specula", where
            assert got.get("app.kubernetes.io/instance") == RELEASE, where
            assert got.get("app.kubernetes.io/managed-by") == "Helm", where
            assert got.get("app.kubernetes.io/version") == specula.__version__, where
            assert got.get("helm.sh/chart") == f"specula-{specula.__version__}", where


def _selectors(obj: dict) -> list[dict[str, str]]:
    spec = obj.get("spec") or {}
    out = []
    if obj["kind"] == "Deployment":
        out.append(spec["selector"]["matchLabels"])
    if obj["kind"] == "Service":
        out.append(spec["selector"])
    if obj["kind"] in ("ServiceMonitor", "PodMonitor"):
        out.append(spec["selector"]["matchLabels"])
    return out


def test_selectors_carry_no_version(rendered):
    seen = 0
    for objects in rendered.values():
        for obj in objects:
            for selector in _selectors(obj):
                seen += 1
                assert "helm.sh/chart" not in selector, obj["metadata"]["name"]
                assert "app.kubernetes.io/version" not in selector, obj["metadata"]["name"]
                assert specula.__version__ not in " ".join(selector.values())
    assert seen >= 10
    # The pods carry the selector, so the Deployment and the Service find them.
    for objects in rendered.values():
        deployment = one(objects, "Deployment")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        for service in find(objects, "Service"):
            assert service["spec"]["selector"].items() <= pod_labels.items()


def test_crd_is_the_generated_one_kept_on_uninstall(rendered):
    source = yaml.safe_load(CRD_SOURCE.read_text())
    crd = one(rendered["default-values.yaml"], "CustomResourceDefinition")
    assert crd["metadata"]["name"] == source["metadata"]["name"]
    assert crd["spec"] == source["spec"]
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    # crds.keep: false drops the annotation only.
    custom = one(rendered["custom-values.yaml"], "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (custom["metadata"].get("annotations") or {})
    assert custom["spec"] == source["spec"]
    assert not find(rendered["crds-disabled-values.yaml"], "CustomResourceDefinition")


def test_crds_disabled_render_creates_no_identity(rendered):
    objects = rendered["crds-disabled-values.yaml"]
    assert sorted(o["kind"] for o in objects) == ["Deployment", "Service"]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "specula-operator"


def test_default_settings_equal_the_operators_defaults(rendered):
    """The chart passes every setting explicitly; with the defaults, to a release named
    ``specula`` in ``specula-system``, the operator ends up exactly at its own defaults
    (runtime image of this version, its Service name and namespace included)."""
    objects = rendered["default-values.yaml"]
    env = operator_env(objects)
    # But one: in the cluster the chart turns on the NetworkPolicies (off for an operator
    # run outside the cluster, whose requests come from no pod), admitting its own pods.
    assert OperatorSettings.from_env(env) == dataclasses.replace(
        OperatorSettings(),
        network_policy=True,
        operator_pod_labels={
            "app.kubernetes.io/name": "specula",
            "app.kubernetes.io/instance": "specula",
            "app.kubernetes.io/component": "operator",
        },
    )
    pod = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert OperatorSettings.from_env(env).operator_pod_labels.items() <= pod.items()
    service = one(objects, "Service")
    assert env["SPECULA_OPERATOR_SERVICE"] == service["metadata"]["name"]
    assert env["SPECULA_HTTP_PORT"] == str(service["spec"]["ports"][0]["port"])


def test_network_policy_value_switches_the_setting_and_its_rbac(helm: Helm):
    def render(*sets: str) -> tuple[OperatorSettings, set]:
        objects = helm.template(sets=sets)
        role = one(objects, "ClusterRole")
        return OperatorSettings.from_env(operator_env(objects)), rules_table(role["rules"])

    settings, rules = render("networkPolicy.metricsNamespaces={monitoring}")
    assert settings.network_policy and settings.metrics_namespaces == ("monitoring",)
    assert ("networking.k8s.io", "networkpolicies", "patch") in rules
    settings, rules = render("networkPolicy.enabled=false")
    assert not settings.network_policy
    assert not {r for r in rules if r[1] == "networkpolicies"}


def test_custom_values_reach_the_operator(rendered):
    objects = rendered["custom-values.yaml"]
    settings = OperatorSettings.from_env(operator_env(objects))
    assert settings.runtime_image == "registry.example.com/specula/runtime:0.1.0-rc1"
    assert (settings.retry_delay_s, settings.tuning_tick_s, settings.scrape_timeout_s) == (
        20.0, 2.5, 1.0,
    )
    service = one(objects, "Service")
    assert settings.service_name == service["metadata"]["name"] == "spec-op-operator"
    assert settings.utilization_url_base == (
        f"http://spec-op-operator.{RELEASE_NAMESPACE}.svc:8080"
    )
    c = container(objects)
    assert c["image"] == "registry.example.com/specula/operator:0.1.0-rc1"
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    assert {"name": "HTTPS_PROXY", "value": "http://proxy.example.com:3128"} in c["env"]
    assert build_parser().parse_args(c["args"]).verbose


def test_operator_pod_is_non_root_with_resources_unset(rendered):
    objects = rendered["default-values.yaml"]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    # The uid the images' USER sets (see the Dockerfile test).
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == RUN_AS_USER
    c = container(objects)
    assert "resources" not in c
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # kopf's liveness endpoint is where the probe looks, on a port of its own.
    liveness = [a for a in c["args"] if a.startswith("--liveness=")]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert liveness == [f"--liveness=http://0.0.0.0:{ports['health']}/healthz"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert ports["health"] != ports["http"]


def test_monitoring_objects_select_the_runtime(rendered):
    objects = rendered["monitoring-values.yaml"]
    runtime = {k: v for k, v in labels("any").items() if k != LABEL_INSTANCE}
    sm = one(objects, "ServiceMonitor", "specula-runtime")
    assert sm["spec"]["selector"]["matchLabels"] == runtime
    assert sm["spec"]["namespaceSelector"] == {"any": True}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [METRICS_PORT_NAME]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pm = one(objects, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == runtime
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == [METRICS_PORT_NAME]
    assert pm["spec"]["podMetricsEndpoints"][0]["interval"] == "15s"
    op_sm = one(objects, "ServiceMonitor", "specula-operator")
    # The utilization gauge's own namespace label must survive the scrape.
    assert op_sm["spec"]["endpoints"][0]["honorLabels"] is True
    assert op_sm["spec"]["selector"]["matchLabels"].items() <= (
        one(objects, "Service")["metadata"]["labels"].items()
    )
    dashboard = one(objects, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "grafana"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "Specula"}
    assert json.loads(dashboard["data"]["speculative-decoding.json"]) == json.loads(
        DASHBOARD.read_text()
    )
    rule = one(objects, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"SpeculativeAcceptanceCollapsed", "SpeculativeAcceptanceLow"}
    assert "< 0.6 *" in alerts["SpeculativeAcceptanceCollapsed"]["expr"]
    assert "offset 1h" in alerts["SpeculativeAcceptanceCollapsed"]["expr"]
    assert "< 0.2" in alerts["SpeculativeAcceptanceLow"]["expr"]


def test_namespaced_monitors_look_only_in_the_watched_namespaces(helm: Helm):
    objects = helm.template(
        values_file("namespaced-values.yaml"), values_file("monitoring-values.yaml")
    )
    for kind in ("ServiceMonitor", "PodMonitor"):
        monitor = one(objects, kind, "specula-runtime")
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def _exported_series() -> dict[str, set[str]]:
    """Sample name -> label names, from the runtime's real Prometheus exporters."""
    stats = SpecDecodingStats(num_spec_tokens=3)
    stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = 4, 12, 7
    stats.num_accepted_tokens_per_pos = [4, 2, 1]
    snap = RuntimeSnapshot(spec_decoding=stats, num_speculative_tokens=3)
    snap.step_times.observe(4, 3, 0.01)
    registry = CollectorRegistry()
    registry.register(SpecDecodingProm(lambda: stats, "m"))
    registry.register(RuntimeProm(lambda: snap, "m"))
    text = generate_latest(registry).decode()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def _referenced(expr: str) -> set[str]:
    # Queries match both engines as {__name__=~"(specula|vllm):<suffix>"}.
    return set(re.findall(r"specula:[a-z_]+", expr.replace("(specula|vllm):", "specula:")))


def test_dashboard_and_alerts_query_series_the_runtime_exports(rendered):
    series = _exported_series()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rule = one(rendered["monitoring-values.yaml"], "PrometheusRule")
    exprs += [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    referenced = set().union(*map(_referenced, exprs))
    assert {
        "specula:spec_decode_num_accepted_tokens_per_pos_total",
        "specula:spec_decode_num_drafts_total",
        "specula:spec_decode_num_accepted_tokens_total",
        "specula:spec_decode_num_draft_tokens_total",
        "specula:num_speculative_tokens",
        "specula:generation_tokens_total",
        "specula:num_requests_waiting",
    } <= referenced
    for name in referenced:
        assert name in series, f"{name} is queried but the runtime exports {sorted(series)}"
        assert "model_name" in series[name], name
    assert "position" in series["specula:spec_decode_num_accepted_tokens_per_pos_total"]


def test_dashboard_has_the_speculative_decoding_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in dashboard["panels"]}
    assert {
        "Acceptance rate per draft position", "Mean acceptance length",
        "num_speculative_tokens (k) in effect", "Goodput", "Requests waiting",
    } <= set(panels)
    mean = panels["Mean acceptance length"]["targets"][0]["expr"]
    assert mean.startswith("1 + ") and mean.index("accepted_tokens") < mean.index("num_drafts")
    per_pos = panels["Acceptance rate per draft position"]["targets"][0]["expr"]
    assert "by (namespace, model_name, position)" in per_pos and "group_left" in per_pos
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {
        "datasource", "namespace", "model_name",
    }


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("operator.bogus=1", "additional properties 'bogus'"),
        ("watchNamespaces[0]=Bad_NS", "/watchNamespaces/0"),
        ("operator.image.pullPolicy=Sometimes", "/operator/image/pullPolicy"),
        ("monitoring.prometheusRule.dropRatio=2", "/monitoring/prometheusRule/dropRatio"),
        ("monitoring.serviceMonitor.interval=soon", "/monitoring/serviceMonitor/interval"),
        ("operator.httpPort=70000", "/operator/httpPort"),
        ("crds.keep=maybe", "/crds/keep"),
    ],
)
def test_schema_rejects_bad_values(helm: Helm, value: str, complaint: str):
    proc = helm.run("template", RELEASE, str(CHART), "--set", value, check=False)
    assert proc.returncode != 0, f"--set {value} was accepted"
    assert complaint in proc.stderr, proc.stderr


def _key_paths(values: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        out.add(path)
        if isinstance(value, dict) and value:
            out |= _key_paths(value, f"{path}.")
    return out


def _schema_paths(schema: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}{key}"
        out.add(path)
        if sub.get("additionalProperties") is False:
            out |= _schema_paths(sub, f"{path}.")
    return out


def test_schema_and_values_cover_the_same_keys():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema.get("additionalProperties") is False
    # Free-form maps (labels, resources, ...) are open in the schema; their example
    # contents in values.yaml (grafana_dashboard) are not chart keys.
    closed = _schema_paths(schema) - {"global"}
    assert _key_paths(values) - {"monitoring.grafanaDashboard.labels.grafana_dashboard"} == closed


def test_every_values_key_is_documented():
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = [
        line.strip()
        for i, line in enumerate(lines)
        if re.match(r"^\s*[A-Za-z_][\w-]*:", line)
        and not (i and lines[i - 1].lstrip().startswith("#"))
    ]
    assert not undocumented, f"values.yaml keys without a comment above: {undocumented}"
