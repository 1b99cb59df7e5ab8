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

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

from specula.api import status as _status
from specula.api.autoscaling import AutoscalingSpec
from specula.api.base import ApiModel, FreeForm
from specula.api.runtime_config import MODEL_URI_PATTERN, Dtype, SpeculatorMethod

# The status half of the resource lives in specula.api.status; re-exported so that
# code using the resource's models finds spec and status in one place.
Condition = _status.Condition
ConditionStatus = _status.ConditionStatus
SpeculationStatus = _status.SpeculationStatus
SpeculativeModelStatus = _status.SpeculativeModelStatus
TunerStatus = _status.TunerStatus
TuningHistoryEntry = _status.TuningHistoryEntry

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

Engine = Literal["specula", "vllm"]
"""What the pods run: the Specula runtime (``specula serve``) or stock vLLM
(``vllm serve``)."""

MTP_METHODS = ("mtp", "gemma4_mtp")
"""Methods whose draft layers come from the target checkpoint (``nPredict`` applies)."""

MAX_NAME_LENGTH = 63
"""Children are named after the resource and carry its name as a label value, both
limited to 63 characters (DNS-1123 label)."""

QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""A non-negative Kubernetes resource quantity (``resource.Quantity``'s grammar, the
pattern controller-gen emits, without the minus sign): ``4``, ``"500m"``, ``"16Gi"``,
``"1e3"``; ``"64GB"`` or ``"lots"`` would only fail later, when the Deployment is
written."""

DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""A DNS-1123 subdomain: the names of Secrets, PersistentVolumeClaims and
ServiceAccounts."""

SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
"""A key of a Secret's ``data`` (Kubernetes ``IsConfigMapKey``)."""


def _check_quantity(value: int | str) -> int | str:
    negative = isinstance(value, int) and value < 0
    if negative or (isinstance(value, str) and not re.fullmatch(QUANTITY_PATTERN, value)):
        raise ValueError(
            f'must be a non-negative quantity such as 8, "500m" or "16Gi", got {value!r}'
        )
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema({
        "x-kubernetes-int-or-string": True,
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-validations": [
            {
                "rule": "type(self) != int || self >= 0",
                "message": "must be a non-negative quantity",
                "reason": "FieldValueInvalid",
            }
        ],
    }),
]
"""A Kubernetes resource quantity such as ``4``, ``"500m"`` or ``"16Gi"``."""

DnsSubdomain = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
"""The name of a Secret, PersistentVolumeClaim or ServiceAccount."""

ModelUri = Annotated[str, Field(pattern=MODEL_URI_PATTERN, max_length=2048)]

DEFAULT_MAX_NUM_SEQS: dict[str, int] = {"specula": 32, "vllm": 256}
"""``spec.maxNumSeqs`` when unset, by engine: the Specula runtime's default, and
vLLM's OpenAI-server default on GPUs below 70 GiB (vLLM picks by GPU,
``EngineArgs.get_batch_defaults``; the operator passes a value explicitly so that it
knows the batch it predicts capacity at)."""

MAX_SPECULATIVE_TOKENS = 16
"""Largest k anywhere in the API (the runtime sizes its buffers by the pod's k)."""

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
"""A Go duration (``time.ParseDuration``) without sign or microseconds: ``30s``,
``2m``, ``1m30s``, ``500ms``; the form CEL's ``duration()`` reads."""

_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds of a duration string such as ``"1m30s"`` (see :data:`DURATION_PATTERN`).

    Raises:
        ValueError: not a duration of that form.
    """
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"not a duration like 30s, 2m or 1m30s: {text!r}")
    return sum(float(n) * _DURATION_UNIT_S[u] for n, u in _DURATION_PART.findall(text))


def _min_duration(minimum_s: float) -> AfterValidator:
    def check(text: str) -> str:
        if parse_duration(text) < minimum_s:
            raise ValueError(f"must be at least {minimum_s:g}s, got {text}")
        return text

    return AfterValidator(check)


Duration = Annotated[str, Field(pattern=DURATION_PATTERN, max_length=32)]
"""A duration string; see :data:`DURATION_PATTERN`."""


class ModelSpec(ApiModel):
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


class DraftModelSpec(ApiModel):
    """Checkpoint of the drafter: a small model, an EAGLE-3 head, a DFlash block drafter."""

    uri: ModelUri
    """Checkpoint location: ``hf://org/name``, ``pvc://claim/path`` or ``file:///path``."""


