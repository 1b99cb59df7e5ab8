"""The engine: paged KV cache, continuous batching, per-request sampling and speculative
decoding, by the same code on a GPU (Triton kernels, CUDA graphs) or a CPU (torch).

One :meth:`LLMEngine.step` (Leviathan et al., arXiv 2211.17192; the step order of vLLM
Model Runner V2):

1. the :class:`~specula.runtime.engine.scheduler.PagedScheduler` picks the step's
   requests and gives each the KV slots the whole step may write;
2. the inputs are built on the device from the persistent
   :class:`~specula.runtime.engine.input_batch.InputBatch`; ONE target forward runs every
   running request's ``[last token, d_1 .. d_k]`` (or one token without drafts) and every
   admitted request's prompt; a batch without prefills replays a captured CUDA graph;
3. sampling on the device: the rejection sampler keeps an accepted prefix of the drafts
   plus one recovered or bonus token (greedy requests: exact argmax matching), prefills
   sample their first token; the persistent state is updated in place;
4. the speculator proposes the next drafts from this forward's inputs, metadata and
   hidden states (:meth:`~specula.runtime.spec_decode.base.BaseSpeculator.propose`);
5. the host reads the step's tokens and accepted counts (one copy, queued before the
   proposal so that its stop checks overlap the drafting) and applies stop conditions.

Log-probabilities are computed on the device for the rows that asked only (emitted
tokens under the target's processed distribution at their positions, prompt tokens from
the prefill's logits) and reach the host by a second non-blocking copy.

With asynchronous scheduling (the default on CUDA; vLLM's ``async_scheduling``), step 5 of one step
runs after steps 1-4 of the next are queued, from the state the device updated itself: the host's
scheduling, input preparation and stop checks overlap the device's work, which never waits for the
host. A request that finished is then part of one more step, whose tokens are dropped; its last
tokens are returned without waiting for that step, which the next call reads.

``k`` may depend on the batch size (:mod:`specula.runtime.engine.spec_schedule`): drafts
are proposed for the k of the step's batch, and the next step verifies the first
``k(surviving requests)`` of them (at most the k proposed). k changes between steps
without recapture (graphs exist for every k up to the maximum).

The engine is single-threaded and not thread-safe: call it from one thread.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specula.runtime.engine.block_manager import BlockManager, cdiv
from specula.runtime.engine.input_batch import InputBatch, to_device
from specula.runtime.engine.request import Request, RequestOutput, TokenLogprobs
from specula.runtime.engine.sampler import STREAM_TARGET, SamplingMetadata, sample, token_logprobs
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.engine.scheduler import PagedScheduler
from specula.runtime.engine.spec_schedule import SpeculativeSettings
from specula.runtime.engine.verification import verify
from specula.runtime.kernels.rejection_sampler import accepted_tokens
from specula.runtime.loader import resolve_model_uri
from specula.runtime.models.config import ModelConfig, eos_token_ids, resolve_dtype
from specula.runtime.models.layers import LOAD_FORMATS
from specula.runtime.models.registry import load_model
from specula.runtime.spec_decode.base import BaseSpeculator, ProposeInputs
from specula.runtime.spec_decode.metrics import SpecDecodingStats
from specula.runtime.spec_decode.registry import create_speculator
from specula.runtime.worker import create_model_runner
from specula.runtime.worker.cudagraph import CUDAGraphManager
from specula.runtime.worker.paged_kv import (
    KVCacheSpec,
    PagedKVCache,
    device_metadata,
    mark_prefills,
    num_blocks_from_free_memory,
)
from specula.runtime.worker.parallel import (
    broadcast_object,
    destroy_parallel,
    fused_workspace_bytes,
    get_parallel,
    min_over_ranks,
)

if TYPE_CHECKING:
    from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig

__all__ = ["LLMEngine", "RequestOutput", "SamplingParams", "create_engine"]


class LLMEngine(SpeculativeSettings):
    """Serves a target checkpoint, with or without a speculator.

    Args:
        target_dir: the resolved target checkpoint (Hugging Face layout).
        tokenizer: its tokenizer (stop strings, eos).
        served_model_name: as the runtime config names it.
        speculator_config: how drafts are proposed; ``None``: the target alone.
        dtype: ``auto``, ``bfloat16``, ``float16`` or ``float32``.
        max_model_len: context length; default the target's ``max_position_embeddings``.
        max_num_seqs: most requests in one step.
        device: ``cpu`` or a CUDA device.
        block_size: KV tokens per block (vLLM's default 16).
        num_gpu_blocks: KV blocks (each holds ``block_size`` tokens of every target and
            draft layer); default: on CUDA, as many as fit in ``gpu_memory_utilization``
            of the free memory after loading, less 1 GiB for activations and graphs; on
            a CPU, enough for ``max_num_seqs`` requests of ``max_model_len`` tokens.
        gpu_memory_utilization: fraction of the free memory the KV cache may take.
        max_num_batched_tokens: prefill tokens per step; default ``max(max_model_len, 2048)``.
        enforce_eager: no CUDA graphs (vLLM's flag of the same name).
        tensor_parallel_size: ranks the target is sharded over
            (:mod:`~specula.runtime.worker.parallel`; :func:`create_engine` starts them),
            each running this engine: the others replay rank 0's calls (:meth:`follow`).
        load_format: ``auto`` (checkpoint weights) or ``dummy`` (random weights from the
            configs, for benchmarks).
        synthetic_acceptance_rate: benchmarks only: accept each draft token with this
            probability given the ones before it, then the target's argmax, instead of
            verifying (vLLM's ``rejection_sample_method="synthetic"``).
        cudagraph_capture_sizes: request counts to capture graphs for; default 1, 2, 4,
            8, then multiples of 8 up to ``max_num_seqs``.
        enable_prefix_caching: reuse the KV blocks of cached prompt prefixes (vLLM's
            automatic prefix caching; :mod:`~specula.runtime.engine.block_manager`).
        async_scheduling: launch each step before reading the previous one's tokens
            (module docstring): :meth:`step` then returns the outputs of the step before
            the one it launched. Default: on for CUDA, off on a CPU.

    Raises:
        ValueError: an unknown ``load_format``; ``max_model_len`` above the target's limit; an
            architecture no paged runner serves (the message names it); a draft that does not fit
            the target (names the field and both values); a KV cache too small for one request of
            ``max_model_len`` tokens; ``tensor_parallel_size`` other than the group's size, a target
            it cannot shard (names the field and both values), ``draft_tensor_parallel_size`` other
            than 1 or ``tensor_parallel_size``, or a sharded draft the method cannot shard (only
            ``draft_model`` drafts can).
        UnsupportedSpeculatorMethod: the speculator method is not implemented.
        FileNotFoundError: a checkpoint is missing.
    """

    def __init__(self, target_dir: Path, tokenizer: Any, *, served_model_name: str,
                 speculator_config: SpeculatorRuntimeConfig | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 32,
                 device: str | torch.device = "cpu", block_size: int = 16,
                 num_gpu_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_batched_tokens: int | None = None, enforce_eager: bool = False,
                 tensor_parallel_size: int = 1, load_format: str = "auto",
                 synthetic_acceptance_rate: float | None = None,
                 cudagraph_capture_sizes: list[int] | None = None,
                 enable_prefix_caching: bool = True, async_scheduling: bool | None = None) -> None:
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")
        parallel = get_parallel()
        if tensor_parallel_size != parallel.world_size:
            raise ValueError(
                f"tensor_parallel_size {tensor_parallel_size} != the {parallel.world_size} "
                "ranks joined; start the engine with create_engine (specula serve)")
        draft_tp = getattr(speculator_config, "draft_tensor_parallel_size", 1)
        if draft_tp not in (1, tensor_parallel_size):
            raise ValueError(
                f"draft_tensor_parallel_size {draft_tp} must be 1 or tensor_parallel_size "
                f"({tensor_parallel_size})")
        self.tensor_parallel_size = tensor_parallel_size
        self._commands: list[tuple[str, tuple, dict]] | None = (
            [] if tensor_parallel_size > 1 and parallel.rank == 0 else None)
        """Rank 0 of several: the calls the other ranks replay before the next step."""
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.model_config = ModelConfig.from_pretrained(target_dir)
        limit = self.model_config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the target's max_position_embeddings {limit}"
            )
        self.max_model_len: int = max_model_len or limit
        self.max_num_seqs = max_num_seqs
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model_config, target_dir, tokenizer)
        self.init_speculative_settings(speculator_config)
        max_k = self.max_num_speculative_tokens
        self.last_step_num_reqs = 0
        """Requests in the last step that decoded or verified (0 when none did)."""
        self.last_step_num_speculative_tokens = 0
        """The k the last step verified (0: plain decoding, or no running request)."""
        self.spec_decoding_stats = SpecDecodingStats(num_spec_tokens=max_k)
        self.generation_tokens_total = 0
        """Tokens emitted to requests since start (a counter)."""
        self._pending: list[RequestOutput] = []
        self._generate_ids = itertools.count(1)
        self.dtype = resolve_dtype(dtype, self.model_config, self.device)
        self.synthetic_acceptance_rate = synthetic_acceptance_rate
        target_config = replace(self.model_config, tensor_parallel_size=tensor_parallel_size)
        model = load_model(target_dir, self.dtype, self.device, target_config, load_format)
        self.speculator: BaseSpeculator | None = None
        if speculator_config is not None:
            self.speculator = create_speculator(
                speculator_config, self.model_config, target_dir=target_dir,
                max_num_seqs=max_num_seqs, dtype=self.dtype, device=self.device,
                load_format=load_format)
        spec = self.speculator
        self.aux_hidden_state_layers: tuple[int, ...] = (
            model.check_aux_hidden_state_layers(spec.aux_hidden_state_layers) if spec else ())
        self.num_lookahead_tokens = spec.num_lookahead_tokens(max_k) if spec else 0
        # Positions reach the context, a verification (k + 1) and the drafts after it.
        runner_len = self.max_model_len + max_k + 1 + self.num_lookahead_tokens
        self.block_size = block_size
        target_spec = KVCacheSpec.from_model_config(model.config, self.dtype, block_size)
        draft_spec = spec.kv_cache_spec(block_size) if spec else None
        self.input_batch = InputBatch(
            max_num_seqs, cdiv(runner_len, block_size), max_k, self.vocab_size, self.device,
            token_capacity=runner_len if spec is not None and spec.needs_token_ids else None,
            keep_draft_probs=spec is not None and spec.keeps_draft_probs)
        if num_gpu_blocks is None:
            if self.device.type == "cuda":
                # The speculator's static buffers come later: keep their largest part.
                probs = 4 * max_num_seqs * max_k * self.vocab_size
                num_gpu_blocks = num_blocks_from_free_memory(
                    target_spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec else 0),
                    self.device, gpu_memory_utilization,
                    reserve_bytes=(1 << 30) + (probs if spec and spec.keeps_draft_probs else 0)
                    + fused_workspace_bytes(model.config.hidden_size, self.dtype))
            else:
                num_gpu_blocks = cdiv(max_num_seqs * runner_len, block_size)
            num_gpu_blocks = min_over_ranks(num_gpu_blocks)  # one scheduler for all ranks
        bm = BlockManager(num_gpu_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = PagedScheduler(
            bm, max_num_seqs, max_num_batched_tokens or max(self.max_model_len, 2048))
        # Most slots one request can hold: the whole pool minus the watermark.
        if (num_gpu_blocks - bm.watermark_blocks) * block_size < runner_len:
            raise ValueError(
                f"the KV cache ({num_gpu_blocks} blocks of {block_size} tokens) cannot hold "
                f"one request of max_model_len {self.max_model_len} tokens; lower "
                "max_model_len or raise gpu_memory_utilization")
        self.num_gpu_blocks = num_gpu_blocks
        self.runner = create_model_runner(
            model, PagedKVCache(target_spec, num_gpu_blocks, self.device), runner_len)
        if spec is not None:
            spec.bind_target(self.runner)
            spec.allocate_kv_cache(num_gpu_blocks, block_size, runner_len)
            spec.init_cudagraph_manager()
        self.graphs: CUDAGraphManager | None = None
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = CUDAGraphManager(
                self.runner, max_num_seqs, list(range(1, max_k + 2)),  # query tokens: 1 or k + 1
                capture_sizes=cudagraph_capture_sizes, aux_layer_ids=self.aux_hidden_state_layers)
            states = self.graphs.capture()
            if spec is not None:
                spec.capture(states)
        counts = torch.arange(1, max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self.cu_num_draft_tokens = {j: counts * j for j in range(max_k + 1)}
        """``k`` -> [max_num_seqs] int32 inclusive cumulative counts of ``k`` drafts each."""
        self._draft_k = 0
        """The k of the drafts the running requests hold (0: they decode one token)."""
        self.async_scheduling = (self.device.type == "cuda" if async_scheduling is None
                                 else async_scheduling)
        self._in_flight: _Launched | None = None
        """The last launched step, its tokens not read yet (asynchronous scheduling only)."""
        self._batch_cache: tuple[Any, ...] = (None, None, None)

    @classmethod
    def from_config(cls, config: RuntimeConfig, device: str | torch.device = "cpu") -> LLMEngine:
        """Resolve the config's URIs and load the target, the draft and the tokenizer
        (``transformers.AutoTokenizer`` from the target directory)."""
        from transformers import AutoTokenizer

        target_dir = resolve_model_uri(config.model, config.revision)
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        if config.chat_template is not None:
            tokenizer.chat_template = config.chat_template
        name = config.served_model_name or config.model.rstrip("/").rsplit("/", 1)[-1]
        return cls(
            target_dir, tokenizer, served_model_name=name, speculator_config=config.speculator,
            dtype=config.dtype, max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs, device=device,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager, tensor_parallel_size=config.tensor_parallel_size,
            load_format=config.load_format, enable_prefix_caching=config.enable_prefix_caching)

    # ---- requests -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue a request.

        Raises:
            ValueError: invalid sampling params, a duplicate ``request_id``, an empty
                prompt, a token id outside the vocabulary, or ``len(prompt_token_ids) +
                max_tokens > max_model_len`` (the cache always holds one request of
                ``max_model_len`` tokens: the constructor refuses a smaller one).
        """
        params.validate()
        if request_id in self.scheduler:
            raise ValueError(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self._add(request_id, list(prompt_token_ids), params, seed)

    def _add(self, request_id: str, tokens: list[int], params: SamplingParams, seed: int) -> None:
        self._mirror("_add", request_id, tokens, params, seed)
        self.scheduler.add(Request(request_id, tokens, params, self.eos_token_ids, seed))

    def _mirror(self, name: str, *args: Any, **kwargs: Any) -> None:
        if self._commands is not None:
            self._commands.append((name, args, kwargs))

    def set_speculative_config(self, *args: Any, **kwargs: Any) -> None:
        super().set_speculative_config(*args, **kwargs)
        self._mirror("set_speculative_config", *args, **kwargs)

    def abort_request(self, request_id: str) -> None:
        """Drop a request; the next :meth:`step` reports it finished with reason
        ``"abort"``. Unknown or finished ids are ignored."""
        self._mirror("abort_request", request_id)
        request = self.scheduler.remove(request_id)
        if request is not None:
            self.input_batch.remove(request)
            self._pending.append(RequestOutput(request_id, [], True, "abort"))

    def has_unfinished_requests(self) -> bool:
        """Whether :meth:`step` has work: requests waiting or running, outputs pending, or a
        step in flight (after a batch's last tokens, one the next call reads, emitting nothing)."""
        sched = self.scheduler
        return bool(sched.waiting or sched.running or self._pending or self._in_flight)

    def scheduler_stats(self) -> dict[str, int]:
        bm = self.scheduler.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_free_gpu_blocks": bm.num_free_blocks, "num_gpu_blocks": bm.num_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
        }

    # ---- stepping -------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns one output per request that produced tokens,
        finished, or was aborted since the last step. With several ranks, rank 0 first
        sends the other ranks the calls they replay before this step (:meth:`follow`)."""
        if self._commands is not None:
            commands, self._commands = self._commands, []
            broadcast_object(commands)
        finished = self._launch()
        if self.async_scheduling:
            finished, self._in_flight = self._in_flight, finished
        outputs, self._pending = self._pending, []
        if finished is not None:
            outputs += self._finish(finished)
        # A step in flight whose requests have all finished since its launch emits nothing:
        # the next call drains it, so that these outputs do not wait for it.
        for request in [r for r in self.scheduler.running if r.finished]:
            self.scheduler.remove(request.request_id)
            self.input_batch.remove(request)
        return outputs

    def follow(self) -> None:
        """The loop of a rank other than 0: replay rank 0's calls and steps until it
        sends ``None`` (:meth:`shutdown`). Collective: blocks until rank 0 steps."""
        while (commands := broadcast_object()) is not None:
            for name, args, kwargs in commands:
                getattr(self, name)(*args, **kwargs)
            self.step()

    def shutdown(self) -> None:
        """Rank 0 of several: end the other ranks' :meth:`follow` loops and leave the group
        with them (an undestroyed group hangs NCCL at exit); a no-op on any other rank."""
        if self._commands is not None:
            from specula.runtime.engine.distributed import stopping

            stopping.set()
            broadcast_object(None)
            self._commands = None
            destroy_parallel()

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run ``prompts`` to completion (batched) and return each one's output tokens, with no
        step left in flight when nothing else is queued."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, list[int]] = {}
        for prompt, p in zip(prompts, params_list, strict=True):
            request_id = f"generate-{next(self._generate_ids)}"
            self.add_request(request_id, prompt, p)
            results[request_id] = []
        while any(i in self.scheduler for i in results):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        if self._in_flight is not None and not (self.scheduler.waiting or self.scheduler.running):
            self.step()  # reads the step left in flight; with nothing scheduled it queues none
        return list(results.values())

    def _launch(self) -> _Launched | None:
        """Schedule a step and queue its device work (module docstring, steps 1-4) and host
        copy; ``None`` when there is nothing to run. With a step in flight, running requests
        also reserve KV slots for its query tokens (their lengths are known a step late)."""
        k = self._draft_k
        q = k + 1
        in_flight = self._in_flight.k + 1 if self._in_flight is not None else 0
        sched = self.scheduler.schedule(q + in_flight, self.num_lookahead_tokens)
        ib = self.input_batch
        for request in sched.preempted:
            ib.remove(request)
        decode, prefill = sched.decode, sched.prefill
        self.last_step_num_reqs = len(decode)
        self.last_step_num_speculative_tokens = k if decode else 0
        if not decode and not prefill:
            return None
        for request in prefill:
            ib.add(request)
        batch = decode + prefill
        for request in batch:
            ib.sync_blocks(request, self.scheduler.block_manager)
        ib.flush()
        nd, num_reqs = len(decode), len(batch)
        dev = self.device
        # The rows' [num_reqs] int64 ids and sampling settings, reused while neither the
        # rows nor the requests holding them change.
        key = (tuple(r.row for r in batch), ib.version)
        if key != self._batch_cache[0]:
            idx = to_device(key[0], torch.int64, dev)
            self._batch_cache = (key, idx, ib.sampling(idx, batch))
        _, idx, sampling = self._batch_cache
        idx_d = idx[:nd]

        # -- inputs and the target forward ----------------------------------------------
        prompt_lens = [len(r.token_ids) for r in prefill]
        cached = [r.num_computed_tokens for r in prefill]  # a reused prefix
        query_lens = [q] * nd + [n - c for n, c in zip(prompt_lens, cached, strict=True)]
        starts = ib.num_computed_tokens[idx]
        metadata, positions = device_metadata(ib.block_table[idx], starts, query_lens, self.block_size)
        mark_prefills(metadata, nd, cached)
        parts = []
        if nd:
            last = ib.last_token_ids[idx_d, None]
            parts.append(torch.cat([last, ib.draft_token_ids[idx_d, :k]], 1).reshape(-1))
        if prefill:
            tokens = [t for r in prefill for t in r.token_ids[r.num_computed_tokens :]]
            parts.append(to_device(tokens, torch.int64, dev))
        input_ids = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.graphs is not None:
            hidden, aux, descriptor = self.graphs.run(input_ids, positions, metadata)
        else:
            hidden, aux = self.runner.forward(input_ids, positions, metadata, self.aux_hidden_state_layers)
            descriptor = None

        # -- sampling and verification --------------------------------------------------
        # Draw keys: the position of the first token this step can emit.
        keys = starts + 1
        if prefill:
            keys = torch.cat([keys[:nd], to_device(prompt_lens, torch.int64, dev)])
        acc_d, outs = None, []
        # Log-probabilities: only of the rows that asked, with one width for the batch.
        num_top = max((t for r in batch for t in (r.params.logprobs, r.params.prompt_logprobs)
                       if t is not None), default=None)
        lp_parts: list[torch.Tensor] = []
        lp_rows: list[tuple[int, bool, int]] = []
        if nd:
            s_d = sampling.select(slice(0, nd)) if prefill else sampling
            logits, argmax = self.runner.logits_and_argmax(  # [nd * q, V] or None (greedy TP)
                hidden[: nd * q], not s_d.all_greedy or num_top is not None)
            if k > 0:
                out_d, acc_d = verify(ib, logits, idx_d, k, self.cu_num_draft_tokens[k][:nd], s_d,
                                      keys[:nd], self.synthetic_acceptance_rate, argmax)
            else:
                out_d = sample(logits, s_d, keys[:nd], STREAM_TARGET, argmax)[0][:, None]
            outs.append(out_d)  # [nd, q]
            self._output_logprobs(decode, 0, logits, s_d, out_d, num_top, lp_parts, lp_rows)
        if prefill:
            last_rows = metadata.query_start_loc[nd + 1 :].long() - 1
            s_p = sampling.select(slice(nd, num_reqs)) if nd else sampling
            logits, argmax = self.runner.logits_and_argmax(
                hidden[last_rows], not s_p.all_greedy or num_top is not None)
            first = sample(logits, s_p, keys[nd:], STREAM_TARGET, argmax)[0][:, None]  # [num_prefill, 1]
            outs.append(first.expand(-1, q))  # one width for the batch; the padding is not read
            self._output_logprobs(prefill, nd, logits, s_p, first, num_top, lp_parts, lp_rows)
            self._prompt_logprobs(prefill, nd, s_p, hidden[nd * q :], query_lens[nd:], num_top,
                                  lp_parts, lp_rows)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        # [num_reqs, 2 + q]: accepted and verified drafts (at most a row's real ones), the tokens.
        staged, next_tokens, committed = accepted_tokens(out, acc_d, ib.num_draft_tokens, idx,
                                                         keys, k, nd)
        num_accepted = staged[:, 0]
        ib.commit(idx, committed, next_tokens, out, num_accepted)
        for request in prefill:  # exact: a prefill commits its whole prompt
            request.num_computed_tokens = len(request.token_ids)
        # The step's only device-to-host copies (plain copies on a CPU, so that the host's
        # tensor is not the one the speculator reads), queued before the drafting so that
        # the host's stop checks overlap it.
        host = staged.to("cpu", non_blocking=True, copy=True)
        lp_host = torch.cat(lp_parts).to("cpu", non_blocking=True) if lp_parts else None
        ready = torch.cuda.current_stream().record_event() if dev.type == "cuda" else None

        # -- drafting ---------------------------------------------------------------------
        k_next = 0
        if self.speculator is not None:
            k_next = self.num_speculative_tokens_for(num_reqs)
            cu_num_draft_tokens = self.cu_num_draft_tokens[k][:num_reqs]
            if prefill:  # prefills verified no drafts
                cu_num_draft_tokens = cu_num_draft_tokens.clamp(max=k * nd)
            draft = self.speculator.propose(ProposeInputs(
                num_reqs=num_reqs, num_decode=nd, idx_mapping=idx, input_batch=ib,
                input_ids=input_ids, positions=positions, metadata=metadata,
                descriptor=descriptor, hidden_states=hidden, aux_hidden_states=aux,
                cu_num_draft_tokens=cu_num_draft_tokens, num_accepted=num_accepted,
                next_token_ids=next_tokens, next_positions=committed, sampling=sampling,
                num_speculative_tokens=k_next))
            if draft is None:
                k_next = 0
            else:
                ib.draft_token_ids[idx, :k_next] = draft.draft_token_ids
                if draft.num_draft_tokens is None:
                    # Not ``[idx] = k_next``: indexed assignment of a host scalar copies it
                    # to the device synchronously, which made the host wait for the step.
                    ib.num_draft_tokens.index_fill_(0, idx, k_next)
                else:
                    ib.num_draft_tokens[idx] = draft.num_draft_tokens
                if draft.draft_probs is not None and ib.draft_probs is not None:
                    ib.draft_probs[idx, :k_next] = draft.draft_probs
        self._draft_k = k_next
        return _Launched(batch, nd, k, host, ready, lp_host, lp_rows)

    def _output_logprobs(
        self, requests: list[Request], first_row: int, logits: torch.Tensor,
        sampling: SamplingMetadata, tokens: torch.Tensor, num_top: int | None,
        parts: list[torch.Tensor], rows: list[tuple[int, bool, int]]) -> None:
        """Queue the log-probabilities of ``tokens [n, P]``, sampled from ``logits [n * P,
        vocab_size]``, of the ``requests`` (batch positions ``first_row ..``) that asked."""
        asked = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if asked:
            sel = to_device(asked, torch.int64, self.device)
            lp = token_logprobs(logits.view(*tokens.shape, -1)[sel], sampling.select(sel),
                                tokens[sel], num_top)
            parts.append(lp.flatten(0, 1))  # [len(asked) * P, 1 + 2 * num_top]
            rows += [(first_row + i, False, tokens.shape[1]) for i in asked]

    def _prompt_logprobs(
        self, prefill: list[Request], nd: int, sampling: SamplingMetadata, hidden: torch.Tensor,
        query_lens: list[int], num_top: int | None, parts: list[torch.Tensor],
        rows: list[tuple[int, bool, int]]) -> None:
        """Queue the prompt log-probabilities due: from the logits at every prompt position
        but the last (``hidden``: the prefills' rows of the forward)."""
        start = 0
        for j, request in enumerate(prefill):
            n = query_lens[j]
            if request.params.prompt_logprobs is not None and request.num_output_tokens == 0:
                assert n == len(request.token_ids), "a prompt-logprobs prefill reused a prefix"
                if n > 1:
                    logits = self.runner.compute_logits(hidden[start : start + n - 1])
                    ids = to_device(request.token_ids[1:], torch.int64, self.device)
                    lp = token_logprobs(logits[None], sampling.select(slice(j, j + 1)),
                                        ids[None], num_top)
                    parts.append(lp[0])  # [n - 1, 1 + 2 * num_top]
                rows.append((nd + j, True, n - 1))
            start += n

    def _finish(self, step: _Launched) -> list[RequestOutput]:
        """Wait for ``step``'s tokens and accepted counts, then commit and emit them (stop
        conditions applied); requests finished, aborted or preempted since the launch get none."""
        if step.ready is not None:
            step.ready.synchronize()
        rows = step.host.tolist()
        logprobs: dict[tuple[int, bool], list[TokenLogprobs]] = {}
        values = [] if step.logprobs is None else step.logprobs.tolist()
        num_top = (len(values[0]) - 1) // 2 if values else 0
        start = 0
        for i, is_prompt, count in step.logprob_rows:
            params = step.batch[i].params
            top = params.prompt_logprobs if is_prompt else params.logprobs
            logprobs[i, is_prompt] = [
                TokenLogprobs(row[0], [(int(row[1 + num_top + t]), row[1 + t]) for t in range(top)])
                for row in values[start : start + count]]
            start += count
        outputs = []
        for i, request in enumerate(step.batch):
            if request.finished or request.row < 0:
                continue
            # A prefill's row verified and accepted nothing: it emits its first token.
            accepted, verified, *tokens = rows[i]
            if verified > 0:
                self.spec_decoding_stats.observe_draft(verified, accepted)
            new = request.append_tokens(tokens[: accepted + 1], self.tokenizer, self.max_model_len)
            self.generation_tokens_total += len(new)
            if i < step.num_decode:
                request.num_computed_tokens += accepted + 1
                self.scheduler.block_manager.cache_blocks(
                    request.request_id, request.token_ids, request.num_computed_tokens)
            outputs.append(RequestOutput(
                request.request_id, new, request.finished, request.finish_reason,
                request.stop_reason,
                logprobs=logprobs[i, False][: len(new)] if (i, False) in logprobs else None,
                prompt_logprobs=[None, *logprobs[i, True]] if (i, True) in logprobs else None))
        if not self.async_scheduling:
            # ``step``'s drafts were proposed before the host knew which requests finish;
            # the next step verifies no more of them than its own batch size asks for.
            survivors = sum(not r.finished for r in step.batch)
            k = self.num_speculative_tokens_for(survivors) if survivors else 0
            self._draft_k = min(self._draft_k, k)
        return outputs


@dataclass
class _Launched:
    """A step whose device work is queued and whose tokens the host has yet to read."""

    batch: list[Request]
    num_decode: int
    k: int
    """Drafts each running request verified (``k + 1``: the most tokens it can commit)."""
    host: torch.Tensor
    """[num_reqs, 2 + width] int64 on the host: accepted, verified, tokens."""
    ready: torch.cuda.Event | None
    """Recorded after the copies (CUDA); ``None``: ``host`` is ready."""
    logprobs: torch.Tensor | None
    """[num_rows, 1 + 2 * num_top] float32 on the host (:func:`token_logprobs`): the rows
    of :attr:`logprob_rows`, in order; ``None`` when there are none."""
    logprob_rows: list[tuple[int, bool, int]]
    """``(batch position, prompt or output, number of rows)`` of each request's block."""


def create_engine(config: RuntimeConfig) -> LLMEngine:
    """The engine ``specula serve`` runs for ``config``, on a CUDA device (``device``
    ``cuda``, or ``auto`` with a GPU visible) or the CPU; with ``tensor_parallel_size``
    N > 1, rank 0's (:func:`~specula.runtime.engine.distributed.launch`).

    Raises:
        ValueError: ``device: cuda`` without a visible GPU (or fewer than N); load
            errors of the engine.
    """
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is visible")
    if config.tensor_parallel_size > 1:
        from specula.runtime.engine.distributed import launch

        return launch(config, device)
    return LLMEngine.from_config(config, device)


def _eos_token_ids(config: ModelConfig, checkpoint_dir: Path, tokenizer: Any) -> frozenset[int]:
    """Union of the eos ids of ``config.json``, ``generation_config.json`` (which
    ``transformers.generate`` uses) and the tokenizer."""
    ids = set(config.eos_token_ids) | set(eos_token_ids(tokenizer))
    gen_path = checkpoint_dir / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)
