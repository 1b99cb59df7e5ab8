"""Checks of our paged model forward against ``transformers``' on the same checkpoint
(float32), shared by the model tests of every architecture, and a one-sequence prefill
helper for draft runners."""

from __future__ import annotations

from pathlib import Path

import torch
from paged_schedule import metadata_from_block_manager

from specula.runtime.engine.block_manager import BlockManager
from specula.runtime.models.registry import load_model
from specula.runtime.worker import create_model_runner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache

ATOL = 1e-4
CPU = torch.device("cpu")
BLOCK_SIZE = 4
"""Small blocks: every request spans several, so block-table indirection matters."""


def cpu_runner(path: Path, max_model_len: int = 64, num_blocks: int = 64):
    """A float32 CPU paged runner of the checkpoint at ``path``."""
    model = load_model(path, torch.float32, CPU)
    spec = KVCacheSpec.from_model_config(model.config, torch.float32, BLOCK_SIZE)
    return create_model_runner(model, PagedKVCache(spec, num_blocks, CPU), max_model_len)


def paged_prefill(runner, input_ids: torch.Tensor, *extra: torch.Tensor):
    """One sequence through ``runner.forward`` as a prefill (positions ``0..n-1``, fresh
    blocks); ``extra`` follow the metadata (a draft's conditioning states)."""
    n = input_ids.shape[0]
    manager = BlockManager(runner.kv_cache.num_blocks, runner.block_size, 0.0)
    manager.allocate("seq", n)
    metadata, positions = metadata_from_block_manager(
        manager, ["seq"], [n], runner.max_blocks_per_req, runner.device
    )
    return runner.forward(input_ids.to(runner.device), positions, metadata, *extra)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """``transformers``' float32 logits at every position of ``tokens``, ``[len, vocab]``."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def check_runner_against_hf(runner, hf, vocab: int, lens: tuple[int, int]) -> None:
    """Logits of the paged ``runner`` equal ``hf``'s (within :data:`ATOL`) for: a batched
    prefill of two random prompts of ``lens`` tokens (the second's blocks handed out
    after another request's were freed); four greedy decode steps of both; three
    speculative tokens verified past the end of request 0 (a ``k + 1`` query) while
    request 1 decodes in the same step, then two of them rejected and overwritten from
    a lower position."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    manager = BlockManager(runner.kv_cache.num_blocks, runner.block_size, 0.0)
    manager.allocate("warm", 9)
    manager.allocate(0, lens[0])
    manager.free("warm")
    manager.allocate(1, lens[1])

    def forward(ids: list[int], query_lens: list[int], tokens: list[int]) -> torch.Tensor:
        device = runner.device
        metadata, positions = metadata_from_block_manager(
            manager, ids, query_lens, runner.max_blocks_per_req, device
        )
        hidden, _ = runner.forward(torch.tensor(tokens, device=device), positions, metadata)
        return runner.compute_logits(hidden).cpu()

    logits = forward([0, 1], list(lens), prompts[0] + prompts[1])
    torch.testing.assert_close(logits[: lens[0]], hf_logits(hf, prompts[0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[lens[0] :], hf_logits(hf, prompts[1]), atol=ATOL, rtol=0)

    seqs = [list(p) for p in prompts]
    last = logits[[lens[0] - 1, sum(lens) - 1]]
    for _ in range(4):
        nxt = last.argmax(-1).tolist()
        for r, (s, t) in enumerate(zip(seqs, nxt, strict=True)):
            s.append(t)
            manager.append_slots(r, 1)
        last = forward([0, 1], [1, 1], nxt)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(last[i], hf_logits(hf, s)[-1], atol=ATOL, rtol=0)

    # Request 0 verifies [next, 3 drafts]; request 1 decodes one token (mixed query
    # lengths: two forwards sharing the cache, as the engine never mixes them).
    spec = torch.randint(0, vocab, (4,), generator=gen).tolist()
    manager.append_slots(0, 4)
    out = forward([0], [4], spec)
    torch.testing.assert_close(out, hf_logits(hf, seqs[0] + spec)[-4:], atol=ATOL, rtol=0)
    # Keep the first two, reject the rest: overwrite positions from there on.
    seqs[0] += spec[:2]
    manager.resize(0, len(seqs[0]))
    fresh = torch.randint(0, vocab, (2,), generator=gen).tolist()
    manager.append_slots(0, 2)
    out = forward([0], [2], fresh)
    seqs[0] += fresh
    torch.testing.assert_close(out, hf_logits(hf, seqs[0])[-2:], atol=ATOL, rtol=0)
