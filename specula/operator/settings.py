"""Operator settings: one small frozen dataclass, read once at start-up.

Kept free of kopf so that the pure builders can use the defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from specula import __version__

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
    """Image of the runtime container when ``spec.image`` is unset.
    Environment: ``SPECULA_RUNTIME_IMAGE``."""

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
        return cls(**kwargs)
