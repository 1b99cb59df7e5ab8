"""The runtime configuration: the JSON the operator writes into a ConfigMap and
``specula serve --config FILE`` reads.

This is the contract between the two halves of Specula.  Keys are snake_case, as
in vLLM's engine arguments (``num_speculative_tokens``, ``max_model_len``), since
the runtime is their consumer; the custom resource uses camelCase.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MODEL_URI_PATTERN = r"^(hf|pvc|file)://.+"
"""Accepted model URI schemes: ``hf://org/name`` (Hugging Face Hub repository,
resolved from the local HF cache), ``pvc://claim/sub/path`` (a PersistentVolumeClaim
the operator mounts read-only) and ``file:///abs/path`` (a path in the container)."""

PVC_MOUNT_ROOT = "/models/pvc"
"""Where the operator mounts ``pvc://<claim>`` volumes: ``{PVC_MOUNT_ROOT}/<claim>``."""

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
SpeculatorMethod = Literal["eagle3", "mtp", "gemma4_mtp", "dflash", "draft_model", "ngram"]

DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 4
"""n-gram sizes prompt lookup (method ``ngram``) uses when the config leaves them unset."""


class SpeculatorRuntimeConfig(BaseModel):
    """How the runtime drafts tokens."""

    model_config = ConfigDict(extra="forbid")

    method: SpeculatorMethod
    """Speculation method, vLLM's ``speculative_config.method`` names."""
    model: str | None = Field(default=None, pattern=MODEL_URI_PATTERN)
    """URI of the draft checkpoint; ``None`` for methods that need none (mtp, ngram)."""
    num_speculative_tokens: int = Field(default=3, ge=1, le=16)
    """k: draft tokens proposed per step when the pod starts."""
    max_num_speculative_tokens: int | None = Field(default=None, ge=1, le=16)
    """The largest k a running pod accepts through ``PUT /v1/speculative_config``; the
    speculator's buffers are sized by it.  ``None`` means ``num_speculative_tokens``."""
    draft_tensor_parallel_size: int = Field(default=1, ge=1, le=8)
    """Tensor-parallel degree of the draft model (1 or the target's degree)."""
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=16)
    """``ngram`` only (ignored by other methods): the shortest n-gram prompt lookup
    matches; ``None`` means 1."""
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=16)
    """``ngram`` only (ignored by other methods): the longest n-gram prompt lookup tries
    first; ``None`` means ``max(4, prompt_lookup_min)``."""
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    """How a draft network picks its tokens (vLLM's ``draft_sample_method``): ``greedy``
    takes the draft's argmax (the verifier treats it as a one-hot proposal, which keeps
    the output exact for every request); ``probabilistic`` samples each sampled
    request's draft under its own temperature, top-k and top-p and hands the
    distributions to the verifier (higher acceptance at temperature > 0, at the cost of
    keeping ``[max_num_seqs, k, vocab_size]`` float32 probabilities). n-gram drafts are
    always deterministic."""

    @model_validator(mode="after")
    def _max_covers_start(self) -> SpeculatorRuntimeConfig:
        if self.max_num_speculative_tokens is not None and (
            self.max_num_speculative_tokens < self.num_speculative_tokens
        ):
            raise ValueError(
                f"max_num_speculative_tokens ({self.max_num_speculative_tokens}) is below "
                f"num_speculative_tokens ({self.num_speculative_tokens})"
            )
        lookup_min, lookup_max = self.prompt_lookup_min, self.prompt_lookup_max
        if lookup_min is not None and lookup_max is not None and lookup_min > lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({lookup_min}) exceeds prompt_lookup_max ({lookup_max})"
            )
        return self

    @property
    def prompt_lookup_range(self) -> tuple[int, int]:
        """``(prompt_lookup_min, prompt_lookup_max)`` with the defaults filled in."""
        lookup_min = self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP_MIN
        return lookup_min, self.prompt_lookup_max or max(DEFAULT_PROMPT_LOOKUP_MAX, lookup_min)

    @property
    def max_k(self) -> int:
        """The bound in force: ``max_num_speculative_tokens`` or, unset, the startup k."""
        return self.max_num_speculative_tokens or self.num_speculative_tokens


