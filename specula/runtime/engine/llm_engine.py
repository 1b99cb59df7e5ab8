"""The synchronous engine: admits requests, prefills them, and runs speculative steps.

One :meth:`LLMEngine.step` admits waiting requests into free slots and prefills them on
the target (each emits its first token), then runs one speculative step for every
running request: the speculator proposes ``k`` draft tokens, the target scores the last
emitted token plus the ``k`` drafts in ONE batched forward, and the rejection sampler
(Leviathan et al., arXiv 2211.17192) keeps an accepted prefix plus one recovered or
bonus token. Rejected positions are rolled back by lowering cache lengths. Without a
speculator (or with ``k = 0``) the step decodes one token per request.

``k`` is either one configured value or, with a per-batch-size schedule
(:mod:`specula.runtime.engine.spec_schedule`), looked up each step from the number of
requests in that step's speculative round. Both change only between steps.

The engine is single-threaded and not thread-safe: call it from one thread.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specula.runtime.engine.engine_base import EngineBase
from specula.runtime.engine.model_runner import ModelRunner
from specula.runtime.engine.request import Request, RequestOutput
from specula.runtime.engine.sampler import SamplingMetadata, sample
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.engine.scheduler import Scheduler
from specula.runtime.engine.spec_schedule import SpeculativeConfigError
from specula.runtime.loader import resolve_model_uri
from specula.runtime.models.config import resolve_dtype
from specula.runtime.models.registry import load_model
from specula.runtime.spec_decode.base import (
    BaseSpeculator,
    SpeculatorInput,
    TargetHiddenStates,
)
from specula.runtime.spec_decode.metrics import SpecDecodingStats
from specula.runtime.spec_decode.registry import create_speculator
from specula.runtime.spec_decode.rejection_sampler import rejection_sample

if TYPE_CHECKING:
    from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig

logger = logging.getLogger(__name__)

__all__ = [
    "LLMEngine",
    "create_engine",
    "RequestOutput",
    "SamplingParams",
    "SpecDecodingStats",
    "SpeculativeConfigError",
]


class LLMEngine(EngineBase):
    """Target model with one KV-cache slot per request, any speculator, on the CPU or
    a GPU (plain torch); see :class:`~specula.runtime.gpu.engine.GPULLMEngine` for the
    paged, continuously batched GPU engine."""

    def __init__(
        self,
        target_dir: Path,
        tokenizer: Any,
        *,
        model_uri: str,
        served_model_name: str,
        speculator_config: SpeculatorRuntimeConfig | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 32,
        device: str | torch.device = "cpu",
    ) -> None:
        """Load the target (and the speculator's draft) from local directories.

        Raises:
            ValueError: ``max_model_len`` above the target's ``max_position_embeddings``;
                draft and target vocabularies differ; an unknown dtype.
            UnsupportedSpeculatorMethod: the speculator method is not implemented.
            FileNotFoundError: a checkpoint is missing.
        """
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
        self.dtype = resolve_dtype(dtype, self.model_config, self.device)
        self.speculator: BaseSpeculator | None = None
        if speculator_config is not None:
            self.speculator = create_speculator(
                speculator_config,
                self.model_config,
                target_dir=target_dir,
                max_num_seqs=max_num_seqs,
                max_model_len=self.max_model_len,
                dtype=self.dtype,
                device=self.device,
            )
        model = load_model(target_dir, self.dtype, self.device, self.model_config)
        # Verification writes k positions past the last emitted token.
        self.runner = ModelRunner(
            model, max_num_seqs, self.max_model_len + self.max_num_speculative_tokens, self.device
        )
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        """Target layers whose hidden states the speculator consumes (EAGLE-3)."""
        if self.speculator is not None:
            self.aux_hidden_state_layers = model.check_aux_hidden_state_layers(
                self.speculator.aux_hidden_state_layers
            )
            self.speculator.bind_target(self.runner)
            self.speculator.init_cudagraph_manager()
            self.speculator.capture()
        self.scheduler = Scheduler(max_num_seqs)

    @classmethod
    def from_config(cls, config: RuntimeConfig, device: str | torch.device = "cpu") -> LLMEngine:
        """Resolve the config's URIs and load the target, the draft and the tokenizer
        (``transformers.AutoTokenizer`` from the target directory)."""
        from transformers import AutoTokenizer

        target_dir = resolve_model_uri(config.model, config.revision)
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        name = config.served_model_name or config.model.rstrip("/").rsplit("/", 1)[-1]
        return cls(
            target_dir,
            tokenizer,
            model_uri=config.model,
            served_model_name=name,
            speculator_config=config.speculator,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            device=device,
        )

    # ---- stepping -------------------------------------------------------------------

    def _run_step(self, emitted: dict[Request, list[int]]) -> None:
        admitted = self.scheduler.admit()
        if admitted:
            self._prefill(admitted, emitted)
        active = [r for r in self.scheduler.running if not r.finished]
        k = self.num_speculative_tokens_for(len(active)) if active else 0
        self.last_step_num_reqs, self.last_step_num_speculative_tokens = len(active), k
        if active:
            if k > 0:
                self._speculative_step(active, k, emitted)
            else:
                self._decode_step(active, emitted)

    def _sampling(self, requests: list[Request]) -> SamplingMetadata:
        return SamplingMetadata.from_params(
            [r.params for r in requests], [r.generator for r in requests], self.device
        )

    def _target_forward(
        self,
        slots: list[int],
        input_ids: torch.Tensor,
        query_lens: list[int],
        starts: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward; also returns the aux hidden states the speculator needs."""
        return self.runner.forward_with_aux(
            slots, input_ids, query_lens, starts, self.aux_hidden_state_layers
        )

    def _observe_target(
        self,
        slots: list[int],
        starts: list[int],
        query_lens: list[int],
        num_committed: list[int],
        hidden: torch.Tensor,
        aux: torch.Tensor | None,
    ) -> None:
        """Hand the speculator the target's hidden states of the first
        ``num_committed[i]`` of request ``i``'s ``query_lens[i]`` rows of ``hidden``
        (``[sum(query_lens), hidden_size]``), when it conditions on them."""
        if self.speculator is None or not self.speculator.uses_target_hidden_states:
            return
        offsets = torch.tensor([0, *query_lens[:-1]]).cumsum(0).tolist()
        rows = torch.cat(
            [torch.arange(o, o + n) for o, n in zip(offsets, num_committed, strict=True)]
        ).to(hidden.device)
        self.speculator.observe_target(
            TargetHiddenStates(
                slot_ids=slots,
                start_positions=starts,
                num_rows=num_committed,
                hidden_states=hidden[rows],
                aux_hidden_states=None if aux is None else aux[rows],
            )
        )

    def _prefill(self, requests: list[Request], emitted: dict[Request, list[int]]) -> None:
        slots = [r.slot for r in requests]
        lens = [r.num_prompt_tokens for r in requests]
        input_ids = torch.tensor([t for r in requests for t in r.token_ids], dtype=torch.long)
        hidden, aux = self._target_forward(slots, input_ids, lens, [0] * len(requests))
        last = torch.tensor(lens).cumsum(0) - 1
        token_ids, _ = sample(self.runner.compute_logits(hidden[last]), self._sampling(requests))
        if self.speculator is not None:
            self.speculator.add_requests(slots)
            self._observe_target(slots, [0] * len(requests), lens, lens, hidden, aux)
        for request, token in zip(requests, token_ids.tolist(), strict=True):
            request.num_computed_tokens = request.num_prompt_tokens
            self._emit(request, [token], emitted)

    def _decode_step(
        self,
        requests: list[Request],
        emitted: dict[Request, list[int]],
        sampling: SamplingMetadata | None = None,
    ) -> None:
        starts = [len(r.token_ids) - 1 for r in requests]
        slots = [r.slot for r in requests]
        input_ids = torch.tensor([r.token_ids[-1] for r in requests], dtype=torch.long)
        ones = [1] * len(requests)
        hidden, aux = self._target_forward(slots, input_ids, ones, starts)
        self._observe_target(slots, starts, ones, ones, hidden, aux)
        if sampling is None:
            sampling = self._sampling(requests)
        token_ids, _ = sample(self.runner.compute_logits(hidden), sampling)
        for request, token in zip(requests, token_ids.tolist(), strict=True):
            request.num_computed_tokens = len(request.token_ids)
            self._emit(request, [token], emitted)

    def _speculative_step(
        self, requests: list[Request], k: int, emitted: dict[Request, list[int]]
    ) -> None:
        assert self.speculator is not None
        num_reqs = len(requests)
        slots = [r.slot for r in requests]
        sampling = self._sampling(requests)
        proposal = self.speculator.propose(
            SpeculatorInput(slots, [r.token_ids for r in requests], sampling), k
        )
        draft_lens = proposal.num_draft_tokens or [k] * num_reqs
        # Verify only as far as the longest real draft; nothing drafted: plain decoding.
        k = max(draft_lens)
        if k == 0:
            self._decode_step(requests, emitted, sampling)  # same requests: reuse sampling
            return
        draft_ids = proposal.draft_token_ids[:, :k]  # [num_reqs, k]
        draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[:, :k]
        lens = [len(r.token_ids) for r in requests]
        assert all(r.num_computed_tokens == n - 1 for r, n in zip(requests, lens, strict=True))
        last_ids = torch.tensor([r.token_ids[-1] for r in requests], dtype=torch.long)
        verify_ids = torch.cat([last_ids[:, None], draft_ids.cpu()], dim=1)
        hidden, aux = self._target_forward(
            slots, verify_ids.flatten(), [k + 1] * num_reqs, [n - 1 for n in lens]
        )  # [num_reqs * (k + 1), hidden_size]
        logits = self.runner.compute_logits(hidden).view(num_reqs, k + 1, -1)
        output_ids, num_accepted = rejection_sample(draft_ids, draft_probs, logits, sampling)
        # Padding past a short draft is verified like a real proposal (one-hot draft
        # probability), so the token at position draft_lens[i] is a valid target sample
        # whether it was accepted or recovered; acceptance stops there.
        num_accepted = [
            min(a, n) for a, n in zip(num_accepted.tolist(), draft_lens, strict=True)
        ]
        output_ids = output_ids.tolist()
        self.speculator.rollback(slots, [n + a for n, a in zip(lens, num_accepted, strict=True)])
        self._observe_target(
            slots, [n - 1 for n in lens], [k + 1] * num_reqs,
            [a + 1 for a in num_accepted], hidden, aux,
        )
        for i, request in enumerate(requests):
            accepted = num_accepted[i]
            # As vLLM: a request that proposed nothing is not a draft.
            if draft_lens[i] > 0:
                self.spec_decoding_stats.observe_draft(draft_lens[i], accepted)
            request.num_computed_tokens = lens[i] + accepted
            self._emit(request, output_ids[i][: accepted + 1], emitted)


def create_engine(config: RuntimeConfig) -> EngineBase:
    """The engine ``specula serve`` runs for ``config``: on a CUDA device (``device``
    ``cuda``, or ``auto`` with a GPU visible) the paged, continuously batched
    :class:`~specula.runtime.gpu.engine.GPULLMEngine` when it supports the target and
    the speculator method, else :class:`LLMEngine` on that device.

    Raises:
        ValueError: ``device: cuda`` without a visible GPU; load errors of the engine.
    """
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is visible")
    if device == "cuda":
        from specula.runtime.gpu.engine import GPULLMEngine, gpu_engine_unsupported_reason
        from specula.runtime.models.config import ModelConfig

        target_config = ModelConfig.from_pretrained(
            resolve_model_uri(config.model, config.revision)
        )
        method = config.speculator.method if config.speculator is not None else None
        reason = gpu_engine_unsupported_reason(target_config, method)
        if reason is None:
            return GPULLMEngine.from_config(config, device)
        logger.info("running the one-slot-per-request engine on the GPU: %s", reason)
    return LLMEngine.from_config(config, device)
