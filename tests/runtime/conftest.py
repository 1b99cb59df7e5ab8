"""Shared fixtures for the runtime tier: tiny random checkpoints that ``transformers``
saves (``config.json``, ``model.safetensors``, tokenizer files), built once per test run.

Fixtures (all session-scoped, each a ``pathlib.Path`` to a checkpoint directory that
also holds the tokenizer):

- ``tiny_llama_target``: Llama, 3 layers, GQA (4 query / 2 kv heads), untied lm_head.
- ``tiny_llama_draft``: Llama, 1 layer, same vocabulary; the target's embeddings, first
  layer and head with noise added, so it agrees with the target often but not always.
- ``tiny_qwen3_target``: Qwen3, 2 layers, explicit ``head_dim`` 32 != hidden/heads,
  tied embeddings.
- ``tiny_qwen3_draft``: Qwen3, 1 layer, derived from the Qwen3 target like the Llama one.
- ``tiny_tokenizer``: the byte-level BPE ``PreTrainedTokenizerFast`` saved in each
  checkpoint (eos ``<|endoftext|>``); ``TINY_VOCAB_SIZE`` is the models' vocab size.

Also: ``hf_model(path)`` loads a checkpoint with ``transformers.AutoModelForCausalLM``
in float32 (cached per path); ``make_engine(target, draft=None, k=3, max_num_seqs=8,
**runtime_config_fields)`` builds an ``LLMEngine`` through ``from_config`` (float32,
``draft_model`` speculator when ``draft`` is given); ``chi_square(counts, probs)`` is
:func:`chi_square_pvalue`; ``sampled_pvalue(engine, hf, prompt, num_samples)`` samples
with ``engine`` and checks against ``hf``'s exact distribution; ``greedy_rounds(engine,
prompts, expected, params, ks)`` checks greedy output for each k. Torch runs single-threaded in this tier.

``interpreted(fn, *args, **kwargs)`` runs a module-level function in a worker process
whose Triton kernels run in the interpreter (for the GPU path's code on the CPU):

Run the Triton kernels on the CPU, in Triton's interpreter, isolated from this process.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is defined, that is when
``triton.language`` (whose ``tl.sum``, ``tl.max``, ... are jit functions too) and the
kernel modules are imported, not when a kernel is launched. Setting it here would come
too late if another test file imported triton first, and would switch every later
import in this process to the interpreter. So the kernel checks run in one worker
process started (spawn, a fresh interpreter) with ``TRITON_INTERPRET=1`` in its
environment; this process's environment is restored right after the start.

Fixture ``interpreted(fn, *args, **kwargs)`` runs the module-level function ``fn`` in
that worker and returns its result; an assertion failing there fails the calling test
with the worker's traceback. ``fn`` is pickled by reference, so it must live at the top
level of a test module (pytest's default "prepend" import mode puts this directory on
``sys.path``, which the worker inherits).
"""

from __future__ import annotations

import copy
import itertools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from sampling_checks import chi_square_pvalue, exact_joint_probs, target_distribution_pvalue

# Tiny models gain nothing from intra-op threads, and on a busy machine thread hand-offs
# cost milliseconds per op.
torch.set_num_threads(1)

TINY_VOCAB_SIZE = 320
_CORPUS = [
    "def speculative_decoding(target, draft, k):",
    "    # the draft proposes k tokens and the target verifies them in one forward",
    "The quick brown fox jumps over the lazy dog while the target model verifies.",
    "Acceptance rate, mean acceptance length and goodput are what the operator tunes.",
    "import torch\nfrom transformers import AutoTokenizer\nprint('hello, world')",
    "Kubernetes reconciles a SpeculativeModel into pods that serve completions.",
]


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    assert len(fast) <= TINY_VOCAB_SIZE
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return _train_tokenizer()


