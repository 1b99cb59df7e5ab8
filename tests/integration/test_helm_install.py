"""The chart installed by the real Helm into a real control plane, and the operator run
under the chart's ServiceAccount with RBAC enforced.

The operator runs as a local process (no kubelet runs pods), started with the
arguments and environment of the chart's Deployment, authenticated with a token the
TokenRequest API issues for the chart's ServiceAccount.  The API server authorizes
with RBAC only, so every call the chart's rules do not allow is refused, and a 403 in
the operator's log fails the test.

The control plane is this module's own: the chart installs the CRD into a cluster
that has none, and a cluster-wide operator here sees no other test's resources.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from specula.devcluster.control_plane import (
    REPO_ROOT,
    ControlPlane,
    ControlPlaneError,
    find_binaries,
    free_port,
    spawn,
    wait_for,
)

from .helm_cli import (
    CHART,
    CRD_WATCH,
    NAMESPACE_WATCH,
    OPERATOR_RULES,
    RELEASE,
    RELEASE_NAMESPACE,
    Helm,
    rules_table,
)
from .operator_process import OperatorProcess
from .sm_objects import GROUP, PLURAL, VERSION, Children, condition, create_sm, sm_body

pytestmark = pytest.mark.integration

CRD_NAME = f"{PLURAL}.{GROUP}"
RUNTIME_REPOSITORY = "registry.example.com/specula/runtime"
FORBIDDEN = re.compile(
    r'forbidden|not enough permissions|HTTP/1\.1" 403\b|status=403\b|\(403\)', re.IGNORECASE
)
"""A refused call as the client libraries log it: the API server's ``Forbidden``
reason, kopf's permission warnings, or the bare status code (timestamps excluded)."""


def forbidden_lines(log: str) -> list[str]:
    """Operator log lines that report a refused API call (the client's 403 errors,
    kopf's "Not enough permissions" warnings)."""
    return [line for line in log.splitlines() if FORBIDDEN.search(line)]


def assert_no_forbidden(op: OperatorProcess) -> None:
    bad = forbidden_lines(op.log_text())
    assert not bad, "the chart's RBAC refused operator calls:\n" + "\n".join(bad[:20])


def test_forbidden_lines_are_refusals_not_timestamps():
    log = "\n".join([
        '[2026-11-21 02:16:03,403] urllib3 [DEBUG] "PATCH /api/v1/x HTTP/1.1" 201 1403',
        '[2026-11-21 02:16:03,404] urllib3 [DEBUG] "GET /api/v1/x HTTP/1.1" 403 301',
        "[2026-11-21 02:16:03,405] kopf [ERROR] APIForbiddenError('...', status=403)",
        "[2026-11-21 02:16:03,406] kopf [ERROR] applying children failed: Forbidden",
        "[2026-11-21 02:16:03,407] kopf [WARNING] Not enough permissions to list namespaces.",
    ])
    assert [line[21:24] for line in forbidden_lines(log)] == ["404", "405", "406", "407"]


@dataclass
class ChartOperator(OperatorProcess):
    """``specula`` with the args and env of the chart's operator Deployment, as its pod
    would run it; the liveness and HTTP ports move to free loopback ports."""

    args: list[str] = field(default_factory=list)

    def start(self, timeout: float = 60) -> None:
        self.liveness_port = free_port()
        args = [
            f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz"
            if a.startswith("--liveness=") else a
            for a in self.args
        ]
        assert args != self.args, "the chart's Deployment sets no --liveness endpoint"
        env = {
            **os.environ,
            **self.env,
            "SPECULA_HTTP_PORT": str(free_port()),
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        argv = [sys.executable, "-m", "specula.cli", *args]
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start: {' '.join(argv)}\n".encode())
        self.proc = spawn(argv, self.log_path, env=env, cwd=REPO_ROOT)
        self.starts += 1
        wait_for(self._live, timeout=timeout, interval=0.3, message="operator liveness endpoint")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    try:
        bin_dir = find_binaries()
    except ControlPlaneError as exc:
        pytest.fail(f"control plane binaries unavailable: {exc}", pytrace=False)
    cp = ControlPlane(bin_dir=bin_dir, workdir=tmp_path_factory.mktemp("helm-control-plane"))
    try:
        try:
            cp.start()
        except (ControlPlaneError, TimeoutError, OSError) as exc:
            pytest.fail(f"control plane did not start: {exc}\n{cp.logs_tail(40)}", pytrace=False)
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="module")
def admin(cluster: ControlPlane) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield api
    api.close()


