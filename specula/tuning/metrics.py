"""One pod's scrape, as the tuner needs it, and windows summed across pods.

A scrape holds the speculative-decoding counters, the ``generation_tokens`` counter
and the step-time histogram (for vLLM pods, which have none, the step counters it is
derived from per window, :mod:`specula.tuning.vllm_steps`).  The tuner works on
*windows*: the increase of every counter between two scrapes of each pod, summed over
pods (ratio of sums).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from specula.tuning._prom import Samples, parse_samples, total
from specula.tuning.acceptance import SpecDecodeCounters, counter_delta
from specula.tuning.cost import StepTimeHistogram
from specula.tuning.goodput import bucket_representatives
from specula.tuning.vllm_steps import EngineStepCounters


@dataclass(frozen=True)
class RuntimeMetrics:
    """Counters of one pod (cumulative) or of a window (increases, summed over pods)."""

    counters: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)
    generation_tokens: float = 0.0
    """Tokens emitted (accepted draft, bonus and recovered tokens; all tokens at k = 0)."""
    step_times: StepTimeHistogram = field(default_factory=StepTimeHistogram)
    engine_steps: EngineStepCounters = field(default_factory=EngineStepCounters)
    """vLLM's step counters (zeros for the Specula runtime); a window whose pod has no
    step-time histogram takes its step times from them."""

    @classmethod
    def from_prometheus_text(cls, text: str) -> RuntimeMetrics:
        """Parse a ``/metrics`` body (``specula:`` or ``vllm:`` names).

        Raises:
            ValueError: invalid exposition.
        """
        return cls.from_samples(parse_samples(text))

    @classmethod
    def from_samples(cls, samples: Samples) -> RuntimeMetrics:
        """From already-parsed samples (see :func:`_prom.parse_samples`)."""
        return cls(
            counters=SpecDecodeCounters.from_samples(samples),
            generation_tokens=total(samples, "generation_tokens_total"),
            step_times=StepTimeHistogram.from_samples(samples),
            engine_steps=EngineStepCounters.from_samples(samples),
        )

    def __add__(self, other: RuntimeMetrics) -> RuntimeMetrics:
        return RuntimeMetrics(
            counters=self.counters + other.counters,
            generation_tokens=self.generation_tokens + other.generation_tokens,
            step_times=self.step_times + other.step_times,
            engine_steps=self.engine_steps + other.engine_steps,
        )

    def is_reset_from(self, prev: RuntimeMetrics) -> bool:
        """True when any counter went down: the process restarted."""
        return (
            self.counters.is_reset_from(prev.counters)
            or self.generation_tokens < prev.generation_tokens
            or self.step_times.is_reset_from(prev.step_times)
            or self.engine_steps.is_reset_from(prev.engine_steps)
        )

    def delta(self, prev: RuntimeMetrics | None) -> RuntimeMetrics:
        """Increase since ``prev``.  A restart (any counter down) resets them all, so the
        whole of ``self`` is the delta; ``prev=None`` (first scrape) gives an empty window.
        """
        if prev is None:
            return RuntimeMetrics()
        if self.is_reset_from(prev):
            return self._with_engine_step_times()
        return RuntimeMetrics(
            counters=counter_delta(prev.counters, self.counters),
            generation_tokens=self.generation_tokens - prev.generation_tokens,
            step_times=self.step_times.delta(prev.step_times),
            engine_steps=self.engine_steps.delta(prev.engine_steps),
        )._with_engine_step_times()

    def _with_engine_step_times(self) -> RuntimeMetrics:
        """A window without a step-time histogram, with the one its engine step counters
        give, at the window's k (draft tokens per draft; 0 without drafts)."""
        if self.step_times.series or self.engine_steps.steps <= 0:
            return self
        c = self.counters
        k = round(c.num_draft_tokens / c.num_drafts) if c.num_drafts > 0 else 0
        return replace(self, step_times=self.engine_steps.histogram(k))

    @property
    def mean_batch_size(self) -> float | None:
        """Steps' mean batch size, ``(generation_tokens - accepted draft tokens) /
        steps``: each sequence emits one bonus or recovered token per step besides its
        accepted draft tokens, whatever the k of the step (so this holds under a
        per-batch-size schedule, where some steps do not draft); ``None`` without steps."""
        steps = self.step_times.total_count
        if steps <= 0 or self.generation_tokens <= 0:
            return None
        plain = self.generation_tokens - max(self.counters.num_accepted_tokens, 0.0)
        return plain / steps if plain > 0 else None

    def drafts_by_k(self) -> dict[int, float]:
        """Drafts per k (k > 0) from the step-time histogram: steps times each bucket's
        representative batch size (see :func:`~specula.tuning.goodput.bucket_representatives`)."""
        steps = self.step_times.steps_by_bucket()
        if not steps:
            return {}
        rep = bucket_representatives(steps, self.mean_batch_size)
        out: dict[int, float] = {}
        for (bucket, k), series in self.step_times.series.items():
            if k > 0 and series.count > 0:
                out[k] = out.get(k, 0.0) + series.count * rep[bucket]
        return out

    @property
    def measured_goodput(self) -> float | None:
        """Tokens per second of engine-busy time (``generation_tokens / sum of step
        seconds``): comparable with the model's G(k) whatever the idle time."""
        busy = self.step_times.total_seconds
        if busy <= 0:
            return None
        return self.generation_tokens / busy

    def to_dict(self) -> dict:
        """JSON-ready form (for keeping per-pod baselines on the resource)."""
        out = {
            "counters": self.counters.to_dict(),
            "generationTokens": self.generation_tokens,
            "stepTimes": self.step_times.to_dict(),
        }
        if self.engine_steps.steps > 0:
            out["engineSteps"] = self.engine_steps.to_list()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> RuntimeMetrics:
        return cls(
            counters=SpecDecodeCounters.from_dict(data.get("counters", {})),
            generation_tokens=float(data.get("generationTokens", 0.0)),
            step_times=StepTimeHistogram.from_dict(data.get("stepTimes", [])),
            engine_steps=EngineStepCounters.from_list(data.get("engineSteps", [0, 0, 0])),
        )


def window_delta(
    prev: Mapping[str, RuntimeMetrics], cur: Mapping[str, RuntimeMetrics]
) -> RuntimeMetrics:
    """Sum over pods of each pod's increase between two scrape rounds.

    Args:
        prev: pod name -> previous scrape (pods seen for the first time have none and
            contribute nothing this window; they count from the next one).
        cur: pod name -> this scrape; pods that disappeared simply stop contributing.
    """
    acc = RuntimeMetrics()
    for pod, metrics in sorted(cur.items()):
        acc = acc + metrics.delta(prev.get(pod))
    return acc
