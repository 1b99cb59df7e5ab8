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

import json
from pathlib import Path
from typing import Any

import torch

from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
from specula.runtime.engine.model_runner import ModelRunner
from specula.runtime.engine.request import Request, RequestOutput
from specula.runtime.engine.sampler import SamplingMetadata, sample
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.engine.scheduler import Scheduler
from specula.runtime.engine.spec_schedule import (
    SCHEDULE_PARAM,
    BatchSizeSchedule,
    SpeculativeConfigError,
    check_k,
)
from specula.runtime.loader import resolve_model_uri
from specula.runtime.models.config import ModelConfig, resolve_dtype
from specula.runtime.models.registry import load_model
from specula.runtime.spec_decode.base import (
    BaseSpeculator,
    SpeculatorInput,
    TargetHiddenStates,
)
from specula.runtime.spec_decode.metrics import SpecDecodingStats
from specula.runtime.spec_decode.registry import create_speculator
from specula.runtime.spec_decode.rejection_sampler import rejection_sample

__all__ = [
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SpecDecodingStats",
    "SpeculativeConfigError",
]


class LLMEngine:
    """Target model, optional speculator, tokenizer, scheduler and counters."""

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
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.model_uri = model_uri
        self.served_model_name = served_model_name
        self.model_config = ModelConfig.from_pretrained(target_dir)
        limit = self.model_config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the target's max_position_embeddings {limit}"
            )
        self.max_model_len: int = max_model_len or limit
        self.max_num_seqs = max_num_seqs
        self.dtype = resolve_dtype(dtype, self.model_config, self.device)
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model_config, target_dir, tokenizer)

        self.speculator_config = speculator_config
        self.speculator: BaseSpeculator | None = None
        self.max_num_speculative_tokens = 0
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
            self.max_num_speculative_tokens = speculator_config.max_k
        self.num_speculative_tokens: int | None = (
            speculator_config.num_speculative_tokens if speculator_config is not None else 0
        )
        """The configured k, or ``None`` while a per-batch-size schedule is in force."""
        self.speculative_schedule: BatchSizeSchedule | None = None
        self.last_step_num_reqs = 0
        """Requests in the last step's decode round (0 when it decoded none)."""
        self.last_step_num_speculative_tokens = 0
        """The k the last decode round drafted (0: plain decoding, or no round ran)."""
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
        self.spec_decoding_stats = SpecDecodingStats(
            num_spec_tokens=self.max_num_speculative_tokens
        )
        self.generation_tokens_total = 0
        """Tokens emitted to requests since start (a counter)."""
        self._pending: list[RequestOutput] = []
        self._generate_counter = 0

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

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Queue a request.

        Raises:
            ValueError: invalid sampling params, a duplicate ``request_id``, an empty
                prompt, a token id outside the vocabulary, or
                ``len(prompt_token_ids) + max_tokens > max_model_len``.
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
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.scheduler.add(
            Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, generator)
        )

    def abort_request(self, request_id: str) -> None:
        """Drop a request; the next :meth:`step` reports it finished with reason
        ``"abort"``. Unknown or finished ids are ignored."""
        if self.scheduler.remove(request_id) is not None:
            self._pending.append(RequestOutput(request_id, [], True, "abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    def scheduler_stats(self) -> dict[str, int]:
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
        }

    # ---- speculation settings -------------------------------------------------------

    def get_speculative_config(self) -> dict[str, Any]:
        """The configured speculation, as ``GET /v1/speculative_config`` returns it.

        ``num_speculative_tokens`` is the configured single k, ``None`` while a
        per-batch-size schedule is in force; ``num_speculative_tokens_per_batch_size``
        is that schedule as ``[[start, end, k], ...]``, else ``None``. The k a step
        actually used is :attr:`last_step_num_speculative_tokens`.
        """
        spec = self.speculator_config
        schedule = self.speculative_schedule
        return {
            "method": spec.method if spec else None,
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_speculative_tokens_per_batch_size": schedule.as_lists() if schedule else None,
            "max_num_speculative_tokens": self.max_num_speculative_tokens,
            "model": spec.model if spec else None,
        }

    def set_speculative_config(
        self,
        num_speculative_tokens: int | None = None,
        num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None,
    ) -> None:
        """Set one k, or a per-batch-size schedule ``[[start, end, k], ...]`` (rules in
        :mod:`specula.runtime.engine.spec_schedule`), from the next step on. Give exactly
        one. k = 0 turns speculation off without unloading the draft. Nothing changes
        when the setting is refused.

        Raises:
            SpeculativeConfigError (a ``ValueError``): no speculator, neither or both
                arguments, a k outside ``[0, max_num_speculative_tokens]``, or an invalid
                schedule (the message names the offending range).
        """
        if (num_speculative_tokens is None) == (num_speculative_tokens_per_batch_size is None):
            raise SpeculativeConfigError(
                "give exactly one of num_speculative_tokens and "
                "num_speculative_tokens_per_batch_size",
                param="num_speculative_tokens", code="invalid_value",
            )
        param = "num_speculative_tokens" if num_speculative_tokens is not None else SCHEDULE_PARAM
        if self.speculator is None:
            raise SpeculativeConfigError(
                "no speculator is configured; num_speculative_tokens is fixed at 0",
                param=param, code="no_speculator",
            )
        if num_speculative_tokens_per_batch_size is not None:
            self.speculative_schedule = BatchSizeSchedule.parse(
                num_speculative_tokens_per_batch_size, self.max_num_speculative_tokens
            )
            self.num_speculative_tokens = None
            return
        assert num_speculative_tokens is not None
        check_k(num_speculative_tokens, self.max_num_speculative_tokens)
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_schedule = None

    def set_num_speculative_tokens(self, k: int) -> None:
        """Use ``k`` draft tokens per step from the next step on (clearing any
        per-batch-size schedule); ``0`` turns speculation off without unloading the draft.

        Raises:
            SpeculativeConfigError (a ``ValueError``): ``k`` outside
                ``[0, max_num_speculative_tokens]`` or no speculator.
        """
        self.set_speculative_config(num_speculative_tokens=k)

    def num_speculative_tokens_for(self, num_reqs: int) -> int:
        """The k a speculative round of ``num_reqs`` (>= 1) requests drafts."""
        if self.speculator is None:
            return 0
        if self.speculative_schedule is not None:
            return self.speculative_schedule.k_for(num_reqs)
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens

    # ---- stepping -------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns one output per request that produced tokens,
        finished, or was aborted since the last step."""
        emitted: dict[Request, list[int]] = {}
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
        outputs, self._pending = self._pending, []
        for request, tokens in emitted.items():
            self.generation_tokens_total += len(tokens)
            outputs.append(
                RequestOutput(
                    request.request_id,
                    tokens,
                    request.finished,
                    request.finish_reason,
                    request.stop_reason,
                )
            )
        self.scheduler.remove_finished()
        return outputs

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run ``prompts`` to completion (batched) and return each one's output tokens."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for prompt, p in zip(prompts, params_list, strict=True):
            self._generate_counter += 1
            ids.append(f"generate-{self._generate_counter}")
            self.add_request(ids[-1], prompt, p)
        results: dict[str, list[int]] = {i: [] for i in ids}
        while any(i in self.scheduler for i in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]

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

    def _emit(self, request: Request, tokens: list[int], emitted: dict[Request, list[int]]) -> None:
        appended = request.append_tokens(tokens, self.tokenizer, self.max_model_len)
        emitted.setdefault(request, []).extend(appended)

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


def _eos_token_ids(config: ModelConfig, checkpoint_dir: Path, tokenizer: Any) -> frozenset[int]:
    """Union of the eos ids of ``config.json``, ``generation_config.json`` (which
    ``transformers.generate`` uses) and the tokenizer."""
    ids = set(config.eos_token_ids)
    gen_path = checkpoint_dir / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
