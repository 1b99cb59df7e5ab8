"""Tensor parallelism on the CPU (gloo): a target sharded over two ranks, each its own
process, produces the greedy tokens of one rank and of ``transformers``, alone and with
speculators; targets that cannot be sharded are refused before any rank starts."""

from __future__ import annotations

import pytest
import torch

from specula.api.runtime_config import SpeculatorRuntimeConfig
from specula.runtime.engine.llm_engine import LLMEngine, SamplingParams, create_engine
from specula.runtime.worker.parallel import (
    ParallelState,
    VocabParallelEmbedding,
    get_parallel,
    shard_tensor,
)
from tests.runtime.conftest import runtime_config

PROMPTS = [[5, 17, 42, 9], [7, 3, 3, 3, 11, 29, 31, 8, 2], [100, 4]]


def _greedy(engine: LLMEngine, n: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return engine.generate(PROMPTS, params)


def _tp2(config) -> list[list[int]]:
    """Greedy outputs of a two-rank engine (rank 1 in a spawned process), which is then
    shut down and the group left."""
    engine = create_engine(config.model_copy(update={"tensor_parallel_size": 2, "device": "cpu"}))
    try:
        assert get_parallel().world_size == 2 and engine.tensor_parallel_size == 2
        # Row-parallel sums deferred to the next norm (the CUDA kernel's torch reference).
        assert engine.runner.fused_reduce is not None
        fused, embedding_sums = engine.runner.fused_reduce, []
        engine.runner.fused_reduce = lambda x, res, w, eps: (embedding_sums.append(res is None)
                                                               or fused(x, res, w, eps))
        first = _greedy(engine)
        # The embedding's rows are summed in layer 0's norm (no residual), once a forward,
        # besides the two sums of each layer's sublayers.
        layers = engine.runner.model.config.num_hidden_layers
        assert 0 < embedding_sums.count(True) * 2 * layers == embedding_sums.count(False)
        # Requests added and aborted between steps reach rank 1 as well.
        engine.add_request("aborted", PROMPTS[0], SamplingParams(max_tokens=30))
        engine.step()
        engine.abort_request("aborted")
        second = _greedy(engine)
    finally:
        engine.shutdown()
    assert get_parallel().world_size == 1  # shutdown left the group
    assert second == first
    return first


@pytest.mark.parametrize("target", ["tiny_llama_target", "tiny_qwen3_target"])
def test_two_ranks_match_one_rank_and_transformers(request, target, hf_model, hf_greedy):
    path = request.getfixturevalue(target)
    config = runtime_config(path, device="cpu")
    sharded = _tp2(config)
    single = _greedy(LLMEngine.from_config(config))
    assert sharded == single
    model = hf_model(path)
    assert sharded == [hf_greedy(model, p, 12) for p in PROMPTS]


def test_two_ranks_with_a_draft_model(tiny_llama_target, tiny_llama_draft, hf_model, hf_greedy):
    config = runtime_config(tiny_llama_target, tiny_llama_draft, k=3, device="cpu")
    sharded = _tp2(config)
    model = hf_model(tiny_llama_target)
    assert sharded == [hf_greedy(model, p, 12) for p in PROMPTS]


def test_two_ranks_with_eagle3(tmp_path_factory, tiny_tokenizer, hf_greedy):
    """EAGLE-3 shares the target's embedding and LM head, which the target holds
    sharded; the head runs unsharded on each rank with their gathered copies."""
    from transformers import AutoModelForCausalLM

    from tests.runtime.hidden_state_drafts import (
        bigram_eagle3_head,
        draft_vocab_ids,
        save_bigram_target,
        save_speculators,
    )

    target = save_bigram_target("llama", tiny_tokenizer, tmp_path_factory.mktemp("tp-target"), 5)
    target_hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    head = bigram_eagle3_head(target_hf, draft_vocab_ids(seed=1, size=288), seed=2)
    draft = save_speculators(head, tmp_path_factory.mktemp("tp-eagle3"), keep_embeddings=False)
    config = runtime_config(target, device="cpu")
    config.speculator = SpeculatorRuntimeConfig(
        method="eagle3", model=f"file://{draft}", num_speculative_tokens=3
    )
    engine = create_engine(config.model_copy(update={"tensor_parallel_size": 2}))
    try:
        # The unsharded head's outputs are whole on every rank: nothing to sum.
        assert engine.runner.fused_reduce is not None
        assert engine.speculator.runner.fused_reduce is None
        sharded = _greedy(engine)
        stats = engine.spec_decoding_stats
        assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    finally:
        engine.shutdown()
    assert get_parallel().world_size == 1  # shutdown left the group
    assert sharded == [hf_greedy(target_hf, p, 12) for p in PROMPTS]


def test_unshardable_targets_are_refused_before_any_rank_starts(tiny_llama_target):
    # 4 query heads and 2 key/value heads: three ranks cannot split them.
    config = runtime_config(tiny_llama_target, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by "
                                         "tensor_parallel_size 3"):
        create_engine(config)
    assert get_parallel().world_size == 1


def test_a_sharded_draft_model_matches_transformers(
    tiny_llama_target, tiny_llama_draft, hf_model, hf_greedy
):
    """``draft_tensor_parallel_size`` equal to the target's: the draft's heads, MLP
    columns and vocabulary are split over the ranks as the target's are."""
    config = runtime_config(tiny_llama_target, tiny_llama_draft, k=3, device="cpu")
    config.speculator.draft_tensor_parallel_size = 2
    engine = create_engine(config.model_copy(update={"tensor_parallel_size": 2}))
    try:
        assert engine.speculator.model.config.tensor_parallel_size == 2
        assert engine.speculator.model.model.layers[0].self_attn.num_heads == 2  # of 4
        sharded = _greedy(engine)
        stats = engine.spec_decoding_stats
        assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    finally:
        engine.shutdown()
    model = hf_model(tiny_llama_target)
    assert sharded == [hf_greedy(model, p, 12) for p in PROMPTS]


def test_draft_tensor_parallel_sizes_that_cannot_run_are_refused(
    tiny_llama_target, tiny_llama_draft
):
    config = runtime_config(tiny_llama_target, tiny_llama_draft, device="cpu")
    config.speculator.draft_tensor_parallel_size = 2
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size 2 must be 1 or "
                                         r"tensor_parallel_size \(1\)"):
        LLMEngine.from_config(config)
    from specula.runtime.models.config import ModelConfig
    from specula.runtime.spec_decode.registry import create_speculator

    eagle3 = SpeculatorRuntimeConfig(method="eagle3", model=f"file://{tiny_llama_draft}",
                                     draft_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="a eagle3 draft runs unsharded on every rank"):
        create_speculator(eagle3, ModelConfig.from_pretrained(tiny_llama_target),
                          target_dir=tiny_llama_target, max_num_seqs=2,
                          dtype=torch.float32, device=torch.device("cpu"))


