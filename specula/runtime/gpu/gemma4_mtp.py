"""The Gemma4 MTP draft (``gemma4_assistant``) on the GPU kernels, reading the target's
paged KV cache, eager and in CUDA graphs.

The assistant (:class:`~specula.runtime.models.gemma4_assistant.
Gemma4AssistantForCausalLM`) has no KV of its own: each of its layers is query-only and
attends to the target's cache entry of the target's last non-shared layer of the same
type, through the target's block tables. After a target forward that sampled token
``t_{n-1}`` (at position ``n - 1``) for a request, :meth:`GPUGemma4AssistantRunner.
propose` drafts ``k`` tokens: every step runs one row per request at the constant rotary
position ``n - 1`` over the committed target positions ``0 .. n - 2`` (sliding layers:
the last ``sliding_window + 1`` of them, the assistant's inclusive window); step 1 reads
``t_{n-1}`` with the target's final hidden state at ``n - 2``, step ``s`` the previous
draft token with the assistant's own ``post_projection`` output. Drafts are greedy
(argmax of the dense or centroid-masked logits). This is the CPU
:class:`~specula.runtime.spec_decode.gemma4.Gemma4MTPSpeculator`'s draft loop; KV the
target wrote for rejected drafts (positions ``>= n - 1``) is never read, since each
row's context ends at ``n - 1``.

:class:`Gemma4DraftGraphManager` captures the whole ``k``-step loop as one graph per
``(padded request count, k)`` (as :class:`~specula.runtime.gpu.draft_graphs.
DraftDecodeGraphManager` does for EAGLE-3's decode steps); a padding row has position 0,
so it attends to nothing. Nothing here copies device data to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula.runtime.gpu.cudagraph import cudagraph_capture_sizes
from specula.runtime.gpu.gemma4_runner import Gemma4PagedLayers, GPUGemma4Runner
from specula.runtime.gpu.paged_kv import PagedAttentionMetadata
from specula.runtime.kernels.layernorm import rms_norm
from specula.runtime.models.gemma4_assistant import (
    Gemma4AssistantForCausalLM,
    check_gemma4_target,
)
from specula.runtime.models.gemma4_config import SLIDING


class GPUGemma4AssistantRunner(Gemma4PagedLayers):
    """Runs a :class:`Gemma4AssistantForCausalLM` on the kernels over the cache of a
    :class:`GPUGemma4Runner`.

    Args:
        model: the assistant, on the target's device, in its dtype, eval mode.
        target: the target runner; its token embedding, KV cache, block-table width and
            rotary length are used.
        attn_num_splits: as for the target runner.

    Raises:
        ValueError: an assistant that does not fit the target (see
            :func:`~specula.runtime.models.gemma4_assistant.check_gemma4_target`), or
            another dtype.
    """

    def __init__(
        self,
        model: Gemma4AssistantForCausalLM,
        target: GPUGemma4Runner,
        attn_num_splits: int | None = None,
    ) -> None:
        check_gemma4_target(model.config, target.config)
        text = model.config.text
        producers = target.config.kv_producer_layers()
        weight = model.pre_projection.weight
        super().__init__(
            text,
            target.kv_cache,
            # Non-shared target layers are a prefix: cache entry == layer index.
            [producers[t] for t in text.layer_types],
            [model.sliding_window if t == SLIDING else None for t in text.layer_types],
            model.rotary.by_type,
            target.max_model_len,
            attn_num_splits,
            weight.device,
            weight.dtype,
        )
        self.model = model
        self.target = target

    def draft_metadata(
        self, positions: torch.Tensor, block_table: torch.Tensor
    ) -> PagedAttentionMetadata:
        """The attention metadata of draft rows at ``positions [num_reqs]`` (int64):
        row ``i`` sees target positions ``< positions[i]`` (``seq_lens = positions``);
        built on the device, no host copy."""
        r = positions.shape[0]
        return PagedAttentionMetadata(
            slot_mapping=torch.full((r,), -1, dtype=torch.int64, device=self.device),
            block_table=block_table,
            seq_lens=positions.to(torch.int32),
            query_start_loc=torch.arange(r + 1, dtype=torch.int32, device=self.device),
            num_reqs=r,
            num_tokens=r,
            uniform_query_len=1,
            prefill=False,
            query_lens_cpu=(1,) * r,
        )

    @torch.no_grad()
    def step(
        self,
        input_ids: torch.Tensor,
        backbone: torch.Tensor,
        positions: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step, :meth:`Gemma4AssistantForCausalLM.forward` on the kernels.

        Args:
            input_ids: [num_reqs] int64 token of each row.
            backbone: [num_reqs, backbone_hidden_size] the target's final hidden state
                (first step) or the previous step's ``post_projection`` output.
            positions: [num_reqs] int64 rotary positions.
            metadata: from :meth:`draft_metadata`.

        Returns:
            ``(hidden [num_reqs, hidden_size] after the final norm, next backbone
            [num_reqs, backbone_hidden_size])``.
        """
        embeds = self.target.model.model.embed(input_ids)  # [num_reqs, backbone]
        x = self.model.pre_projection(torch.cat([embeds, backbone.to(embeds.dtype)], dim=-1))
        for i, layer in enumerate(self.model.model.layers):
            x = self._layer(layer, x, None, positions, i, metadata, {})
        norm = self.model.model.norm
        hidden = rms_norm(x, norm.weight, norm.eps)
        return hidden, self.model.post_projection(hidden)

    @torch.no_grad()
    def propose(
        self,
        next_token_ids: torch.Tensor,
        backbone: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        num_speculative_tokens: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy drafts of ``num_speculative_tokens`` steps.

        Args:
            next_token_ids: [num_reqs] int64, each request's last sampled token.
            backbone: [num_reqs, backbone_hidden_size], the target's final hidden state
                at the position before that token.
            positions: [num_reqs] int64, the token's position (= context the rows see).
            block_table: [num_reqs, max_blocks_per_req] int32, the target's.
            num_speculative_tokens: ``k`` >= 1.
            out: optional [num_reqs, k] int64 buffer.

        Returns:
            [num_reqs, k] int64 draft token ids.

        Raises:
            AssertionError: shapes or dtypes that do not match the above.
        """
        r = next_token_ids.shape[0]
        assert next_token_ids.dtype == torch.int64 and positions.dtype == torch.int64
        assert positions.shape == (r,) and backbone.shape[0] == r
        assert block_table.shape == (r, self.max_blocks_per_req)
        assert num_speculative_tokens >= 1
        if out is None:
            out = torch.empty(r, num_speculative_tokens, dtype=torch.int64, device=self.device)
        metadata = self.draft_metadata(positions, block_table)
        tokens = next_token_ids
        for s in range(num_speculative_tokens):
            hidden, backbone = self.step(tokens, backbone, positions, metadata)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)  # [num_reqs]
            out[:, s] = tokens
        return out


class Gemma4DraftGraphManager:
    """CUDA graphs of :meth:`GPUGemma4AssistantRunner.propose`, one per ``(request
    count, k)``, captured largest first into one memory pool on static input buffers.

    Args:
        runner: the draft runner.
        max_num_reqs: most requests in one step.
        max_num_speculative_tokens: largest ``k``; every ``k`` in ``1..`` it is captured.
        capture_sizes: request counts; default
            :func:`~specula.runtime.gpu.cudagraph.cudagraph_capture_sizes`.

    Raises:
        ValueError: a capture size outside ``[1, max_num_reqs]`` or ``k`` < 1.
    """

    def __init__(
        self,
        runner: GPUGemma4AssistantRunner,
        max_num_reqs: int,
        max_num_speculative_tokens: int,
        capture_sizes: Sequence[int] | None = None,
    ) -> None:
        sizes = sorted(set(capture_sizes or cudagraph_capture_sizes(max_num_reqs)))
        if sizes[0] < 1 or sizes[-1] > max_num_reqs:
            raise ValueError(f"capture sizes {sizes} outside [1, {max_num_reqs}]")
        if max_num_speculative_tokens < 1:
            raise ValueError(f"max_num_speculative_tokens {max_num_speculative_tokens} < 1")
        self.runner = runner
        self.capture_sizes = sizes
        self.max_k = max_num_speculative_tokens
        r, device = max_num_reqs, runner.device
        backbone_size = runner.model.config.backbone_hidden_size
        self.next_token_ids = torch.zeros(r, dtype=torch.int64, device=device)
        self.backbone = torch.zeros(r, backbone_size, dtype=runner.dtype, device=device)
        self.positions = torch.zeros(r, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(
            r, runner.max_blocks_per_req, dtype=torch.int32, device=device
        )
        self.draft_token_ids = torch.zeros(r, self.max_k, dtype=torch.int64, device=device)
        self.pool: tuple | None = None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def _propose(self, r: int, k: int) -> torch.Tensor:
        return self.runner.propose(
            self.next_token_ids[:r],
            self.backbone[:r],
            self.positions[:r],
            self.block_table[:r],
            k,
            out=self.draft_token_ids[:r, :k],
        )

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every ``(request count, k)``, largest first.

        Raises:
            RuntimeError: the runner is not on a CUDA device.
        """
        if self.runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the runner on a CUDA device")
        self.positions.zero_()  # padding rows: nothing to attend to, nothing read
        keys = sorted(
            ((r, k) for r in self.capture_sizes for k in range(1, self.max_k + 1)),
            key=lambda rk: rk[0] * rk[1],
            reverse=True,
        )
        for r, k in keys:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._propose(r, k)  # compiles this launch shape's kernels
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._propose(r, k)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(r, k)] = graph
        torch.cuda.synchronize()

    def padded_num_reqs(self, num_reqs: int) -> int | None:
        """The captured request count a batch of ``num_reqs`` pads to, or ``None``."""
        return next((r for r in self.capture_sizes if r >= num_reqs), None)

    @torch.no_grad()
    def propose(
        self,
        next_token_ids: torch.Tensor,
        backbone: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        num_speculative_tokens: int,
    ) -> torch.Tensor:
        """:meth:`GPUGemma4AssistantRunner.propose` by graph replay when a captured size
        fits, else eagerly (same arguments).

        Returns:
            [num_reqs, k] int64 draft tokens; after a replay a view of the graph's output
            buffer, valid until the next replay.
        """
        r, k = next_token_ids.shape[0], num_speculative_tokens
        padded = self.padded_num_reqs(r)
        graph = self.graphs.get((padded, k)) if padded is not None else None
        if graph is None:
            return self.runner.propose(next_token_ids, backbone, positions, block_table, k)
        self.next_token_ids[:r].copy_(next_token_ids)
        self.backbone[:r].copy_(backbone)
        self.positions[:r].copy_(positions)
        self.block_table[:r].copy_(block_table)
        if padded > r:
            self.positions[r:padded].zero_()
        graph.replay()
        return self.draft_token_ids[:r, :k]
