"""Tensor parallelism: the process group, the collectives of a sharded forward, and the
sharding of checkpoint tensors (Megatron-LM, arXiv 1909.08053).

A target of ``tensor_parallel_size`` N runs on N processes, one device each. Every rank holds:

- ``colwise`` weights (``qkv_proj``, ``gate_up_proj``): its ``1/N`` of the output rows,
  so of the query and key/value heads and of the MLP's intermediate columns;
- ``rowwise`` weights (``o_proj``, ``down_proj``): its ``1/N`` of the input columns; the
  partial outputs are summed by one all-reduce per layer and sublayer, on CUDA fused
  with the residual add and norm after it (:func:`fused_all_reduce_add_norm`);
- ``vocab`` weights (``embed_tokens``, ``lm_head``): its ``ceil(V / N)`` rows of the vocabulary (the
  last rank's padded with zeros); an embedding lookup masks the ids of other ranks and all-reduces
  (in a runner, fused with layer 0's norm), the LM head all-gathers its logits (or, in an all-greedy
  step, each rank's best token, :func:`gather_argmax`).

Names of the plan follow Hugging Face's ``base_model_tp_plan`` (``colwise``, ``rowwise``).
Every rank runs the same engine on the same inputs (SPMD): the rank that serves HTTP
broadcasts each step's requests to the others (:mod:`specula.runtime.engine.distributed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from specula.runtime.engine.block_manager import cdiv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelState:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    group: Any = None
    """The device collectives' group (NCCL on CUDA, gloo on a CPU); ``None``: one rank."""
    cpu_group: Any = None
    """A gloo group for host objects (the broadcast step commands)."""


_STATE = ParallelState(0, 1)


def get_parallel() -> ParallelState:
    """The tensor-parallel state of this process (rank 0 of 1 until initialised)."""
    return _STATE


def init_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> ParallelState:
    """Join the group of ``world_size`` ranks at ``init_method`` (``tcp://host:port``) as
    ``rank``: NCCL for the device collectives on CUDA, gloo on a CPU and for host objects.

    Raises:
        RuntimeError: the rendezvous fails (``torch.distributed``'s errors).
    """
    global _STATE
    if world_size == 1:
        _STATE = ParallelState(0, 1)
        return _STATE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None)
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    _STATE = ParallelState(rank, world_size, dist.group.WORLD, cpu_group)
    return _STATE


