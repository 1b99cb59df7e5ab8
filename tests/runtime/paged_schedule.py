"""The step schedule the paged-runner tests drive, shared by the CPU tier (the kernels'
torch references, ``test_models_gemma4``) and the GPU tier: a varlen prefill of two
requests, greedy decode steps, a mixed step (both decode while a third request
prefills) and a (k + 1)-token verification step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula.runtime.worker.paged_kv import build_attention_metadata


def metadata_from_block_manager(manager, request_ids, query_lens, max_blocks_per_req, device):
    """``build_attention_metadata`` for requests whose slots for this forward were already
    taken (``BlockManager.allocate`` or ``append_slots``)."""
    return build_attention_metadata(
        [manager.block_table(r) for r in request_ids],
        [manager.num_tokens(r) for r in request_ids],
        query_lens, manager.block_size, max_blocks_per_req, device,
    )

def run_schedule(
    runner,
    manager,
    prompts: Sequence[Sequence[int]],
    late_prompt: Sequence[int],
    drafts: Sequence[Sequence[int]],
    *,
    decode_steps: int,
    warm_tokens: int,
    device: torch.device,
) -> tuple[list[list[int]], list[dict]]:
    """Run the schedule on ``runner`` (a paged runner) with ``manager``'s blocks.

    A request of ``warm_tokens`` comes and goes first, so the others get non-contiguous
    blocks. Returns each request's tokens and, per request, ``{position: logits}`` for
    every computed position (prompt positions included).
    """
    manager.allocate("warm", warm_tokens)
    manager.allocate(0, len(prompts[0]))
    manager.free("warm")
    manager.allocate(1, len(prompts[1]))
    tokens: list[list[int]] = [[], [], []]
    logits: list[dict] = [{}, {}, {}]

    def step(ids: list[int], new_tokens: list[list[int]]) -> None:
        metadata, positions = metadata_from_block_manager(
            manager, ids, [len(t) for t in new_tokens], runner.max_blocks_per_req, device
        )
        input_ids = torch.tensor([t for toks in new_tokens for t in toks], device=device)
        hidden, _ = runner.forward(input_ids, positions, metadata)
        out = runner.compute_logits(hidden)  # [num_tokens, vocab]
        row = 0
        for r, toks in zip(ids, new_tokens, strict=True):
            for t in toks:
                logits[r][len(tokens[r])] = out[row]
                tokens[r].append(t)
                row += 1

    def greedy(r: int) -> int:
        return int(logits[r][len(tokens[r]) - 1].argmax())

    def decode_both() -> list[int]:
        nxt = [greedy(0), greedy(1)]
        for r in (0, 1):
            manager.append_slots(r, 1)
        return nxt

    step([0, 1], [list(prompts[0]), list(prompts[1])])
    for _ in range(decode_steps):
        nxt = decode_both()
        step([0, 1], [[nxt[0]], [nxt[1]]])
    # Mixed: decode rows first, then the new request's prefill.
    nxt = decode_both()
    manager.allocate(2, len(late_prompt))
    step([0, 1, 2], [[nxt[0]], [nxt[1]], list(late_prompt)])
    verify = [[greedy(r), *drafts[r]] for r in range(3)]
    for r in range(3):
        manager.append_slots(r, len(verify[r]))
    step([0, 1, 2], verify)
    return tokens, logits