def save_checkpoint(model, tokenizer, path: Path) -> Path:
    """Save ``model`` (float32 safetensors) and ``tokenizer`` into ``path``."""
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def derive_draft(target, num_layers: int, noise: float, seed: int):
    """A shallower copy of ``target``: its embeddings, head and first ``num_layers``
    layers, perturbed by Gaussian noise of std ``noise``."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft = type(target)(config).eval()
    state = {k: v for k, v in target.state_dict().items() if k in draft.state_dict()}
    draft.load_state_dict(state)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    return draft


def _damp_later_layers(model, factor: float = 0.2):
    """Scale the residual contributions of layers 1.. by ``factor``.

    A random model's layers all matter equally, so a shallow draft taken from it agrees
    with it only by chance (a few percent); damped later layers give the 1-layer drafts
    about 50% greedy agreement, like a real draft/target pair, while the output stays
    diverse (``initializer_range`` 0.2: smaller weights make the models repeat tokens).
    """
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)
    return model


def _tiny_causal_lm(config_cls, model_cls, tokenizer, num_layers: int, seed: int, **overrides):
    """A tiny random ``model_cls``: the shape every test checkpoint shares, plus the
    architecture-specific ``overrides``."""
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        **overrides,
    )
    return _damp_later_layers(model_cls(config).eval())


def _llama(tokenizer, num_layers: int, seed: int, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    overrides = {"tie_word_embeddings": False, **overrides}
    return _tiny_causal_lm(LlamaConfig, LlamaForCausalLM, tokenizer, num_layers, seed, **overrides)


def _qwen3(tokenizer, num_layers: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _tiny_causal_lm(
        Qwen3Config, Qwen3ForCausalLM, tokenizer, num_layers, seed,
        head_dim=32, tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def _tiny_llama_model(tiny_tokenizer):
    return _llama(tiny_tokenizer, num_layers=3, seed=0)


@pytest.fixture(scope="session")
def _tiny_qwen3_model(tiny_tokenizer):
    return _qwen3(tiny_tokenizer, num_layers=2, seed=1)


@pytest.fixture(scope="session")
def tiny_llama_target(tmp_path_factory, tiny_tokenizer, _tiny_llama_model) -> Path:
    return save_checkpoint(
        _tiny_llama_model, tiny_tokenizer, tmp_path_factory.mktemp("llama-target")
    )


@pytest.fixture(scope="session")
def tiny_llama_draft(tmp_path_factory, tiny_tokenizer, _tiny_llama_model) -> Path:
    draft = derive_draft(_tiny_llama_model, num_layers=1, noise=0.01, seed=2)
    return save_checkpoint(draft, tiny_tokenizer, tmp_path_factory.mktemp("llama-draft"))


@pytest.fixture(scope="session")
def tiny_qwen3_target(tmp_path_factory, tiny_tokenizer, _tiny_qwen3_model) -> Path:
    return save_checkpoint(
        _tiny_qwen3_model, tiny_tokenizer, tmp_path_factory.mktemp("qwen3-target")
    )


@pytest.fixture(scope="session")
def tiny_qwen3_draft(tmp_path_factory, tiny_tokenizer, _tiny_qwen3_model) -> Path:
    draft = derive_draft(_tiny_qwen3_model, num_layers=1, noise=0.01, seed=3)
    return save_checkpoint(draft, tiny_tokenizer, tmp_path_factory.mktemp("qwen3-draft"))


@pytest.fixture(scope="session")
def _hf_models() -> dict[Path, torch.nn.Module]:
    return {}


@pytest.fixture
def hf_model(_hf_models):
    """``hf_model(path)`` -> the checkpoint loaded by ``transformers`` (float32, eval)."""
    from transformers import AutoModelForCausalLM

    def load(path: Path):
        if path not in _hf_models:
            _hf_models[path] = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32
            ).eval()
        return _hf_models[path]

    return load


def hf_greedy_ids(model, prompt_ids: list[int], n: int) -> list[int]:
    """``transformers`` greedy ``generate`` to exactly ``n`` new tokens, run past eos
    (the runtime's requests set ``ignore_eos``)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    generated = out[0, len(prompt_ids) :].tolist()
    assert len(generated) == n
    return generated


@pytest.fixture(scope="session")
def hf_greedy():
    """The :func:`hf_greedy_ids` function, for tests in other files."""
    return hf_greedy_ids


def sampled_target_pvalue(
    engine, hf, prompt: list[int], num_samples: int,
    temperature: float = 0.9, top_k: int = 4, length: int = 3,
) -> float:
    """Sample ``length`` tokens after ``prompt`` with ``engine`` ``num_samples`` times
    (seeds ``0..num_samples - 1``) and return the chi-square p-value of the outputs
    against ``hf``'s exact distribution (:func:`exact_joint_probs`).

    Fails unless both branches of the verifier ran (some but not all draft tokens
    accepted, position 1 accepted at least once): otherwise the p-value says little.
    """
    from specula.runtime.engine.llm_engine import SamplingParams

    params = [
        SamplingParams(
            max_tokens=length, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True
        )
        for s in range(num_samples)
    ]
    outputs = engine.generate([prompt] * num_samples, params)
    stats = engine.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[1] > 0
    joint = exact_joint_probs(hf, prompt, temperature, top_k, length)
    return target_distribution_pvalue(outputs, joint)


@pytest.fixture(scope="session")
def sampled_pvalue():
    """The :func:`sampled_target_pvalue` function, for tests in other files."""
    return sampled_target_pvalue


class GreedyRound(NamedTuple):
    """What one ``generate`` call at a fixed k did: its outputs and the counters' growth."""

    k: int
    outputs: list[list[int]]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_generation_tokens: int


def greedy_rounds_equal_expected(
    engine, prompts: list[list[int]], expected: list[list[int]], params, ks
) -> list[GreedyRound]:
    """For each k in ``ks``: set k, ``generate`` ``prompts`` with ``params`` and check
    every output equals ``expected``, with both verifier branches run (some but not all
    draft tokens accepted: the check can fail either way). After all rounds, accepted
    counts per position form a prefix (position i+1 accepted only after i) that sums to
    the accepted total, and no request is left. Returns one :class:`GreedyRound` per k
    for method-specific checks."""
    stats = engine.spec_decoding_stats
    rounds = []
    for k in ks:
        engine.set_num_speculative_tokens(k)
        before = (
            stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            engine.generation_tokens_total,
        )
        got = engine.generate(prompts, params)
        for prompt, g, e in zip(prompts, got, expected, strict=True):
            assert g == e, f"k={k}, prompt length {len(prompt)}"
        done = GreedyRound(
            k, got, stats.num_drafts - before[0], stats.num_draft_tokens - before[1],
            stats.num_accepted_tokens - before[2], engine.generation_tokens_total - before[3],
        )
        assert 0 < done.num_accepted_tokens < done.num_draft_tokens, (
            f"k={k}: accepted {done.num_accepted_tokens} of {done.num_draft_tokens}"
        )
        rounds.append(done)
    per_pos = stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in itertools.pairwise(per_pos))
    assert not engine.has_unfinished_requests()
    return rounds