def destroy_parallel() -> None:
    """Leave the group (if any) and return to one rank, freeing the CUDA graphs first
    (:func:`~specula.runtime.worker.cudagraph.release_graphs`): this rank's engine
    cannot replay them after."""
    global _STATE
    if _STATE.world_size > 1 and dist.is_initialized():
        from specula.runtime.worker.cudagraph import release_graphs

        release_graphs()
        _FUSED.clear()
        _FUSED_KEEP.clear()
        dist.destroy_process_group()
    _STATE = ParallelState(0, 1)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks in place (a row-parallel layer's partial outputs); the
    identity on one rank. Capturable in a CUDA graph (NCCL)."""
    if _STATE.world_size > 1:
        dist.all_reduce(x, group=_STATE.group)
    return x


FUSED_MAX_ROWS = 1024
"""Rows a fused all-reduce takes (a decode or verification step); more go to NCCL."""

_FUSED: dict[tuple[int, torch.dtype], Callable | None] = {}


def fused_workspace_bytes(hidden_size: int, dtype: torch.dtype) -> int:
    """Device bytes the fused sum's buffer takes on each rank (0 on one rank)."""
    world = _STATE.world_size
    return 0 if world == 1 else 2 * world * FUSED_MAX_ROWS * hidden_size * dtype.itemsize


def fused_all_reduce_add_norm(hidden_size: int, dtype: torch.dtype, device: torch.device):
    """``(partial [n, hidden_size], residual or None, weight, eps) -> (normed, stream)`` for ``n
    <=`` :data:`FUSED_MAX_ROWS` rows of ``dtype``: the sum over the ranks, residual add
    and RMSNorm in one kernel (:mod:`~specula.runtime.kernels.all_reduce`); off CUDA its
    torch reference; ``None`` on one rank or without peer-mapped memory (NCCL then, with
    a warning). One workspace per process and shape; the first call is collective."""
    if _STATE.world_size == 1:
        return None
    if device.type != "cuda":  # the torch reference
        from specula.runtime.kernels.layernorm import fused_add_rms_norm

        return lambda x, residual, weight, eps: fused_add_rms_norm(  # x + 0: x, exactly
            all_reduce(x), torch.zeros_like(x) if residual is None else residual, weight, eps)
    key = (hidden_size, dtype)
    if key not in _FUSED:
        global _MAPPED_GROUP
        # Symmetric memory is mapped for one process group a process: in a group created
        # after destroy_parallel (tests do) its rendezvous does not return. The ranks
        # agree before any allocates (a rank spawned for this group has no earlier one).
        if min_over_ranks(int(_MAPPED_GROUP in (None, _STATE.group))) == 0:
            logger.warning("tensor parallelism: symmetric memory was mapped for an earlier "
                           "process group of this process; row-parallel sums go through NCCL")
            _FUSED[key] = None
        else:
            _MAPPED_GROUP = _STATE.group
            _FUSED[key] = _symmetric_workspace(hidden_size, dtype, device)
    return _FUSED[key]


_MAPPED_GROUP: Any = None
"""The process group this process mapped symmetric memory for, if any."""


def _symmetric_workspace(hidden_size: int, dtype: torch.dtype, device: torch.device):
    import torch.distributed._symmetric_memory as symm_mem

    from specula.runtime.kernels.all_reduce import all_reduce_add_rms_norm

    group = _STATE.group
    reason = None if hidden_size * dtype.itemsize % 16 == 0 else "rows not 16-byte multiples"
    try:  # every rank allocates, then all agree, before the collective rendezvous
        numel = fused_workspace_bytes(hidden_size, dtype) // dtype.itemsize
        buffer = symm_mem.empty(numel, dtype=dtype, device=device).fill_(-0.0)  # every slot free
        launches = torch.zeros(FUSED_MAX_ROWS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
    except (RuntimeError, ValueError) as exc:
        reason = reason or str(exc)
    if min_over_ranks(int(reason is None)) == 0:
        logger.warning("tensor parallelism: no symmetric memory between the GPUs (%s); "
                       "row-parallel sums go through NCCL", reason or "on another rank")
        return None
    # Collective: every rank's buffer is free before any rank returns.
    handle = symm_mem.rendezvous(buffer, group)
    assert getattr(handle, "offset", 0) == 0, "buffers at their allocation's start"
    buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
    _FUSED_KEEP.append((buffer, handle))

    def fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        if _STATE.group is not group:
            raise RuntimeError("the process group of this tensor-parallel runner was left")
        if x.shape[1] != hidden_size or x.dtype != dtype:
            raise ValueError(f"rows of {x.shape[1]} {x.dtype} in a workspace for rows of "
                             f"{hidden_size} {dtype}")
        return all_reduce_add_rms_norm(x, residual, weight, eps, buffers, launches, _STATE.rank)
    return fused


_FUSED_KEEP: list = []
"""The symmetric allocations behind :data:`_FUSED`, freed when the group is left."""


def gather_vocab(x: torch.Tensor, vocab_size: int, dim: int = -1) -> torch.Tensor:
    """The ranks' vocabulary shards of ``x`` concatenated along ``dim``, the last rank's
    padding dropped: logits ``[n, ceil(V / N)]`` -> ``[n, vocab_size]`` (``dim`` -1), or
    a vocabulary-parallel weight ``[ceil(V / N), H]`` -> ``[vocab_size, H]`` (``dim``
    0); ``x`` itself on one rank. Collective: every rank calls it."""
    if _STATE.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, vocab_size)


def gather_argmax(pairs: torch.Tensor) -> torch.Tensor:
    """The vocabulary-wide argmax from each rank's over its shard: ``pairs`` [2, n]
    float32, the rows' maximum logits here and their first token ids (exact below 2^24; from
    :func:`~specula.runtime.kernels.gemv.argmax`'s ``into``) -> [n] int64, the greatest
    value's token, the lowest rank's on a tie (``argmax``'s first index over the gathered
    logits), by one all-gather of the pairs instead of the logits (with NaN logits the
    pick is unspecified). Collective: every rank calls it."""
    world = _STATE.world_size
    if world == 1:
        return pairs[1].long()
    parts = torch.empty(world * 2, pairs.shape[1], dtype=torch.float32, device=pairs.device)
    dist.all_gather_into_tensor(parts, pairs, group=_STATE.group)  # ranks along dim 0
    parts = parts.view(world, 2, -1)
    best, token = parts[0]  # elementwise over ranks (an argmax over dim 0 took 10 us)
    for r in range(1, world):  # strictly greater: the lowest rank keeps a tie
        better = parts[r, 0] > best
        token = torch.where(better, parts[r, 1], token)
        best = torch.where(better, parts[r, 0], best) if r < world - 1 else best
    return token.long()


def broadcast_object(obj: Any = None) -> Any:
    """``obj`` of rank 0 on every rank (``broadcast_object_list`` over the gloo group)."""
    if _STATE.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_STATE.cpu_group)
    return box[0]


