"""Rendering of the runtime config from a ``SpeculativeModel`` spec."""

from __future__ import annotations

from specula.api.models import SpeculativeModelSpec
from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig

RUNTIME_PORT = 8000
"""Port the runtime's HTTP server listens on in the pod (OpenAI API, ``/health`` and
``/metrics``; no admin route)."""

METRICS_PORT = 9090
"""Port on which the runtime also serves ``/metrics`` alone (the container port ``metrics``)."""


ADMIN_PORT = 8001
"""Port of the runtime's admin API (``GET``/``PUT /v1/speculative_config``), the
container port ``admin``: never a Service port; the operator calls it on pod addresses."""

ADMIN_TOKEN_DIR = "/etc/specula-admin"
"""Mount point of the resource's admin-token Secret in runtime pods."""

ADMIN_TOKEN_KEY = "token"
"""Key of the admin token in that Secret, and file name under :data:`ADMIN_TOKEN_DIR`."""


def render_runtime_config(name: str, spec: SpeculativeModelSpec) -> RuntimeConfig:
    """The config ``specula serve --config`` reads in every pod of resource ``name``.

    Clients address the model by the resource name (``served_model_name``), so
    replacing the checkpoint behind a resource does not change its API name.
    Model URIs pass through unchanged; the runtime resolves ``pvc://claim/path``
    under :data:`specula.api.runtime_config.PVC_MOUNT_ROOT`, where the operator
    mounts the claim.

    The admin API listens on :data:`ADMIN_PORT` and checks the token the operator
    mounts at ``ADMIN_TOKEN_DIR/ADMIN_TOKEN_KEY`` (the path only: no secret is in the
    config, which goes into a ConfigMap).

    Pods start at ``speculator.numSpeculativeTokens``; the most they accept later
    (``max_num_speculative_tokens``) is ``tuning.maxSpeculativeTokens`` in ``Auto``
    tuning mode, where the operator moves k through the admin API, otherwise the
    spec's k.
    """
    speculator = spec.speculator
    return RuntimeConfig(
        model=spec.model.uri,
        served_model_name=name,
        revision=spec.model.revision,
        dtype=spec.model.dtype,
        max_model_len=spec.model.max_model_len,
        tensor_parallel_size=spec.model.tensor_parallel_size,
        speculator=SpeculatorRuntimeConfig(
            method=speculator.method,
            model=speculator.model.uri if speculator.model is not None else None,
            num_speculative_tokens=speculator.num_speculative_tokens,
            max_num_speculative_tokens=spec.pod_max_num_speculative_tokens,
            draft_tensor_parallel_size=speculator.draft_tensor_parallel_size,
            prompt_lookup_min=speculator.prompt_lookup_min,
            prompt_lookup_max=speculator.prompt_lookup_max,
            draft_sample_method=speculator.draft_sample_method,
        ),
        port=RUNTIME_PORT,
        metrics_port=METRICS_PORT,
        admin_port=ADMIN_PORT,
        admin_token_file=f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}",
        max_num_seqs=spec.pod_max_num_seqs,
        enable_prefix_caching=spec.enable_prefix_caching,
    )