class RuntimeConfig(BaseModel):
    """Everything ``specula serve`` needs to start one replica."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(pattern=MODEL_URI_PATTERN)
    """URI of the target checkpoint (Hugging Face layout)."""
    served_model_name: str | None = None
    """Name clients pass as ``model`` in OpenAI requests; defaults to the URI's last path part."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for ``hf://`` URIs."""
    dtype: Dtype = "auto"
    """Weight and activation dtype; ``auto`` takes the checkpoint's ``torch_dtype``
    (float32 on CPU when the checkpoint says bfloat16/float16 and the device lacks support)."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length in tokens (prompt + completion); defaults to the checkpoint's
    ``max_position_embeddings``."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=8)
    speculator: SpeculatorRuntimeConfig | None = None
    """``None`` serves the target alone (no speculation)."""
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the OpenAI-compatible API (also serves ``/metrics`` and ``/health``)."""
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """A second port serving only ``/metrics`` (Prometheus exposition), so that scrapers
    and NetworkPolicies can treat metrics apart from the API; ``None`` serves metrics on
    ``port`` only."""
    admin_port: int | None = Field(default=None, ge=1, le=65535)
    """Port of the admin API (``GET``/``PUT /v1/speculative_config``), apart from the
    model port so that the Service never exposes it; ``None``: no admin API."""
    admin_token_file: str | None = None
    """File holding the admin API's bearer token (a mounted Secret), read again on
    each admin request so a replaced Secret takes effect without a restart.  The
    token itself never appears in this config (it is written to a ConfigMap)."""
    max_num_seqs: int = Field(default=32, ge=1)
    """Most requests decoded together in one batch."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine runs; ``auto`` picks a CUDA GPU when one is visible. The engine
    is the same everywhere (paged KV cache, continuous batching); on a GPU it runs the
    Triton kernels and CUDA graphs, on a CPU the kernels' torch references."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """Fraction of the GPU's free memory (after loading the weights) the paged KV cache
    may take (vLLM's option of the same name)."""
    enforce_eager: bool = False
    """Run the GPU engine without CUDA graphs (vLLM's option of the same name)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes seen before (vLLM's automatic prefix
    caching, on by default as there); ``false`` prefills every prompt whole."""
    load_format: Literal["auto", "dummy"] = "auto"
    """``auto`` reads the checkpoints' weights; ``dummy`` initialises random weights
    from their configs alone, for benchmarks (vLLM's option of the same name)."""
    max_request_body_bytes: int = Field(default=8 * 2**20, ge=1024)
    """Largest request body the HTTP API reads; a larger one is answered 413 (before
    it is read, when ``Content-Length`` says so)."""
    http_read_timeout_s: float = Field(default=30.0, gt=0)
    """Time a client has to send a request's headers, and again its body; a slower one
    (a slow-loris client) has its connection closed, or gets 408 for the body."""
    max_queued_requests: int = Field(default=256, ge=0)
    """Requests that may wait beyond the ``max_num_seqs`` being decoded; one more is
    answered 429 with ``Retry-After`` at once instead of queueing (admission limit)."""
    max_n: int = Field(default=16, ge=1, le=1024)
    """Most samples (``n``) one prompt may ask for; a larger ``n`` is answered 400."""
    chat_template: str | None = None
    """Jinja chat template (the text) that ``/v1/chat/completions`` renders messages
    with, instead of the checkpoint's (``specula serve --chat-template FILE`` reads it
    from a file); ``None``: the checkpoint's own, and a 400 for chat requests if it
    has none."""
    drain_timeout_s: float = Field(default=25.0, ge=0)
    """On SIGTERM, how long the server keeps finishing in-flight completions (answering
    new ones and ``/health`` 503) before it stops; keep it below the pod's
    ``terminationGracePeriodSeconds`` (30 s by default)."""

    @model_validator(mode="after")
    def _distinct_ports(self) -> RuntimeConfig:
        if self.admin_port is not None and self.admin_port in (self.port, self.metrics_port):
            raise ValueError(
                f"admin_port ({self.admin_port}) must differ from port and metrics_port: "
                "the admin API needs a listener of its own"
            )
        return self

