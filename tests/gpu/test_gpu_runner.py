"""The paged GPU model runner in bfloat16 on CUDA, against Hugging Face ``transformers``,
and its CUDA graphs against its eager forward.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu``.

Logits: a varlen prefill of two requests, greedy decode steps and a (k + 1)-token
verification step, every computed position compared with ``transformers``' float32
forward over the whole sequence. The bound is relative to ``transformers``' own
bfloat16 error on the same positions (ours within twice theirs plus 0.05): bfloat16
rounding, not a fixed number, sets the scale.

Graphs: decode batches of 1, 3 (padded to the captured 4) and 8 requests, and a
verification batch of 3 requests x 4 tokens, replayed and run eagerly on the same
cache state; hidden states within 3e-2 (cuBLAS and the attention split count may
differ between a padded and an unpadded shape). A batch larger than every captured
size runs eagerly.
"""

from __future__ import annotations

import pytest
import torch
from paged_schedule import metadata_from_block_manager

from specula.runtime.models.registry import load_model
from specula.runtime.worker.cudagraph import CUDAGraphManager, cudagraph_capture_sizes
from specula.runtime.worker.model_runner import ModelRunner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
PROMPTS = ([5, 17, 42, 7, 99] * 5, [3, 1, 4, 1, 5, 9, 2] * 3)
DECODE_STEPS = 4
DRAFTS = ([11, 12, 13], [21, 22, 23])


def _save_tiny(tmp_path_factory, arch: str):
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
        rms_norm_eps=1e-6,
        initializer_range=0.05,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**common, head_dim=128, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(config)
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return _save_tiny(tmp_path_factory, request.param)


def _runner(checkpoint, num_blocks: int = 64):
    model = load_model(checkpoint, torch.bfloat16, DEVICE)
    spec = KVCacheSpec.from_model_config(model.config, torch.bfloat16, BLOCK_SIZE)
    cache = PagedKVCache(spec, num_blocks, DEVICE)
    return ModelRunner(model, cache, MAX_MODEL_LEN), cache.block_manager(watermark=0.0)


def _forward(runner, manager, ids, query_lens, new_tokens):
    metadata, positions = metadata_from_block_manager(
        manager, ids, query_lens, runner.max_blocks_per_req, DEVICE
    )
    input_ids = torch.tensor([t for toks in new_tokens for t in toks], device=DEVICE)
    return metadata, positions, input_ids


def test_logits_match_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    runner, manager = _runner(checkpoint)
    ids = [0, 1]
    manager.allocate("warm", 40)  # freed below: later requests get scattered blocks
    manager.allocate(0, len(PROMPTS[0]))
    manager.free("warm")
    manager.allocate(1, len(PROMPTS[1]))
    tokens = [list(p) for p in PROMPTS]
    logits: list[dict] = [{}, {}]

    def run(query_lens, new_tokens):
        md, pos, inp = _forward(runner, manager, ids, query_lens, new_tokens)
        hidden, _ = runner.forward(inp, pos, md)
        return md, runner.compute_logits(hidden)

    md, out = run([len(p) for p in PROMPTS], tokens)
    last = runner.last_token_indices(md)
    for r in ids:
        logits[r][len(tokens[r]) - 1] = out[last[r]]
    for _ in range(DECODE_STEPS):
        nxt = [int(logits[r][len(tokens[r]) - 1].argmax()) for r in ids]
        for r in ids:
            manager.append_slots(r, 1)
        _, out = run([1, 1], [[t] for t in nxt])
        for r in ids:
            tokens[r].append(nxt[r])
            logits[r][len(tokens[r]) - 1] = out[r]
    verify = [[int(logits[r][len(tokens[r]) - 1].argmax()), *DRAFTS[r]] for r in ids]
    for r in ids:
        manager.append_slots(r, 4)
    _, out = run([4, 4], verify)
    for r in ids:
        for j, t in enumerate(verify[r]):
            tokens[r].append(t)
            logits[r][len(tokens[r]) - 1] = out[4 * r + j]

    hf32 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE)
    hf16 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(DEVICE)
    for toks, rows in zip(tokens, logits, strict=True):
        positions = sorted(rows)
        batch = torch.tensor([toks], device=DEVICE)
        with torch.no_grad():
            ref = hf32(batch).logits[0, positions].float()
            hf_err = (hf16(batch).logits[0, positions].float() - ref).abs().max().item()
        ours = torch.stack([rows[p] for p in positions])
        err = (ours - ref).abs().max().item()
        assert err <= 2 * hf_err + 0.05, (err, hf_err)


