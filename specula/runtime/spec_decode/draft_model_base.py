"""State shared by every speculator that runs a draft network of its own, and the paged
runner base of the draft heads (EAGLE-3, MTP, DFlash)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specula.runtime.kernels.draft_inputs import draft_step_slots, draft_steps
from specula.runtime.kernels.layernorm import fused_add_rms_norm
from specula.runtime.models.config import ModelConfig
from specula.runtime.spec_decode.base import BaseSpeculator, ProposeInputs
from specula.runtime.worker.cudagraph import (
    BatchExecutionDescriptor,
    CapturedAttentionState,
    capture_graph,
    cudagraph_capture_sizes,
    padded_size,
)
from specula.runtime.worker.model_runner import ModelRunner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedAttentionMetadata, PagedKVCache

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
"""vLLM's ``draft_sample_method``: the draft's argmax (one-hot for the verifier), or a
sample under each request's settings whose distribution goes to the verifier."""


class DraftRunner(ModelRunner):
    """A draft head's forward with the sublayers of the target's :class:`ModelRunner`,
    over a paged KV cache of its own layers indexed by the *target's* block tables and
    slot mappings (as vLLM allocates draft layers in the target's KV-cache groups), so
    that a draft forward over a verification's slots reuses its attention metadata
    (vLLM PR #40410). ``model``'s parameter :attr:`weight_name` gives device and dtype.

    Raises:
        ValueError: target weights the head shares not bound yet
            (``model.missing_target_weights``), or a cache that does not match the head.
    """

    weight_name = "fc.weight"
    """A parameter of the head's own (never one shared from the target)."""

    def __init__(self, model: nn.Module, kv_cache: PagedKVCache, max_model_len: int) -> None:
        if getattr(model, "missing_target_weights", None):
            raise ValueError(f"bind the target's {sorted(model.missing_target_weights)} first")
        weight = model.get_parameter(self.weight_name)
        self.setup_paged(model, kv_cache, max_model_len, None, weight)

    def normed_pair(self, input_ids: torch.Tensor, hidden: torch.Tensor, en: nn.Module,
                    hn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, 2H]``: norm ``en`` of the embedding rows of ``input_ids`` [n] (gathered from the
        head's table in the norm kernel) beside norm ``hn`` of ``hidden [n, H]``, each writing its
        half in one launch (no cat; EAGLE-3's first layer, MTP's ``eh_proj``), and the right half,
        a view."""
        table, h = self.model.embed_tokens.weight, hidden.shape[1]
        x = table.new_empty(input_ids.shape[0], 2 * h)
        fused_add_rms_norm(table, None, en.weight, en.eps, out=x, ids=input_ids,
                           pair=(hidden.to(x.dtype), hn.weight, hn.eps))
        return x, x[:, h:]


class DraftModelSpeculator(BaseSpeculator):
    """Owns the draft network (:meth:`load_draft_model`), its runner over a paged KV
    cache on the target's block tables (:meth:`build_runner`: ``forward(input_ids,
    positions, metadata[, hidden_states])``), and buffers sized by ``max_num_seqs``.

    Args:
        num_speculative_tokens: the largest k.
        draft_sample_method: one of :data:`DRAFT_SAMPLE_METHODS`.
        load_format: ``auto`` (the checkpoint's weights) or ``dummy`` (random weights).

    Raises (at construction):
        ValueError: the draft does not fit the target (:meth:`load_draft_model`), or an
            unknown ``draft_sample_method``.
    """

    def __init__(self, draft_dir: Path, target_config: ModelConfig, num_speculative_tokens: int,
                 max_num_seqs: int, dtype: torch.dtype, device: torch.device,
                 draft_sample_method: str = "greedy", load_format: str = "auto") -> None:
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"draft_sample_method {draft_sample_method!r} is not one of {DRAFT_SAMPLE_METHODS}")
        self.draft_dir, self.target_config = draft_dir, target_config
        self.max_num_speculative_tokens, self.max_num_seqs = num_speculative_tokens, max_num_seqs
        self.dtype, self.device = dtype, device
        self.vocab_size = target_config.vocab_size
        self.keeps_draft_probs = draft_sample_method == "probabilistic"
        self.load_format = load_format
        self.model = self.load_draft_model()
        self.runner: Any = None
        """Set by :meth:`allocate_kv_cache` or, for drafts on the target's cache,
        :meth:`bind_target`."""

    @abstractmethod
    def load_draft_model(self) -> nn.Module:
        """Build and load the draft network.

        Raises:
            ValueError: the checkpoint is malformed or does not fit the target; the
                message names the field and both values.
        """

    def build_runner(self, kv_cache: PagedKVCache, max_model_len: int) -> Any:
        """The draft network's paged runner over ``kv_cache`` (drafts with a KV cache
        of their own implement it)."""
        raise NotImplementedError

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec | None:
        return KVCacheSpec.from_model_config(self.model.config, self.dtype, block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        spec = self.kv_cache_spec(block_size)
        if spec is not None:
            kv_cache = PagedKVCache(spec, num_blocks, self.device)
            self.runner = self.build_runner(kv_cache, max_model_len)

    def init_cudagraph_manager(self) -> None:
        r, dev = self.max_num_seqs, self.device
        self.next_token_ids = torch.zeros(r, dtype=torch.int64, device=dev)
        """[max_num_seqs] the token each request sampled last."""
        self.start_positions = torch.full((r,), -1, dtype=torch.int64, device=dev)
        """[max_num_seqs] position of the sampled token; -1 marks a padding row."""
        self.block_table = torch.zeros(r, self.runner.max_blocks_per_req, dtype=torch.int32, device=dev)
        self.draft_token_ids = torch.zeros(max(self.max_num_speculative_tokens, 1), r,
                                           dtype=torch.int64, device=dev).t()
        """[max_num_seqs, k] the drafts of the last proposal, each column contiguous (a draft
        step's argmax writes it)."""
        self.token_starts = torch.arange(r * (self.max_num_speculative_tokens + 2) + 1,
                                         dtype=torch.int32, device=dev)
        """``0, 1, 2, ..``: the query start offsets of one-row-per-request steps."""
        self.capture_sizes = cudagraph_capture_sizes(r)
        self.pool: tuple | None = None
        self.prefill_graphs: dict[BatchExecutionDescriptor, torch.cuda.CUDAGraph] = {}
        """Draft prefill (DFlash: context) graphs, per target graph."""
        self.decode_graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        """Draft decode (DFlash: block) graphs, per padded request count (and steps)."""
        self.num_prefill_replays = self.num_decode_replays = 0

    @torch.no_grad()
    def capture(
        self, captured_attention_states: dict[BatchExecutionDescriptor, CapturedAttentionState]
    ) -> None:
        """:meth:`capture_graphs` for the target's request counts (none captured: the
        default ladder)."""
        self.capture_sizes = sorted({d.num_reqs for d in captured_attention_states}) or self.capture_sizes
        self.start_positions.fill_(-1)
        self.capture_graphs(captured_attention_states)
        torch.cuda.synchronize()

    @abstractmethod
    def capture_graphs(
        self, captured_attention_states: dict[BatchExecutionDescriptor, CapturedAttentionState]
    ) -> None:
        """The method's graphs, each through :meth:`capture_in_pool`."""

    def capture_in_pool(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """``fn`` captured as a graph in the speculator's one memory pool."""
        graph = capture_graph(fn, self.pool)
        self.pool = self.pool or graph.pool()
        return graph

    def replay_or_run(self, graphs: dict[Any, torch.cuda.CUDAGraph], key: Any, counter: str,
                      run: Callable[[], None]) -> None:
        """Replay ``graphs[key]``, counting it in the attribute ``counter``, else ``run()``."""
        graph = graphs.get(key)
        if graph is None:
            run()
        else:
            graph.replay()
            setattr(self, counter, getattr(self, counter) + 1)

    def load_inputs(self, inputs: ProposeInputs, *more: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Copy the step's sampled tokens, their positions, the block tables and each
        ``(static buffer, value)`` of ``more`` into the static buffers by torch's foreach copy
        per dtype (one launch where each pair's sizes and strides match, else a copy each);
        returns the number of rows the graphs run (padded rows get position -1)."""
        r = inputs.num_reqs
        padded = padded_size(self.capture_sizes, r) or r
        groups: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for pair in ((self.next_token_ids[:r], inputs.next_token_ids),
                     (self.start_positions[:r], inputs.next_positions),
                     (self.block_table[:r], inputs.metadata.block_table[:r]), *more):
            groups.setdefault(pair[0].dtype, []).append(pair)
        for pairs in groups.values():
            torch._foreach_copy_(*map(list, zip(*pairs, strict=True)))
        if padded > r:
            self.start_positions[r:padded] = -1
            self.next_token_ids[r:padded] = 0
        return padded

    def slots(self, positions: torch.Tensor, valid: torch.Tensor,
              writes_kv: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slots ``[r * q]`` of ``positions [r, q]`` of rows ``0..r-1`` of
        :attr:`block_table` (-1, write nothing, where ``valid [r]`` is False) and the
        sequence lengths ``[r]`` int32 after them (:func:`draft_step_slots`)."""
        return draft_step_slots(positions, valid, self.block_table, self.runner.block_size,
                                writes_kv=writes_kv)

    def steps(self, start: torch.Tensor, steps: int, shift: int,
              writes_kv: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions, cache slots and sequence lengths ``[steps, ..]`` of ``steps`` draft steps
        of rows ``0..r-1`` of :attr:`block_table` from ``start [r, q]`` (:func:`draft_steps`)."""
        return draft_steps(start, self.block_table, self.runner.block_size, steps, shift=shift,
                           writes_kv=writes_kv)

    def decode_metadata(self, slots: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, q: int) -> PagedAttentionMetadata:
        """Metadata of ``n`` requests with ``q`` consecutive query rows each: ``slots
        [n, q]``, ``block_table [n, max_blocks_per_req]``, ``seq_lens [n]``."""
        n = seq_lens.shape[0]
        if q == 1 and n < self.token_starts.shape[0]:  # a view: no launch in a draft step
            query_start_loc = self.token_starts[: n + 1]
        else:
            query_start_loc = torch.arange(0, n * q + 1, q, device=slots.device, dtype=torch.int32)
        return PagedAttentionMetadata(
            slot_mapping=slots.reshape(-1), block_table=block_table,
            seq_lens=seq_lens.to(torch.int32), query_start_loc=query_start_loc, num_reqs=n,
            num_tokens=n * q, uniform_query_len=q, prefill=False, query_lens_cpu=(q,) * n)
