"""``vllm serve`` arguments and ``--speculative-config`` rendered from a spec."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from specula.api.models import SpeculativeModelSpec
from specula.api.render_vllm import (
    DEFAULT_VLLM_IMAGE,
    VLLM_VERSION,
    PodSpeculation,
    VllmConfigError,
    model_path,
    render_speculative_config,
    render_vllm_args,
    schedule_problems,
    speculative_config_problems,
)


def make_spec(**overrides) -> SpeculativeModelSpec:
    raw = {
        "engine": "vllm",
        "model": {"uri": "hf://Qwen/Qwen3-8B"},
        "speculator": {"method": "eagle3", "model": {"uri": "hf://org/qwen3-8b-eagle3"}},
    }
    raw.update(overrides)
    return SpeculativeModelSpec.model_validate(raw)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_default_image_is_pinned_to_the_followed_release():
    assert DEFAULT_VLLM_IMAGE == f"vllm/vllm-openai:v{VLLM_VERSION}"
    assert "latest" not in DEFAULT_VLLM_IMAGE


@pytest.mark.parametrize(
    ("uri", "path"),
    [
        ("hf://Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),
        ("file:///models/qwen", "/models/qwen"),
        ("pvc://weights/qwen/8b", "/models/pvc/weights/qwen/8b"),
    ],
)
def test_model_path(uri, path):
    assert model_path(uri) == path


def test_model_path_rejects_other_schemes():
    with pytest.raises(VllmConfigError):
        model_path("s3://bucket/model")


def test_args_carry_the_spec():
    spec = make_spec(
        model={"uri": "pvc://weights/qwen", "dtype": "bfloat16", "maxModelLen": 8192,
               "tensorParallelSize": 4, "revision": "v2"},
        speculator={"method": "eagle3", "model": {"uri": "hf://org/head"},
                    "numSpeculativeTokens": 5, "draftTensorParallelSize": 4},
        maxNumSeqs=128,
    )
    args = render_vllm_args("qwen", spec)
    assert args[0] == "/models/pvc/weights/qwen"
    assert flag(args, "--served-model-name") == "qwen"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--tensor-parallel-size") == "4"
    assert flag(args, "--max-model-len") == "8192"
    assert flag(args, "--max-num-seqs") == "128"
    assert flag(args, "--revision") == "v2"
    assert (flag(args, "--host"), flag(args, "--port")) == ("0.0.0.0", "8000")
    assert json.loads(flag(args, "--speculative-config")) == {
        "method": "eagle3",
        "model": "org/head",
        "num_speculative_tokens": 5,
        "draft_tensor_parallel_size": 4,
    }


def test_probabilistic_drafting_reaches_both_engines():
    from specula.api.render import render_runtime_config

    spec = make_spec(
        speculator={"method": "eagle3", "model": {"uri": "hf://org/head"},
                    "draftSampleMethod": "probabilistic"},
    )
    config = json.loads(flag(render_vllm_args("m", spec), "--speculative-config"))
    assert config["draft_sample_method"] == "probabilistic"
    assert render_runtime_config("m", spec).speculator.draft_sample_method == "probabilistic"
    with pytest.raises(ValueError, match="draftSampleMethod"):
        make_spec(speculator={"method": "eagle3", "model": {"uri": "hf://org/head"},
                              "draftSampleMethod": "random"})


def test_default_max_num_seqs_is_explicit_and_optional_flags_absent():
    args = render_vllm_args("m", make_spec())
    assert flag(args, "--max-num-seqs") == "256"
    assert "--max-model-len" not in args and "--revision" not in args
    assert "--no-enable-prefix-caching" not in args


def test_prefix_caching_off_reaches_both_engines():
    from specula.api.render import render_runtime_config

    assert render_runtime_config("m", make_spec()).enable_prefix_caching is True
    spec = make_spec(enablePrefixCaching=False)
    assert "--no-enable-prefix-caching" in render_vllm_args("m", spec)
    assert render_runtime_config("m", spec).enable_prefix_caching is False


def test_ngram_renders_the_runtime_defaults_not_vllms():
    spec = make_spec(speculator={"method": "ngram", "numSpeculativeTokens": 4})
    assert render_speculative_config(spec) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
    }
    spec = make_spec(speculator={"method": "ngram", "promptLookupMin": 6})
    config = render_speculative_config(spec)
    assert (config["prompt_lookup_min"], config["prompt_lookup_max"]) == (6, 6)


def test_mtp_renders_without_model():
    spec = make_spec(speculator={"method": "mtp", "numSpeculativeTokens": 2, "nPredict": 1})
    assert render_speculative_config(spec) == {
        "method": "mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1,
    }


def test_tuned_k_and_schedule():
    spec = make_spec()
    assert render_speculative_config(spec, PodSpeculation(5))["num_speculative_tokens"] == 5
    schedule = ((1, 8, 4), (9, 64, 2), (65, 256, 0))
    config = render_speculative_config(spec, PodSpeculation(2, schedule))
    # vLLM caps each range's k at num_speculative_tokens: it must be the largest.
    assert config["num_speculative_tokens"] == 4
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 8, 4], [9, 64, 2], [65, 256, 0]]


def test_schedule_of_one_k_renders_as_that_k():
    """Turning tuning.perBatchSize on makes the k in effect a one-row schedule; vLLM
    pods keep their arguments (no roll) until the tuner decides a real schedule."""
    spec = make_spec()
    assert render_speculative_config(spec, PodSpeculation(3, ((1, 256, 3),))) == (
        render_speculative_config(spec, PodSpeculation(3))
    )
    two_rows = render_speculative_config(spec, PodSpeculation(3, ((1, 8, 3), (9, 256, 3))))
    assert "num_speculative_tokens_per_batch_size" not in two_rows
    assert two_rows["num_speculative_tokens"] == 3


def test_k_zero_means_no_speculative_config():
    spec = make_spec()
    assert render_speculative_config(spec, PodSpeculation(0)) is None
    assert render_speculative_config(spec, PodSpeculation(0, ((1, 256, 0),))) is None
    assert "--speculative-config" not in render_vllm_args("m", spec, PodSpeculation(0))


def test_rendering_refuses_what_vllm_would():
    spec = make_spec(speculator={"method": "mtp", "numSpeculativeTokens": 2, "nPredict": 2})
    with pytest.raises(VllmConfigError, match="divisible by n_predict=2"):
        render_speculative_config(spec, PodSpeculation(3))
    with pytest.raises(VllmConfigError, match="overlap"):
        render_speculative_config(make_spec(), PodSpeculation(2, ((1, 8, 2), (8, 16, 1))))


def test_config_problems():
    base = {"method": "eagle3", "model": "m", "num_speculative_tokens": 3}
    assert speculative_config_problems(base, target_tensor_parallel_size=1) == []
    cases = {
        "unknown field 'tensor_parallel_size'": {**base, "tensor_parallel_size": 2},
        "not a vLLM speculative method": {**base, "method": "medusa2"},
        "integer >= 1": {**base, "num_speculative_tokens": 0},
        "needs a draft model": {"method": "draft_model", "num_speculative_tokens": 2},
        "must be 1 or the target's": {**base, "draft_tensor_parallel_size": 2},
        "1 <= min <= max": {"method": "ngram", "num_speculative_tokens": 2,
                            "prompt_lookup_min": 5, "prompt_lookup_max": 3},
    }
    for expected, config in cases.items():
        problems = speculative_config_problems(config, target_tensor_parallel_size=4)
        assert any(expected in p for p in problems), (expected, problems)
    tp = {**base, "draft_tensor_parallel_size": 4}
    assert speculative_config_problems(tp, target_tensor_parallel_size=4) == []


@pytest.mark.parametrize(
    ("schedule", "ok"),
    [
        ([[1, 4, 3], [5, 256, 1]], True),
        ([[5, 256, 1], [1, 4, 3]], True),
        ([[1, 4, 3], [10, 256, 1]], True),
        ([[2, 4, 3]], False),
        ([[1, 4, 3], [4, 8, 1]], False),
        ([[1, 4, -1]], False),
        ([[1, 4]], False),
        ([[4, 1, 1]], False),
        ([], False),
        ("1-4:3", False),
    ],
)
def test_schedule_problems(schedule, ok):
    assert (schedule_problems(schedule) == []) is ok


def test_spec_rules_for_mtp_layers():
    with pytest.raises(ValidationError, match="multiple of it"):
        make_spec(speculator={"method": "mtp", "numSpeculativeTokens": 3, "nPredict": 2})
    make_spec(speculator={"method": "mtp", "numSpeculativeTokens": 4, "nPredict": 2})
    with pytest.raises(ValidationError, match="mtp and gemma4_mtp only"):
        make_spec(speculator={"method": "eagle3", "model": {"uri": "hf://a/b"}, "nPredict": 2})
    with pytest.raises(ValidationError, match="must not exceed speculator.nPredict"):
        make_spec(
            speculator={"method": "mtp", "numSpeculativeTokens": 2, "nPredict": 2},
            tuning={"mode": "Auto", "maxSpeculativeTokens": 4},
        )
    make_spec(
        speculator={"method": "mtp", "numSpeculativeTokens": 2, "nPredict": 1},
        tuning={"mode": "Auto", "maxSpeculativeTokens": 7},
    )