def test_cudagraph_capture_sizes():
    assert cudagraph_capture_sizes(1) == [1]
    assert cudagraph_capture_sizes(8) == [1, 2, 4, 8]
    assert cudagraph_capture_sizes(36) == [1, 2, 4, 8, 16, 24, 32, 36]


@pytest.mark.parametrize("num_reqs, q_len", [(1, 1), (3, 1), (8, 1), (3, 4), (9, 1)])
def test_cudagraph_replay_matches_eager(checkpoint, num_reqs, q_len):
    runner, manager = _runner(checkpoint, num_blocks=128)
    graphs = CUDAGraphManager(runner, max_num_reqs=8, uniform_query_lens=(1, 4))
    states = graphs.capture()
    assert len(states) == len(graphs.descriptors()) == 8
    ids = list(range(num_reqs))
    gen = torch.Generator().manual_seed(num_reqs)
    prompt_lens = torch.randint(3, 40, (num_reqs,), generator=gen).tolist()
    for r, n in zip(ids, prompt_lens, strict=True):
        manager.allocate(r, n)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in prompt_lens]
    md, pos, inp = _forward(runner, manager, ids, prompt_lens, prompts)
    runner.forward(inp, pos, md)
    for step in range(3):
        for r in ids:
            manager.append_slots(r, q_len)
        new = torch.randint(0, 512, (num_reqs, q_len), generator=gen).tolist()
        md, pos, inp = _forward(runner, manager, ids, [q_len] * num_reqs, new)
        descriptor = graphs.descriptor_for(num_reqs, q_len)
        if num_reqs > 8:
            assert descriptor is None
        else:
            assert descriptor is not None and descriptor.num_reqs >= num_reqs
            assert descriptor.num_tokens == descriptor.num_reqs * q_len
        eager, _ = runner.forward(inp, pos, md)
        eager = eager.clone()
        replayed, _, ran = graphs.run(inp, pos, md)
        assert ran == descriptor
        replayed = replayed.clone()
        assert replayed.shape == eager.shape == (num_reqs * q_len, runner.config.hidden_size)
        assert torch.isfinite(replayed).all()
        torch.testing.assert_close(replayed, eager, atol=3e-2, rtol=3e-2, msg=f"step {step}")


def _two_llama8b_layers(path):
    """Two Llama-3.1-8B-shaped layers and its LM head in bfloat16, random weights."""
    import json

    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=MAX_MODEL_LEN,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    return load_model(path, torch.bfloat16, DEVICE, load_format="dummy")


