"""Pydantic models of the ``SpeculativeModel`` custom resource (``specula.dev/v1alpha1``).

These models are the single source of truth: :mod:`specula.api.crd` turns their JSON
schema into the CRD's structural OpenAPI schema, and the operator parses every object
it sees through them.  Python attribute names are snake_case; the wire format (and
the CRD) is camelCase through an alias generator, so both
``SpeculativeModelSpec.model_validate(body["spec"])`` and keyword construction with
snake_case names work.

Validation rules that span fields are written twice on purpose: once as a CEL rule
(``x-kubernetes-validations``) so the API server rejects bad objects before the
operator sees them, and once as a pydantic validator so code that builds objects in
Python gets the same answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from specula.api.runtime_config import MODEL_URI_PATTERN, Dtype, SpeculatorMethod

GROUP = "specula.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "SpeculativeModel"
PLURAL = "speculativemodels"
SINGULAR = "speculativemodel"
SHORT_NAMES = ("specmodel", "sm")

METHODS_WITHOUT_DRAFT_MODEL = ("mtp", "ngram")
"""Methods whose drafter lives inside the target checkpoint (MTP heads) or needs no
weights at all (n-gram lookup), so ``spec.speculator.model`` may be omitted."""

DEFAULT_GPU_RESOURCE_NAME = "nvidia.com/gpu"

MAX_NAME_LENGTH = 63
"""Children are named after the resource and carry its name as a label value, both
limited to 63 characters (DNS-1123 label)."""

Quantity = Annotated[int | str, WithJsonSchema({"x-kubernetes-int-or-string": True})]
"""A Kubernetes resource quantity such as ``4``, ``"500m"`` or ``"16Gi"``."""

FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""An object passed through to a Kubernetes core type unchanged (``env[].valueFrom``)."""

ModelUri = Annotated[str, Field(pattern=MODEL_URI_PATTERN, max_length=2048)]


class _Base(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )

    def to_k8s(self) -> dict[str, Any]:
        """The object as Kubernetes stores it: camelCase keys, unset optionals omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ModelSpec(_Base):
    """The target model: the checkpoint whose distribution the output follows."""

    uri: ModelUri
    """Checkpoint location: ``hf://org/name``, ``pvc://claim/path`` or ``file:///path``."""
    revision: str | None = Field(default=None, max_length=256)
    """Hub revision (branch, tag or commit) for ``hf://`` URIs."""
    dtype: Dtype = "auto"
    """Weight and activation dtype; ``auto`` keeps the checkpoint's."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length in tokens (prompt + completion); default: the checkpoint's."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=8)
    """GPUs the target model is sharded over (tensor parallelism)."""


class DraftModelSpec(_Base):
    """Checkpoint of the drafter: a small model, an EAGLE-3 head, a DFlash block drafter."""

    uri: ModelUri
    """Checkpoint location: ``hf://org/name``, ``pvc://claim/path`` or ``file:///path``."""


class SpeculatorSpec(_Base):
    """How draft tokens are proposed before the target verifies them."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.method in ['mtp', 'ngram'] || has(self.model)",
                    "message": "speculator.model.uri is required unless method is mtp or ngram",
                    "fieldPath": ".model",
                    "reason": "FieldValueRequired",
                }
            ]
        }
    )

    method: SpeculatorMethod
    """Speculation method (vLLM ``speculative_config.method`` names)."""
    model: DraftModelSpec | None = None
    """Draft checkpoint; required unless ``method`` is ``mtp`` or ``ngram``."""
    num_speculative_tokens: int = Field(default=3, ge=1, le=16)
    """k: draft tokens proposed per step, and the most the tuner may set later."""
    draft_tensor_parallel_size: int = Field(default=1, ge=1, le=8)
    """Tensor-parallel degree of the draft model: 1 or the target's degree."""

    @model_validator(mode="after")
    def _draft_model_required(self) -> SpeculatorSpec:
        if self.model is None and self.method not in METHODS_WITHOUT_DRAFT_MODEL:
            raise ValueError(
                f"speculator.model.uri is required unless method is mtp or ngram "
                f"(method is {self.method})"
            )
        return self


class GpuResources(_Base):
    """GPUs per replica."""

    count: int = Field(default=1, ge=0, le=8)
    """GPUs per pod; 0 runs without a GPU limit (CPU inference)."""
    resource_name: str = Field(default=DEFAULT_GPU_RESOURCE_NAME, max_length=253)
    """Extended resource that the device plugin advertises."""


