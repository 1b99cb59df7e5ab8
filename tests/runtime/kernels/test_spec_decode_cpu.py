"""EAGLE-3 speculative decoding on the GPU path's code, run on the CPU (Triton kernels
in the interpreter, in the ``interpreted`` worker, eager: CUDA graphs need a device).

The case of ``tests/gpu/test_spec_decode.py`` (a real EAGLE-3 head whose drafts the
target sometimes accepts): greedy speculative decoding with the greedy rejection
sampling kernel emits exactly the target-only greedy tokens of the same runner, with
accepted and rejected drafts in the run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.runtime

GPU_CASE = Path(__file__).resolve().parents[2] / "gpu" / "test_spec_decode.py"


def _case_module():
    spec = importlib.util.spec_from_file_location("spec_decode_gpu_case", GPU_CASE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def greedy_spec_decode_on_cpu() -> tuple[list, list, int, int]:
    import torch
    from specula.runtime.gpu.spec_decode import GPUEagle3SpecDecoder

    case = _case_module()
    runner, draft, manager, aux = case.build_case(torch.device("cpu"))
    decoder = GPUEagle3SpecDecoder(runner, draft, manager, aux, 2, [case.K], use_cuda_graphs=False)
    # Fewer steps than on the GPU: the interpreter is slow.
    tokens, accepted, drafted, _ = case.spec_tokens(decoder, steps=5)
    reference = case.greedy_tokens(runner, manager, max(len(t) for t in tokens))
    return tokens, reference, accepted, drafted


def test_greedy_spec_decode_matches_target_greedy(interpreted):
    tokens, reference, accepted, drafted = interpreted(greedy_spec_decode_on_cpu)
    assert 0 < accepted < drafted
    for r, toks in enumerate(tokens):
        assert len(toks) > 5
        assert toks == reference[r][: len(toks)]