class SpeculatorSpec(ApiModel):
    """How draft tokens are proposed before the target verifies them."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.method in ['mtp', 'ngram'] || has(self.model)",
                    "message": "speculator.model.uri is required unless method is mtp or ngram",
                    "fieldPath": ".model",
                    "reason": "FieldValueRequired",
                },
                {
                    "rule": "!has(self.promptLookupMin) || !has(self.promptLookupMax)"
                    " || self.promptLookupMin <= self.promptLookupMax",
                    "message": "speculator.promptLookupMin must not exceed "
                    "speculator.promptLookupMax",
                    "fieldPath": ".promptLookupMin",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.nPredict) || self.method in ['mtp', 'gemma4_mtp']",
                    "message": "speculator.nPredict applies to methods mtp and gemma4_mtp only",
                    "fieldPath": ".nPredict",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "!has(self.nPredict) || self.numSpeculativeTokens <= self.nPredict"
                    " || self.numSpeculativeTokens % self.nPredict == 0",
                    "message": "speculator.numSpeculativeTokens above speculator.nPredict "
                    "must be a multiple of it (the MTP layers are reused in turn)",
                    "fieldPath": ".numSpeculativeTokens",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    method: SpeculatorMethod
    """Speculation method (vLLM ``speculative_config.method`` names)."""
    model: DraftModelSpec | None = None
    """Draft checkpoint; required unless ``method`` is ``mtp`` or ``ngram``."""
    num_speculative_tokens: int = Field(default=3, ge=1, le=MAX_SPECULATIVE_TOKENS)
    """k: draft tokens proposed per step when a pod starts (and what ``tuning.mode``
    ``Off`` keeps); the tuner moves it within ``tuning.minSpeculativeTokens`` ..
    ``tuning.maxSpeculativeTokens``."""
    draft_tensor_parallel_size: int = Field(default=1, ge=1, le=8)
    """Tensor-parallel degree of the draft model: 1 or the target's degree."""
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=16)
    """Method ``ngram`` only (other methods ignore it): the shortest n-gram that prompt
    lookup matches; default 1."""
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=16)
    """Method ``ngram`` only (other methods ignore it): the longest n-gram that prompt
    lookup tries first; default ``max(4, promptLookupMin)``."""
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    """How a draft network picks its tokens (vLLM's ``draft_sample_method``): ``greedy``
    takes its argmax; ``probabilistic`` samples each sampled request's drafts under the
    request's own temperature, top-k and top-p (higher acceptance at temperature > 0, at
    the cost of keeping the draft distributions). Output stays the target's either way.
    n-gram drafts are always deterministic."""
    n_predict: int | None = Field(default=None, ge=1, le=MAX_SPECULATIVE_TOKENS)
    """Methods ``mtp``/``gemma4_mtp`` only: MTP layers in the checkpoint (vLLM's
    ``n_predict``, Hugging Face ``num_nextn_predict_layers``).  A k above it must be a
    multiple of it, since the layers are reused in turn (vLLM
    ``vllm/config/speculative.py``, ``SpeculativeConfig.__post_init__``)."""

    @model_validator(mode="after")
    def _draft_model_required(self) -> SpeculatorSpec:
        if self.model is None and self.method not in METHODS_WITHOUT_DRAFT_MODEL:
            raise ValueError(
                f"speculator.model.uri is required unless method is mtp or ngram "
                f"(method is {self.method})"
            )
        lookup_min, lookup_max = self.prompt_lookup_min, self.prompt_lookup_max
        if lookup_min is not None and lookup_max is not None and lookup_min > lookup_max:
            raise ValueError(
                f"speculator.promptLookupMin ({lookup_min}) must not exceed "
                f"speculator.promptLookupMax ({lookup_max})"
            )
        if self.n_predict is not None:
            if self.method not in MTP_METHODS:
                raise ValueError("speculator.nPredict applies to methods mtp and gemma4_mtp only")
            if not k_fits_mtp_layers(self.num_speculative_tokens, self.n_predict):
                raise ValueError(
                    f"speculator.numSpeculativeTokens ({self.num_speculative_tokens}) above "
                    f"speculator.nPredict ({self.n_predict}) must be a multiple of it"
                )
        return self


