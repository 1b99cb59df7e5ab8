"""EAGLE-3 speculative decoding on the GPU path (target and draft on the Triton kernels,
CUDA graphs for verification, draft prefill and draft decode).

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu``.

The draft is a real EAGLE-3 head (not synthetic acceptance) built so that it drafts
something the target sometimes accepts: ``fc`` is the identity over the target's final
residual stream (auxiliary layer ``L``), the decoder layer's output projections are
zero (so the layer passes its residual through), and ``norm`` / ``lm_head`` are the
target's over a 64-token draft vocabulary (``d2t`` into 96 target tokens). It thus
proposes the target's last token again, and the target (``lm_head`` equal to its
embeddings) repeats tokens now and then: the runs see both accepted and rejected
drafts. float32 throughout, so greedy choices are not decided by rounding.

- Greedy speculative decoding emits exactly the target-only greedy tokens of the same
  runner (eager and with CUDA graphs; two requests padded to a captured batch of 4).
- With synthetic acceptance, the CUDA-graph speculative step (verification, draft
  prefill reusing the verification's attention state, draft decode) emits the same
  tokens and leaves the same draft state as the eager step.
"""

from __future__ import annotations

import pytest
import torch
from specula.runtime.gpu.spec_decode import GPUEagle3SpecDecoder
from transformers import LlamaConfig

from specula.runtime.models.config import ModelConfig
from specula.runtime.models.llama import LlamaForCausalLM
from specula.runtime.spec_decode.eagle.runner import Eagle3Runner, random_eagle3_head
from specula.runtime.worker.model_runner import ModelRunner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache, metadata_from_block_manager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
DTYPE = torch.float32
BLOCK_SIZE = 4
MAX_MODEL_LEN = 128
PROMPTS = [[5, 17, 42, 7, 9, 1], [3, 1, 4, 1, 5, 9]]
K = 3
STEPS = 8


def build_case(device: torch.device = DEVICE):
    """Target runner, draft runner, block manager and auxiliary layer ids of the case
    described in the module docstring; the weights are drawn on the CPU, so every
    device gets the same ones."""
    cpu = torch.device("cpu")
    config = ModelConfig.from_hf_config(
        LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=MAX_MODEL_LEN,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config, device=cpu).to(DTYPE)
    with torch.no_grad():
        for p in target.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.1)
        target.model.embed_tokens.weight.normal_(0.0, 1.0)
        target.lm_head.weight.copy_(target.model.embed_tokens.weight)
    target.to(device).eval()
    layers = config.num_hidden_layers
    head = random_eagle3_head(
        config, draft_vocab_size=64, aux_layer_ids=(layers,), dtype=DTYPE, device=cpu
    )
    with torch.no_grad():
        head.fc.weight.copy_(torch.eye(config.hidden_size))
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(target.model.norm.weight)
    head.to(device)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head_weight[head.draft_to_target])
    head.embed_tokens = target.model.embed_tokens
    cache = PagedKVCache(KVCacheSpec.from_model_config(config, DTYPE, BLOCK_SIZE), 96, device)
    draft_cache = PagedKVCache(
        KVCacheSpec.from_model_config(head.config, DTYPE, BLOCK_SIZE), 96, device
    )
    runner = ModelRunner(target, cache, MAX_MODEL_LEN)
    draft = Eagle3Runner(head, draft_cache, MAX_MODEL_LEN)
    return runner, draft, cache.block_manager(watermark=0.0), (layers,)


def spec_tokens(decoder, synthetic=None, steps: int = STEPS):
    """Per request the tokens emitted over ``steps`` steps; accepted and drafted counts;
    the final draft state."""
    prompts = torch.tensor(PROMPTS, device=decoder.device)
    first = decoder.start([0, 1], prompts, K)
    tokens = [[t] for t in first.tolist()]
    accepted = 0
    for step in range(steps):
        out, acc = decoder.step(None if synthetic is None else synthetic[step])
        accepted += sum(acc)
        for r, row in enumerate(out.tolist()):
            tokens[r] += [t for t in row if t >= 0]
    draft_state = decoder.buffers.draft_hidden[:2].clone()
    decoder.finish()
    return tokens, accepted, steps * 2 * K, draft_state


def greedy_tokens(runner, manager, num_tokens: int):
    """Target-only greedy decoding of ``PROMPTS`` on the same runner, eager."""
    device = runner.device
    ids = [0, 1]
    for r in ids:
        manager.allocate(r, len(PROMPTS[r]))
    metadata, positions = metadata_from_block_manager(
        manager, ids, [len(p) for p in PROMPTS], runner.max_blocks_per_req, device
    )
    hidden, _ = runner.forward(torch.tensor(PROMPTS, device=device).view(-1), positions, metadata)
    nxt = runner.compute_logits(hidden[runner.last_token_indices(metadata)]).argmax(-1)
    tokens = [[t] for t in nxt.tolist()]
    for _ in range(num_tokens - 1):
        for r in ids:
            manager.append_slots(r, 1)
        metadata, positions = metadata_from_block_manager(
            manager, ids, [1, 1], runner.max_blocks_per_req, device
        )
        hidden, _ = runner.forward(nxt, positions, metadata)
        nxt = runner.compute_logits(hidden).argmax(-1)
        for r in ids:
            tokens[r].append(int(nxt[r]))
    for r in ids:
        manager.free(r)
    return tokens


@pytest.mark.parametrize("use_cuda_graphs", [False, True], ids=["eager", "cudagraph"])
def test_greedy_spec_decode_matches_target_greedy(use_cuda_graphs):
    runner, draft, manager, aux = build_case()
    decoder = GPUEagle3SpecDecoder(
        runner,
        draft,
        manager,
        aux,
        4,
        [K],
        use_cuda_graphs=use_cuda_graphs,
        capture_sizes=[1, 4],
    )
    if use_cuda_graphs:
        decoder.capture()
    tokens, accepted, drafted, _ = spec_tokens(decoder)
    # Both outcomes of verification happen in this run.
    assert 0 < accepted < drafted
    reference = greedy_tokens(runner, manager, max(len(t) for t in tokens))
    for r in range(2):
        assert tokens[r] == reference[r][: len(tokens[r])]


def test_cudagraph_spec_step_matches_eager():
    runner, draft, manager, aux = build_case()
    # Fixed accepted counts, every value from 0 to K, per step and request.
    synthetic = [[(s + r) % (K + 1) for r in range(2)] for s in range(STEPS)]
    results = []
    for graphs in (False, True):
        decoder = GPUEagle3SpecDecoder(
            runner, draft, manager, aux, 4, [K], use_cuda_graphs=graphs, capture_sizes=[1, 4]
        )
        if graphs:
            decoder.capture()
        results.append(spec_tokens(decoder, synthetic))
    (eager_tokens, *_, eager_state), (graph_tokens, *_, graph_state) = results
    assert graph_tokens == eager_tokens
    torch.testing.assert_close(graph_state, eager_state, atol=1e-4, rtol=1e-4)
