"""The paged Gemma4 runner on CUDA against Hugging Face ``transformers``, its CUDA graphs
against its eager forward, and the sliding-window paged attention kernel at Gemma 4's
head sizes against its torch reference.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_gemma4_runner.py``.

The checkpoint is a random 6-layer Gemma4 text model at Gemma 4's head sizes (256 for
sliding layers, 512 for full ones), with a 16-token window, KV-shared layers 4 and 5
(reading layers 3 and 2), ``attention_k_eq_v``, proportional RoPE, per-layer inputs and
soft-capping.

Logits: a varlen prefill of two requests (40 and 11 tokens), greedy decode steps, a mixed
step (both decode while a third request prefills) and a (k + 1)-token verification step;
every query row compared with ``transformers``' float32 forward over the whole
sequence. float32: within 1e-4. bfloat16: within twice ``transformers``' own bfloat16
error on the same rows plus 0.05 (bfloat16 rounding, not a fixed number, sets the
scale).

Graphs: decode batches of 1, 3 (padded to the captured 4) and 8 requests, and a
verification batch of 3 requests x 4 tokens, with contexts past the window, replayed and
run eagerly on the same cache state; final and auxiliary hidden states within 3e-2
(cuBLAS and the attention split count may differ between a padded and an unpadded
shape).

MTP draft: the ``gemma4_mtp`` speculator over a random 2-layer assistant (centroid-masked
logits) proposing k = 1, 2, 4 greedy tokens for 1, 3 (padded to the captured 4) and 8
requests over the target's cache, by its draft decode graphs and by its eager loop on
the same launch shape: equal tokens.

Kernel: decode and verification queries with head sizes 256 and 512 (up to 64 query
rows per program), contexts shorter and far longer than a 512-token window, default and
forced split counts, against the float32 reference: bfloat16 within 2e-2, float32
within 1e-4; a window no shorter than the context gives bit-identical output to no
window.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import triton
from paged_schedule import metadata_from_block_manager, run_schedule

from specula.runtime.engine.sampler import SamplingMetadata
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.kernels.paged_attention import paged_attention, paged_attention_reference
from specula.runtime.models.gemma4_assistant import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
)
from specula.runtime.models.gemma4_config import FULL, SLIDING
from specula.runtime.models.registry import load_model
from specula.runtime.spec_decode.base import ProposeInputs
from specula.runtime.spec_decode.gemma4 import Gemma4MTPSpeculator
from specula.runtime.worker.cudagraph import CUDAGraphManager, padded_size
from specula.runtime.worker.gemma4_runner import Gemma4Runner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
WINDOW = 16
VOCAB = 512
PROMPTS = ([5, 17, 42, 7, 99, 3, 8, 61] * 5, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
LATE_PROMPT = [7, 70, 2, 9, 33, 4, 5, 81, 16, 2, 200, 13, 6, 77, 1, 90, 45, 23, 8]
DECODE_STEPS = 4
DRAFTS = ([11, 12, 13], [21, 22, 23], [31, 32, 33])
AUX_LAYER_IDS = (1, 3, 6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        sliding_window=WINDOW,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=30.0,
        max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.05,
        eos_token_id=1,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # Off their initial ones, so that loading them matters.
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("layer_scalar"):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
        # Unit-RMS queries and keys at softmax scale 1 give scores of std sqrt(head_dim)
        # (16 to 22), a near-argmax softmax that bfloat16 rounding flips; trained
        # Gemma 4 norms keep them small.
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(0.3)
            if hasattr(layer.self_attn, "k_norm"):
                layer.self_attn.k_norm.weight.mul_(0.3)
    path = tmp_path_factory.mktemp("gemma4")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _runner(checkpoint, dtype: torch.dtype, num_blocks: int = 64):
    model = load_model(checkpoint, dtype, DEVICE)
    spec = KVCacheSpec.from_model_config(model.config, dtype, BLOCK_SIZE)
    cache = PagedKVCache(spec, num_blocks, DEVICE)
    return Gemma4Runner(model, cache, MAX_MODEL_LEN), cache.block_manager(watermark=0.0)


def _inputs(runner, manager, ids, new_tokens):
    metadata, positions = metadata_from_block_manager(
        manager, ids, [len(t) for t in new_tokens], runner.max_blocks_per_req, DEVICE
    )
    input_ids = torch.tensor([t for toks in new_tokens for t in toks], device=DEVICE)
    return input_ids, positions, metadata


def _run_schedule(runner, manager) -> tuple[list[list[int]], list[dict]]:
    """Prefill, decode, mixed and verification steps; every query row's logits."""
    return run_schedule(
        runner, manager, PROMPTS, LATE_PROMPT, DRAFTS,
        decode_steps=DECODE_STEPS, warm_tokens=40, device=DEVICE,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_transformers(checkpoint, dtype):
    from transformers import AutoModelForCausalLM

    tokens, logits = _run_schedule(*_runner(checkpoint, dtype))
    assert min(len(t) for t in tokens) > WINDOW
    hf32 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE)
    hf16 = None
    if dtype == torch.bfloat16:
        hf16 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(DEVICE)
    for toks, rows in zip(tokens, logits, strict=True):
        assert sorted(rows) == list(range(len(toks)))
        batch = torch.tensor([toks], device=DEVICE)
        with torch.no_grad():
            ref = hf32(batch).logits[0].float()
            ours = torch.stack([rows[p] for p in range(len(toks))])
            err = (ours - ref).abs().max().item()
            if hf16 is None:
                assert err <= 1e-4, err
            else:
                hf_err = (hf16(batch).logits[0].float() - ref).abs().max().item()
                assert err <= 2 * hf_err + 0.05, (err, hf_err)


