"""The speculation settings the admin API reads and writes (``GET``/``PUT
/v1/speculative_config``): one k or a per-batch-size schedule, bounded by the k the
engine was started with, applied from the next proposal on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specula.runtime.engine.spec_schedule import (
    SCHEDULE_PARAM,
    BatchSizeSchedule,
    SpeculativeConfigError,
    check_k,
)

if TYPE_CHECKING:
    from specula.api.runtime_config import SpeculatorRuntimeConfig


class SpeculativeSettings:
    """The engine's speculation settings and their admin operations (a base of
    :class:`~specula.runtime.engine.llm_engine.LLMEngine`)."""

    speculator_config: SpeculatorRuntimeConfig | None
    max_num_speculative_tokens: int

    def init_speculative_settings(self, speculator_config: SpeculatorRuntimeConfig | None) -> None:
        """Start from the config's k (0 without a speculator)."""
        self.speculator_config = speculator_config
        self.max_num_speculative_tokens = (
            speculator_config.max_k if speculator_config is not None else 0
        )
        self.num_speculative_tokens: int | None = (
            speculator_config.num_speculative_tokens if speculator_config is not None else 0
        )
        """The configured k, or ``None`` while a per-batch-size schedule is in force."""
        self.speculative_schedule: BatchSizeSchedule | None = None

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
        :mod:`specula.runtime.engine.spec_schedule`), from the next proposal on. Give
        exactly one. k = 0 turns speculation off without unloading the draft. Nothing
        changes when the setting is refused.

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
        """Draft ``k`` tokens per step from the next proposal on (clearing any
        per-batch-size schedule); ``0`` turns speculation off without unloading the draft.

        Raises:
            SpeculativeConfigError (a ``ValueError``): ``k`` outside
                ``[0, max_num_speculative_tokens]`` or no speculator.
        """
        self.set_speculative_config(num_speculative_tokens=k)

    def num_speculative_tokens_for(self, num_reqs: int) -> int:
        """The k a proposal for ``num_reqs`` (>= 1) requests drafts."""
        if self.speculator_config is None:
            return 0
        if self.speculative_schedule is not None:
            return self.speculative_schedule.k_for(num_reqs)
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens
