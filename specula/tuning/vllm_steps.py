"""Engine step times of a vLLM pod, which exports no step-time histogram.

The tuner's cost model T(B, k) is fitted to the Specula runtime's
``specula:step_duration_seconds{batch_bucket, num_speculative_tokens}``.  vLLM has no
such series, but two of its histograms (``vllm/v1/metrics/loggers.py``) give a
window's steps on average:

- ``vllm:iteration_tokens_total``: one observation per engine step, so its
  ``_count`` counts steps;
- ``vllm:inter_token_latency_seconds``: one observation per decoding request per step
  (``IterationStats.update_from_output``, ``vllm/v1/metrics/stats.py``), the time since
  that request's previous output, i.e. the step's duration; its ``_count`` is the sum
  of the steps' batch sizes and its ``_sum`` the sum of batch size times step time.

So over a window the mean batch is ``itl_count / steps`` and the mean step time
``itl_sum / itl_count``; :meth:`EngineStepCounters.histogram` turns them into one
histogram series at that batch's bucket and the window's k (draft tokens per draft),
which the cost fit reads like the runtime's.  It is an average, not a distribution:
windows at different loads give the fit its spread of batch sizes, and a window whose
steps mixed k (a per-batch-size schedule) is recorded at its mean k.
"""

from __future__ import annotations

from dataclasses import dataclass

from specula.tuning._prom import Samples, total
from specula.tuning.cost import StepTimeHistogram, StepTimeSeries, batch_bucket


@dataclass(frozen=True)
class EngineStepCounters:
    """A vLLM pod's step counters (cumulative), or their increase over a window."""

    steps: float = 0.0
    """Engine steps (``iteration_tokens_total`` observations)."""
    request_steps: float = 0.0
    """(request, step) pairs that produced output (``inter_token_latency_seconds`` count)."""
    request_step_seconds: float = 0.0
    """Sum of their step durations (``inter_token_latency_seconds`` sum)."""

    @classmethod
    def from_samples(cls, samples: Samples) -> EngineStepCounters:
        """From parsed ``vllm:`` samples; zeros where vLLM's histograms are absent
        (the Specula runtime, which exports step times itself)."""
        return cls(
            steps=total(samples, "iteration_tokens_total_count"),
            request_steps=total(samples, "inter_token_latency_seconds_count"),
            request_step_seconds=total(samples, "inter_token_latency_seconds_sum"),
        )

    def __add__(self, other: EngineStepCounters) -> EngineStepCounters:
        return EngineStepCounters(
            self.steps + other.steps,
            self.request_steps + other.request_steps,
            self.request_step_seconds + other.request_step_seconds,
        )

    def is_reset_from(self, prev: EngineStepCounters) -> bool:
        """True when a counter went down: the pod restarted."""
        return (
            self.steps < prev.steps
            or self.request_steps < prev.request_steps
            or self.request_step_seconds < prev.request_step_seconds
        )

    def delta(self, prev: EngineStepCounters) -> EngineStepCounters:
        """Increase since ``prev`` (the caller handles restarts)."""
        return EngineStepCounters(
            self.steps - prev.steps,
            self.request_steps - prev.request_steps,
            self.request_step_seconds - prev.request_step_seconds,
        )

    def histogram(self, num_speculative_tokens: int) -> StepTimeHistogram:
        """A window's steps as one step-time series: ``steps`` steps of the mean
        duration, at the bucket of the mean batch and ``num_speculative_tokens``;
        empty without steps or outputs."""
        if self.steps <= 0 or self.request_steps <= 0 or self.request_step_seconds <= 0:
            return StepTimeHistogram()
        batch = max(1, round(self.request_steps / self.steps))
        mean_step_s = self.request_step_seconds / self.request_steps
        key = (batch_bucket(batch), num_speculative_tokens)
        return StepTimeHistogram({key: StepTimeSeries(self.steps, self.steps * mean_step_s)})

    def to_list(self) -> list[float]:
        return [self.steps, self.request_steps, self.request_step_seconds]

    @classmethod
    def from_list(cls, values: list[float]) -> EngineStepCounters:
        steps, request_steps, seconds = (float(v) for v in values)
        return cls(steps, request_steps, seconds)
