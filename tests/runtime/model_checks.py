"""Checks of our model forward against ``transformers``' on the same checkpoint
(float32), shared by the model tests of every architecture."""

from __future__ import annotations

from pathlib import Path

import torch

from specula.runtime.engine.model_runner import ModelRunner
from specula.runtime.models.registry import load_model

ATOL = 1e-4
CPU = torch.device("cpu")


def cpu_runner(path: Path) -> ModelRunner:
    """A float32 CPU :class:`ModelRunner` of the checkpoint at ``path`` (4 slots of 64)."""
    return ModelRunner(load_model(path, torch.float32, CPU), max_num_seqs=4, max_len=64, device=CPU)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """``transformers``' float32 logits at every position of ``tokens``, ``[len, vocab]``."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def check_runner_against_hf(
    runner: ModelRunner,
    hf,
    vocab: int,
    lens: tuple[int, int],
    slots: tuple[int, int],
    rollback_request: int,
) -> None:
    """Logits of ``runner`` equal ``hf``'s (within :data:`ATOL`) for: a batched prefill
    of two random prompts of ``lens`` tokens in cache ``slots`` (non-trivial slots: the
    cache row is not the batch index); four greedy decode steps of both; then three
    speculative tokens written past the end of request ``rollback_request`` and two of
    them overwritten from a lower position, in a step that also advances the other
    request by one token."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    slots = list(slots)

    hidden = runner.forward(slots, torch.tensor(prompts[0] + prompts[1]), list(lens), [0, 0])
    logits = runner.compute_logits(hidden)
    torch.testing.assert_close(logits[: lens[0]], hf_logits(hf, prompts[0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[lens[0] :], hf_logits(hf, prompts[1]), atol=ATOL, rtol=0)

    seqs = [list(p) for p in prompts]
    last = logits[[lens[0] - 1, sum(lens) - 1]]
    for _ in range(4):
        nxt = last.argmax(-1).tolist()
        starts = [len(s) for s in seqs]
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        last = runner.compute_logits(runner.forward(slots, torch.tensor(nxt), [1, 1], starts))
        for i, s in enumerate(seqs):
            torch.testing.assert_close(last[i], hf_logits(hf, s)[-1], atol=ATOL, rtol=0)

    r = rollback_request
    spec = torch.randint(0, vocab, (3,), generator=gen).tolist()
    runner.forward([slots[r]], torch.tensor(spec), [3], [len(seqs[r])])
    seqs[r].append(spec[0])
    fresh = torch.randint(0, vocab, (3,), generator=gen).tolist()
    num_new = [2 if i == r else 1 for i in range(2)]
    starts = [len(s) for s in seqs]
    seqs[0] += fresh[: num_new[0]]
    seqs[1] += fresh[num_new[0] :]
    out = runner.compute_logits(runner.forward(slots, torch.tensor(fresh), num_new, starts))
    torch.testing.assert_close(
        out[: num_new[0]], hf_logits(hf, seqs[0])[-num_new[0] :], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        out[num_new[0] :], hf_logits(hf, seqs[1])[-num_new[1] :], atol=ATOL, rtol=0
    )