@pytest.mark.parametrize("num_reqs, q_len", [(1, 1), (3, 1), (8, 1), (3, 4)])
def test_cudagraph_replay_matches_eager(checkpoint, num_reqs, q_len):
    runner, manager = _runner(checkpoint, torch.bfloat16, num_blocks=128)
    graphs = CUDAGraphManager(
        runner, max_num_reqs=8, uniform_query_lens=(1, 4), aux_layer_ids=AUX_LAYER_IDS
    )
    states = graphs.capture()
    assert len(states) == len(graphs.descriptors()) == 8
    ids = list(range(num_reqs))
    gen = torch.Generator().manual_seed(num_reqs)
    prompt_lens = torch.randint(WINDOW // 2, 3 * WINDOW, (num_reqs,), generator=gen).tolist()
    for r, n in zip(ids, prompt_lens, strict=True):
        manager.allocate(r, n)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    runner.forward(*_inputs(runner, manager, ids, prompts))
    hidden_size = runner.config.hidden_size
    for step in range(3):
        for r in ids:
            manager.append_slots(r, q_len)
        new = torch.randint(0, VOCAB, (num_reqs, q_len), generator=gen).tolist()
        inp, pos, md = _inputs(runner, manager, ids, new)
        descriptor = graphs.descriptor_for(num_reqs, q_len)
        assert descriptor is not None and descriptor.num_reqs >= num_reqs
        eager, eager_aux = runner.forward(inp, pos, md, AUX_LAYER_IDS)
        eager, eager_aux = eager.clone(), eager_aux.clone()
        replayed, aux, replayed_descriptor = graphs.run(inp, pos, md)
        assert replayed_descriptor == descriptor
        replayed, aux = replayed.clone(), aux.clone()
        assert replayed.shape == eager.shape == (num_reqs * q_len, hidden_size)
        assert aux.shape == eager_aux.shape == (num_reqs * q_len, 3 * hidden_size)
        assert torch.isfinite(replayed).all() and torch.isfinite(aux).all()
        torch.testing.assert_close(replayed, eager, atol=3e-2, rtol=3e-2, msg=f"step {step}")
        torch.testing.assert_close(aux, eager_aux, atol=3e-2, rtol=3e-2, msg=f"aux {step}")


def _paged_case(seq_lens, num_heads, num_kv_heads, head_dim, q_len, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    num_reqs = len(seq_lens)
    max_blocks = max(triton.cdiv(s, BLOCK_SIZE) for s in seq_lens) + 1
    num_blocks = num_reqs * max_blocks + 3
    table = torch.randperm(num_blocks, generator=gen, device=DEVICE)[: num_reqs * max_blocks]
    block_table = table.view(num_reqs, max_blocks).to(torch.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    vc = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    q = torch.randn(num_reqs * q_len, num_heads, head_dim, generator=gen, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q.to(dtype), kc, vc, block_table, lens


@pytest.mark.parametrize(
    "head_dim, num_kv_heads, q_len, dtype, num_splits",
    [
        (256, 2, 1, torch.bfloat16, None),
        (256, 2, 4, torch.bfloat16, 4),
        (512, 1, 1, torch.bfloat16, 4),
        # 8 query tokens x 8 heads of one KV head: 64 rows, the largest query tile,
        # with 512-wide heads: the key tile shrinks to fit in shared memory.
        (512, 1, 8, torch.bfloat16, None),
        (512, 1, 1, torch.float32, None),
        (512, 1, 8, torch.float32, 4),
    ],
)
def test_sliding_window_kernel_matches_reference(head_dim, num_kv_heads, q_len, dtype, num_splits):
    seq_lens, window = [9, 513, 2000, 0], 512  # each >= q_len (or 0: padding)
    q, kc, vc, bt, lens = _paged_case(seq_lens, 8, num_kv_heads, head_dim, q_len, dtype)
    scale = head_dim**-0.5
    out = paged_attention(
        q, kc, vc, bt, lens, scale, q_len, num_splits=num_splits, sliding_window=window
    )
    ref = paged_attention_reference(q, kc, vc, bt, lens, scale, q_len, window)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
    assert torch.all(out[3 * q_len :] == 0)  # the padding request


def test_window_covering_the_context_equals_no_window():
    q, kc, vc, bt, lens = _paged_case([30, 100, 257], 8, 2, 256, 4, seed=1)
    scale = 256**-0.5
    full = paged_attention(q, kc, vc, bt, lens, scale, 4, num_splits=2)
    windowed = paged_attention(q, kc, vc, bt, lens, scale, 4, num_splits=2, sliding_window=257)
    assert torch.equal(full, windowed)


def _assistant(runner: Gemma4Runner) -> Gemma4AssistantForCausalLM:
    """A random assistant shaped to read the target's producer layers (one sliding,
    one full), its token embedding the target's (tied logits, as trained ones are)."""
    tc = runner.config
    producers = tc.kv_producer_layers()
    types = (SLIDING, FULL)
    text = dataclasses.replace(
        tc,
        num_hidden_layers=2,
        layer_types=types,
        layer_head_dims=tuple(tc.layer_head_dims[producers[t]] for t in types),
        layer_num_kv_heads=tuple(tc.layer_num_kv_heads[producers[t]] for t in types),
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=0,
        use_double_wide_mlp=False,
        tie_word_embeddings=True,
    )
    config = Gemma4AssistantConfig(
        text=text,
        backbone_hidden_size=tc.hidden_size,
        use_ordered_embeddings=True,
        num_centroids=8,
        centroid_intermediate_top_k=2,
    )
    torch.manual_seed(1)
    model = Gemma4AssistantForCausalLM(config, DEVICE)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(runner.model.model.embed_tokens.weight)
        model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(0.3)
    return model.to(DEVICE, runner.dtype).eval()


class _InMemoryMTP(Gemma4MTPSpeculator):
    """The ``gemma4_mtp`` speculator over an assistant built in memory (no checkpoint)."""

    def __init__(self, assistant: Gemma4AssistantForCausalLM, runner: Gemma4Runner, k: int):
        self._assistant = assistant
        super().__init__(
            draft_dir=Path("in-memory"), target_config=runner.config,
            num_speculative_tokens=k, max_num_seqs=8, dtype=runner.dtype, device=DEVICE,
        )

    def load_draft_model(self) -> Gemma4AssistantForCausalLM:
        return self._assistant


def _propose_inputs(r, k, input_ids, positions, metadata, hidden, tokens, next_positions):
    """A proposal for the first ``r`` requests of a prefill forward: no drafts verified,
    each request's sampled token ``tokens[i]`` at ``next_positions[i]``."""
    return ProposeInputs(
        num_reqs=r,
        num_decode=0,
        idx_mapping=torch.arange(r, device=DEVICE),
        input_batch=None,  # type: ignore[arg-type]  # token history: unused by this method
        input_ids=input_ids,
        positions=positions,
        metadata=metadata,
        descriptor=None,
        hidden_states=hidden,
        aux_hidden_states=None,
        cu_num_draft_tokens=torch.zeros(r, dtype=torch.int32, device=DEVICE),
        num_accepted=torch.zeros(r, dtype=torch.int64, device=DEVICE),
        next_token_ids=tokens[:r],
        next_positions=next_positions[:r],
        sampling=SamplingMetadata.from_params([SamplingParams()] * r, range(r), DEVICE),
        num_speculative_tokens=k,
    )


def test_mtp_draft_graphs_match_eager(checkpoint):
    """The speculator's draft decode graphs (one per padded request count and k) give
    the drafts of its eager loop on the same padded launch shape."""
    runner, manager = _runner(checkpoint, torch.bfloat16, num_blocks=128)
    spec = _InMemoryMTP(_assistant(runner), runner, k=4)
    spec.bind_target(runner)
    spec.init_cudagraph_manager()
    spec.capture({})  # draft rows read the target's cache: no prefill graphs
    assert not spec.prefill_graphs
    assert sorted(spec.decode_graphs) == [(r, k) for r in (1, 2, 4, 8) for k in (1, 2, 3, 4)]
    ids = list(range(8))
    gen = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(WINDOW // 2, 3 * WINDOW, (8,), generator=gen).tolist()
    for r, n in zip(ids, prompt_lens, strict=True):
        manager.allocate(r, n)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    inp, pos, md = _inputs(runner, manager, ids, prompts)
    hidden, _ = runner.forward(inp, pos, md)
    last = runner.last_token_indices(md)
    tokens = runner.compute_logits(hidden[last]).argmax(-1)  # [8]
    next_positions = torch.tensor(prompt_lens, device=DEVICE)
    for r, k in [(1, 1), (3, 4), (8, 4), (8, 2)]:
        inputs = _propose_inputs(r, k, inp, pos, md, hidden, tokens, next_positions)
        replays = spec.num_decode_replays
        replayed = spec.propose(inputs).draft_token_ids.clone()
        assert spec.num_decode_replays == replays + 1, (r, k)
        # Eager on the padded launch shape, from the buffers the proposal loaded (padding
        # rows at position -1: they attend to nothing).
        spec._decode(padded_size(spec.capture_sizes, r), k)
        eager = spec.draft_token_ids[:r, :k]
        assert replayed.shape == (r, k)
        assert torch.equal(replayed, eager), (r, k)
        assert ((replayed >= 0) & (replayed < VOCAB)).all()
