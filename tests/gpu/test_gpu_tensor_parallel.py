"""Tensor parallelism over NCCL on two GPUs (``make test-gpu`` on a 2-GPU machine): the
demo target sharded over two ranks gives the greedy tokens of one rank, alone and with
its EAGLE-3 head, with CUDA graphs captured and replayed on the ranks."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

MAX_TOKENS = 48


def _config(demo, eagle3: bool, tp: int):
    from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig

    target, head = demo
    spec = SpeculatorRuntimeConfig(method="eagle3", model=f"file://{head}",
                                   num_speculative_tokens=4) if eagle3 else None
    return RuntimeConfig(model=f"file://{target}", dtype="float32", max_num_seqs=8,
                         speculator=spec, tensor_parallel_size=tp, device="cuda",
                         gpu_memory_utilization=0.3)


@pytest.mark.parametrize("eagle3", [False, True], ids=["target-only", "eagle3"])
def test_two_ranks_match_one_rank(demo, prompts, eagle3):
    from specula.runtime.engine.llm_engine import LLMEngine, SamplingParams, create_engine
    from specula.runtime.worker.parallel import destroy_parallel

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    single = LLMEngine.from_config(_config(demo, eagle3, 1), "cuda")
    expected = single.generate(prompts, params)
    del single
    torch.cuda.empty_cache()
    engine = create_engine(_config(demo, eagle3, 2))
    try:
        assert engine.generate(prompts, params) == expected
        assert engine.graphs is not None and engine.graphs.num_replays > 0
        if eagle3:
            assert engine.speculator.num_decode_replays > 0
            assert engine.spec_decoding_stats.num_accepted_tokens > 0
    finally:
        engine.shutdown()
        destroy_parallel()
