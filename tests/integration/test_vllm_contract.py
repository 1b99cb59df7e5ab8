"""The operator's vLLM rendering against vLLM's own code, at the release it follows.

``hack/vllm-source.sh`` fetches the sources of vLLM ``VLLM_VERSION`` (from its wheel,
cached outside the repository).  vLLM cannot be imported here (it needs CUDA builds of
torch and its kernels), so the checks read its source: field and method names from
the syntax tree, and the two rules that are self-contained functions — the schedule
validator and the draft tensor-parallel check — are compiled from that source and run
against the same inputs as :mod:`specula.api.render_vllm`.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from specula.api.models import SpeculativeModelSpec
from specula.api.render_vllm import (
    RENDERED_FIELDS,
    VLLM_SPECULATIVE_METHODS,
    VLLM_VERSION,
    PodSpeculation,
    render_speculative_config,
    render_vllm_args,
    schedule_problems,
    speculative_config_problems,
)
from specula.api.runtime_config import SpeculatorMethod
from specula.devcluster.control_plane import REPO_ROOT
from specula.tuning import DEFAULT_COST_PARAMS, StepCostModel, optimal_schedule

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def vllm_source() -> Path:
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "hack" / "vllm-source.sh"), VLLM_VERSION],
        capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
    )
    if proc.returncode != 0:
        pytest.fail(f"hack/vllm-source.sh failed:\n{proc.stderr}", pytrace=False)
    return Path(proc.stdout.strip())


def _tree(root: Path, relative: str) -> ast.Module:
    return ast.parse((root / relative).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _fields(cls: ast.ClassDef) -> set[str]:
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def _literal_values(tree: ast.Module, alias: str) -> set[str]:
    """Strings of a module-level ``X = Literal[...]``, nested aliases expanded."""
    aliases = {
        n.targets[0].id: n.value
        for n in tree.body
        if isinstance(n, ast.Assign)
        and len(n.targets) == 1
        and isinstance(n.targets[0], ast.Name)
        and isinstance(n.value, ast.Subscript)
        and isinstance(n.value.value, ast.Name)
        and n.value.value.id == "Literal"
    }

    def expand(node: ast.expr) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name):
            return expand(aliases[node.id].slice)
        if isinstance(node, ast.Tuple):
            return set().union(*(expand(e) for e in node.elts))
        raise AssertionError(f"unexpected node in {alias}: {ast.dump(node)}")

    return expand(aliases[alias].slice)


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spec(**overrides) -> SpeculativeModelSpec:
    raw = {
        "engine": "vllm",
        "model": {"uri": "hf://Qwen/Qwen3-8B", "tensorParallelSize": 2},
        "speculator": {"method": "eagle3", "model": {"uri": "hf://org/eagle3-head"}},
    }
    raw.update(overrides)
    return SpeculativeModelSpec.model_validate(raw)


def test_rendered_keys_are_speculative_config_fields(vllm_source):
    fields = _fields(_class(_tree(vllm_source, "vllm/config/speculative.py"), "SpeculativeConfig"))
    assert RENDERED_FIELDS <= fields, RENDERED_FIELDS - fields
    for method in typing.get_args(SpeculatorMethod):
        spec = _spec(speculator={"method": method, "model": {"uri": "file:///models/draft"}})
        config = render_speculative_config(spec)
        assert set(config) <= fields


def test_method_names_match_vllm(vllm_source):
    methods = _literal_values(_tree(vllm_source, "vllm/config/speculative.py"), "SpeculativeMethod")
    assert methods == VLLM_SPECULATIVE_METHODS
    assert set(typing.get_args(SpeculatorMethod)) <= methods


def test_schedule_rule_matches_vllm_validator(vllm_source):
    vllm = _load_module(
        vllm_source / "vllm/v1/spec_decode/dynamic/utils.py", "_vllm_dynamic_sd_utils"
    )

    def vllm_accepts(schedule) -> bool:
        try:
            vllm.validate_and_normalize_dynamic_sd_schedule(schedule)
        except ValueError:
            return False
        return True

    cases = [
        [[1, 4, 3], [5, 16, 2], [17, 256, 1]],
        [[1, 1, 0]],
        [[5, 16, 2], [1, 4, 3]],  # unsorted but disjoint: vLLM sorts
        [[1, 8, 4], [32, 64, 1]],  # a gap: vLLM carries the previous k forward
        [[2, 8, 3]],  # does not start at 1
        [[1, 8, 3], [8, 16, 2]],  # overlap at 8
        [[1, 8, -1]],
        [[0, 8, 2]],
        [[1, 8]],
        [[3, 2, 1], [1, 1, 1]],
        [],
    ]
    for schedule in cases:
        assert (schedule_problems(schedule) == []) == vllm_accepts(schedule), schedule

    # Schedules the tuner builds, as the renderer emits them.
    cost = StepCostModel(params=DEFAULT_COST_PARAMS)
    for alphas in ([0.9, 0.85, 0.8, 0.75], [0.5, 0.4, 0.3, 0.2], [0.05] * 4):
        schedule = optimal_schedule(alphas, cost, [0, 1, 2, 3, 4], 256)
        config = render_speculative_config(
            _spec(), PodSpeculation(schedule[0][2], tuple(tuple(r) for r in schedule))
        )
        if config is None:  # k = 0 everywhere: no speculation at all
            assert all(k == 0 for *_, k in schedule)
            continue
        rendered = config["num_speculative_tokens_per_batch_size"]
        assert vllm_accepts(rendered)
        assert config["num_speculative_tokens"] == max(k for *_, k in rendered)


def test_draft_tensor_parallel_rule_matches_vllm(vllm_source):
    cls = _class(_tree(vllm_source, "vllm/config/speculative.py"), "SpeculativeConfig")
    func = next(
        n for n in cls.body
        if isinstance(n, ast.FunctionDef) and n.name == "_verify_and_get_draft_tp"
    )
    func.decorator_list = []
    namespace: dict = {}
    module = ast.Module(body=[func], type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), "speculative.py", "exec"), {
        "ParallelConfig": object,
    }, namespace)
    verify = namespace["_verify_and_get_draft_tp"]

    def vllm_accepts(draft_tp: int, target_tp: int) -> bool:
        try:
            verify(SimpleNamespace(tensor_parallel_size=target_tp), draft_tp)
        except ValueError:
            return False
        return True

    for target_tp in (1, 2, 4, 8):
        for draft_tp in (1, 2, 3, 4, 8):
            config = {"method": "eagle3", "model": "m", "num_speculative_tokens": 2,
                      "draft_tensor_parallel_size": draft_tp}
            ours = speculative_config_problems(config, target_tensor_parallel_size=target_tp)
            assert (ours == []) == vllm_accepts(draft_tp, target_tp), (draft_tp, target_tp)


def test_inline_rules_still_in_vllm(vllm_source):
    """The MTP and n-gram rules live inline in ``SpeculativeConfig.__post_init__``;
    they are encoded in ``speculative_config_problems``, and this checks that the
    release still states them as encoded."""
    cls = _class(_tree(vllm_source, "vllm/config/speculative.py"), "SpeculativeConfig")
    post_init = next(
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__post_init__"
    )
    source = ast.unparse(post_init)
    assert "self.num_speculative_tokens % n_predict != 0" in source
    assert "self.num_speculative_tokens > n_predict" in source
    assert "self.prompt_lookup_min > self.prompt_lookup_max" in source
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    assert speculative_config_problems(mtp, target_tensor_parallel_size=1, n_predict=2)
    assert not speculative_config_problems(mtp, target_tensor_parallel_size=1, n_predict=3)
    assert not speculative_config_problems(
        {**mtp, "num_speculative_tokens": 4}, target_tensor_parallel_size=1, n_predict=2
    )


def test_cli_flags_are_engine_args(vllm_source):
    fields = _fields(_class(_tree(vllm_source, "vllm/engine/arg_utils.py"), "EngineArgs"))
    args = render_vllm_args("qwen", _spec(maxNumSeqs=64, model={
        "uri": "hf://Qwen/Qwen3-8B", "maxModelLen": 4096, "revision": "main",
    }))
    args += render_vllm_args("qwen", _spec(enablePrefixCaching=False))
    # A --no-X flag is the negative of boolean field X (argparse's BooleanOptionalAction).
    flags = {a[2:].replace("-", "_").removeprefix("no_") for a in args if a.startswith("--")}
    assert "enable_prefix_caching" in flags
    # --host and --port belong to the OpenAI frontend, not to the engine.
    assert flags - {"host", "port"} <= fields, (flags - {"host", "port"}) - fields


def test_scraped_vllm_metric_names_exist(vllm_source):
    names: set[str] = set()
    for relative in ("vllm/v1/metrics/loggers.py", "vllm/v1/spec_decode/metrics.py"):
        for node in ast.walk(_tree(vllm_source, relative)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    for suffix in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
        "generation_tokens", "num_requests_running", "num_requests_waiting",
        "iteration_tokens_total", "inter_token_latency_seconds",
    ):
        assert f"vllm:{suffix}" in names, suffix