def k_fits_mtp_layers(k: int, n_predict: int | None) -> bool:
    """Whether ``k`` draft tokens can be proposed by ``n_predict`` MTP layers used in
    turn: ``k <= n_predict`` or ``k`` a multiple of ``n_predict`` (vLLM
    ``vllm/config/speculative.py``, ``SpeculativeConfig.__post_init__``: "Ensure
    divisibility for MTP module reuse").  Any k fits when ``n_predict`` is unknown."""
    return n_predict is None or k <= n_predict or k % n_predict == 0


TuningMode = Literal["Off", "Recommend", "Auto"]

PER_BATCH_SIZE_NEEDS_AUTO = (
    "tuning.perBatchSize applies to tuning.mode Auto only: Off and Recommend apply "
    "nothing (Recommend records the best schedule in status.speculation.schedule anyway)"
)


class TuningSpec(ApiModel):
    """How the operator tunes k (``num_speculative_tokens``) from the pods' acceptance
    counters and step times, maximising goodput.

    The runtime refuses a k above the one it started with, so in ``Auto`` mode the pods
    start with ``maxSpeculativeTokens`` (their bound) and the operator sets the k in
    effect, initially ``speculator.numSpeculativeTokens``, through each pod's admin API
    (``PUT /v1/speculative_config``).  In ``Off`` and ``Recommend`` mode the pods start
    with ``speculator.numSpeculativeTokens``, which is then also the k in effect.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": (
                        "!has(self.maxSpeculativeTokens) || "
                        "(has(self.minSpeculativeTokens) ? self.minSpeculativeTokens : 0)"
                        " <= self.maxSpeculativeTokens"
                    ),
                    "message": "minSpeculativeTokens must not exceed maxSpeculativeTokens",
                    "fieldPath": ".minSpeculativeTokens",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.interval) || duration(self.interval) >= duration('1s')",
                    "message": "interval must be at least 1s",
                    "fieldPath": ".interval",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": (
                        "!has(self.perBatchSize) || !self.perBatchSize"
                        " || (has(self.mode) && self.mode == 'Auto')"
                    ),
                    "message": PER_BATCH_SIZE_NEEDS_AUTO,
                    "fieldPath": ".perBatchSize",
                    "reason": "FieldValueForbidden",
                },
            ]
        }
    )

    mode: TuningMode = "Recommend"
    """``Off``: the pods keep ``speculator.numSpeculativeTokens`` (a k set by an earlier
    ``Auto`` is put back); ``Recommend``: measure and record the best k in status
    without applying it; ``Auto``: apply it to every ready pod without a restart."""
    min_speculative_tokens: int = Field(default=0, ge=0, le=MAX_SPECULATIVE_TOKENS)
    """Smallest k the tuner may choose; 0 lets it turn speculation off where drafting
    does not pay (the draft stays loaded)."""
    max_speculative_tokens: int | None = Field(default=None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    """Largest k the tuner may choose; default ``speculator.numSpeculativeTokens``.  In
    ``Auto`` mode it is the pods' bound for k (they start at the spec's k), so changing
    it rolls them."""
    interval: Annotated[Duration, _min_duration(1.0)] = "30s"
    """Measurement window: the pods are scraped and a decision taken once per interval."""
    cooldown: Duration = "2m"
    """No new change until this long after the last one (the window after a change
    verifies it and may revert it)."""
    min_gain: float = Field(default=0.05, ge=0.0, le=1.0)
    """Predicted goodput gain (fraction) a change must bring with 95% posterior
    probability; hysteresis against flapping."""
    per_batch_size: bool = False
    """``Auto`` mode only: apply a per-batch-size schedule instead of one k (vLLM's
    ``num_speculative_tokens_per_batch_size``, ``[[start, end, k], ...]``), so that
    each engine step drafts the k that is best at its own batch size.  The tuner
    decides the schedule under the same probability, ``minGain``, cooldown and revert
    rules as a single k; ``engine: specula`` pods take it through their admin API,
    ``engine: vllm`` pods through ``--speculative-config`` (a new schedule rolls them).
    Off by default: in the tuning simulator a schedule wins only where the batch size
    varies within an interval (+1% goodput on the bursty-shift trace) and loses
    0.6-6.2% where the load moves between intervals (``bench/RESULTS.md``).  The
    schedule applied is in ``status.speculation.numSpeculativeTokensPerBatchSize``;
    the best one is recommended in ``status.speculation.schedule`` in every mode."""

    @model_validator(mode="after")
    def _min_le_max(self) -> TuningSpec:
        if self.max_speculative_tokens is not None and (
            self.min_speculative_tokens > self.max_speculative_tokens
        ):
            raise ValueError(
                f"minSpeculativeTokens ({self.min_speculative_tokens}) must not exceed "
                f"maxSpeculativeTokens ({self.max_speculative_tokens})"
            )
        if self.per_batch_size and self.mode != "Auto":
            raise ValueError(f"{PER_BATCH_SIZE_NEEDS_AUTO} (mode is {self.mode})")
        return self

    @property
    def interval_s(self) -> float:
        """``interval`` in seconds."""
        return parse_duration(self.interval)

    @property
    def cooldown_s(self) -> float:
        """``cooldown`` in seconds."""
        return parse_duration(self.cooldown)


class GpuResources(ApiModel):
    """GPUs per replica."""

    # No default in the schema on purpose: the API server would store it, and an omitted
    # count could no longer follow the tensor-parallel degree (SpeculativeModelSpec.pod_gpus
    # fills it in).
    count: int | None = Field(default=None, ge=0, le=8)
    """GPUs per pod; default: ``model.tensorParallelSize`` (one GPU per shard).  0 runs
    without a GPU limit (CPU inference); any other count must be at least
    ``model.tensorParallelSize``, since each pod holds every shard."""
    resource_name: str = Field(default=DEFAULT_GPU_RESOURCE_NAME, max_length=253)
    """Extended resource that the device plugin advertises."""


class ResourcesSpec(ApiModel):
    """Compute resources of each replica."""

    gpu: GpuResources = Field(default_factory=GpuResources)
    """GPU limit; default: ``model.tensorParallelSize`` ``nvidia.com/gpu``."""
    cpu: Quantity | None = None
    """CPU request and limit (a quantity such as ``8`` or ``"7500m"``)."""
    memory: Quantity | None = None
    """Memory request and limit (a quantity such as ``"64Gi"``)."""


class Toleration(ApiModel):
    """A pod toleration (Kubernetes ``core/v1`` ``Toleration``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    # The pod validation's rule, checked here so that the resource is
                    # refused rather than its Deployment.
                    "rule": "!has(self.operator) || self.operator != 'Exists'"
                    " || !has(self.value) || self.value == ''",
                    "message": "tolerations[].value must be empty when operator is Exists",
                    "fieldPath": ".value",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    key: str | None = Field(default=None, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(
                f"tolerations[].value must be empty when operator is Exists, got {self.value!r}"
            )
        return self


class SecretKeySelector(ApiModel):
    """A key of a Secret in the resource's namespace (Kubernetes ``SecretKeySelector``)."""

    name: DnsSubdomain
    """Secret name."""
    key: str = Field(default="token", min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN)
    """Key within the Secret (letters, digits, ``-``, ``_`` and ``.``)."""


class ModelCacheSpec(ApiModel):
    """Where ``hf://`` checkpoints are downloaded before the engine starts: a Hugging
    Face cache (``HF_HOME``) shared by both engines' layouts."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.claimName) || !has(self.sizeLimit)",
                    "message": "modelCache.sizeLimit applies to the default emptyDir only, "
                    "not to modelCache.claimName",
                    "fieldPath": ".sizeLimit",
                    "reason": "FieldValueForbidden",
                },
            ]
        }
    )

    claim_name: DnsSubdomain | None = None
    """PersistentVolumeClaim holding the cache, so that replicas and restarts reuse
    downloads (pods on several nodes need a ``ReadWriteMany`` claim); default: an
    ``emptyDir`` per pod."""
    size_limit: Quantity | None = None
    """Size limit of the default ``emptyDir`` (a quantity such as ``"40Gi"``)."""


class EnvVar(ApiModel):
    """An environment variable of the runtime container (Kubernetes ``core/v1`` ``EnvVar``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    # The pod validation's rule: a non-empty value and a valueFrom
                    # together are refused when the Deployment is written.
                    "rule": "!has(self.valueFrom) || !has(self.value) || self.value == ''",
                    "message": "env[].value and env[].valueFrom are exclusive",
                    "fieldPath": ".valueFrom",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: FreeForm | None = None
    """``secretKeyRef``, ``configMapKeyRef``, ``fieldRef`` or ``resourceFieldRef``, as in a pod."""

    @model_validator(mode="after")
    def _value_or_value_from(self) -> EnvVar:
        if self.value and self.value_from is not None:
            raise ValueError(f"env[].value and env[].valueFrom are exclusive (env {self.name})")
        return self


class SpeculativeModelSpec(ApiModel):
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
                },
                {
                    "rule": (
                        "!has(self.tuning) || ("
                        "(!has(self.tuning.minSpeculativeTokens)"
                        " || self.tuning.minSpeculativeTokens"
                        " <= self.speculator.numSpeculativeTokens)"
                        " && (!has(self.tuning.maxSpeculativeTokens)"
                        " || self.speculator.numSpeculativeTokens"
                        " <= self.tuning.maxSpeculativeTokens))"
                    ),
                    "message": (
                        "speculator.numSpeculativeTokens must lie within "
                        "[tuning.minSpeculativeTokens, tuning.maxSpeculativeTokens]"
                    ),
                    "fieldPath": ".speculator.numSpeculativeTokens",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": (
                        "!has(self.speculator.nPredict) || self.speculator.nPredict == 1"
                        " || !has(self.tuning) || self.tuning.mode != 'Auto'"
                        " || (has(self.tuning.maxSpeculativeTokens)"
                        " ? self.tuning.maxSpeculativeTokens"
                        " : self.speculator.numSpeculativeTokens) <= self.speculator.nPredict"
                    ),
                    "message": (
                        "with speculator.nPredict > 1 and tuning.mode Auto, "
                        "tuning.maxSpeculativeTokens must not exceed speculator.nPredict "
                        "(the tuner may pick any k up to it)"
                    ),
                    "fieldPath": ".tuning.maxSpeculativeTokens",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": (
                        "(!has(self.modelCache) && !has(self.hfTokenSecret))"
                        " || self.model.uri.startsWith('hf://')"
                        " || (has(self.speculator.model)"
                        " && self.speculator.model.uri.startsWith('hf://'))"
                    ),
                    "message": (
                        "modelCache and hfTokenSecret apply to hf:// checkpoints only: "
                        "neither model.uri nor speculator.model.uri is an hf:// URI"
                    ),
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": (
                        "!has(self.autoscaling) || !has(self.tuning)"
                        " || self.tuning.mode != 'Off'"
                    ),
                    "message": (
                        "autoscaling needs the tuner's measurements: "
                        "tuning.mode must be Recommend or Auto"
                    ),
                    "fieldPath": ".tuning.mode",
                    "reason": "FieldValueInvalid",
                },
                {
                    # Only a GPU count the spec gives (the schema has no default for
                    # it): an omitted count is model.tensorParallelSize.
                    "rule": (
                        "!has(self.resources) || !has(self.resources.gpu)"
                        " || !has(self.resources.gpu.count) || self.resources.gpu.count == 0"
                        " || !has(self.model.tensorParallelSize)"
                        " || self.resources.gpu.count >= self.model.tensorParallelSize"
                    ),
                    "message": (
                        "resources.gpu.count must be 0 (no GPU limit) or at least "
                        "model.tensorParallelSize: each pod holds every shard"
                    ),
                    "fieldPath": ".resources.gpu.count",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    engine: Engine = "specula"
    """``specula``: pods run ``specula serve`` and the tuner sets k in place through
    their admin API; ``vllm``: pods run ``vllm serve`` with ``--speculative-config``
    rendered from this spec, and a new k rolls them (vLLM cannot change k in place)."""
    model: ModelSpec
    """The target model."""
    speculator: SpeculatorSpec
    """The drafter and how many tokens it proposes."""
    replicas: int = Field(default=1, ge=0)
    """Pods serving the model; also the ``scale`` subresource's target."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes the pod has seen (automatic prefix caching,
    on by default in both engines); ``false`` prefills every prompt whole
    (``--no-enable-prefix-caching`` for ``vllm``)."""
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096)
    """Most requests a pod decodes together in one step (``--max-num-seqs``); also the
    batch at which the operator predicts a pod's capacity.  Default: 32 for
    ``specula``, 256 for ``vllm``; always passed to the pods explicitly."""
    image: str | None = Field(default=None, max_length=1024)
    """Container image; default: the operator's configured runtime image (``specula``)
    or vLLM image (``vllm``)."""
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
    service_account_name: DnsSubdomain | None = None
    """Service account the pods run as."""
    model_cache: ModelCacheSpec | None = None
    """Cache of ``hf://`` checkpoints; default: an ``emptyDir`` per pod.  Only with an
    ``hf://`` URI."""
    hf_token_secret: SecretKeySelector | None = None
    """Secret key holding a Hugging Face Hub token (``HF_TOKEN``) for ``hf://``
    downloads of private or gated repositories.  Only with an ``hf://`` URI."""
    api_key_secret: SecretKeySelector | None = None
    """Secret key holding the API key clients must send (``Authorization: Bearer``) on
    the OpenAI routes; ``/health`` and ``/metrics`` stay open.  The pods read it from
    the Secret (``SPECULA_API_KEY``, or ``VLLM_API_KEY`` for ``engine: vllm``); the key
    never appears in the pod spec or a ConfigMap.  Unset: the routes are open to every
    client that reaches the Service."""
    tuning: TuningSpec = Field(default_factory=TuningSpec)
    """Tuning of k from live acceptance; default: ``Recommend``."""
    autoscaling: AutoscalingSpec | None = None
    """Scale replicas on acceptance-adjusted load.  When set, ``replicas`` belongs to
    the autoscaler (it writes it through the ``scale`` subresource) and the Deployment
    gets it within ``[minReplicas, maxReplicas]``."""

    @property
    def pod_max_num_seqs(self) -> int:
        """``max_num_seqs`` with the engine's default filled in."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return DEFAULT_MAX_NUM_SEQS[self.engine]

    @property
    def desired_replicas(self) -> int:
        """Replicas for the Deployment: ``replicas``, within the autoscaling bounds
        when autoscaling is set (the autoscaler writes values within them anyway;
        the clamp only covers the time before it first acts)."""
        if self.autoscaling is None:
            return self.replicas
        return self.autoscaling.clamp(self.replicas)

    @property
    def max_speculative_tokens(self) -> int:
        """Largest k the tuner may choose (``tuning.maxSpeculativeTokens`` or, unset,
        ``speculator.numSpeculativeTokens``)."""
        explicit = self.tuning.max_speculative_tokens
        return self.speculator.num_speculative_tokens if explicit is None else explicit

    @property
    def pod_max_num_speculative_tokens(self) -> int:
        """The pods' upper bound for ``PUT /v1/speculative_config`` (they start at
        ``speculator.numSpeculativeTokens``): ``max_speculative_tokens`` in ``Auto``
        mode, so the tuner can move k up to it without a restart, else the spec's k."""
        if self.tuning.mode == "Auto":
            return max(self.max_speculative_tokens, self.speculator.num_speculative_tokens)
        return self.speculator.num_speculative_tokens

    @property
    def hf_uris(self) -> list[tuple[str, str | None]]:
        """``(uri, revision)`` of each ``hf://`` checkpoint (target first), which pods
        download into :attr:`model_cache` before the engine starts."""
        found = []
        if self.model.uri.startswith("hf://"):
            found.append((self.model.uri, self.model.revision))
        if self.speculator.model is not None and self.speculator.model.uri.startswith("hf://"):
            found.append((self.speculator.model.uri, None))
        return found

    @model_validator(mode="after")
    def _hub_fields_need_hf_uri(self) -> SpeculativeModelSpec:
        if (self.model_cache is not None or self.hf_token_secret is not None) and not (
            self.hf_uris
        ):
            raise ValueError(
                "modelCache and hfTokenSecret apply to hf:// checkpoints only: neither "
                "model.uri nor speculator.model.uri is an hf:// URI"
            )
        if (
            self.model_cache is not None
            and self.model_cache.claim_name is not None
            and self.model_cache.size_limit is not None
        ):
            raise ValueError(
                "modelCache.sizeLimit applies to the default emptyDir only, not to "
                "modelCache.claimName"
            )
        return self

    @model_validator(mode="after")
    def _env_names_unique(self) -> SpeculativeModelSpec:
        names = [var.name for var in self.env]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"env names must be unique, duplicated: {', '.join(duplicates)}")
        return self

    @model_validator(mode="after")
    def _k_within_tuning_bounds(self) -> SpeculativeModelSpec:
        k = self.speculator.num_speculative_tokens
        lo, hi = self.tuning.min_speculative_tokens, self.max_speculative_tokens
        if not lo <= k <= hi:
            raise ValueError(
                f"speculator.numSpeculativeTokens ({k}) must lie within "
                f"[tuning.minSpeculativeTokens, tuning.maxSpeculativeTokens] = [{lo}, {hi}]"
            )
        return self

    @model_validator(mode="after")
    def _mtp_bound_and_autoscaling(self) -> SpeculativeModelSpec:
        n_predict = self.speculator.n_predict
        if (
            n_predict is not None
            and n_predict > 1
            and self.tuning.mode == "Auto"
            and self.max_speculative_tokens > n_predict
        ):
            raise ValueError(
                f"with speculator.nPredict ({n_predict}) > 1 and tuning.mode Auto, "
                f"tuning.maxSpeculativeTokens ({self.max_speculative_tokens}) must not "
                f"exceed speculator.nPredict"
            )
        if self.autoscaling is not None and self.tuning.mode == "Off":
            raise ValueError(
                "autoscaling needs the tuner's measurements: tuning.mode must be "
                "Recommend or Auto"
            )
        return self

    @property
    def pod_gpus(self) -> int:
        """GPUs each pod asks for: ``resources.gpu.count``, or when it is omitted
        ``model.tensorParallelSize`` (one per shard); 0 means no GPU limit."""
        count = self.resources.gpu.count
        return self.model.tensor_parallel_size if count is None else count

    @model_validator(mode="after")
    def _gpus_hold_the_shards(self) -> SpeculativeModelSpec:
        gpus, tp = self.resources.gpu.count, self.model.tensor_parallel_size
        if gpus is not None and 0 < gpus < tp:
            raise ValueError(
                f"resources.gpu.count ({gpus}) must be 0 (no GPU limit) or at least "
                f"model.tensorParallelSize ({tp}): each pod holds every shard"
            )
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


class SpeculativeModel(ApiModel):
    """A whole ``SpeculativeModel`` object as the API server returns it."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["specula.dev/v1alpha1"] = API_VERSION
    kind: Literal["SpeculativeModel"] = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: SpeculativeModelSpec
    status: SpeculativeModelStatus | None = None