def create_namespace(admin: client.ApiClient, name: str) -> None:
    try:
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": name}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def install(helm: Helm, cluster: ControlPlane, *sets: str) -> None:
    """``helm upgrade --install`` of the chart as release ``specula`` in
    ``specula-system``: a fresh install unless an earlier test left the release."""
    args = ["upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
            "--create-namespace", "--timeout", "60s"]
    for item in (f"runtime.image.repository={RUNTIME_REPOSITORY}",
                 "operator.settings.tuningTickSeconds=1", "operator.verbose=true", *sets):
        args += ["--set", item]
    helm.run(*args, kubeconfig=cluster.kubeconfig)


def service_account_kubeconfig(
    admin: client.ApiClient, cluster: ControlPlane, name: str, path: Path
) -> Path:
    """A kubeconfig authenticating as ServiceAccount ``name`` of the release namespace,
    with a token from the TokenRequest API (what the kubelet mounts into the pod)."""
    token = client.CoreV1Api(admin).create_namespaced_service_account_token(
        name, RELEASE_NAMESPACE, {"spec": {"expirationSeconds": 3600}}
    ).status.token
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {
            "server": cluster.server, "certificate-authority": str(cluster.ca_file),
        }}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": name}}],
        "current-context": "sa",
    }))
    path.chmod(0o600)
    return path


def effective_rules(kubeconfig: Path, namespace: str) -> set[tuple[str, str, str]]:
    """What the kubeconfig's identity may do in ``namespace``
    (SelfSubjectRulesReview), as ``(apiGroup, resource, verb)`` triples."""
    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        review = client.AuthorizationV1Api(api).create_self_subject_rules_review(
            {"spec": {"namespace": namespace}}
        )
    finally:
        api.close()
    return rules_table([
        {"apiGroups": r.api_groups or [], "resources": r.resources or [], "verbs": r.verbs}
        for r in review.status.resource_rules
    ])


def wait_granted(kubeconfig: Path, namespace: str, rules: set[tuple[str, str, str]]) -> None:
    """Wait until the API server's authorizer grants ``rules`` in ``namespace``: it
    learns new Roles and bindings from a watch, so the operator would otherwise meet
    403s the chart does not cause."""
    wait_for(
        lambda: effective_rules(kubeconfig, namespace) >= rules,
        timeout=30,
        message=lambda: f"rules granted in {namespace}; missing "
        f"{sorted(rules - effective_rules(kubeconfig, namespace))}",
    )


def release_deployment(admin: client.ApiClient) -> client.V1Deployment:
    (dep,) = client.AppsV1Api(admin).list_namespaced_deployment(
        RELEASE_NAMESPACE, label_selector=f"app.kubernetes.io/instance={RELEASE}"
    ).items
    return dep


def chart_operator(
    admin: client.ApiClient, cluster: ControlPlane, workdir: Path, log_name: str
) -> ChartOperator:
    """The operator as the chart's Deployment defines it, under its ServiceAccount."""
    dep = release_deployment(admin)
    pod = dep.spec.template.spec
    (c,) = pod.containers
    kubeconfig = service_account_kubeconfig(
        admin, cluster, pod.service_account_name, workdir / f"{log_name}.kubeconfig"
    )
    return ChartOperator(
        kubeconfig=kubeconfig,
        namespace="",
        log_path=workdir / f"{log_name}.log",
        env={e.name: e.value for e in c.env if e.value is not None},
        args=list(c.args),
    )


def policy_rules(rules: list[client.V1PolicyRule]) -> set[tuple[str, str, str]]:
    return rules_table([
        {"apiGroups": r.api_groups or [], "resources": r.resources or [], "verbs": r.verbs}
        for r in rules
    ])


