"""Run-time speculation settings, which the admin API reads and writes (``GET``/``PUT
/v1/speculative_config``): one k, or k chosen per step by batch size, bounded by the k
the engine was started with, applied from the next proposal on.

A per-batch-size schedule has the shape of vLLM's ``num_speculative_tokens_per_batch_size``
speculative-config field (the batch-size dependence of the best k is SmartSpec's
finding, arXiv 2406.14066): a list of inclusive ranges ``[start, end, k]`` over the
number of requests in a speculative round. The first range starts at 1, ranges are
sorted, contiguous and non-overlapping, and larger batches use the last range's ``k``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specula.api.runtime_config import SpeculatorRuntimeConfig


class SpeculativeConfigError(ValueError):
    """A speculation setting the engine refuses.

    Attributes:
        param: the request field at fault (``num_speculative_tokens`` or
            ``num_speculative_tokens_per_batch_size``).
        code: ``no_speculator``, ``above_max`` (a k above the maximum the engine was
            started with), ``invalid_value`` (a negative k) or ``invalid_schedule``.
    """

    def __init__(self, message: str, *, param: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


SCHEDULE_PARAM = "num_speculative_tokens_per_batch_size"
K_PARAM = "num_speculative_tokens"


def check_k(k: int, max_k: int, *, param: str = K_PARAM, where: str = "") -> None:
    """Check ``0 <= k <= max_k``.

    Raises:
        SpeculativeConfigError: ``k`` negative (``invalid_value``) or above ``max_k``
            (``above_max``; the message names the maximum).
    """

    def refused(reason: str, code: str = "invalid_value") -> SpeculativeConfigError:
        message = f"{where}num_speculative_tokens {reason}"
        return SpeculativeConfigError(message, param=param, code=code)

    if isinstance(k, bool) or not isinstance(k, int):
        raise refused(f"must be an integer, got {k!r}")
    if k < 0:
        raise refused(f"{k} outside [0, {max_k}]")
    if k > max_k:
        raise refused(f"{k} outside [0, {max_k}] (the maximum is the value the engine was started "
                      f"with, max_num_speculative_tokens={max_k})", "above_max")


def _invalid_schedule(message: str) -> SpeculativeConfigError:
    return SpeculativeConfigError(message, param=SCHEDULE_PARAM, code="invalid_schedule")


@dataclass(frozen=True)
class BatchSizeSchedule:
    """A validated ``[[start, end, k], ...]`` schedule; :meth:`k_for` looks k up."""

    ranges: tuple[tuple[int, int, int], ...]

    @classmethod
    def parse(cls, ranges: list[tuple[int, int, int]] | list[list[int]],
              max_k: int) -> BatchSizeSchedule:
        """Validate ``ranges`` against the rules in the module docstring.

        Raises:
            SpeculativeConfigError: an empty schedule, a range that is not three
                integers, ``start < 1`` or ``end < start``, a first range not starting
                at 1, a gap or overlap with the previous range (``invalid_schedule``), or
                a k outside ``[0, max_k]`` (``above_max`` / ``invalid_value``). The
                message names the offending range by index and value.
        """
        if not ranges:
            raise _invalid_schedule("the schedule is empty; "
                                    "give at least one [start, end, k] range")
        parsed: list[tuple[int, int, int]] = []
        for i, entry in enumerate(ranges):
            where = f"range {i} {list(entry)!r}: "
            if len(entry) != 3 or any(isinstance(v, bool) or not isinstance(v, int) for v in entry):
                raise _invalid_schedule(f"{where}each range must be three integers [start, end, k]")
            start, end, k = entry
            if end < start:
                raise _invalid_schedule(f"{where}end {end} is below start {start}")
            if i == 0 and start != 1:
                raise _invalid_schedule(f"{where}the first range must start at batch size 1, "
                                        f"not {start}")
            prev_end = parsed[-1][1] if parsed else 0
            if start <= prev_end:
                raise _invalid_schedule(f"{where}overlaps the previous range, which ends at {prev_end}")
            if start > prev_end + 1:
                raise _invalid_schedule(f"{where}leaves a gap: batch sizes {prev_end + 1}.."
                                        f"{start - 1} are in no range")
            check_k(k, max_k, param=SCHEDULE_PARAM, where=where)
            parsed.append((start, end, k))
        return cls(tuple(parsed))

    def k_for(self, batch_size: int) -> int:
        """The k for a speculative round of ``batch_size`` (>= 1) requests; sizes above
        the last range use the last range's k."""
        i = bisect.bisect_left([end for _, end, _ in self.ranges], batch_size)
        return self.ranges[min(i, len(self.ranges) - 1)][2]