def test_an_engine_needs_its_ranks(tiny_llama_target):
    config = runtime_config(tiny_llama_target, device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 != the 1 ranks joined"):
        LLMEngine.from_config(config)


def test_shards_of_checkpoint_tensors(monkeypatch):
    import specula.runtime.worker.parallel as parallel

    w = torch.arange(5 * 4, dtype=torch.float32).view(5, 4)
    for rank in (0, 1):
        monkeypatch.setattr(parallel, "_STATE", ParallelState(rank, 2))
        assert torch.equal(shard_tensor(w, "colwise", torch.Size([2, 4])), w[2 * rank : 2 * rank + 2])
        assert torch.equal(shard_tensor(w, "rowwise", torch.Size([5, 2])), w[:, 2 * rank : 2 * rank + 2])
        bias = shard_tensor(w[0], "rowwise", torch.Size([4]))
        assert torch.equal(bias, w[0] if rank == 0 else torch.zeros(4))
    # The vocabulary's last shard is padded with zero rows.
    last = shard_tensor(w, "vocab", torch.Size([3, 4]))
    assert torch.equal(last, torch.cat([w[3:], torch.zeros(1, 4)]))


def test_vocab_parallel_embedding_looks_up_only_its_rows(monkeypatch):
    import specula.runtime.worker.parallel as parallel

    monkeypatch.setattr(parallel, "_STATE", ParallelState(1, 2))
    reduced = []
    monkeypatch.setattr(parallel, "all_reduce", lambda x: reduced.append(x) or x)
    embed = VocabParallelEmbedding(7, 3, world_size=2)  # rows 4..7 of 8 (7 padded)
    torch.nn.init.normal_(embed.weight)
    ids = torch.tensor([0, 4, 6, 3])
    out = embed(ids)
    assert torch.equal(out[0], torch.zeros(3)) and torch.equal(out[3], torch.zeros(3))
    assert torch.equal(out[1], embed.weight[0]) and torch.equal(out[2], embed.weight[2])
    assert len(reduced) == 1 and reduced[0] is out
    # reduce=False: the same rows of this rank, left for the caller to sum (the runner's
    # fused all-reduce with layer 0's norm).
    assert torch.equal(embed(ids, reduce=False), out) and len(reduced) == 1



def _argmax_rank(rank: int, port: int, world: int) -> None:
    from specula.runtime.worker.parallel import destroy_parallel, gather_argmax, init_parallel

    init_parallel(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    # Whole-vocabulary logits, alike on every rank: ties inside a shard and across
    # ranks, and at two ranks an uneven last shard (5 + 4 columns; its padding rows are
    # test_a_padded_vocabulary_shard_never_offers_its_padding's).
    vocab = 9
    shard = -(-vocab // world)
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 0.0, 2.0, 3.0, 0.0, 1.0],  # first 3: rank 0
                           [0.0, 1.0, 1.0, 1.0, 1.0, 4.0, 2.0, 4.0, 0.0],  # tie in rank 1
                           [-5.0, -4.0, -3.0, -2.0, -3.0, -2.0, -1.0, -3.0, -1.5],
                           [7.0, 0.0, 0.0, 0.0, 0.0, 7.0, 0.0, 0.0, 0.0]])
    mine = logits[:, rank * shard : min(vocab, (rank + 1) * shard)]
    value, index = mine.max(dim=-1)
    tokens = gather_argmax(torch.stack([value, (index + rank * shard).float()]))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist() == [1, 5, 6, 0], tokens
    destroy_parallel()