def wait_reconciled(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict:
    """The resource once the operator wrote status for its current generation."""

    def done():
        sm = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        ready = condition(sm, "Ready")
        gen = sm["metadata"]["generation"]
        return sm if ready and ready.get("observedGeneration") == gen else None

    return wait_for(done, timeout=60, message=f"status of {namespace}/{name}")


def test_cluster_wide_release_runs_the_operator_within_its_rbac(
    cluster: ControlPlane, helm: Helm, admin: client.ApiClient, tmp_path: Path
):
    install(helm, cluster)
    ext = client.ApiextensionsV1Api(admin)

    def established():
        crd = ext.read_custom_resource_definition(CRD_NAME)
        conditions = crd.status.conditions or []
        return crd if any(c.type == "Established" and c.status == "True" for c in conditions) else None

    crd = wait_for(established, timeout=30, message="CRD Established")
    custom = client.CustomObjectsApi(admin)
    # Until the new kind's storage is ready, lists answer 429 and kopf backs off.
    wait_for(
        lambda: custom.list_cluster_custom_object(GROUP, VERSION, PLURAL) is not None,
        timeout=30,
        message="SpeculativeModels served",
    )
    assert crd.metadata.annotations["helm.sh/resource-policy"] == "keep"
    assert crd.metadata.annotations["meta.helm.sh/release-name"] == RELEASE
    assert crd.metadata.labels["app.kubernetes.io/managed-by"] == "Helm"
    rbac = client.RbacAuthorizationV1Api(admin)
    role = rbac.read_cluster_role(f"{RELEASE}-operator")
    assert policy_rules(role.rules) == OPERATOR_RULES | CRD_WATCH
    binding = rbac.read_cluster_role_binding(f"{RELEASE}-operator")
    (subject,) = binding.subjects
    client.CoreV1Api(admin).read_namespaced_service_account(subject.name, subject.namespace)
    client.CoreV1Api(admin).read_namespaced_service(f"{RELEASE}-operator", RELEASE_NAMESPACE)

    namespace = "models"
    create_namespace(admin, namespace)
    op = chart_operator(admin, cluster, tmp_path, "operator-cluster-wide")
    assert "--all-namespaces" in op.args
    wait_granted(op.kubeconfig, namespace, OPERATOR_RULES | CRD_WATCH)

    core = client.CoreV1Api(admin)
    apps = client.AppsV1Api(admin)
    op.start()
    try:
        sm = create_sm(custom, namespace, sm_body("chart-sm", {"autoscaling": {
            "minReplicas": 1, "maxReplicas": 2, "provider": "hpa",
        }}))
        children = Children(core, apps, namespace, sm["metadata"]["uid"])
        cm, dep, _ = children.wait_all(timeout=60)
        hpas = client.AutoscalingV2Api(admin)
        wait_for(
            lambda: hpas.list_namespaced_horizontal_pod_autoscaler(namespace).items,
            timeout=30,
            message="HorizontalPodAutoscaler",
        )
        # The chart's default runtime image reached the operator.
        app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
        image = dep.spec.template.spec.containers[0].image
        assert image == f"{RUNTIME_REPOSITORY}:{app_version}"
        wait_reconciled(custom, namespace, "chart-sm")
        # The admin-token Secret and the NetworkPolicy (on by default in the chart),
        # both owned by the resource, written under the chart's RBAC.
        uid = sm["metadata"]["uid"]
        secret = core.read_namespaced_secret("chart-sm-admin-token", namespace)
        assert [r.uid for r in secret.metadata.owner_references] == [uid]
        assert len(secret.data["token"]) > 40
        policy = client.NetworkingV1Api(admin).read_namespaced_network_policy("chart-sm", namespace)
        assert [r.uid for r in policy.metadata.owner_references] == [uid]
        operator_peer = policy.spec.ingress[1]._from[0]
        assert operator_peer.namespace_selector.match_labels == {
            "kubernetes.io/metadata.name": RELEASE_NAMESPACE
        }
        assert operator_peer.pod_selector.match_labels[
            "app.kubernetes.io/component"] == "operator"
        assert {p.port for p in policy.spec.ingress[1].ports} == {"admin", "metrics"}
        assert policy.spec.ingress[0]._from is None  # the model port: open
        # A deleted child comes back (watch on ConfigMaps, create).
        core.delete_namespaced_config_map(cm.metadata.name, namespace)
        wait_for(lambda: children.config_maps(), timeout=30, message="ConfigMap recreated")
        # Autoscaling off: the operator deletes its HorizontalPodAutoscaler.
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "chart-sm", {"spec": {"autoscaling": None}}
        )
        wait_for(
            lambda: not hpas.list_namespaced_horizontal_pod_autoscaler(namespace).items,
            timeout=30,
            message="HorizontalPodAutoscaler deleted",
        )
        # Tuning ticks (every second, from the chart's value): the tuner reads the
        # resource and its EndpointSlices and writes status.
        op.wait_for_log_count(r"Timer 'on_tuning_tick' succeeded", 3, timeout=30)
        # Deletion: kopf removes its finalizer (patch), the resource goes.
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "chart-sm")
        wait_for(
            lambda: not custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL
            )["items"],
            timeout=30,
            message="SpeculativeModel deleted",
        )
        op.check_alive()
    except BaseException:
        print(op.tail(80))
        raise
    finally:
        op.stop()
    assert_no_forbidden(op)

    helm.run("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait",
             kubeconfig=cluster.kubeconfig)
    # crds.keep: the CRD, and with it every SpeculativeModel, outlives the release.
    assert ext.read_custom_resource_definition(CRD_NAME).metadata.name == CRD_NAME
    with pytest.raises(ApiException) as gone:
        rbac.read_cluster_role(f"{RELEASE}-operator")
    assert gone.value.status == 404


