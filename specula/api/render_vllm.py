"""Rendering of ``vllm serve`` arguments from a ``SpeculativeModel`` spec (``engine: vllm``).

The speculative settings go to vLLM as one ``--speculative-config`` JSON object whose
keys are fields of vLLM's ``SpeculativeConfig`` (``vllm/config/speculative.py``).
vLLM checks that object only when a pod starts, deep inside engine start-up; the
rules it applies there that the operator can know in advance are checked here first
(:func:`speculative_config_problems`), so a bad combination is reported on the
resource instead of as a crash-looping pod:

- ``method`` is one of vLLM's ``SpeculativeMethod`` names;
- ``num_speculative_tokens`` > 0, and a draft ``model`` for the methods that load one;
- ``draft_tensor_parallel_size`` is 1 or the target's degree
  (``SpeculativeConfig._verify_and_get_draft_tp``);
- n-gram: ``prompt_lookup_min`` <= ``prompt_lookup_max``, both >= 1;
- MTP: a k above ``n_predict`` must be a multiple of it (``__post_init__``);
- ``num_speculative_tokens_per_batch_size``: ``[start, end, k]`` rows with positive
  inclusive ranges, ``k >= 0``, sorted, not overlapping, the first starting at 1
  (``vllm/v1/spec_decode/dynamic/utils.py``,
  ``validate_and_normalize_dynamic_sd_schedule``).

Sources are vLLM v0.33.0 (:data:`VLLM_VERSION`); ``tests/integration/test_vllm_contract.py``
checks the names and the schedule and tensor-parallel rules against that release's
own code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specula.api.models import SpeculativeModelSpec
from specula.api.runtime_config import PVC_MOUNT_ROOT, SpeculatorRuntimeConfig

VLLM_VERSION = "0.33.0"
"""vLLM release whose ``SpeculativeConfig`` the rendering follows."""

DEFAULT_VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
"""Image of ``engine: vllm`` pods when ``spec.image`` is unset (operator setting
``SPECULA_VLLM_IMAGE`` overrides it)."""

VLLM_PORT = 8000
"""Port ``vllm serve`` listens on: the OpenAI API, ``/health`` and ``/metrics``."""

VLLM_SPECULATIVE_METHODS: frozenset[str] = frozenset({
    "ngram", "draft_model", "suffix", "custom_class",
    "eagle", "eagle3", "extract_hidden_states", "dflash", "ngram_gpu", "dspark",
    # MTPModelTypes: all but "mtp" are deprecated aliases that vLLM maps to "mtp".
    "mtp", "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
    "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
    "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp",
    "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "kimi_k3_mtp",
    "pangu_ultra_moe_mtp", "step3p5_mtp", "step5_mtp", "hy_v3_mtp", "hy_v4_mtp",
    "gemma4_mtp", "inkling_mtp", "glm5_next_mtp",
})
"""vLLM's ``SpeculativeMethod`` literal (with ``EagleModelTypes`` and ``MTPModelTypes``
expanded) in ``vllm/config/speculative.py``."""

RENDERED_FIELDS: frozenset[str] = frozenset({
    "method",
    "model",
    "num_speculative_tokens",
    "draft_tensor_parallel_size",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "num_speculative_tokens_per_batch_size",
    "draft_sample_method",
})
"""``SpeculativeConfig`` fields the operator sets; any other key is a rendering bug."""

_DRAFT_MODEL_FREE = frozenset({"ngram", "ngram_gpu", "suffix", "mtp", "gemma4_mtp", "dspark"})
"""Methods vLLM runs without a ``model`` (n-gram lookup, suffix trees, or layers of
the target checkpoint)."""

_NGRAM_METHODS = frozenset({"ngram", "ngram_gpu"})

Schedule = tuple[tuple[int, int, int], ...]
"""``num_speculative_tokens_per_batch_size`` as ``((start, end, k), ...)``."""


class VllmConfigError(ValueError):
    """The spec (or the tuner's k) renders a ``--speculative-config`` vLLM would refuse."""


@dataclass(frozen=True)
class PodSpeculation:
    """What the pods are started with: one k, or a per-batch-size schedule."""

    num_speculative_tokens: int
    """k of every step (0: no speculation); with a schedule, its k at the batch size
    the tuner measured last (for status only)."""
    schedule: Schedule | None = None
    """Per-batch-size k, ``((start, end, k), ...)``; ``None``: the single k."""


def model_path(uri: str) -> str:
    """The model argument vLLM takes for a Specula model URI.

    ``hf://org/name`` -> ``org/name`` (a Hub repository id), ``file:///abs`` ->
    ``/abs``, ``pvc://claim/sub`` -> ``{PVC_MOUNT_ROOT}/claim/sub`` (where the operator
    mounts the claim).

    Raises:
        VllmConfigError: another scheme.
    """
    for prefix, root in (("hf://", ""), ("file://", ""), ("pvc://", f"{PVC_MOUNT_ROOT}/")):
        if uri.startswith(prefix):
            return root + uri[len(prefix):]
    raise VllmConfigError(f"unsupported model URI {uri!r}")


def render_speculative_config(
    spec: SpeculativeModelSpec, speculation: PodSpeculation | None = None
) -> dict[str, Any] | None:
    """The ``--speculative-config`` object for ``spec`` at ``speculation`` (default:
    the spec's k); ``None`` when the pods must not speculate (k = 0 everywhere).

    With a schedule, ``num_speculative_tokens`` is the schedule's largest k: vLLM caps
    every range's k at it (``build_dynamic_sd_schedule_lookup``).  A schedule with one
    k at every batch size is rendered as that k alone: the same steps, without vLLM's
    dynamic-k path, and the pods are not rolled when ``tuning.perBatchSize`` turns it
    on before the tuner has decided anything.

    Raises:
        VllmConfigError: vLLM would refuse the result (see the module docstring).
    """
    spec_k = spec.speculator.num_speculative_tokens
    speculation = speculation or PodSpeculation(spec_k)
    schedule = speculation.schedule
    if schedule and len({r[2] for r in schedule}) == 1:
        schedule = None
        k = speculation.schedule[0][2]
    else:
        k = max(r[2] for r in schedule) if schedule else speculation.num_speculative_tokens
    if k <= 0:
        return None
    speculator = spec.speculator
    config: dict[str, Any] = {"method": speculator.method, "num_speculative_tokens": k}
    if speculator.model is not None:
        config["model"] = model_path(speculator.model.uri)
    if speculator.method in _NGRAM_METHODS:
        # vLLM's own defaults (5, 5) differ from the runtime's; render the spec's meaning.
        lookup = SpeculatorRuntimeConfig(
            method=speculator.method,
            prompt_lookup_min=speculator.prompt_lookup_min,
            prompt_lookup_max=speculator.prompt_lookup_max,
        ).prompt_lookup_range
        config["prompt_lookup_min"], config["prompt_lookup_max"] = lookup
    else:
        config["draft_tensor_parallel_size"] = speculator.draft_tensor_parallel_size
        if speculator.draft_sample_method != "greedy":  # vLLM's default is greedy too
            config["draft_sample_method"] = speculator.draft_sample_method
    if schedule:
        config["num_speculative_tokens_per_batch_size"] = [list(r) for r in schedule]
    problems = speculative_config_problems(
        config,
        target_tensor_parallel_size=spec.model.tensor_parallel_size,
        n_predict=speculator.n_predict,
    )
    if problems:
        raise VllmConfigError("; ".join(problems))
    return config


def speculative_config_problems(
    config: Mapping[str, Any], *, target_tensor_parallel_size: int, n_predict: int | None = None
) -> list[str]:
    """Why vLLM would refuse ``config`` as ``--speculative-config`` (empty: it would not).

    Args:
        config: the JSON object.
        target_tensor_parallel_size: ``--tensor-parallel-size`` of the target.
        n_predict: MTP layers of the checkpoint, when known.
    """
    problems = [f"unknown field {key!r}" for key in sorted(set(config) - RENDERED_FIELDS)]
    method = config.get("method")
    if method not in VLLM_SPECULATIVE_METHODS:
        problems.append(f"method {method!r} is not a vLLM speculative method")
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        problems.append(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        k = None
    if method not in _DRAFT_MODEL_FREE and not config.get("model"):
        problems.append(f"method {method!r} needs a draft model")
    draft_tp = config.get("draft_tensor_parallel_size")
    if draft_tp is not None and draft_tp not in (1, target_tensor_parallel_size):
        problems.append(
            f"draft_tensor_parallel_size={draft_tp} must be 1 or the target's "
            f"tensor_parallel_size ({target_tensor_parallel_size})"
        )
    if method in _NGRAM_METHODS:
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            problems.append(
                f"prompt_lookup_min={lo} and prompt_lookup_max={hi} must satisfy 1 <= min <= max"
            )
    if method in ("mtp", "gemma4_mtp") and n_predict and k is not None:
        if k > n_predict and k % n_predict != 0:
            problems.append(f"num_speculative_tokens={k} must be divisible by n_predict={n_predict}")
    if "num_speculative_tokens_per_batch_size" in config:
        problems += schedule_problems(config["num_speculative_tokens_per_batch_size"])
    return problems


def schedule_problems(schedule: Any) -> list[str]:
    """Why vLLM would refuse ``num_speculative_tokens_per_batch_size`` (empty: it would
    not): a non-empty list of ``[start, end, k]`` integer rows, ``0 < start <= end``,
    ``k >= 0``, ranges sorted by start without overlap, the first starting at 1."""
    if not isinstance(schedule, Sequence) or isinstance(schedule, str) or not schedule:
        return ["num_speculative_tokens_per_batch_size must be a non-empty list"]
    rows: list[tuple[int, int, int]] = []
    for row in schedule:
        if (
            not isinstance(row, Sequence)
            or len(row) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in row)
        ):
            return [f"schedule entry {row!r} is not [start, end, k] of integers"]
        start, end, k = row
        if start <= 0 or end <= 0 or start > end or k < 0:
            return [f"schedule entry {list(row)} needs 0 < start <= end and k >= 0"]
        rows.append((start, end, k))
    previous_end = 0
    for start, end, _ in sorted(rows):
        if start <= previous_end:
            return ["schedule ranges overlap"]
        previous_end = end
    if min(r[0] for r in rows) != 1:
        return ["the first schedule range must start at 1"]
    return []


def speculative_config_json(config: Mapping[str, Any]) -> str:
    """``config`` as compact JSON with sorted keys (equal configs, equal text)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def render_vllm_args(
    name: str, spec: SpeculativeModelSpec, speculation: PodSpeculation | None = None
) -> list[str]:
    """Arguments of ``vllm serve`` for the pods of resource ``name``.

    Clients address the model by the resource name (``--served-model-name``); the
    server listens on all addresses at :data:`VLLM_PORT`.

    Raises:
        VllmConfigError: see :func:`render_speculative_config`.
    """
    model = spec.model
    args = [
        model_path(model.uri),
        "--served-model-name", name,
        "--dtype", model.dtype,
        "--tensor-parallel-size", str(model.tensor_parallel_size),
        "--max-num-seqs", str(spec.pod_max_num_seqs),
        "--host", "0.0.0.0",
        "--port", str(VLLM_PORT),
    ]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    if not spec.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    if model.revision is not None:
        args += ["--revision", model.revision]
    config = render_speculative_config(spec, speculation)
    if config is not None:
        args += ["--speculative-config", speculative_config_json(config)]
    return args