class ResourcesSpec(_Base):
    """Compute resources of each replica."""

    gpu: GpuResources = Field(default_factory=GpuResources)
    """GPU limit; default: one ``nvidia.com/gpu``."""
    cpu: Quantity | None = None
    """CPU request and limit (a quantity such as ``8`` or ``"7500m"``)."""
    memory: Quantity | None = None
    """Memory request and limit (a quantity such as ``"64Gi"``)."""


class Toleration(_Base):
    """A pod toleration (Kubernetes ``core/v1`` ``Toleration``)."""

    key: str | None = Field(default=None, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(_Base):
    """An environment variable of the runtime container (Kubernetes ``core/v1`` ``EnvVar``)."""

    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: FreeForm | None = None
    """``secretKeyRef``, ``configMapKeyRef``, ``fieldRef`` or ``resourceFieldRef``, as in a pod."""


class SpeculativeModelSpec(_Base):
    """Desired state: a target model served with speculative decoding."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": (
                        "!has(self.speculator.draftTensorParallelSize)"
                        " || self.speculator.draftTensorParallelSize == 1"
                        " || (has(self.model.tensorParallelSize)"
                        " && self.speculator.draftTensorParallelSize"
                        " == self.model.tensorParallelSize)"
                    ),
                    "message": (
                        "speculator.draftTensorParallelSize must be 1 or equal to "
                        "model.tensorParallelSize"
                    ),
                    "fieldPath": ".speculator.draftTensorParallelSize",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    model: ModelSpec
    """The target model."""
    speculator: SpeculatorSpec
    """The drafter and how many tokens it proposes."""
    replicas: int = Field(default=1, ge=0)
    """Pods serving the model; also the ``scale`` subresource's target."""
    image: str | None = Field(default=None, max_length=1024)
    """Runtime container image; default: the operator's configured runtime image."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """GPU, CPU and memory per replica."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the pods must match."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Taints the pods tolerate (GPU nodes are often tainted)."""
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        # Keyed by name, as in a pod: the API server rejects duplicates, which
        # server-side apply of the Deployment could not merge.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Extra environment variables of the runtime container (e.g. ``HF_TOKEN``)."""
    service_account_name: str | None = Field(default=None, max_length=253)
    """Service account the pods run as."""

    @model_validator(mode="after")
    def _env_names_unique(self) -> SpeculativeModelSpec:
        names = [var.name for var in self.env]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"env names must be unique, duplicated: {', '.join(duplicates)}")
        return self

    @model_validator(mode="after")
    def _draft_tp_matches(self) -> SpeculativeModelSpec:
        draft_tp = self.speculator.draft_tensor_parallel_size
        if draft_tp not in (1, self.model.tensor_parallel_size):
            raise ValueError(
                f"speculator.draftTensorParallelSize must be 1 or equal to "
                f"model.tensorParallelSize ({self.model.tensor_parallel_size}), got {draft_tp}"
            )
        return self


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Base):
    """One aspect of the observed state (``metav1.Condition`` fields)."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(max_length=316)
    """``Ready``, ``Progressing`` or ``Degraded``."""
    status: ConditionStatus
    reason: str = Field(default="", max_length=1024)
    """CamelCase machine-readable cause of the last transition or update."""
    message: str = Field(default="", max_length=32768)
    """Human-readable details."""
    last_transition_time: str | None = Field(
        default=None, json_schema_extra={"format": "date-time"}
    )
    """RFC 3339 time at which ``status`` last changed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """``metadata.generation`` the condition was computed from."""


class SpeculationStatus(_Base):
    """Speculation parameters in effect."""

    model_config = ConfigDict(extra="ignore")

    num_speculative_tokens: int | None = None
    """k currently applied to the runtime."""


class SpeculativeModelStatus(_Base):
    """Observed state, written by the operator."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    """``metadata.generation`` of the spec the children were last built from."""
    replicas: int | None = None
    """Pods of the runtime Deployment (its ``status.replicas``)."""
    ready_replicas: int | None = None
    """Pods passing their readiness probe (the Deployment's ``status.readyReplicas``)."""
    selector: str | None = None
    """Label selector of the pods, for the ``scale`` subresource (and so for HPA)."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    """``Ready``, ``Progressing`` and ``Degraded``, one entry per type."""
    speculation: SpeculationStatus | None = None
    """Speculation parameters in effect."""


class SpeculativeModel(_Base):
    """A whole ``SpeculativeModel`` object as the API server returns it."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["specula.dev/v1alpha1"] = API_VERSION
    kind: Literal["SpeculativeModel"] = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: SpeculativeModelSpec
    status: SpeculativeModelStatus | None = None
