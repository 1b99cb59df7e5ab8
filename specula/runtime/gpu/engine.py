"""The GPU engine: paged KV cache, continuous batching, Triton kernels, CUDA graphs,
and EAGLE-3 speculative decoding with per-request sampling.

One :meth:`GPULLMEngine.step` (the order of vLLM's GPU model runner with its EAGLE
drafter; Leviathan et al., arXiv 2211.17192; EAGLE-3, arXiv 2503.01840):

1. the :class:`~specula.runtime.gpu.scheduler.PagedScheduler` picks the running
   requests and admits new ones by KV capacity (preempting by recompute when the
   running ones cannot grow);
2. ONE target forward runs every running request's ``[last token, d_1 .. d_k]``
   (``k + 1`` verification tokens; one token without speculation) and every admitted
   request's whole prompt; a batch without prefills replays the CUDA graph of its
   :class:`~specula.runtime.gpu.cudagraph.BatchExecutionDescriptor`, a mixed one runs
   eagerly (prefills attend over their own tokens, the rest over the paged cache);
3. sampling on the device with each request's temperature, top-k, top-p and seeded
   generator: the rejection-sampling kernel keeps an accepted prefix of the drafts plus
   one recovered or bonus token (greedy requests: exact argmax matching), prefills
   sample their first token; the host then reads the tokens once, for stop conditions;
4. the EAGLE-3 head's prefill over the same token slots (its graph reads the target
   graph's :class:`~specula.runtime.gpu.cudagraph.CapturedAttentionState`, vLLM PR
   #40410), the KV bookkeeping (accepted slots kept, the next verification's slots
   taken), and ``k - 1`` draft decode steps (one graph) propose the next ``k`` drafts.

The drafts are greedy (argmax over the draft vocabulary); the rejection sampler treats
them as one-hot proposals, which keeps every request's output distribution exactly the
target's. ``k`` changes between steps (admin API, per-batch-size schedule) without
recapturing: graphs exist for every ``k`` up to ``max_num_speculative_tokens``.

Targets: Llama and Qwen3 (:class:`~specula.runtime.gpu.model_runner.GPUModelRunner`),
alone or with ``eagle3``; Gemma4 text models
(:class:`~specula.runtime.gpu.gemma4_runner.GPUGemma4Runner`: sliding-window layers,
KV-shared layers reading their producer's cache), alone or with ``gemma4_mtp``
(:class:`~specula.runtime.gpu.gemma4_mtp.GPUGemma4AssistantRunner`: Q-only draft layers
on the target's KV, the whole k-step loop in one CUDA graph). :func:`gpu_engine_unsupported_reason` says why
another configuration runs on the slot engine instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specula.runtime.engine.engine_base import EngineBase
from specula.runtime.engine.request import Request
from specula.runtime.engine.sampler import (
    SamplingMetadata,
    compute_probs,
    random_exponential,
    random_uniform,
    sample,
)
from specula.runtime.gpu.block_manager import BlockManager
from specula.runtime.gpu.cudagraph import CUDAGraphManager
from specula.runtime.gpu.draft_graphs import (
    DraftBuffers,
    DraftDecodeGraphManager,
    DraftPrefillGraphManager,
    draft_decode,
    draft_prefill,
    set_decode_metadata,
)
from specula.runtime.gpu.eagle3_runner import GPUEagle3Runner
from specula.runtime.gpu.gemma4_mtp import Gemma4DraftGraphManager, GPUGemma4AssistantRunner
from specula.runtime.gpu.gemma4_runner import GPUGemma4Runner
from specula.runtime.gpu.model_runner import SUPPORTED_MODELS, GPUModelRunner
from specula.runtime.gpu.paged_kv import (
    KVCacheSpec,
    PagedKVCache,
    metadata_from_block_manager,
    num_blocks_from_free_memory,
)
from specula.runtime.gpu.per_layer_kv import PerLayerKVCacheSpec, PerLayerPagedKVCache
from specula.runtime.gpu.scheduler import PagedScheduler
from specula.runtime.kernels.rejection_sampler import rejection_sample
from specula.runtime.models.config import ModelConfig, resolve_dtype
from specula.runtime.models.gemma4 import Gemma4ForCausalLM
from specula.runtime.models.gemma4_assistant import load_gemma4_assistant
from specula.runtime.models.llama_eagle3 import load_eagle3_draft, share_target_weights
from specula.runtime.models.registry import MODEL_REGISTRY, load_model

if TYPE_CHECKING:
    from specula.api.runtime_config import SpeculatorRuntimeConfig

GPU_ENGINE_METHODS = ("eagle3",)
"""Speculator methods the GPU engine runs (besides none)."""


def gpu_engine_unsupported_reason(config: ModelConfig, speculator_method: str | None) -> str | None:
    """Why the GPU engine cannot serve this target/speculator pair (``None``: it can)."""
    model_cls = MODEL_REGISTRY.get(config.architecture)
    if model_cls is Gemma4ForCausalLM:
        if getattr(config, "enable_moe_block", False):
            return "the mixture-of-experts Gemma4 has no paged GPU runner"
        if speculator_method not in (None, "gemma4_mtp"):
            return f"speculator method {speculator_method!r} has no paged GPU path for Gemma4"
        return None
    if speculator_method == "gemma4_mtp":
        return "gemma4_mtp drafts for Gemma4 targets only"
    if model_cls not in SUPPORTED_MODELS:
        return f"architecture {config.architecture!r} has no paged GPU runner"
    if speculator_method is not None and speculator_method not in GPU_ENGINE_METHODS:
        return f"speculator method {speculator_method!r} has no paged GPU path"
    return None


class GPULLMEngine(EngineBase):
    """Paged, continuously batched engine on the GPU kernels.

    Args:
        target_dir, tokenizer, model_uri, served_model_name, speculator_config, dtype,
        max_model_len, max_num_seqs: as :class:`~specula.runtime.engine.llm_engine.LLMEngine`.
        device: a CUDA device; a CPU device runs the same code eagerly (Triton in its
            interpreter, ``TRITON_INTERPRET=1``) and needs ``num_gpu_blocks``.
        draft_dir: the resolved EAGLE-3 checkpoint (``speculator_config.model``).
        block_size: KV tokens per block (vLLM's default 16).
        num_gpu_blocks: KV blocks (each holds ``block_size`` tokens of every target and
            draft layer); default: as many as fit in ``gpu_memory_utilization`` of the
            device's free memory after loading, less 1 GiB for activations and graphs.
        gpu_memory_utilization: fraction of the free memory the KV cache may take.
        max_num_batched_tokens: prompt tokens prefilled per step; default
            ``max(max_model_len, 2048)``.
        enforce_eager: no CUDA graphs (vLLM's flag of the same name).

    Raises:
        ValueError: a configuration :func:`gpu_engine_unsupported_reason` refuses; an
            EAGLE-3 checkpoint that does not fit the target; a KV cache too small for
            one request of ``max_model_len`` tokens; ``max_model_len`` above the
            target's limit; a CPU device without ``num_gpu_blocks``.
        FileNotFoundError: a checkpoint is missing.
    """

    def __init__(
        self,
        target_dir: Path,
        tokenizer: Any,
        *,
        model_uri: str,
        served_model_name: str,
        speculator_config: SpeculatorRuntimeConfig | None = None,
        draft_dir: Path | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 32,
        device: str | torch.device = "cuda",
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self._init_engine(
            target_dir,
            tokenizer,
            model_uri=model_uri,
            served_model_name=served_model_name,
            speculator_config=speculator_config,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            device=device,
        )
        method = speculator_config.method if speculator_config is not None else None
        reason = gpu_engine_unsupported_reason(self.model_config, method)
        if reason is not None:
            raise ValueError(f"the GPU engine cannot serve this model: {reason}")
        if method is not None and draft_dir is None:
            raise ValueError(f"speculator method {method!r} needs its checkpoint (draft_dir)")
        self.dtype = resolve_dtype(dtype, self.model_config, self.device)
        max_k = self.max_num_speculative_tokens
        # Positions reach the context plus a verification (k + 1) plus the next
        # verification's drafts; the block table and the rotary table cover them.
        runner_len = self.max_model_len + 2 * max_k + 2
        model = load_model(target_dir, self.dtype, self.device, self.model_config)
        head = None
        assistant = None
        self.aux_layer_ids: tuple[int, ...] = ()
        if method == "gemma4_mtp":
            assistant = load_gemma4_assistant(draft_dir, self.dtype, self.device)
        elif method is not None:
            head = load_eagle3_draft(draft_dir, self.model_config, self.dtype, self.device)
            share_target_weights(head, model.model.embed_tokens, model.lm_head_weight)
            self.aux_layer_ids = model.check_aux_hidden_state_layers(
                head.eagle.aux_hidden_state_layer_ids
            )
        is_gemma4 = isinstance(model, Gemma4ForCausalLM)
        target_spec = (
            PerLayerKVCacheSpec.from_model_config(model.config, self.dtype, block_size)
            if is_gemma4
            else KVCacheSpec.from_model_config(self.model_config, self.dtype, block_size)
        )
        draft_spec = None
        if head is not None:
            draft_spec = KVCacheSpec(
                len(head.layers),
                head.config.num_key_value_heads,
                head.config.head_dim,
                block_size,
                self.dtype,
            )
        if num_gpu_blocks is None:
            if self.device.type != "cuda":
                raise ValueError("num_gpu_blocks must be given on a device other than CUDA")
            num_gpu_blocks = num_blocks_from_free_memory(
                sum(spec.bytes_per_block for spec in (target_spec, draft_spec) if spec),
                self.device,
                gpu_memory_utilization,
            )
        lookahead = max_k + 1
        if num_gpu_blocks * block_size < self.max_model_len + 2 * lookahead:
            raise ValueError(
                f"the KV cache ({num_gpu_blocks} blocks of {block_size} tokens) cannot hold "
                f"one request of max_model_len {self.max_model_len} tokens; lower "
                "max_model_len or raise gpu_memory_utilization"
            )
        self.num_gpu_blocks = num_gpu_blocks
        if is_gemma4:
            self.target = GPUGemma4Runner(
                model, PerLayerPagedKVCache(target_spec, num_gpu_blocks, self.device), runner_len
            )
        else:
            self.target = GPUModelRunner(
                model, PagedKVCache(target_spec, num_gpu_blocks, self.device), runner_len
            )
        self.draft: GPUEagle3Runner | None = None
        self.buffers: DraftBuffers | None = None
        if head is not None:
            self.draft = GPUEagle3Runner(
                head, PagedKVCache(draft_spec, num_gpu_blocks, self.device), runner_len
            )
            self.buffers = DraftBuffers(self.draft, max_num_seqs, max_k)
        self.assistant: GPUGemma4AssistantRunner | None = None
        if assistant is not None:
            self.assistant = GPUGemma4AssistantRunner(assistant, self.target)
        self.draft_token_ids = (
            self.buffers.draft_token_ids
            if self.buffers is not None
            else torch.zeros(max_num_seqs, max(max_k, 1), dtype=torch.int64, device=self.device)
        )
        """[max_num_seqs, max_k] the drafts of the next verification, by request row."""
        self.cu_num_draft_tokens = {
            j: torch.arange(1, max_num_seqs + 1, dtype=torch.int32, device=self.device) * j
            for j in range(max_k + 1)
        }
        """``k`` -> [max_num_seqs] int32 inclusive cumulative counts of ``k`` drafts each."""
        self.scheduler = PagedScheduler(
            BlockManager(num_gpu_blocks, block_size),
            max_num_seqs,
            max_num_batched_tokens or max(self.max_model_len, 2048),
            lookahead,
        )
        self.use_cuda_graphs = self.device.type == "cuda" and not enforce_eager
        self.target_graphs: CUDAGraphManager | None = None
        self.prefill_graphs: DraftPrefillGraphManager | None = None
        self.decode_graphs: DraftDecodeGraphManager | None = None
        self.assistant_graphs: Gemma4DraftGraphManager | None = None
        if self.use_cuda_graphs:
            self._capture(max_num_seqs, max_k)
        self._draft_k = 0
        """The k of the drafts the running requests hold (0: they decode one token)."""
        self._draft_rows: dict[Request, int] = {}
        self._next_verify: tuple | None = None
        """``(request ids, k, metadata, positions)`` of the next verification, built while
        drafting (the draft decode steps write at its slots)."""
        """Row of each running request's drafts in ``buffers``."""

    @classmethod
    def from_config(cls, config: Any, device: str | torch.device = "cuda") -> GPULLMEngine:
        """Resolve a ``RuntimeConfig``'s URIs and load the target, the EAGLE-3 head and
        the tokenizer (``transformers.AutoTokenizer``)."""
        from transformers import AutoTokenizer

        from specula.runtime.loader import resolve_model_uri

        target_dir = resolve_model_uri(config.model, config.revision)
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        spec = config.speculator
        draft_dir = resolve_model_uri(spec.model) if spec is not None and spec.model else None
        return cls(
            target_dir,
            tokenizer,
            model_uri=config.model,
            served_model_name=(
                config.served_model_name or config.model.rstrip("/").rsplit("/", 1)[-1]
            ),
            speculator_config=spec,
            draft_dir=draft_dir,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            device=device,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager,
        )

    def _capture(self, max_num_seqs: int, max_k: int) -> None:
        """Target graphs for decode (query 1) and every verification width (``k + 1``,
        ``k`` up to ``max_k``); with a head, its prefill graphs on the target's captured
        attention states and its decode-step graphs."""
        query_lens = [1] + [k + 1 for k in range(1, max_k + 1)]
        self.target_graphs = CUDAGraphManager(
            self.target, max_num_seqs, query_lens, aux_layer_ids=self.aux_layer_ids
        )
        self.target_graphs.capture()
        if self.assistant is not None and max_k > 0:
            self.assistant_graphs = Gemma4DraftGraphManager(self.assistant, max_num_seqs, max_k)
            self.assistant_graphs.capture()
        if self.draft is None:
            return
        self.prefill_graphs = DraftPrefillGraphManager(
            self.draft, self.buffers, self.target_graphs, reuse_target_state=True
        )
        # Also after plain decode steps (k = 0): the head's KV then stays complete, so
        # drafting can resume when k is raised again.
        self.prefill_graphs.capture(self.target_graphs.descriptors())
        self.decode_graphs = DraftDecodeGraphManager(
            self.draft,
            self.buffers,
            self.target_graphs.capture_sizes,
            [k - 1 for k in range(2, max_k + 1)],
        )
        self.decode_graphs.capture()

    def scheduler_stats(self) -> dict[str, int]:
        bm = self.scheduler.block_manager
        return {
            **super().scheduler_stats(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_free_gpu_blocks": bm.num_free_blocks,
            "num_gpu_blocks": bm.num_blocks,
        }

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        """As :meth:`EngineBase.add_request`; also refuses a request the whole KV cache
        could not hold.

        Raises:
            ValueError: as the base, or prompt plus ``max_tokens`` above the cache's
                capacity.
        """
        limit = self.scheduler.max_request_tokens()
        if len(prompt_token_ids) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens "
                f"({params.max_tokens}) exceeds the KV cache's capacity of {limit} tokens"
            )
        super().add_request(request_id, prompt_token_ids, params)

    # ---- one step -------------------------------------------------------------------

    def _run_step(self, emitted: dict[Request, list[int]]) -> None:
        sched = self.scheduler.schedule()
        decode, prefill = sched.decode, sched.prefill
        k = self._draft_k if decode else 0
        self.last_step_num_reqs = len(decode)
        self.last_step_num_speculative_tokens = k if decode else 0
        if not decode and not prefill:
            return
        batch = decode + prefill
        num_decode, num_prefill = len(decode), len(prefill)
        q = k + 1
        bm = self.scheduler.block_manager
        ids = [r.request_id for r in batch]
        query_lens = [q] * num_decode + [len(r.token_ids) for r in prefill]
        cached, self._next_verify = self._next_verify, None
        if not prefill and cached is not None and cached[:2] == (tuple(ids), k):
            # The drafting at the end of the last step built this verification's
            # metadata already, and nothing was admitted, preempted or aborted since.
            metadata, positions = cached[2], cached[3]
        else:
            metadata, positions = metadata_from_block_manager(
                bm, ids, query_lens, self.target.max_blocks_per_req, self.device
            )
        input_ids, drafts = self._input_ids(decode, prefill, k)
        graphed = None
        if self.target_graphs is not None and not prefill:
            graphed = self.target_graphs.descriptor_for(num_decode, q)
            hidden, aux = self.target_graphs.run_with_aux(input_ids, positions, metadata)
        else:
            hidden, aux = self.target.forward(input_ids, positions, metadata, self.aux_layer_ids)
        n_dec = num_decode * q
        rows = torch.arange(n_dec, device=self.device)
        if num_prefill:
            last = self.target.last_token_indices(metadata)[num_decode:]
            rows = torch.cat([rows, last])
        logits = self.target.compute_logits(hidden[rows])  # [n_dec + num_prefill, V]
        out_dec = acc_dec = None
        if num_decode:
            out_dec, acc_dec = self._sample_decode(logits[:n_dec], decode, drafts, k)
        first = None
        if num_prefill:
            first, _ = sample(logits[n_dec:], self._sampling(prefill))
        # The one wait for the device per step: stop conditions are checked on the host.
        host_out = out_dec.tolist() if out_dec is not None else []
        host_acc = acc_dec.tolist() if acc_dec is not None else []
        host_first = first.tolist() if first is not None else []
        for request, tokens, accepted in zip(decode, host_out, host_acc, strict=True):
            if k > 0:
                self.spec_decoding_stats.observe_draft(k, accepted)
            self._emit(request, tokens[: accepted + 1], emitted)
        for request, token in zip(prefill, host_first, strict=True):
            self._emit(request, [token], emitted)
        survivors = [i for i, r in enumerate(batch) if not r.finished]
        k_next = self.num_speculative_tokens_for(len(survivors)) if survivors else 0
        if self.draft is not None:
            next_tokens = first if out_dec is None else out_dec.gather(1, acc_dec[:, None])[:, 0]
            if out_dec is not None and first is not None:
                next_tokens = torch.cat([next_tokens, first])
            self._draft_prefill(
                metadata,
                input_ids,
                positions,
                aux,
                acc_dec,
                next_tokens,
                num_decode,
                num_prefill,
                k,
                graphed,
            )
        elif self.assistant is None:
            k_next = 0
        alive = [batch[i] for i in survivors]
        for request in alive:
            self.scheduler.finish_step(request, k_next + 1)
        self._draft_k = k_next
        self._draft_rows = {r: i for i, r in enumerate(alive)}
        if self.draft is not None and alive:
            self._propose(alive, survivors, k_next)
        elif self.assistant is not None and alive and k_next > 0:
            self._propose_gemma4(hidden, batch, survivors, host_acc, k, k_next)

    def _sampling(self, requests: list[Request]) -> SamplingMetadata:
        return SamplingMetadata.from_params(
            [r.params for r in requests], [r.generator for r in requests], self.device
        )

    def _input_ids(
        self, decode: list[Request], prefill: list[Request], k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(input_ids [num_tokens] int64, drafts [num_decode * k] int64 or None)``:
        each decode request's last token and drafts, then each prefill's tokens."""
        pin = self.device.type == "cuda"
        parts = []
        drafts = None
        if decode:
            last = torch.tensor([r.token_ids[-1] for r in decode], pin_memory=pin)
            last = last.to(self.device, non_blocking=pin)[:, None]
            if k > 0:
                rows = torch.tensor([self._draft_rows[r] for r in decode], pin_memory=pin)
                drafts = self.draft_token_ids[rows.to(self.device, non_blocking=pin), :k]
                last = torch.cat([last, drafts], dim=1)
                drafts = drafts.reshape(-1)
            parts.append(last.reshape(-1))
        if prefill:
            host = torch.tensor([t for r in prefill for t in r.token_ids], pin_memory=pin)
            parts.append(host.to(self.device, non_blocking=pin))
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), drafts

    def _sample_decode(
        self,
        logits: torch.Tensor,
        decode: list[Request],
        drafts: torch.Tensor | None,
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling of the decode rows (``logits [num_decode * (k + 1), V]``,
        ``drafts [num_decode * k]``).

        Returns:
            ``(output [num_decode, k + 1] int64, num_accepted [num_decode] int64)``; with
            ``k = 0`` one sampled token per request and no acceptance.
        """
        r = len(decode)
        part = self._sampling(decode)
        if k == 0:
            tokens, _ = sample(logits, part)
            return tokens[:, None], torch.zeros(r, dtype=torch.int64, device=self.device)
        vocab = logits.shape[-1]
        assert drafts is not None and drafts.shape == (r * k,)
        cu = self.cu_num_draft_tokens[k][:r]
        argmax = logits.argmax(dim=-1)
        if part.all_greedy:
            return rejection_sample(drafts, cu, argmax, k)
        probs = compute_probs(logits.view(r, k + 1, vocab), part).view(-1, vocab)
        return rejection_sample(
            drafts,
            cu,
            argmax,
            k,
            is_greedy=part.is_greedy,
            target_probs=probs,
            uniform_samples=random_uniform((k,), part.generators, self.device).view(-1),
            exponential_noise=random_exponential((vocab,), part.generators, self.device),
        )

    def _draft_prefill(
        self,
        metadata,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        aux: torch.Tensor,
        accepted: torch.Tensor | None,
        next_tokens: torch.Tensor,
        num_decode: int,
        num_prefill: int,
        k: int,
        graphed,
    ) -> None:
        """The head's forward over this step's token slots: its KV for the verified
        (or prompt) positions and the first draft of every request in batch order."""
        buf = self.buffers
        r = num_decode + num_prefill
        buf.num_accepted.zero_()
        if accepted is not None:
            buf.num_accepted[:num_decode] = accepted
        buf.next_token_ids[:r] = next_tokens
        if graphed is not None and graphed in self.prefill_graphs.graphs:
            self.prefill_graphs.run(graphed)
            return
        if num_prefill == 0:
            counts: int | torch.Tensor = k
        else:
            per_req = torch.tensor([k] * num_decode + [0] * num_prefill, dtype=torch.int32)
            counts = per_req.cumsum(0, dtype=torch.int32).to(self.device)
        draft_prefill(self.draft, buf, metadata, input_ids, positions, aux, counts)

    def _propose(self, alive: list[Request], survivors: list[int], k_next: int) -> None:
        """Move the survivors' first drafts to rows ``0..len(alive)-1`` and run the
        ``k_next - 1`` draft decode steps at the next verification's slots."""
        buf = self.buffers
        r = len(alive)
        if survivors != list(range(r)):
            idx = torch.tensor(survivors, device=self.device)
            buf.draft_token_ids[:r, 0] = buf.draft_token_ids[idx, 0]
            buf.draft_hidden[:r] = buf.draft_hidden[idx]
        if k_next <= 1:
            return
        metadata, positions = metadata_from_block_manager(
            self.scheduler.block_manager,
            [req.request_id for req in alive],
            [k_next + 1] * r,
            self.draft.max_blocks_per_req,
            self.device,
        )
        self._next_verify = (tuple(req.request_id for req in alive), k_next, metadata, positions)
        if self.decode_graphs is None:
            set_decode_metadata(buf, metadata, positions, k_next)
            draft_decode(self.draft, buf, r, k_next - 1)
        else:
            padded = self.decode_graphs.padded_num_reqs(r)
            set_decode_metadata(buf, metadata, positions, k_next, padded)
            self.decode_graphs.run(r, k_next - 1)

    def _propose_gemma4(
        self,
        hidden: torch.Tensor,
        batch: list[Request],
        survivors: list[int],
        accepted: list[int],
        k: int,
        k_next: int,
    ) -> None:
        """The Gemma4 assistant's ``k_next`` drafts for the surviving requests: each
        reads its last emitted token and the target's final hidden state at the row
        before it (the last accepted verification row, or a prompt's last row), at the
        constant position of that token, over the committed target KV."""
        num_decode = len(accepted)
        q = k + 1
        rows, tokens, positions = [], [], []
        offset = num_decode * q
        for i, request in enumerate(batch):
            if i < num_decode:
                row = i * q + accepted[i]
            else:
                offset += len(request.token_ids) - 1  # its prompt (one token since)
                row = offset - 1
            if not request.finished:
                rows.append(row)
                tokens.append(request.token_ids[-1])
                positions.append(len(request.token_ids) - 1)
        assert len(rows) == len(survivors)
        pin = self.device.type == "cuda"

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, pin_memory=pin).to(
                self.device, non_blocking=pin
            )

        bm = self.scheduler.block_manager
        width = self.target.max_blocks_per_req
        tables = [bm.block_table(batch[i].request_id) for i in survivors]
        block_table = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, pin_memory=pin
        ).to(self.device, non_blocking=pin)
        backbone = hidden[dev(rows)]
        runner = self.assistant_graphs if self.assistant_graphs is not None else self.assistant
        drafts = runner.propose(dev(tokens), backbone, dev(positions), block_table, k_next)
        self.draft_token_ids[: len(rows), :k_next] = drafts
