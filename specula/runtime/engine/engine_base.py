"""What every engine shares: request intake and validation, stop conditions, the
speculative-config admin operations, per-step outputs and counters.

:class:`~specula.runtime.engine.llm_engine.LLMEngine` (one KV slot per request, any
speculator, CPU or GPU) and :class:`~specula.runtime.gpu.engine.GPULLMEngine` (paged
KV, continuous batching, Triton kernels and CUDA graphs) subclass :class:`EngineBase`
and implement :meth:`EngineBase._run_step`; the server drives either through this
interface.

Engines are single-threaded and not thread-safe: call one from one thread.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specula.runtime.engine.request import Request, RequestOutput
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.engine.spec_schedule import (
    SCHEDULE_PARAM,
    BatchSizeSchedule,
    SpeculativeConfigError,
    check_k,
)
from specula.runtime.models.config import ModelConfig
from specula.runtime.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from specula.api.runtime_config import SpeculatorRuntimeConfig


class EngineBase:
    """Requests, speculation settings and counters of an engine.

    Subclasses call :meth:`_init_engine` first, set ``self.scheduler`` (an object with
    ``add``, ``remove``, ``remove_finished``, ``__contains__``, ``waiting`` and
    ``running``) and implement :meth:`_run_step`.
    """

    scheduler: Any

    def _init_engine(
        self,
        target_dir: Path,
        tokenizer: Any,
        *,
        model_uri: str,
        served_model_name: str,
        speculator_config: SpeculatorRuntimeConfig | None,
        max_model_len: int | None,
        max_num_seqs: int,
        device: str | torch.device,
    ) -> None:
        """Read the target's config and set the shared attributes.

        Raises:
            ValueError: ``max_model_len`` above the target's ``max_position_embeddings``.
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
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model_config, target_dir, tokenizer)
        self.speculator_config = speculator_config
        self.max_num_speculative_tokens = (
            speculator_config.max_k if speculator_config is not None else 0
        )
        self.num_speculative_tokens: int | None = (
            speculator_config.num_speculative_tokens if speculator_config is not None else 0
        )
        """The configured k, or ``None`` while a per-batch-size schedule is in force."""
        self.speculative_schedule: BatchSizeSchedule | None = None
        self.last_step_num_reqs = 0
        """Requests in the last step's decode round (0 when it decoded none)."""
        self.last_step_num_speculative_tokens = 0
        """The k the last decode round drafted (0: plain decoding, or no round ran)."""
        self.spec_decoding_stats = SpecDecodingStats(
            num_spec_tokens=self.max_num_speculative_tokens
        )
        self.generation_tokens_total = 0
        """Tokens emitted to requests since start (a counter)."""
        self._pending: list[RequestOutput] = []
        self._generate_counter = 0

    def _run_step(self, emitted: dict[Request, list[int]]) -> None:
        """Schedule and run one step, appending each request's new tokens to
        ``emitted`` (through :meth:`_emit`) and setting ``last_step_num_reqs`` and
        ``last_step_num_speculative_tokens``."""
        raise NotImplementedError

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
                param="num_speculative_tokens",
                code="invalid_value",
            )
        param = "num_speculative_tokens" if num_speculative_tokens is not None else SCHEDULE_PARAM
        if self.speculator_config is None:
            raise SpeculativeConfigError(
                "no speculator is configured; num_speculative_tokens is fixed at 0",
                param=param,
                code="no_speculator",
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
        if self.speculator_config is None:
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
        self._run_step(emitted)
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

    def _emit(self, request: Request, tokens: list[int], emitted: dict[Request, list[int]]) -> None:
        appended = request.append_tokens(tokens, self.tokenizer, self.max_model_len)
        emitted.setdefault(request, []).extend(appended)


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
