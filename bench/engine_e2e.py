"""End-to-end engine benchmarks on one GPU: the engine as ``specula serve`` runs it, with
requests in and tokens out, for target-only decoding and every speculator method.

Workload (the one the vLLM side measures too, ``bench/peer_vllm.py``): a
Llama-3.1-8B-shaped target in bfloat16 with random weights (``load_format: dummy``),
``max_model_len`` 2048, ``batch`` requests of 128 random prompt tokens each, 256 greedy
tokens each (``ignore_eos``), up to 16384 prompt tokens prefilled per step (vLLM's
``LLM`` default on this GPU, :data:`VLLM_MAX_NUM_BATCHED_TOKENS`). One warm-up run of the
same batch, then ``--repeats`` timed runs, whose rates are averaged (the target-only rate is
every speedup's denominator; one commit's spread by about 1 % between calls).
Decode tokens/s = the decode tokens of all requests (each one's tokens after its
first) / (the last request's last token time - the first request's first token time),
timestamps taken on the host when :meth:`LLMEngine.step` returns them.

Speculative rows use *synthetic acceptance* (vLLM's ``rejection_sample_method=
"synthetic"``): each draft token is accepted with probability 0.8 given that the ones
before it were (the engine's ``synthetic_acceptance_rate``), so random weights give a
known mean acceptance length. Methods and their drafts (all random weights):

- ``eagle3``: a 1-layer head, draft vocabulary 32000 (vLLM's and ``speculators``'
  default), aux layers ``(2, 16, 29)``, k = 4;
- ``mtp``: one MTP layer with the target's full-vocabulary head, k = 4;
- ``draft_model``: a Llama-3.2-1B-shaped draft, k = 4;
- ``dflash``: 5 Qwen3-style layers, block 8, k = 7;
- ``ngram``: no draft network and *real* verification on a copy-heavy workload (the
  prompt is a random 64-token span, the target's own 128-token greedy continuation of
  it, and the span again), k = 4. A random-weight target does not repeat that
  continuation after the second span, so at the 8B shape no draft is accepted: the row is
  the cost of looking up and verifying drafts that miss.
- ``ngram_copies``: the same with every decoder layer's output projections (``o_proj``,
  ``down_proj``) zeroed after loading (:func:`zero_layer_outputs`). The residual stream
  is then the last token's embedding, the greedy output a function of the last token,
  and the output after the second span really repeats the prompt's continuation: its
  first 128 tokens can be found by the lookup and accepted by real verification, the rest
  are new. Each step streams the same weights as the dense target's (its attention reads
  the longer prompt's keys: up to 512 positions against 384).

``engine_vs_runner`` divides the engine's decode tokens/s by the target runner's: its
CUDA graph replayed back to back at the batch size, each replay followed by the LM head
and the argmax (batch / step time). That is the model runner's decode step as
``bench/engine.py`` times it, whose figures are the "runner only" column of the engine
issue's table. ``engine_vs_graph_only`` divides by the graph alone, without the LM head
and argmax (which run outside the graph).

Phase ``ksweep`` times ``--sweep-methods`` at batch 1 for every k of ``--sweep-k``, or of a
method's own ``name:k1+k2`` (one engine per method, started at the largest k and moved with
:meth:`LLMEngine.set_num_speculative_tokens`, as the operator's tuner moves it), and
reports each method's speedup at the k that gave the most decode tokens/s at the expected
acceptance length (``speedup_by_method_best_k``: ``speedup`` at that length, ``by_k`` as
measured) beside its speedup at every k. With ``--paired`` a target-only engine stays
loaded beside the method's and runs alternate with the method's, each k's speedup taken
against its own target-only runs (:func:`k_sweep`).

Run on the GPU machine::

    PYTHONPATH=. python3 bench/engine_e2e.py [--phases target,methods,ksweep]
        [--batches 1,8,32,128] [--methods eagle3,...] [--sweep-k 3,4,5,6] [--paired]
        [--output FILE] [--target gemma4]

``--target gemma4`` runs the target-only and methods phases on a Gemma-4-E2B-shaped
target (``bench/gemma4_kv.py``'s text config: sliding and full layers, KV sharing,
per-layer inputs, 262144-token vocabulary) with ``gemma4_mtp`` and ``eagle3``
(:func:`write_gemma4_checkpoints`), k = 4, and merges under ``e2e_gemma4``.

Merges into ``bench/results/engine.json`` under ``e2e`` (with command, GPU, versions,
date) and prints a table. ``--dry-run`` runs tiny shapes on the CPU to check plumbing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

DEFAULT_OUTPUT = HERE / "results" / "engine.json"

VLLM_MAX_NUM_BATCHED_TOKENS = 16384
"""Prompt tokens prefilled per step, as vLLM 0.26's ``LLM`` class sets it by default on a
GPU of 70 GiB or more (``EngineArgs._set_default_args``): a whole batch of 128 prompts
of 128 tokens then prefills in one step on both sides."""

ACCEPTANCE = 0.8
"""The synthetic per-position acceptance rate of every speculative row."""

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, hidden_act="silu", attention_bias=False,
    mlp_bias=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001,
)
LLAMA_1B = dict(
    LLAMA_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    rope_scaling=dict(LLAMA_8B["rope_scaling"], factor=32.0),
)
"""Llama-3.2-1B's shape (its ``config.json``: 64-wide heads, ``qkv_proj`` 3072 x 2048)."""
TINY = dict(
    LLAMA_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
)
TINY_DRAFT = dict(TINY, num_hidden_layers=1)