@pytest.mark.parametrize("num_reqs", [1, 32])
def test_gemv_epilogues_match_the_unfused_kernels(tmp_path, monkeypatch, num_reqs):
    """Two Llama-3.1-8B-shaped layers and its LM head (random weights), the shapes the
    GEMV's SwiGLU and argmax epilogues serve: a decode step with them on and off."""

    from specula.runtime.kernels.activation import silu_and_mul
    from specula.runtime.kernels.gemv import linear
    from specula.runtime.worker import model_runner

    model = _two_llama8b_layers(tmp_path)
    spec = KVCacheSpec.from_model_config(model.config, torch.bfloat16, BLOCK_SIZE)
    cache = PagedKVCache(spec, 4 * num_reqs, DEVICE)
    # Norms unfolded: the patched functions below are the unfolded path's.
    runner = ModelRunner(model, cache, MAX_MODEL_LEN, fold=False)
    manager = cache.block_manager(watermark=0.0)
    ids = list(range(num_reqs))
    for r in ids:
        manager.allocate(r, 20)
    prompts = torch.randint(0, 128256, (num_reqs, 20)).tolist()
    md, pos, inp = _forward(runner, manager, ids, [20] * num_reqs, prompts)
    runner.forward(inp, pos, md)
    for r in ids:
        manager.append_slots(r, 1)
    md, pos, inp = _forward(runner, manager, ids, [1] * num_reqs, [[7]] * num_reqs)
    results = {}
    for on in (True, False):
        hidden, _ = runner.forward(inp, pos, md)
        results[on] = (hidden.clone(), *runner.logits_and_argmax(hidden))
        # Unfused: the GEMV, then the activation kernel; the logits, then torch.argmax.
        monkeypatch.setattr(
            model_runner, "linear_silu_and_mul", lambda x, w, b: silu_and_mul(linear(x, w, b))
        )
        monkeypatch.setattr(
            model_runner, "linear_argmax",
            lambda x, w, into=None: (y := linear(x, w), y.float().argmax(-1)),
        )
    (h_off, logits_off, idx_off), (h_on, logits_on, idx_on) = results[False], results[True]
    torch.testing.assert_close(h_on, h_off, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(logits_on.float(), logits_off.float(), atol=5e-2, rtol=3e-2)
    assert torch.equal(idx_on, logits_on.argmax(-1))  # exact on the same logits
    assert torch.equal(idx_off, logits_off.float().argmax(-1))
    # Across the two paths only a near-tie (the hidden states may differ by rounding)
    # may pick another token, and then one within rounding of the maximum.
    best = logits_on.float().max(-1).values
    assert bool((logits_on.float().gather(1, idx_off[:, None])[:, 0] >= best - 0.1).all())


@pytest.mark.parametrize("num_reqs", [1, 5, 32])
def test_folded_norms_match_the_norm_kernels(tmp_path, num_reqs):
    """Two Llama-3.1-8B-shaped layers (random weights) with their norms folded into
    ``qkv_proj`` and ``gate_up_proj``, against a copy run with the norm kernels: a prefill
    (library GEMM and unit-weight norms) and a decode step (the GEMV's residual and 1/rms
    epilogues), hidden states and the captured residual streams."""
    import copy

    model = _two_llama8b_layers(tmp_path)
    with torch.no_grad():  # norm weights other than 1, or folding them changes nothing
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_(1.0, 0.2)
            layer.post_attention_layernorm.weight.normal_(1.0, 0.2)
    unfolded = copy.deepcopy(model)
    spec = KVCacheSpec.from_model_config(model.config, torch.bfloat16, BLOCK_SIZE)
    outputs = []
    for m, fold in ((model, True), (unfolded, False)):
        cache = PagedKVCache(spec, 4 * num_reqs, DEVICE)
        runner, manager = ModelRunner(m, cache, MAX_MODEL_LEN, fold=fold), cache.block_manager(watermark=0.0)
        assert runner.norms_folded == fold and getattr(m, "norms_folded", False) == fold
        ids = list(range(num_reqs))
        for r in ids:
            manager.allocate(r, 20)
        prompts = torch.randint(0, 128256, (num_reqs, 20), generator=torch.Generator().manual_seed(1))
        md, pos, inp = _forward(runner, manager, ids, [20] * num_reqs, prompts.tolist())
        prefill, _ = runner.forward(inp, pos, md)
        for r in ids:
            manager.append_slots(r, 1)
        md, pos, inp = _forward(runner, manager, ids, [1] * num_reqs, [[7]] * num_reqs)
        decode, aux = runner.forward(inp, pos, md, aux_layer_ids=(0, 1, 2))
        outputs.append((prefill, decode, aux))
    for got, want in zip(*outputs, strict=True):
        # Rounding moves with the norm weight: it multiplies the weights once (folded) or
        # each normed activation (unfolded).
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2
    # A runner built later on the folded model knows, whatever it is asked.
    cache = PagedKVCache(spec, 4, DEVICE)
    assert ModelRunner(model, cache, MAX_MODEL_LEN, fold=False).norms_folded


def test_release_graphs_frees_every_live_captured_graph(monkeypatch):
    """A tensor-parallel rank frees its graphs before leaving the group (NCCL cannot
    destroy a communicator that a live graph captured): every graph
    :func:`capture_graph` made and still referenced is reset, and a graph already
    collected is no longer tracked. (Tracked in a registry of this test's own, so the
    graphs of other tests' fixtures stay live.)"""
    import weakref

    from specula.runtime.worker import cudagraph

    monkeypatch.setattr(cudagraph, "_captured", weakref.WeakSet())
    x = torch.ones(8, device=DEVICE)
    kept = [cudagraph.capture_graph(lambda: x.mul_(2), None) for _ in range(2)]
    dropped = weakref.ref(cudagraph.capture_graph(lambda: x.add_(1), None))
    assert dropped() is None
    assert set(cudagraph._captured) == set(kept)
    before = x.clone()
    kept[0].replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before * 2)
    cudagraph.release_graphs()
    assert len(cudagraph._captured) == 0
    for graph in kept:
        with pytest.raises(RuntimeError):
            graph.replay()