def min_over_ranks(value: int) -> int:
    """The least of every rank's ``value`` (the KV blocks all ranks can hold)."""
    if _STATE.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.cpu_group)
    return int(t)


def check_divisible(config: Any, world_size: int) -> None:
    """Refuse a target whose heads or MLP columns do not split evenly over the ranks.

    Raises:
        ValueError: ``num_attention_heads``, ``num_key_value_heads`` or ``intermediate_size`` not
            divisible by ``tensor_parallel_size``; the message names the field and both values.
    """
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field)
        if value % world_size:
            raise ValueError(f"{field} {value} is not divisible by tensor_parallel_size "
                             f"{world_size}: the model cannot be sharded over that many GPUs")


def shard_tensor(tensor: torch.Tensor, style: str, shape: torch.Size) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``tensor`` for a parameter of ``shape``.

    ``colwise`` and ``vocab`` take rows ``[rank * shape[0], ...)`` (``vocab`` pads the last
    rank's with zeros); ``rowwise`` takes columns ``[rank * shape[1], ...)`` of a matrix,
    and of a bias the whole on rank 0 and zeros elsewhere (the all-reduce sums it once)."""
    rank = _STATE.rank
    if style == "rowwise":
        if tensor.ndim == 1:
            return tensor if rank == 0 else torch.zeros_like(tensor)
        return tensor.narrow(1, rank * shape[1], shape[1])
    rows = shape[0]
    part = tensor[rank * rows : (rank + 1) * rows]
    if part.shape[0] < rows:  # vocabulary padding
        return torch.cat([part, tensor.new_zeros((rows - part.shape[0], *tensor.shape[1:]))])
    return part


class VocabParallelEmbedding(nn.Embedding):
    """The ``embedding_dim``-wide (hidden size) embedding of this rank's ``ceil(vocab_size /
    world_size)`` ids of the whole vocabulary, spread over ``world_size`` ranks; the lookup of
    another rank's id is zero before the all-reduce that sums the ranks' rows."""

    def __init__(self, vocab_size: int, embedding_dim: int, world_size: int = 1) -> None:
        super().__init__(cdiv(vocab_size, world_size), embedding_dim)
        self.world_size = world_size
        if world_size > 1:
            self.tp_style = "vocab"

    def forward(self, input_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, embedding_dim]; ``reduce=False``: this
        rank's rows, to be summed over the ranks by the caller."""
        if self.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - _STATE.rank * self.num_embeddings
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0)
        return all_reduce(out) if reduce else out
