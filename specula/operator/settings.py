"""Operator settings: one small frozen dataclass, read once at start-up.

Kept free of kopf so that the pure builders can use the defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from specula import __version__
from specula.api.render_vllm import DEFAULT_VLLM_IMAGE

DEFAULT_RUNTIME_IMAGE = f"ghcr.io/specula-dev/specula-runtime:{__version__}"
"""Runtime image used when a resource leaves ``spec.image`` unset: the ``runtime``
target of the Dockerfile, tagged with this package's version so operator and
runtime speak the same runtime-config schema."""

FIELD_MANAGER = "specula-operator"
"""Server-side-apply field manager of every child object the operator writes."""

ANNOTATION_PREFIX = "specula.dev"
"""Prefix of the annotations kopf keeps on SpeculativeModel objects (handler progress,
last-handled spec), so they read as Specula's and not kopf's."""


@dataclass(frozen=True)
class OperatorSettings:
    """How the operator reconciles; every field has a safe default."""

    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    """Image of the runtime container when ``spec.image`` is unset (``engine:
    specula``).  Environment: ``SPECULA_RUNTIME_IMAGE``."""

    vllm_image: str = DEFAULT_VLLM_IMAGE
    """Image of ``engine: vllm`` pods when ``spec.image`` is unset: vLLM's OpenAI
    server image of the release the ``--speculative-config`` rendering follows.
    Environment: ``SPECULA_VLLM_IMAGE``."""

    field_manager: str = FIELD_MANAGER
    """Server-side-apply field manager.  Fixed, so that re-applying unchanged children
    is a no-op on the API server (no ``resourceVersion`` bump)."""

    retry_delay_s: float = 10.0
    """Seconds before kopf retries a reconcile whose API calls failed.
    Environment: ``SPECULA_RETRY_DELAY_S``."""

    status_conflict_retries: int = 5
    """Attempts to write status after a Deployment change when the resource moved
    under us (HTTP 409), before leaving it to the next event."""

    annotation_prefix: str = ANNOTATION_PREFIX
    """Prefix of kopf's bookkeeping annotations on the resources."""

    post_events: bool = False
    """Whether kopf posts a Kubernetes Event for every handler run.  Off: conditions
    carry the state, and per-run events are noise."""

    tuning_tick_s: float = 5.0
    """Period of the tuning timer, seconds.  Each resource is measured every
    ``spec.tuning.interval`` (rounded to ticks); pods that refused a new k are retried
    every tick.  Environment: ``SPECULA_TUNING_TICK_S``."""

    scrape_timeout_s: float = 3.0
    """Timeout of each HTTP request to a pod (``/metrics``, admin API), seconds.
    Environment: ``SPECULA_SCRAPE_TIMEOUT_S``."""

    http_host: str = "0.0.0.0"
    """Address of the operator's HTTP server (utilization for KEDA's ``metrics-api``
    scaler, Prometheus ``/metrics``).  Environment: ``SPECULA_HTTP_HOST``."""

    http_port: int = 8080
    """Port of that server; 0 turns it off (autoscaling with ``provider: keda`` then
    has no endpoint to poll).  Environment: ``SPECULA_HTTP_PORT``."""

    service_name: str = "specula-operator"
    """Name of the Service in front of the operator's HTTP port, which the rendered
    ScaledObjects poll.  Environment: ``SPECULA_OPERATOR_SERVICE``."""

    namespace: str = "specula-system"
    """Namespace of the operator and of that Service.  Environment:
    ``SPECULA_OPERATOR_NAMESPACE``, else ``POD_NAMESPACE`` (the downward API)."""

    utilization_base_url: str | None = None
    """Base URL the ScaledObjects poll, when the Service above is not the way in
    (e.g. ``http://127.0.0.1:8080`` for an operator outside the cluster); default
    ``http://<service_name>.<namespace>.svc:<http_port>``.  Environment:
    ``SPECULA_UTILIZATION_BASE_URL``."""

    network_policy: bool = False
    """Give every resource a NetworkPolicy (``builders.build_network_policy``) that
    admits only the operator's pods to the runtime pods' admin and metrics ports.  Off
    by default for an operator run outside the cluster (its requests come from no pod);
    the Helm chart turns it on (value ``networkPolicy.enabled``).  Environment:
    ``SPECULA_NETWORK_POLICY`` (``true``/``false``)."""

    operator_pod_labels: dict[str, str] = field(default_factory=dict)
    """Labels of the operator's pods (in ``namespace``), the peer the NetworkPolicy
    admits.  Environment: ``SPECULA_OPERATOR_POD_LABELS`` (``k=v,k=v``)."""

    metrics_namespaces: tuple[str, ...] = ()
    """Namespaces whose pods may also scrape the runtime pods' ``metrics`` port (a
    Prometheus).  Environment: ``SPECULA_METRICS_NAMESPACES`` (comma-separated)."""

    @property
    def unpinned_images(self) -> list[str]:
        """Default images not pinned by digest (``@sha256:``): a tag can be moved to other
        content, so the operator warns about them at start-up.  Not refused: images
        built and imported locally (the development node) have no registry digest."""
        return [i for i in (self.runtime_image, self.vllm_image) if "@sha256:" not in i]

    @property
    def utilization_url_base(self) -> str:
        """Scheme, host and port of the utilization endpoint as the cluster reaches it."""
        if self.utilization_base_url:
            return self.utilization_base_url.rstrip("/")
        return f"http://{self.service_name}.{self.namespace}.svc:{self.http_port}"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorSettings:
        """Defaults overridden by ``SPECULA_*`` environment variables.

        Raises:
            ValueError: a variable that does not parse.
        """
        env = os.environ if environ is None else environ
        kwargs: dict[str, object] = {}
        if env.get("SPECULA_RUNTIME_IMAGE"):
            kwargs["runtime_image"] = env["SPECULA_RUNTIME_IMAGE"]
        if env.get("SPECULA_RETRY_DELAY_S"):
            kwargs["retry_delay_s"] = float(env["SPECULA_RETRY_DELAY_S"])
        if env.get("SPECULA_TUNING_TICK_S"):
            kwargs["tuning_tick_s"] = float(env["SPECULA_TUNING_TICK_S"])
        if env.get("SPECULA_SCRAPE_TIMEOUT_S"):
            kwargs["scrape_timeout_s"] = float(env["SPECULA_SCRAPE_TIMEOUT_S"])
        if env.get("SPECULA_VLLM_IMAGE"):
            kwargs["vllm_image"] = env["SPECULA_VLLM_IMAGE"]
        if env.get("SPECULA_HTTP_HOST"):
            kwargs["http_host"] = env["SPECULA_HTTP_HOST"]
        if env.get("SPECULA_HTTP_PORT"):
            port = int(env["SPECULA_HTTP_PORT"])
            if not 0 <= port <= 65535:
                raise ValueError(f"SPECULA_HTTP_PORT must be 0..65535, got {port}")
            kwargs["http_port"] = port
        if env.get("SPECULA_OPERATOR_SERVICE"):
            kwargs["service_name"] = env["SPECULA_OPERATOR_SERVICE"]
        namespace = env.get("SPECULA_OPERATOR_NAMESPACE") or env.get("POD_NAMESPACE")
        if namespace:
            kwargs["namespace"] = namespace
        if env.get("SPECULA_UTILIZATION_BASE_URL"):
            kwargs["utilization_base_url"] = env["SPECULA_UTILIZATION_BASE_URL"]
        if env.get("SPECULA_NETWORK_POLICY"):
            flag = env["SPECULA_NETWORK_POLICY"].strip().lower()
            if flag not in ("true", "false"):
                raise ValueError(f"SPECULA_NETWORK_POLICY must be true or false, got {flag!r}")
            kwargs["network_policy"] = flag == "true"
        if env.get("SPECULA_OPERATOR_POD_LABELS"):
            pairs = [p.split("=", 1) for p in env["SPECULA_OPERATOR_POD_LABELS"].split(",") if p]
            if any(len(p) != 2 or not p[0] for p in pairs):
                raise ValueError("SPECULA_OPERATOR_POD_LABELS must be k=v[,k=v...]")
            kwargs["operator_pod_labels"] = {k.strip(): v.strip() for k, v in pairs}
        if env.get("SPECULA_METRICS_NAMESPACES"):
            kwargs["metrics_namespaces"] = tuple(
                ns.strip() for ns in env["SPECULA_METRICS_NAMESPACES"].split(",") if ns.strip()
            )
        if kwargs.get("network_policy") and not kwargs.get("operator_pod_labels"):
            raise ValueError(
                "SPECULA_NETWORK_POLICY=true needs SPECULA_OPERATOR_POD_LABELS: without "
                "them the policy would admit no operator to the admin ports"
            )
        return cls(**kwargs)