def write_checkpoints(root: Path, target: dict, draft: dict) -> dict[str, Path]:
    """Config-only checkpoint directories (``load_format: dummy``) for the target and
    every method's draft."""
    dirs = {}

    def save(name: str, config: dict) -> None:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config))
        dirs[name] = root / name

    save("target", target)
    save("draft_model", draft)
    layer = {k: v for k, v in target.items() if k not in ("architectures", "torch_dtype")}
    layer["num_hidden_layers"] = 1
    n = target["num_hidden_layers"]
    save("eagle3", {
        "speculators_model_type": "eagle3", "transformer_layer_config": layer,
        "draft_vocab_size": min(32000, target["vocab_size"]),
        "eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3],
    })
    save("mtp", {"speculators_model_type": "mtp", "transformer_layer_config": layer})
    qwen3 = dict(layer, model_type="qwen3", num_hidden_layers=5 if n > 4 else 1,
                 head_dim=target["hidden_size"] // target["num_attention_heads"])
    save("dflash", {
        "speculators_model_type": "dflash", "transformer_layer_config": qwen3,
        "block_size": 8, "mask_token_id": target["vocab_size"] - 1,
        "aux_hidden_state_layer_ids": [1, n // 2, n - 1],
    })
    return dirs


TINY_GEMMA4 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    attention_k_eq_v=False, sliding_window=64, num_kv_shared_layers=2,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=512, use_double_wide_mlp=True,
    max_position_embeddings=4096, final_logit_softcapping=30.0,
)
"""A tiny Gemma4 text config with every feature of the real ones (the CPU dry run)."""

GEMMA4_METHODS = {"gemma4_mtp": 4, "eagle3": 4}


def write_gemma4_checkpoints(root: Path, text: dict) -> dict[str, Path]:
    """Config-only checkpoints of a Gemma4 target of ``text`` (a ``Gemma4TextConfig``'s
    fields), its ``gemma4_assistant`` draft (``gemma4_mtp``: 4 KV-shared layers, three
    sliding and one full, of the target's width and head shapes, reading the target's KV)
    and a 1-layer EAGLE-3 head (Llama-style layer of the target's width, draft vocabulary
    32000, auxiliary states of layers 2, L/2 and L-3)."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig

    dirs = {name: root / name for name in ("target", "gemma4_mtp", "eagle3")}
    Gemma4TextConfig(
        **text, architectures=["Gemma4ForCausalLM"], bos_token_id=2, eos_token_id=1,
        pad_token_id=0, torch_dtype="bfloat16",
    ).save_pretrained(dirs["target"])
    n, hidden = text["num_hidden_layers"], text["hidden_size"]
    assistant = dict(
        text, num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        num_kv_shared_layers=4, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        use_double_wide_mlp=False,
    )
    Gemma4AssistantConfig(
        text_config=assistant, backbone_hidden_size=hidden, architectures=["Gemma4AssistantForCausalLM"],
        torch_dtype="bfloat16",
    ).save_pretrained(dirs["gemma4_mtp"])
    heads = max(text["num_attention_heads"], hidden // 128)
    layer = dict(
        LLAMA_8B, vocab_size=text["vocab_size"], hidden_size=hidden,
        intermediate_size=text["intermediate_size"], num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads,
        max_position_embeddings=text["max_position_embeddings"],
    )
    for key in ("architectures", "torch_dtype", "rope_scaling"):
        layer.pop(key)
    dirs["eagle3"].mkdir(parents=True, exist_ok=True)
    (dirs["eagle3"] / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": layer,
        "draft_vocab_size": min(32000, text["vocab_size"]),
        "eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3],
    }))
    return dirs


def make_engine(
    dirs, method: str | None, k: int, batches: tuple[int, ...], device: str, synthetic,
    max_num_batched_tokens: int | None = None, **engine_kw,
):
    from specula.api.runtime_config import SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine

    max_num_seqs = max(batches)
    cuda = str(device).startswith("cuda")  # "cuda" or a rank's "cuda:<i>"
    if max_num_batched_tokens is None and cuda:
        max_num_batched_tokens = VLLM_MAX_NUM_BATCHED_TOKENS
    # Graphs for the batch sizes measured only: capture time, not speed, depends on it.
    capture_sizes = list(batches) if cuda else None
    spec = None
    if method is not None:
        model = None if method == "ngram" else f"file://{dirs[method]}"
        spec = SpeculatorRuntimeConfig(method=method, model=model, num_speculative_tokens=k)
    return LLMEngine(
        dirs["target"],
        None,
        served_model_name="bench",
        speculator_config=spec,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        device=device,
        load_format="dummy",
        synthetic_acceptance_rate=synthetic if method not in (None, "ngram") else None,
        cudagraph_capture_sizes=capture_sizes,
        max_num_batched_tokens=max_num_batched_tokens,
        **engine_kw,
    )


def timed_run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Serve ``prompts`` to ``max_tokens`` each; decode tokens/s as the module says."""
    from specula.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    stats = engine.spec_decoding_stats
    drafts_before, accepted_before = stats.num_drafts, stats.num_accepted_tokens
    tag = f"t{time.perf_counter_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
    elapsed = time.perf_counter() - start
    decode_tokens = sum(n - 1 for n in count.values())
    window = max(last.values()) - min(first.values())
    drafts = stats.num_drafts - drafts_before
    accepted = stats.num_accepted_tokens - accepted_before
    return {
        "decode_tokens_per_s": round(decode_tokens / window, 1),
        "end_to_end_s": round(elapsed, 3),
        "steps": steps,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
    }


def with_expected_acceptance(row: dict, k: int) -> dict:
    """``row`` (a :func:`mean_of_runs` of synthetic acceptance at ``k``) with the rate at
    the expected acceptance length, ``(1 - a^(k+1)) / (1 - a)``: the step time measured,
    the tokens per step taken as expected. The draws move a 256-token run's mean
    acceptance length by several percent (the best of several k or runs is the luckiest)."""
    expected = (1 - ACCEPTANCE ** (k + 1)) / (1 - ACCEPTANCE)
    row["expected_acceptance_length"] = round(expected, 3)
    row["decode_tokens_per_s_at_expected_acceptance"] = round(
        row["decode_tokens_per_s"] * expected / row["mean_acceptance_length"], 1
    )
    return row


def mean_of_runs(runs: list[dict]) -> dict:
    """:func:`timed_run`'s figures averaged over ``runs`` (each run's rate kept)."""
    mean = {key: round(sum(r[key] for r in runs) / len(runs), 3)
            for key in ("decode_tokens_per_s", "end_to_end_s", "steps", "mean_acceptance_length")
            if all(r[key] is not None for r in runs)}
    return mean | {"runs": [r["decode_tokens_per_s"] for r in runs]}


def runner_tokens_per_s(engine, batch: int, reps: int = 50, with_logits: bool = False) -> float:
    """The target's decode graph at ``batch`` replayed back to back: batch / step time.
    ``with_logits``: each replay followed by the LM head and the argmax over its rows
    (the rest of a decode step's unavoidable device work, outside the graph)."""
    import torch

    graphs = engine.graphs
    d = graphs.descriptor_for(batch, 1)
    graph = graphs.graphs[d]
    hidden = graphs.states[d].hidden_states[:batch]

    def one() -> None:
        graph.replay()
        if with_logits:
            engine.runner.compute_logits(hidden).argmax(dim=-1)

    for _ in range(5):
        one()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        one()
    end.record()
    torch.cuda.synchronize()
    return batch / (start.elapsed_time(end) / 1e3 / reps)


def random_prompts(batch: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=gen).tolist()


def release_memory() -> None:
    """Return the memory of engines no longer referenced (call after ``del engine``)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args) -> dict:
    device = "cpu" if args.dry_run else "cuda"
    max_tokens = 16 if args.dry_run else 256
    batches = (1, 2) if args.dry_run else tuple(int(b) for b in args.batches.split(","))
    root = Path(tempfile.mkdtemp())
    if args.target == "gemma4":
        from bench.gemma4_kv import GEMMA4_E2B_TEXT

        text = TINY_GEMMA4 if args.dry_run else GEMMA4_E2B_TEXT
        vocab = text["vocab_size"]
        dirs = write_gemma4_checkpoints(root, text)
        methods = GEMMA4_METHODS
    else:
        target = TINY if args.dry_run else LLAMA_8B
        vocab = target["vocab_size"]
        dirs = write_checkpoints(root, target, TINY_DRAFT if args.dry_run else LLAMA_1B)
        methods = {"eagle3": 4, "mtp": 4, "draft_model": 4, "dflash": 7, "ngram": 4,
                   "ngram_copies": 4}
    out: dict = {}
    if "target" in args.phases:
        engine = make_engine(dirs, None, 0, batches, device, None)
        rows = {}
        for b in batches:
            prompts = random_prompts(b, vocab, 128, seed=b)
            timed_run(engine, prompts, max_tokens)  # warm-up
            rows[f"bs{b}"] = mean_of_runs(
                [timed_run(engine, prompts, max_tokens) for _ in range(args.repeats)])
            if device == "cuda":
                rows[f"bs{b}"]["runner_tokens_per_s"] = round(runner_tokens_per_s(engine, b), 1)
                rows[f"bs{b}"]["runner_with_logits_tokens_per_s"] = round(
                    runner_tokens_per_s(engine, b, with_logits=True), 1
                )
            print(f"target-only bs{b}: {rows[f'bs{b}']}", flush=True)
        out["target_only"] = rows
        del engine
        release_memory()
    if "methods" in args.phases:
        rows = {}
        for method, k in methods.items():
            if args.methods and method not in args.methods:
                continue
            bs = (1, 32) if not args.dry_run else (1, 2)
            copies = method == "ngram_copies"
            engine = make_engine(dirs, "ngram" if copies else method, k, bs, device, ACCEPTANCE)
            if copies:
                zero_layer_outputs(engine)
            rows[method] = {"num_speculative_tokens": k}
            for b in bs:
                if method.startswith("ngram"):
                    prompts = copy_heavy_prompts(engine, b, vocab, max_tokens)
                else:
                    prompts = random_prompts(b, vocab, 128, seed=b)
                timed_run(engine, prompts, max_tokens)
                # Synthetic acceptance draws move one run's mean acceptance length by ~5 %
                # at batch 1: the mean of several runs (each with fresh draws).
                runs = [timed_run(engine, prompts, max_tokens) for _ in range(args.repeats)]
                row = mean_of_runs(runs)
                synthetic = engine.synthetic_acceptance_rate is not None  # ngram verifies for real
                rows[method][f"bs{b}"] = with_expected_acceptance(row, k) if synthetic else row
                print(f"{method} bs{b}: {rows[method][f'bs{b}']}", flush=True)
            del engine
            release_memory()
        out["methods"] = rows
    if "ksweep" in args.phases:
        out["k_sweep"] = k_sweep(args, dirs, device, vocab, max_tokens)
    return out


PAIRED_NUM_GPU_BLOCKS = 1024
"""KV blocks of each engine with ``--paired`` (16384 tokens): two 8B engines fit on one GPU."""


def sweep_plan(methods: str, sweep_k: str) -> dict[str, list[int]]:
    """``--sweep-methods`` and ``--sweep-k`` as ``{method: sorted k values}``. A method
    written ``name:k`` or ``name:k1+k2`` takes its own k values instead of ``--sweep-k``
    (``dflash:7``: the block-8 draft's one k). Raises ``ValueError`` on a k that is not a
    positive integer or a method named twice."""
    plan = {}
    for item in filter(None, methods.split(",")):
        name, sep, own = item.partition(":")
        try:
            ks = sorted({int(k) for k in (own.split("+") if sep else sweep_k.split(","))})
        except ValueError:
            ks = [0]
        if ks[0] < 1 or name in plan:
            raise ValueError(f"--sweep-methods {item!r}: k values must be positive integers "
                             f"(--sweep-k {sweep_k!r}) and each method named once")
        plan[name] = ks
    return plan


def k_sweep(args, dirs, device: str, vocab: int, max_tokens: int) -> dict:
    """Batch-1 decode tokens/s of each ``--sweep-methods`` method at every k of
    ``--sweep-k`` or its own ``name:k1+k2`` (mean of ``--repeats`` timed runs after a
    warm-up run at that k).

    With ``--paired``, a target-only engine stays loaded beside each method's engine (both
    with :data:`PAIRED_NUM_GPU_BLOCKS`) and each timed run of the method follows one of the
    target alone on the same prompt: the row's ``target_only`` is the mean of those, its
    speedup's denominator, so both sides see the same GPU. (Unpaired, the target-only phase
    runs first; the same graph was measured 1.4 % slower a minute into a call than at its
    start, on an H100, which lowers every unpaired speedup.)"""
    sizes = (1,) if device == "cuda" else (1, 2)  # (the CPU dry run's KV cache: as the methods phase's)
    blocks = {"num_gpu_blocks": PAIRED_NUM_GPU_BLOCKS} if args.paired else {}
    base = make_engine(dirs, None, 0, sizes, device, None, **blocks) if args.paired else None
    rows: dict = {}
    for method, ks in args.sweep_plan.items():
        engine = make_engine(dirs, method, ks[-1], sizes, device, ACCEPTANCE, **blocks)
        prompts = random_prompts(1, vocab, 128, seed=1)
        rows[method] = {}
        for k in ks:
            engine.set_num_speculative_tokens(k)
            runs, base_runs = [], []
            for _ in range(args.repeats + 1):  # the first of each: a warm-up
                if base is not None:
                    base_runs.append(timed_run(base, prompts, max_tokens))
                runs.append(timed_run(engine, prompts, max_tokens))
            row = with_expected_acceptance(mean_of_runs(runs[1:]), k)
            if base is not None:
                row["target_only"] = mean_of_runs(base_runs[1:])
            rows[method][f"k{k}"] = row
            print(f"{method} k={k} bs1: {row}", flush=True)
        del engine
        release_memory()
    return rows


def zero_layer_outputs(engine) -> None:
    """Zero ``engine``'s target decoder layers' ``o_proj`` and ``down_proj`` weights in
    place (the captured CUDA graphs read the same tensors). Raises ``RuntimeError`` if there
    are none (a model whose names differ)."""
    import torch

    names = ("o_proj.weight", "down_proj.weight")
    zeroed = 0
    with torch.no_grad():
        for name, param in engine.runner.model.named_parameters():
            if name.endswith(names):
                param.zero_()
                zeroed += 1
    if not zeroed:
        raise RuntimeError("no o_proj or down_proj weights in the target")


def copy_heavy_prompts(engine, batch: int, vocab: int, max_tokens: int) -> list[list[int]]:
    """A random 64-token span, the target's greedy continuation of it (128 tokens,
    with speculation off), and the span again, per request."""
    from specula.runtime.engine.sampling_params import SamplingParams

    spans = random_prompts(batch, vocab, 64, seed=1000 + batch)
    k = engine.num_speculative_tokens
    engine.set_num_speculative_tokens(0)
    continuations = engine.generate(spans, SamplingParams(max_tokens=128, ignore_eos=True))
    engine.set_num_speculative_tokens(k)
    return [s + c + s for s, c in zip(spans, continuations, strict=True)]


def summarize(results: dict, peer: dict | None) -> dict:
    """The keys the issue asks for: ``speedup_by_method`` (batch 1 and 32 against
    target-only; at batch 1 also at the expected acceptance length), ``engine_vs_runner``,
    ``vs_vllm`` (when the peer's figures exist); also
    ``speedup_by_method_best_k`` (phase ``ksweep``) and ``engine_vs_graph_only``."""
    target = results.get("target_only", {})
    summary: dict = {}
    if target and "methods" in results:
        summary["speedup_by_method"] = {
            m: round(r["bs1"]["decode_tokens_per_s"] / target["bs1"]["decode_tokens_per_s"], 3)
            for m, r in results["methods"].items()
        }
        summary["speedup_by_method_at_expected_acceptance"] = {
            m: round(r["bs1"]["decode_tokens_per_s_at_expected_acceptance"]
                     / target["bs1"]["decode_tokens_per_s"], 3)
            for m, r in results["methods"].items() if "bs1" in r
            and "decode_tokens_per_s_at_expected_acceptance" in r["bs1"]
        }
        summary["speedup_by_method_bs32"] = {
            m: round(r["bs32"]["decode_tokens_per_s"] / target["bs32"]["decode_tokens_per_s"], 3)
            for m, r in results["methods"].items() if "bs32" in r and "bs32" in target
        }
    if "k_sweep" in results and (target.get("bs1") or all(
            "target_only" in r for by_k in results["k_sweep"].values() for r in by_k.values())):
        target_bs1 = target.get("bs1", {}).get("decode_tokens_per_s")
        best = {}
        for m, by_k in results["k_sweep"].items():
            # --paired: each k's own target-only runs, interleaved with its runs
            base = {k: r.get("target_only", {}).get("decode_tokens_per_s", target_bs1)
                    for k, r in by_k.items()}
            speedups = {int(k[1:]): round(r["decode_tokens_per_s"] / base[k], 3)
                        for k, r in by_k.items()}
            expected = {int(k[1:]): round(r["decode_tokens_per_s_at_expected_acceptance"] / base[k], 3)
                        for k, r in by_k.items()}
            k = max(expected, key=expected.get)  # the draws' luck left out
            best[m] = {"k": k, "speedup": expected[k], "by_k": speedups,
                       "by_k_at_expected_acceptance": expected,
                       "paired": all("target_only" in r for r in by_k.values())}
        summary["speedup_by_method_best_k"] = best
    for key, runner in (("engine_vs_runner", "runner_with_logits_tokens_per_s"),
                        ("engine_vs_graph_only", "runner_tokens_per_s")):
        if target and all(runner in target.get(b, {}) for b in ("bs1", "bs32")):
            summary[key] = {
                b: round(target[b]["decode_tokens_per_s"] / target[b][runner], 3)
                for b in ("bs1", "bs32")
            }
    if peer:
        ratios = {}
        for b in ("bs1", "bs8", "bs32", "bs128"):
            if b in target and b in peer.get("target_only", {}):
                ratios[b] = round(
                    target[b]["decode_tokens_per_s"]
                    / peer["target_only"][b]["decode_tokens_per_s"], 3
                )
        ours = results.get("methods", {}).get("eagle3", {})
        for b in ("bs1", "bs32"):
            if b in ours and b in peer.get("eagle3", {}):
                ratios[f"eagle3_{b}"] = round(
                    ours[b]["decode_tokens_per_s"] / peer["eagle3"][b]["decode_tokens_per_s"], 3
                )
        summary["vs_vllm"] = ratios
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", default="target,methods")
    parser.add_argument("--methods", default="", help="comma-separated subset")
    parser.add_argument("--batches", default="1,8,32,128", help="target-only batch sizes")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--peer", type=Path, default=None, help="peer_vllm.py's JSON")
    parser.add_argument("--repeats", type=int, default=6, help="timed runs per row")
    parser.add_argument("--sweep-k", default="3,4,5,6", help="phase ksweep: the k values")
    parser.add_argument("--sweep-methods", default="eagle3,mtp,draft_model",
                        help="phase ksweep: the methods; name:k1+k2 gives one its own k values")
    parser.add_argument("--paired", action="store_true",
                        help="phase ksweep: time a target-only engine between the method's runs")
    parser.add_argument("--target", choices=("llama", "gemma4"), default="llama",
                        help="gemma4: a Gemma-4-E2B-shaped target with gemma4_mtp and eagle3 "
                             "(figures under e2e_gemma4)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.phases = args.phases.split(",")
    args.methods = [m for m in args.methods.split(",") if m]
    args.sweep_plan = sweep_plan(args.sweep_methods, args.sweep_k)  # a typo fails before any phase
    import torch

    from bench.engine import recorded_command

    results = run(args)
    peer = json.loads(args.peer.read_text()) if args.peer and args.peer.is_file() else None
    record = {
        "command": recorded_command("bench/engine_e2e.py", argv or sys.argv[1:]),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.node(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **results,
        **summarize(results, peer),
    }
    if peer:
        record["vllm"] = peer
    print(json.dumps(summarize(results, peer), indent=1))
    if args.dry_run:
        return 0
    data = json.loads(args.output.read_text()) if args.output.is_file() else {}
    data.setdefault("e2e_gemma4" if args.target == "gemma4" else "e2e", {}).update(record)
    args.output.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
