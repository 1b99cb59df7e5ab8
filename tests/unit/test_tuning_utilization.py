"""Utilization (demand over predicted capacity) on metrics recorded from real
``specula serve`` runs (``tests/unit/data/specula_serve``, made by
``hack/record_runtime_metrics.py``): the tiny Llama target with a close draft and with
a far one, each under 6 concurrent requests for ``max_num_seqs`` 4 (so 2 queue)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specula.api.autoscaling import AutoscalingSpec
from specula.operator.autoscaling import autoscaling_status, desired_replicas
from specula.tuning import (
    AcceptanceEstimate,
    QueueGauges,
    RuntimeMetrics,
    StepCostModel,
    TuningSettings,
    TuningState,
    compute_utilization,
    expected_accepted_length,
    predicted_capacity,
    utilization_from_state,
)
from specula.tuning.state import with_window

DATA = Path(__file__).parent / "data" / "specula_serve"
SETTINGS = TuningSettings(max_speculative_tokens=3)


@dataclass
class Recorded:
    window: RuntimeMetrics
    queue: QueueGauges
    seconds: float
    max_num_seqs: int
    state: TuningState
    texts: tuple[str, str]

    @property
    def cost(self) -> StepCostModel:
        return StepCostModel.fit(self.state.cost_observations(), prior=SETTINGS.cost_prior)

    @property
    def alphas(self) -> list[float]:
        return AcceptanceEstimate.from_evidence(
            self.state.acceptance_trials, self.state.acceptance_accepted, 3
        ).means


def recorded(run: str) -> Recorded:
    directory = DATA / run
    texts = ((directory / "scrape_0.prom").read_text(), (directory / "scrape_1.prom").read_text())
    meta = json.loads((directory / "window.json").read_text())
    window = RuntimeMetrics.from_prometheus_text(texts[1]).delta(
        RuntimeMetrics.from_prometheus_text(texts[0])
    )
    state, _ = with_window(TuningState.initial(3, SETTINGS), window, SETTINGS, now=1000.0)
    return Recorded(
        window, QueueGauges.from_prometheus_text(texts[1]), meta["window_seconds"],
        meta["max_num_seqs"], state, texts,
    )


def sample(text: str, name: str) -> float:
    """A sample's value read with the reference parser, summed over label sets."""
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


@pytest.fixture(scope="module")
def close() -> Recorded:
    return recorded("draft_close")


@pytest.fixture(scope="module")
def far() -> Recorded:
    return recorded("draft_far")


def test_demand_is_generated_rate_plus_queued_work(close):
    u = utilization_from_state(
        close.state, SETTINGS, close.window, close.seconds, close.queue, close.max_num_seqs, 1
    )
    before, after = close.texts
    generated = (
        sample(after, "specula:generation_tokens_total")
        - sample(before, "specula:generation_tokens_total")
    )
    running = sample(after, "specula:num_requests_running")
    waiting = sample(after, "specula:num_requests_waiting")
    assert (running, waiting) == (4, 2)
    rate = generated / close.seconds
    assert u.generation_tokens_per_second == pytest.approx(rate)
    assert u.demand_tokens_per_second == pytest.approx(rate * (running + waiting) / running)
    assert u.utilization == pytest.approx(u.demand_tokens_per_second / u.capacity_tokens_per_second)
    # More requests than slots: the pod is over capacity.
    assert u.utilization > 1.0


@pytest.mark.parametrize("run", ["draft_close", "draft_far"])
def test_capacity_at_the_measured_batch_matches_measured_goodput(run):
    """The steps ran at batch ~4 (= max_num_seqs): the predicted capacity there must
    agree with what the pod emitted per second of engine time."""
    r = recorded(run)
    assert r.window.mean_batch_size == pytest.approx(r.max_num_seqs, rel=0.05)
    capacity = predicted_capacity(r.alphas, 3, r.cost, r.max_num_seqs, ready_replicas=1)
    assert capacity == pytest.approx(r.window.measured_goodput, rel=0.1)