def test_namespaced_release_confines_the_operator_and_a_missing_rule_shows(
    cluster: ControlPlane, helm: Helm, admin: client.ApiClient, tmp_path: Path
):
    watched, other = "team-a", "team-b"
    for ns in (watched, other):
        create_namespace(admin, ns)
    # Reinstalling over the CRD the previous release kept adopts it.
    install(helm, cluster, f"watchNamespaces={{{watched}}}")
    rbac = client.RbacAuthorizationV1Api(admin)
    role = rbac.read_namespaced_role(f"{RELEASE}-operator", watched)
    assert policy_rules(role.rules) == OPERATOR_RULES
    with pytest.raises(ApiException) as no_cluster_role:
        rbac.read_cluster_role(f"{RELEASE}-operator")
    assert no_cluster_role.value.status == 404

    op = chart_operator(admin, cluster, tmp_path, "operator-namespaced")
    assert f"--namespace={watched}" in op.args
    wait_granted(op.kubeconfig, watched, OPERATOR_RULES | CRD_WATCH | NAMESPACE_WATCH)
    assert not effective_rules(op.kubeconfig, other) & OPERATOR_RULES

    custom = client.CustomObjectsApi(admin)
    core = client.CoreV1Api(admin)
    apps = client.AppsV1Api(admin)
    op.start()
    try:
        sm = create_sm(custom, watched, sm_body("scoped"))
        Children(core, apps, watched, sm["metadata"]["uid"]).wait_all(timeout=60)
        wait_reconciled(custom, watched, "scoped")
        op.wait_for_log_count(r"Timer 'on_tuning_tick' succeeded", 2, timeout=30)
        outside = create_sm(custom, other, sm_body("outside"))
        time.sleep(3)
        outside = custom.get_namespaced_custom_object(GROUP, VERSION, other, PLURAL, "outside")
        assert not outside.get("status") and not outside["metadata"].get("finalizers"), outside
        op.check_alive()
        assert_no_forbidden(op)

        # The same check catches a rule the operator needs but the chart lacks: drop
        # Services from the Role, and the next resource's reconcile is refused.
        rbac.patch_namespaced_role(role.metadata.name, watched, {"rules": [
            {"apiGroups": r.api_groups, "resources": kept, "verbs": r.verbs}
            for r in role.rules
            if (kept := [x for x in r.resources if x != "services"])
        ]})
        create_sm(custom, watched, sm_body("needs-services"))
        wait_for(
            lambda: forbidden_lines(op.log_text()),
            timeout=60,
            message="a 403 in the operator log",
        )
        with pytest.raises(AssertionError, match="RBAC refused"):
            assert_no_forbidden(op)
    except BaseException:
        print(op.tail(80))
        raise
    finally:
        op.stop()
    helm.run("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait",
             kubeconfig=cluster.kubeconfig)
