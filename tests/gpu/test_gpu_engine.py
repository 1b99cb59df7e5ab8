"""The engine on a GPU, on real text: the demo's trained Llama target and EAGLE-3 head
(``make demo``; the directory comes from ``SPECULA_DEMO_DIR`` or the demo cache), float32,
CUDA graphs on.

- greedy: EAGLE-3 and target-only outputs equal ``transformers``' greedy ``generate``;
- continuous batching with a small KV pool: more requests than ``max_num_seqs``, mixed
  prefill/decode steps, preemptions, every output still its greedy reference;
- changing k between steps (graphs exist for every k) keeps the greedy output;
- sampling (temperature 0.9, top-k 4, seeded): the first two tokens of 2000 requests
  follow the target's exact distribution (chi-square, alpha 0.001).

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch
from sampling_checks import exact_joint_probs, target_distribution_pvalue

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

K = 4
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def hf_target(demo):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo[0], dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def reference(hf_target, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            gen = hf_target.generate(
                ids,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(gen[0, len(p) :].tolist())
    return out


def _engine(demo, tokenizer, *, eagle3: bool = True, **kw):
    from specula.api.runtime_config import SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine

    target, head = demo
    spec = None
    if eagle3:
        spec = SpeculatorRuntimeConfig(
            method="eagle3", model=f"file://{head}", num_speculative_tokens=K
        )
    return LLMEngine(
        target,
        tokenizer,
        served_model_name="demo",
        speculator_config=spec,
        dtype="float32",
        device="cuda",
        **kw,
    )


def _greedy(n: int = MAX_TOKENS):
    from specula.runtime.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("eagle3", [True, False], ids=["eagle3", "target-only"])
def test_greedy_equals_transformers(demo, tokenizer, prompts, reference, eagle3):
    engine = _engine(demo, tokenizer, eagle3=eagle3, max_num_seqs=8)
    assert engine.generate(prompts, _greedy()) == reference
    # The steps without prefills ran as graph replays, the draft's too (counted).
    assert engine.graphs.num_replays > 0
    if eagle3:
        assert engine.speculator.num_prefill_replays > 0
        assert engine.speculator.num_decode_replays > 0
    stats = engine.spec_decoding_stats
    if eagle3:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_continuous_batching_with_preemption(demo, tokenizer, prompts, reference):
    from specula.runtime.engine.sampling_params import SamplingParams

    # 12 blocks of 16 tokens: 8 requests of up to ~70 tokens (prompt, 48 tokens, k ahead)
    # need up to 40. (24 blocks with max_model_len 256 preempted nothing with the demo
    # models of one training run: whether a pool that large runs short depends on how many
    # tokens the head's drafts add each step.)
    engine = _engine(demo, tokenizer, max_num_seqs=8, num_gpu_blocks=12, max_model_len=96)
    steps = []
    schedule = engine.scheduler.schedule

    def recording(*args):
        out = schedule(*args)
        steps.append((len(out.decode), len(out.prefill)))
        return out

    engine.scheduler.schedule = recording
    lengths = [8 + (i * 11) % (MAX_TOKENS - 7) for i in range(40)]
    load = [prompts[i % len(prompts)] for i in range(40)]
    outputs = engine.generate(load, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    assert outputs == [reference[i % len(prompts)][:n] for i, n in enumerate(lengths)]
    assert engine.scheduler.num_preemptions > 0
    assert any(d and p for d, p in steps)
    assert max(d + p for d, p in steps) <= 8
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_k_changes_between_steps(demo, tokenizer, prompts, reference):
    engine = _engine(demo, tokenizer, max_num_seqs=8)
    for request_id, prompt in enumerate(prompts):
        engine.add_request(str(request_id), prompt, _greedy())
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    ks = [1, 4, 0, 2, 3]
    step = 0
    while engine.has_unfinished_requests():
        if step % 3 == 0:
            engine.set_num_speculative_tokens(ks[(step // 3) % len(ks)])
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        step += 1
    assert [outputs[str(i)] for i in range(len(prompts))] == reference


def test_sampling_keeps_target_distribution(demo, tokenizer, prompts):
    from transformers import AutoModelForCausalLM

    from specula.runtime.engine.sampling_params import SamplingParams

    torch.manual_seed(0)
    engine = _engine(demo, tokenizer, max_num_seqs=256)
    prompt = prompts[0]
    n, temperature, top_k, length = 2000, 0.9, 4, 2
    params = [
        SamplingParams(
            max_tokens=length, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True
        )
        for s in range(n)
    ]
    outputs = engine.generate([prompt] * n, params)
    stats = engine.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    hf_cpu = AutoModelForCausalLM.from_pretrained(demo[0], dtype=torch.float32).eval()
    joint = exact_joint_probs(hf_cpu, prompt, temperature, top_k, length)
    assert target_distribution_pvalue(outputs, joint) > 0.001


@pytest.mark.parametrize("method", [None, "gemma4_mtp", "draft_model"],
                         ids=["target-only", "gemma4_mtp", "gemma4_draft_model"])
def test_gemma4_engine_in_cuda_graphs(tmp_path, method, tokenizer):
    """A tiny Gemma4 (sliding-window and KV-shared layers) alone, with its MTP assistant, or
    with itself as its draft model (its runner's argmax into the drafts) through the GPU
    engine with CUDA graphs: greedy output equals ``transformers``' on the CPU, with mixed
    steps and accepted drafts."""
    from gemma4_checkpoints import save, tiny_gemma4, tiny_gemma4_assistant
    from test_engine_paged import run_gpu_engine
    from transformers import AutoModelForCausalLM

    from specula.demo.prompts import PROMPTS

    model = tiny_gemma4(len(tokenizer), tokenizer.eos_token_id, seed=10, sliding_window=4)
    path = save(model, tokenizer, tmp_path / "gemma4")
    draft = path if method == "draft_model" else None
    if method == "gemma4_mtp":
        draft = save(tiny_gemma4_assistant(model, seed=12), tokenizer, tmp_path / "mtp")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    max_tokens = [4 + i for i in range(len(prompts))]  # prompt + output <= MAX_MODEL_LEN
    got = run_gpu_engine(
        path, draft, prompts, [{"max_tokens": n, "ignore_eos": True} for n in max_tokens],
        max_num_seqs=4, num_gpu_blocks=64, method=method or "gemma4_mtp", device="cuda",
    )
    expected = []
    for p, n in zip(prompts, max_tokens, strict=True):
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )
        expected.append(out[0, len(p) :].tolist())
    assert got["outputs"] == expected
    assert any(d and p for d, p in got["steps"])
    if method == "gemma4_mtp":
        assert 0 < got["num_accepted_tokens"] < got["num_draft_tokens"]
    elif method == "draft_model":  # the target drafting for itself: its drafts are accepted
        assert got["num_accepted_tokens"] > 0
