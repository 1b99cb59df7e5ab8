"""The fused all-reduce's protocol on a CPU: two ranks, each its own process running the
kernel in Triton's interpreter, over buffers in shared memory that each maps at its own
addresses (as symmetric memory maps the GPUs'). Varying row counts, several rows per
program, a hidden size with masked columns, partials holding ``-0.0`` (the free mark) and
launches without a residual (an embedding's rows): both ranks must return the sum's add
and norm of every launch, with nothing stale."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

pytestmark = pytest.mark.runtime

HIDDEN = 48  # a tile of 64 columns: 16 masked
MAX_ROWS = 8
ROWS = (3, 1, 3, 5, 2, 5, 5, 1)


def _rank(rank: int, buffers: list[torch.Tensor], dtype: torch.dtype) -> None:
    from specula.runtime.kernels import all_reduce
    from specula.runtime.kernels.layernorm import fused_add_rms_norm

    all_reduce.MAX_PROGRAMS = 2  # so that programs take several rows in turn
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    launches = torch.zeros(MAX_ROWS, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)  # every rank draws every rank's inputs
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
    for i, rows in enumerate(ROWS):
        parts = [torch.randn(rows, HIDDEN, generator=gen).to(dtype) for _ in range(2)]
        parts[0][:, ::5] = -0.0
        parts[1][:, ::3] = -0.0
        residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype) if i % 3 else None
        out, stream = all_reduce.all_reduce_add_rms_norm(
            parts[rank], residual, weight, 1e-5, table, launches, rank)
        summed = (parts[0].float() + parts[1].float()).to(dtype)
        want_out, want_stream = fused_add_rms_norm(
            summed, torch.zeros_like(summed) if residual is None else residual, weight, 1e-5)
        assert torch.equal(stream, want_stream), rows
        torch.testing.assert_close(out, want_out, rtol=1e-3, atol=1e-3)
    assert launches.tolist() == [sum(r > i for r in ROWS) % 2 for i in range(MAX_ROWS)]
    mine = buffers[rank]  # every slot free again: -0.0
    assert torch.equal(mine, torch.full_like(mine, -0.0)) and torch.signbit(mine).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_two_interpreted_ranks_sum_add_and_norm(dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks inherit it
    buffers = [torch.full((2 * 2 * MAX_ROWS * HIDDEN,), -0.0, dtype=dtype).share_memory_()
               for _ in range(2)]
    run_ranks(_rank, buffers, dtype)