def shared_prefix_prompts(vocab: int, seed: int, prefix_len: int = 40) -> list[list[int]]:
    """A prompt and four more that share its first ``prefix_len`` tokens: tails of 1, 6
    and 21 tokens, and the same prompt again (ids avoid eos 0)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, vocab, (prefix_len,), generator=gen).tolist()
    tails = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 1, 6, 21)]
    return [prefix + t for t in tails] + [prefix + tails[0]]


def prefix_cached_outputs(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """``prompts[0]`` alone, then the others together (more than ``max_num_seqs`` of
    them join running batches mid-way), so that the others reuse its cached prompt
    blocks. Checks that each did reuse every full block of the prefix it shares with
    ``prompts[0]`` (short of its last token), and returns every output."""
    bm = engine.scheduler.block_manager
    first = engine.generate(prompts[:1], params)
    hits = bm.prefix_cache_hits
    rest = engine.generate(prompts[1:], params)
    bs = bm.block_size
    expected_hits = 0
    for p in prompts[1:]:
        common = next(
            (i for i, (a, b) in enumerate(zip(p, prompts[0], strict=False)) if a != b),
            min(len(p), len(prompts[0])),
        )
        expected_hits += min(common, len(p) - 1) // bs * bs
    assert expected_hits > 0
    assert bm.prefix_cache_hits - hits >= expected_hits
    assert not engine.has_unfinished_requests()
    return first + rest


@pytest.fixture(scope="session")
def prefix_cached():
    """:func:`shared_prefix_prompts` and :func:`prefix_cached_outputs`, for tests in
    other files."""
    return shared_prefix_prompts, prefix_cached_outputs


@pytest.fixture(scope="session")
def greedy_rounds():
    """The :func:`greedy_rounds_equal_expected` function, for tests in other files."""
    return greedy_rounds_equal_expected


@pytest.fixture(scope="session")
def chi_square():
    """The :func:`chi_square_pvalue` function, for tests in other files."""
    return chi_square_pvalue


def runtime_config(
    target: Path, draft: Path | None = None, k: int = 3, max_num_seqs: int = 8, **kw
):
    """A float32 :class:`RuntimeConfig` serving ``target`` with ``draft`` as a
    ``draft_model`` speculator of ``k`` tokens (no speculator when ``draft`` is None)."""
    from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig

    speculator = None
    if draft is not None:
        speculator = SpeculatorRuntimeConfig(
            method="draft_model", model=f"file://{draft}", num_speculative_tokens=k
        )
    return RuntimeConfig(
        model=f"file://{target}",
        dtype="float32",
        max_num_seqs=max_num_seqs,
        speculator=speculator,
        **kw,
    )


@pytest.fixture(scope="session")
def make_engine():
    """``make_engine(target, draft=None, k=3, max_num_seqs=8, **config_fields)`` ->
    ``LLMEngine.from_config(runtime_config(...))``."""
    from specula.runtime.engine.llm_engine import LLMEngine

    def make(target: Path, draft: Path | None = None, k: int = 3, max_num_seqs: int = 8, **kw):
        return LLMEngine.from_config(runtime_config(target, draft, k, max_num_seqs, **kw))

    return make


@pytest.fixture(scope="session")
def interpreted():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=torch.set_num_threads,
            initargs=(1,),
        )
        # The worker starts on the first submit and copies the environment then.
        assert pool.submit(os.getenv, "TRITON_INTERPRET").result() == "1"
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous

    def run(fn, *args, **kwargs):
        return pool.submit(fn, *args, **kwargs).result()

    yield run
    pool.shutdown()