def test_acceptance_drop_raises_utilization_before_queues_grow(close, far):
    """The same load (close draft's tokens/s and queue) against the capacity the far
    draft's acceptance predicts: utilization rises with no change in queue or rate."""
    assert far.window.counters.acceptance_rate < 0.1 < close.window.counters.acceptance_rate
    common = dict(
        generation_tokens=close.window.generation_tokens, window_seconds=close.seconds,
        queue=close.queue, num_speculative_tokens=3, max_num_seqs=close.max_num_seqs,
        ready_replicas=1,
    )
    before = compute_utilization(alphas=close.alphas, cost=close.cost, **common)
    after = compute_utilization(alphas=far.alphas, cost=far.cost, **common)
    assert after.demand_tokens_per_second == pytest.approx(before.demand_tokens_per_second)
    ratio = after.utilization / before.utilization
    e_close = expected_accepted_length(close.alphas, 3)
    e_far = expected_accepted_length(far.alphas, 3)
    # Capacity scales with E(k) at an unchanged step time, within the fit's difference.
    assert ratio == pytest.approx(e_close / e_far, rel=0.15)
    assert ratio > 1.5


def test_queue_and_replicas(close):
    base = dict(
        generation_tokens=close.window.generation_tokens, window_seconds=close.seconds,
        alphas=close.alphas, num_speculative_tokens=3, cost=close.cost, max_num_seqs=4,
    )
    idle_queue = compute_utilization(queue=QueueGauges(4, 0), ready_replicas=1, **base)
    queued = compute_utilization(queue=QueueGauges(4, 8), ready_replicas=1, **base)
    rate = close.window.generation_tokens / close.seconds
    assert queued.demand_tokens_per_second - idle_queue.demand_tokens_per_second == (
        pytest.approx(8 * rate / 4)
    )
    doubled = compute_utilization(queue=QueueGauges(4, 8), ready_replicas=2, **base)
    assert doubled.utilization == pytest.approx(queued.utilization / 2)


def test_queue_with_nothing_running_counts_at_a_lone_sequences_speed(close):
    u = compute_utilization(
        generation_tokens=0.0, window_seconds=10.0, queue=QueueGauges(0, 3),
        alphas=close.alphas, num_speculative_tokens=3, cost=close.cost, max_num_seqs=4,
        ready_replicas=1,
    )
    lone = expected_accepted_length(close.alphas, 3) / close.cost.predict(1, 3)
    assert u.per_sequence_tokens_per_second == pytest.approx(lone)
    assert u.demand_tokens_per_second == pytest.approx(3 * lone)


def test_schedule_k_at_the_largest_batch_sets_capacity(close):
    schedule = [[1, 2, 3], [3, 4, 0]]
    with_schedule = predicted_capacity(close.alphas, 3, close.cost, 4, 1, schedule)
    at_zero = predicted_capacity(close.alphas, 0, close.cost, 4, 1)
    assert with_schedule == pytest.approx(at_zero)


def test_invalid_inputs(close):
    common = dict(
        generation_tokens=1.0, queue=QueueGauges(1, 0), alphas=close.alphas,
        num_speculative_tokens=3, cost=close.cost, max_num_seqs=4,
    )
    with pytest.raises(ValueError, match="window_seconds"):
        compute_utilization(window_seconds=0.0, ready_replicas=1, **common)
    with pytest.raises(ValueError, match="ready_replicas"):
        compute_utilization(window_seconds=1.0, ready_replicas=0, **common)
    with pytest.raises(ValueError, match="acceptance rates"):
        predicted_capacity(close.alphas[:1], 3, close.cost, 4, 1)


def test_vllm_gauges_are_read_and_summed_over_engines():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 5.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0\n'
    )
    assert QueueGauges.from_prometheus_text(text) == QueueGauges(8.0, 7.0)


def test_desired_replicas_follow_the_hpa_rule():
    spec = AutoscalingSpec(min_replicas=1, max_replicas=10, target_utilization=0.7)
    assert desired_replicas(spec, 2, 0.7) == 2
    assert desired_replicas(spec, 2, 1.4) == 4
    assert desired_replicas(spec, 3, 0.1) == 1
    assert desired_replicas(spec, 4, 5.0) == 10


def test_autoscaling_status_from_a_window(close):
    spec = AutoscalingSpec(max_replicas=8, target_utilization=0.5)
    args = (SETTINGS, close.window, close.seconds, close.queue)
    status = autoscaling_status(spec, close.state, *args, 1, 4, "2026-01-01T00:00:00Z")
    u = utilization_from_state(close.state, *args, 4, 1)
    assert status.utilization == pytest.approx(u.utilization, abs=1e-6)
    assert status.desired_replicas == math.ceil(u.utilization / 0.5)
    assert (status.current_replicas, status.requests_waiting) == (1, 2)
    assert autoscaling_status(spec, close.state, *args, 0, 4, "t") is None
    assert autoscaling_status(
        spec, close.state, SETTINGS, close.window, None, close.queue, 1, 4, "t"
    ) is None