class SpeculativeSettings:
    """The engine's speculation settings and their admin operations (a base of
    :class:`~specula.runtime.engine.llm_engine.LLMEngine`)."""

    def init_speculative_settings(self, speculator_config: SpeculatorRuntimeConfig | None) -> None:
        self.speculator_config = spec = speculator_config
        self.max_num_speculative_tokens = spec.max_k if spec else 0
        self.num_speculative_tokens: int | None = spec.num_speculative_tokens if spec else 0
        """The configured k, or ``None`` while a per-batch-size schedule is in force."""
        self.speculative_schedule: BatchSizeSchedule | None = None

    def get_speculative_config(self) -> dict[str, Any]:
        """The configured speculation, as ``GET /v1/speculative_config`` returns it: one k
        (``num_speculative_tokens``) or a schedule (``num_speculative_tokens_per_batch_size``
        as ``[[start, end, k], ...]``), the other ``None``. The k a step actually used is
        :attr:`last_step_num_speculative_tokens`."""
        spec, schedule = self.speculator_config, self.speculative_schedule
        ranges = [list(r) for r in schedule.ranges] if schedule else None
        return {"method": spec.method if spec else None,
                "num_speculative_tokens": self.num_speculative_tokens,
                "num_speculative_tokens_per_batch_size": ranges,
                "max_num_speculative_tokens": self.max_num_speculative_tokens,
                "model": spec.model if spec else None}

    def set_speculative_config(
        self, num_speculative_tokens: int | None = None,
        num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None,
    ) -> None:
        """Set one k, or a per-batch-size schedule ``[[start, end, k], ...]`` (module
        docstring), from the next proposal on; give exactly one. k = 0 turns speculation
        off without unloading the draft. Nothing changes when the setting is refused.

        Raises:
            SpeculativeConfigError (a ``ValueError``): no speculator, neither or both
                arguments, a k outside ``[0, max_num_speculative_tokens]``, or an invalid
                schedule (the message names the offending range).
        """
        if (num_speculative_tokens is None) == (num_speculative_tokens_per_batch_size is None):
            raise SpeculativeConfigError("give exactly one of num_speculative_tokens and "
                                         "num_speculative_tokens_per_batch_size", param=K_PARAM,
                                         code="invalid_value")
        param = K_PARAM if num_speculative_tokens is not None else SCHEDULE_PARAM
        if self.speculator_config is None:
            raise SpeculativeConfigError("no speculator is configured; num_speculative_tokens is "
                                         "fixed at 0", param=param, code="no_speculator")
        if num_speculative_tokens is None:
            self.speculative_schedule = BatchSizeSchedule.parse(
                num_speculative_tokens_per_batch_size, self.max_num_speculative_tokens)
        else:
            check_k(num_speculative_tokens, self.max_num_speculative_tokens)
            self.speculative_schedule = None
        self.num_speculative_tokens = num_speculative_tokens

    def set_num_speculative_tokens(self, k: int) -> None:
        """:meth:`set_speculative_config` with ``num_speculative_tokens=k`` (same errors)."""
        self.set_speculative_config(num_speculative_tokens=k)

    def num_speculative_tokens_for(self, num_reqs: int) -> int:
        """The k a proposal for ``num_reqs`` (>= 1) requests drafts."""
        if self.speculative_schedule is not None:
            return self.speculative_schedule.k_for(num_reqs)
        return self.num_speculative_tokens or 0
