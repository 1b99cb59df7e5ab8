"""The paged forward of a Llama / Qwen3 target on the GPU kernels.

The model classes in :mod:`specula.runtime.models` own the weights (Hugging Face names,
fused ``qkv_proj`` and ``gate_up_proj``); this module runs those same parameters through
the Triton kernels of :mod:`specula.runtime.kernels` over a paged KV cache, as functions
of the modules, so one checkpoint load serves both the CPU engine and this path.

Per decoder layer: fused residual add + RMSNorm, the qkv GEMM, (Qwen3: RMSNorm of each query
and key head), rotary in place fused with the cache write, paged attention, ``o_proj``,
fused residual add + RMSNorm, the gate/up GEMM with SiLU-and-multiply (one kernel at small
batch), ``down_proj`` (vLLM's decoder structure, with the residual carried beside the hidden
state so each add fuses into the next norm). At batch 1 a step is bound by reading the
weights; every small kernel adds a fixed launch latency on top, hence the fusions.

Attention reads the paged cache for decode (one query token per request) and verification
(``k + 1`` per request, causal among themselves). A prefill (every request's context empty)
attends over the prompt itself with ``scaled_dot_product_attention`` and writes its keys and
values to the cache for later steps. Nothing here copies device data to the host, so a decode or
verification forward can be captured in a CUDA graph (:mod:`specula.runtime.worker.cudagraph`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from specula.runtime.engine.block_manager import cdiv
from specula.runtime.kernels.dispatch import use_reference
from specula.runtime.kernels.gemv import (
    fold_norm_weight,
    gemv,
    linear,
    linear_argmax,
    linear_silu_and_mul,
    screened_argmax,
    use_gemv,
)
from specula.runtime.kernels.layernorm import fused_add_rms_norm, rms_norm
from specula.runtime.kernels.paged_attention import paged_attention
from specula.runtime.kernels.rotary import build_cos_sin_cache, rotary_embedding_and_cache
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.llama import LlamaAttention, LlamaForCausalLM
from specula.runtime.models.qwen3 import Qwen3ForCausalLM
from specula.runtime.worker.paged_kv import PagedAttentionMetadata, PagedKVCache
from specula.runtime.worker.parallel import FUSED_MAX_ROWS, all_reduce, fused_all_reduce_add_norm

SUPPORTED_MODELS = (LlamaForCausalLM, Qwen3ForCausalLM)


def _add_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; ``(rms_norm(x), x)`` without a residual."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    return fused_add_rms_norm(x, residual, weight, eps)


def fold_norms(model: nn.Module, layers: Sequence[nn.Module] | None = None) -> bool:
    """Fold the input and post-attention RMSNorm weights of each of ``layers`` (default
    ``model.model.layers``) into ``qkv_proj`` and ``gate_up_proj`` (:func:`~specula.
    runtime.kernels.gemv.fold_norm_weight`) where the GEMV's epilogues will run them, once
    per model: in bfloat16/float16 on one rank, on CUDA (or in Triton's interpreter).
    Returns whether they are (``model.norms_folded``); its weights then serve only a
    runner that knows."""
    if getattr(model, "norms_folded", False):
        return True
    layers = model.model.layers if layers is None else layers
    weight = layers[0].self_attn.qkv_proj.weight
    tp = model.config.tensor_parallel_size  # > 1: the all-reduce sits between GEMV and add
    if use_reference(weight) or weight.dtype not in (torch.bfloat16, torch.float16) or tp > 1:
        return False
    with torch.no_grad():
        for layer in layers:
            fold_norm_weight(layer.self_attn.qkv_proj.weight, layer.input_layernorm.weight)
            fold_norm_weight(layer.mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight)
    model.norms_folded = True
    return True


def _causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_reqs: int, scale: float,
    window: int | None,
) -> torch.Tensor:
    # q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] of
    # num_reqs requests of one length, attended in one call as [num_reqs, heads, q_len, head_dim].
    n, num_heads, head_dim = q.shape
    q_len = n // num_reqs
    mask = None
    if window is not None and q_len > window:
        # Causal band: query i sees keys (i - window, i].
        mask = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril().triu(1 - window)
    q, k, v = (x.view(num_reqs, q_len, -1, head_dim).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(n, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, metadata: PagedAttentionMetadata, scale: float, window: int | None,
) -> torch.Tensor:
    # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    if metadata.uniform_query_len is not None and not metadata.context_lens_cpu:
        return _causal_sdpa(q, k, v, metadata.num_reqs, scale, window)
    out = torch.empty_like(q)
    for length, rows, tables, seq_lens in metadata.context_groups:
        # After a reused prefix: the paged kernel reads the prefix (and this forward's
        # keys and values, written already) from the cache, as for a verification.
        out[rows] = paged_attention(q[rows], key_cache, value_cache, tables, seq_lens, scale,
                                    length, sliding_window=window)
    starts = list(accumulate(metadata.query_lens_cpu, initial=0))
    context = metadata.context_lens_cpu or (0,) * metadata.num_reqs
    for start, end, cached in zip(starts, starts[1:], context, strict=False):
        if not cached:
            out[start:end] = _causal_sdpa(q[start:end], k[start:end], v[start:end], 1, scale, window)
    return out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, metadata: PagedAttentionMetadata, scale: float,
    num_splits: int | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of one layer after this forward's keys and values were written to
    ``key_cache``/``value_cache``: prefill requests attend over their own tokens
    (``scaled_dot_product_attention``, causal), decode and verification requests over
    the paged cache (:func:`~specula.runtime.kernels.paged_attention.paged_attention`),
    a mixed batch (``metadata.split``) both ways, each over its own rows.

    Args:
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        sliding_window: ``W`` >= 1: a query at position ``p`` sees keys at positions
            ``(p - W, p]`` (Hugging Face's ``sliding_window_overlay``; Gemma4's sliding
            layers) through the paged kernel's window and a banded causal mask for
            prefill rows; ``None``: full causal attention.

    Returns:
        [num_tokens, num_heads, head_dim].

    Raises:
        ValueError: a batch that is neither a prefill, nor of one query length, nor a
            mixed batch (decode requests of one query length, then prefills).
    """
    if metadata.prefill:
        return _prefill_attention(q, k, v, key_cache, value_cache, metadata, scale, sliding_window)
    decode, prefill = metadata.split or (metadata, None)
    if decode.uniform_query_len is None:
        raise ValueError("paged attention needs the same query length for every request "
                         "(decode: 1, verification: k + 1), optionally followed by prefills; "
                         "split the batch")
    n = decode.num_tokens
    out = paged_attention(q[:n], key_cache, value_cache, decode.block_table, decode.seq_lens, scale,
                          decode.uniform_query_len, num_splits=num_splits,
                          sliding_window=sliding_window)
    if prefill is None:
        return out
    rest = _prefill_attention(q[n:], k[n:], v[n:], key_cache, value_cache, prefill, scale, sliding_window)
    return torch.cat([out, rest])


class ModelRunner:
    """Runs a :class:`LlamaForCausalLM` or :class:`Qwen3ForCausalLM` over a
    :class:`PagedKVCache` with the kernels (their torch references off CUDA).

    Args:
        model: the model, on its device, in eval mode, in the cache's dtype.
        kv_cache: one key/value cache pair per decoder layer.
        max_model_len: longest context (tokens) a request may reach; fixes the
            block-table width ``max_blocks_per_req`` and the rotary table length.
        attn_num_splits: programs per (request, KV head) along the context in paged
            attention; ``None`` uses the kernel's default for each launch shape.
        fold: fold the layers' norms into the projections after them where the GEMV
            then runs them (:func:`fold_norms`; two launches fewer a layer at decode).

    Raises:
        ValueError: an unsupported model class, or a cache that does not match the model.
    """

    norms_folded = False
    """The decoder layers' norm weights live in ``qkv_proj`` and ``gate_up_proj``."""
    fused_reduce = None
    """Tensor parallelism's sum, residual add and norm in one kernel, or None (NCCL)."""
    own_keys_only = True
    """A decode row reads no other request's new keys: attention may write them itself."""

    def __init__(
        self, model: LlamaForCausalLM, kv_cache: PagedKVCache, max_model_len: int,
        attn_num_splits: int | None = None, fold: bool = True,
    ) -> None:
        if type(model) not in SUPPORTED_MODELS:
            raise ValueError(f"{type(model).__name__} is not supported by the paged runner; "
                             f"supported: {', '.join(c.__name__ for c in SUPPORTED_MODELS)}")
        weight = model.model.embed_tokens.weight
        self.setup_paged(model, kv_cache, max_model_len, attn_num_splits, weight)
        self.norms_folded = fold_norms(model) if fold else getattr(model, "norms_folded", False)

    def setup_paged(
        self, model: nn.Module, kv_cache: PagedKVCache, max_model_len: int,
        attn_num_splits: int | None, weight: torch.Tensor,
    ) -> None:
        """Set what the sublayers read: ``model`` and its ``config`` (heads, head size,
        ``model_type``), the cache (checked against the config's ``num_hidden_layers`` layers of
        its KV shape and ``weight``'s dtype), the rotary table of ``model.rotary``, device and
        dtype of ``weight``. Draft runners built on these sublayers call it too.

        Raises:
            ValueError: a cache that does not match.
        """
        self.model = model
        config, num_layers = model.config, model.config.num_hidden_layers
        tp = config.tensor_parallel_size
        expected = ((config.num_key_value_heads // tp, config.head_dim),) * num_layers
        if kv_cache.spec.layer_shapes != expected:
            raise ValueError(f"KV cache {kv_cache.spec} does not match {num_layers} layers of the model")
        self.setup_cache(config, kv_cache, max_model_len, attn_num_splits, weight)
        self.has_qk_norm = config.model_type == "qwen3"
        # Row-parallel outputs are partial sums over the ranks (Megatron-LM).
        self.reduce = all_reduce if tp > 1 else (lambda x: x)
        # Up to FUSED_MAX_ROWS rows the sum is deferred to the next norm, fused with it.
        self.fused_reduce = (
            fused_all_reduce_add_norm(config.hidden_size, weight.dtype, weight.device) if tp > 1 else None
        )
        self.scale = config.head_dim**-0.5
        self.unit_norm = torch.ones(config.hidden_size, dtype=self.dtype, device=self.device)
        inv_freq = model.rotary.inv_freq.to(self.device)
        self.cos_sin_cache = build_cos_sin_cache(inv_freq, max_model_len)

    def setup_cache(
        self, config: ModelConfig, kv_cache: PagedKVCache, max_model_len: int,
        attn_num_splits: int | None, weight: torch.Tensor,
    ) -> None:
        """Set what every paged runner reads: ``config``, the cache, the device and dtype
        of ``weight`` (one of the layers' parameters), the block size and the block-table
        width ``max_blocks_per_req``.

        Raises:
            ValueError: a cache in another dtype.
        """
        if kv_cache.spec.dtype != weight.dtype:
            raise ValueError(f"KV cache dtype {kv_cache.spec.dtype} != model dtype {weight.dtype}")
        self.config = config
        self.kv_cache = kv_cache
        self.device = weight.device
        self.dtype = weight.dtype
        self.block_size = kv_cache.spec.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_req = cdiv(max_model_len, self.block_size)
        self.attn_num_splits = attn_num_splits

    def _attend(
        self, attn: LlamaAttention, qkv: torch.Tensor, positions: torch.Tensor, layer_idx: int,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        """``qkv [n, (heads + 2 * kv_heads) * head_dim]`` -> the attention output [n,
        heads * head_dim]: q/k norms (Qwen3), rotary with the cache write, attention."""
        n, head_dim = qkv.shape[0], attn.head_dim
        q, k, v = qkv.view(n, -1, head_dim).split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=1)
        if self.has_qk_norm:
            q = rms_norm(q.reshape(-1, head_dim), attn.q_norm.weight, attn.q_norm.eps).view_as(q)
            k = rms_norm(k.reshape(-1, head_dim), attn.k_norm.weight, attn.k_norm.eps).view_as(k)
        key_cache, value_cache = self.kv_cache.layer(layer_idx)
        if self.own_keys_only and not metadata.prefill and metadata.split is None and metadata.uniform_query_len:
            m = metadata.num_tokens  # decode, verification: rotary and the cache write inside
            out = paged_attention(
                q[:m], key_cache, value_cache, metadata.block_table, metadata.seq_lens, self.scale,
                metadata.uniform_query_len, num_splits=self.attn_num_splits,
                new_kv=(k[:m], v[:m], positions[:m], metadata.slot_mapping[:m], self.cos_sin_cache))
            return out.reshape(m, -1)
        rotary_embedding_and_cache(positions, q, k, v, key_cache, value_cache,
                                   metadata.slot_mapping, self.cos_sin_cache)
        out = attend(q, k, v, key_cache, value_cache, metadata, self.scale, self.attn_num_splits)
        # reshape: a one-request prefill's attention output may be a transposed view.
        return out.reshape(n, -1)

    def _norm_linear(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, sum_sq: torch.Tensor | None,
        norm: nn.Module | None, proj: nn.Linear, prefetch: torch.Tensor, silu_mul: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sublayer's input ``norm`` and first projection -> ``(output, residual stream)``. The
        stream is ``hidden + residual`` (``hidden`` when ``residual`` is None); ``norm=None``:
        ``hidden`` is the normed input already. With folded norms (:func:`fold_norms`) the norm is
        the GEMV's 1/rms epilogue when ``sum_sq`` (the stream's sums of squares) is given and the
        GEMV takes the shape (``prefetch``: :func:`gemv`'s), else the norm kernel with a unit weight."""
        if norm is None:
            normed, stream = hidden, residual
        elif sum_sq is not None and proj.bias is None and use_gemv(hidden, proj.weight):
            return gemv(hidden, proj.weight, silu_mul=silu_mul, rms=(sum_sq, norm.eps), prefetch=prefetch), hidden
        else:
            weight = self.unit_norm if self.norms_folded else norm.weight
            normed, stream = self._add_norm(hidden, residual, weight, norm.eps)
        if silu_mul:
            return linear_silu_and_mul(normed, proj.weight, proj.bias), stream
        return linear(normed, proj.weight, proj.bias), stream

    def _out_linear(
        self, x: torch.Tensor, proj: nn.Linear, stream: torch.Tensor, prefetch: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A sublayer's last projection -> ``(hidden, residual, sum_sq)`` for the next
        norm: with folded norms the GEMV's residual epilogue where it takes the shape
        (``(new stream, None, its sums of squares [n, P] float32)``), else ``(proj(x)``
        summed over the ranks, ``stream, None)``, the add left to the next norm kernel."""
        if self.norms_folded and proj.bias is None and use_gemv(x, proj.weight):
            out, sum_sq = gemv(x, proj.weight, residual=stream, prefetch=prefetch)
            return out, None, sum_sq
        if self._fuses_reduce(x):  # partial sums: the next _add_norm reduces them
            return linear(x, proj.weight, proj.bias), stream, None
        return self.reduce(linear(x, proj.weight, proj.bias)), stream, None

    def _fuses_reduce(self, x: torch.Tensor) -> bool:
        return self.fused_reduce is not None and x.shape[0] <= FUSED_MAX_ROWS

    def _add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`_add_norm`; with a residual and a fused reduce, ``x`` is the ranks'
        partial sums (:meth:`_out_linear`), summed in the same kernel."""
        if residual is not None and self._fuses_reduce(x):
            return self.fused_reduce(x, residual, weight, eps)
        return _add_norm(x, residual, weight, eps)

    def decoder(
        self, layers: Sequence[nn.Module], hidden: torch.Tensor, residual: torch.Tensor | None,
        positions: torch.Tensor, metadata: PagedAttentionMetadata, norm: nn.Module,
        aux_layer_ids: Sequence[int] = (), captured: dict[int, torch.Tensor] | None = None,
        sum_sq: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder ``layers``, then the final ``norm``, each norm fused with its
        residual add (with folded norms, :func:`fold_norms`, with the GEMVs around it).

        Args:
            hidden: with ``residual=None``, [n, H] the residual stream entering layer 0
                (the embeddings); else [n, width] layer 0's attention input, normed.
            residual: [n, H] the residual stream entering layer 0, or None.
            aux_layer_ids, captured: the residual stream entering each layer of
                ``aux_layer_ids`` goes in ``captured`` under the layer's index.
            sum_sq: ``hidden``'s sums of squares (``residual=None``) for a folded layer 0.

        Returns:
            ``(normed [n, H], residual stream [n, H])``.
        """
        assert sum_sq is None or (self.norms_folded and residual is None), "sum_sq: folded layer 0"
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            ln = layer.input_layernorm if i > 0 or residual is None else None
            qkv, stream = self._norm_linear(hidden, residual, sum_sq, ln, attn.qkv_proj, attn.o_proj.weight)
            if i in aux_layer_ids:
                captured[i] = stream
            out = self._attend(attn, qkv, positions, i, metadata)
            hidden, residual, sum_sq = self._out_linear(out, attn.o_proj, stream, mlp.gate_up_proj.weight)
            ln = layer.post_attention_layernorm
            act, stream = self._norm_linear(hidden, residual, sum_sq, ln, mlp.gate_up_proj, mlp.down_proj.weight,
                                            silu_mul=True)
            after = layers[i + 1].self_attn.qkv_proj.weight if i + 1 < len(layers) else None
            hidden, residual, sum_sq = self._out_linear(act, mlp.down_proj, stream, after)
        return self._add_norm(hidden, residual, norm.weight, norm.eps)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata,
        aux_layer_ids: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of a flattened batch, writing its keys and values to the cache
        (Gemma4: of its non-shared layers).

        Args:
            input_ids: [num_tokens] int64 token ids, request-major.
            positions: [num_tokens] int64 rotary positions (< ``max_model_len``).
            metadata: from :func:`~specula.runtime.worker.paged_kv.device_metadata` or
                :func:`~specula.runtime.worker.paged_kv.build_attention_metadata` (one
                for every layer: all share the block tables), whose ``block_table`` is
                ``max_blocks_per_req`` wide.
            aux_layer_ids: residual streams to return, Hugging Face ``output_hidden_states`` ids as
                in :meth:`LlamaForCausalLM.check_aux_hidden_state_layers` (``i``: the input of
                decoder layer ``i``; the number of layers: the last layer's output; EAGLE-3, arXiv
                2503.01840).

        Returns:
            ``(hidden [num_tokens, hidden_size] after the final norm, aux [num_tokens,
            len(aux_layer_ids) * hidden_size] or None)``.

        Raises:
            AssertionError: shapes or dtypes that do not match the above.
            ValueError: a batch :func:`attend` refuses.
        """
        assert input_ids.ndim == 1 and input_ids.shape == positions.shape
        assert input_ids.shape[0] == metadata.num_tokens
        assert positions.dtype == torch.int64
        assert metadata.block_table.shape[1] == self.max_blocks_per_req
        captured: dict[int, torch.Tensor] = {}
        hidden, captured[len(self.model.model.layers)] = self._run_layers(
            input_ids, positions, metadata, aux_layer_ids, captured)
        aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return hidden, aux

    def _run_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata,
        aux_layer_ids: Sequence[int], captured: dict[int, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding and :meth:`decoder`; returns ``(normed [num_tokens, hidden_size],
        the last layer's output)``."""
        model = self.model.model
        if self._fuses_reduce(input_ids):  # TP > 1: a vocabulary-parallel embedding, no folding
            ln = model.layers[0].input_layernorm  # the ranks' rows summed in layer 0's norm kernel
            hidden, residual = self.fused_reduce(model.embed_tokens(input_ids, reduce=False), None, ln.weight, ln.eps)
        else:
            hidden, residual = model.embed_tokens(input_ids), None  # [num_tokens, hidden_size]
        return self.decoder(model.layers, hidden, residual, positions, metadata, model.norm,
                            aux_layer_ids, captured)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, hidden_size] -> [num_positions, vocab_size] float32 logits."""
        return self.model.compute_logits(hidden)

    @torch.no_grad()
    def logits_and_argmax(self, hidden: torch.Tensor, need_logits: bool = True,
                          into: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """[num_positions, hidden_size] -> ``(logits [num_positions, vocab_size] in the model's
        dtype, greedy tokens [num_positions] int64)``: the LM head with the argmax fused in
        (:func:`~specula.runtime.kernels.gemv.linear_argmax`). Sharded, the logits are gathered,
        or without ``need_logits`` only each rank's best token (the logits then ``None``). Without
        ``need_logits`` and with the model's ``lm_head_screen`` set (a greedy draft at one rank):
        ``(None, tokens)`` from :func:`~specula.runtime.kernels.gemv.screened_argmax`.
        ``into``: a contiguous [num_positions] int64 tensor to write the tokens to (and return)."""
        screen = None if need_logits else getattr(self.model, "lm_head_screen", None)
        if screen is not None:
            return None, screened_argmax(hidden, self.model.lm_head_weight, screen, into)
        if self.config.tensor_parallel_size == 1:
            return linear_argmax(hidden, self.model.lm_head_weight, into)
        logits = self.model.vocab_logits(hidden) if need_logits else None
        tokens = self.model.vocab_argmax(hidden) if logits is None else logits.argmax(dim=-1)
        assert into is None or (into.shape == tokens.shape and into.stride(0) == 1)
        return logits, tokens if into is None else into.copy_(tokens)

    @staticmethod
    def last_token_indices(metadata: PagedAttentionMetadata) -> torch.Tensor:
        """[num_reqs] int64 row of each request's last query token (where a prefill samples)."""
        return metadata.query_start_loc[1:].long() - 1