@pytest.mark.parametrize("world", [2, 3])
def test_the_vocabulary_argmax_gathers_each_ranks_best(world):
    """An all-greedy sharded step gathers each rank's ``(max logit, token)`` instead of
    its logits: the result is ``argmax``'s first index over the whole vocabulary."""
    from ranks import free_port, run_ranks

    run_ranks(_argmax_rank, free_port(), world, world=world, timeout=120)


def test_a_padded_vocabulary_shard_never_offers_its_padding(monkeypatch):
    """The last rank's shard of a vocabulary that does not divide evenly ends in zero
    rows (logit 0): its best token is a real one even when every real logit is negative,
    and a shard that is all padding offers -inf."""
    from types import SimpleNamespace

    import specula.runtime.models.llama as llama
    import specula.runtime.worker.parallel as parallel

    monkeypatch.setattr(llama, "gather_argmax", lambda pairs: (pairs[0], pairs[1].long()))
    hidden = -torch.ones(2, 3)
    for rank, world, vocab, want in ((1, 2, 9, [5, 5]), (3, 4, 9, None)):
        monkeypatch.setattr(parallel, "_STATE", ParallelState(rank, world))
        shard = -(-vocab // world)  # rows per rank, the last padded with zeros
        real = max(0, vocab - rank * shard)
        weight = torch.cat([torch.arange(1.0, real + 1)[:, None].expand(real, 3),
                            torch.zeros(shard - real, 3)])  # real logits -3, -6, ...: all < 0
        model = SimpleNamespace(lm_head_weight=weight, config=SimpleNamespace(vocab_size=vocab))
        value, index = llama.LlamaForCausalLM.vocab_argmax(model, hidden)
        if want is None:
            assert torch.isinf(value).all() and (value < 0).all()
        else:
            assert index.tolist() == want and value.tolist() == [-3.0, -3.0]


def test_a_server_that_exits_without_shutdown_stops_its_ranks(tiny_llama_target, tmp_path):
    """``specula serve`` returns without calling ``shutdown``: the exit handler ends the
    other ranks and leaves the group, and the process exits 0."""
    import subprocess
    import sys

    script = tmp_path / "serve_and_exit.py"
    script.write_text(
        "import sys\n"
        "from specula.api.runtime_config import RuntimeConfig\n"
        "from specula.runtime.engine.llm_engine import SamplingParams, create_engine\n"
        "if __name__ == '__main__':\n"
        f"    config = RuntimeConfig(model='file://{tiny_llama_target}', dtype='float32',\n"
        "                           device='cpu', tensor_parallel_size=2)\n"
        "    engine = create_engine(config)\n"
        "    print(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True)))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("[[")
    assert "rank 1 left the group" in done.stderr  # told to stop, not terminated
