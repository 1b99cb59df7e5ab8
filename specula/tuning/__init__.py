"""Pure tuning logic (acceptance estimation, cost model, goodput optimiser); no Kubernetes, no torch.

- :mod:`~specula.tuning.acceptance`: counters, per-position Beta posteriors, E(k);
- :mod:`~specula.tuning.cost`: step-time histogram and the T(B, k) model;
- :mod:`~specula.tuning.goodput`: G(k) = B * E(k) / T(B, k), best k, per-batch schedules;
- :mod:`~specula.tuning.metrics`: a pod's scrape and windows summed over pods;
- :mod:`~specula.tuning.state` / :mod:`~specula.tuning.policy`: settings, the stored
  state and the decision policy (cooldown, hysteresis, exploration, revert);
- :mod:`~specula.tuning.utilization`: demand over predicted capacity, for autoscaling.
"""

from specula.tuning._prom import parse_samples
from specula.tuning.acceptance import (
    AcceptanceEstimate,
    AcceptancePrior,
    SpecDecodeCounters,
    counter_delta,
    expected_accepted_length,
    sum_counters,
    wilson_interval,
)
from specula.tuning.cost import (
    DEFAULT_COST_PARAMS,
    CostObservation,
    CostParams,
    StepCostModel,
    StepTimeHistogram,
)
from specula.tuning.goodput import BatchDistribution, best_k, goodput, optimal_schedule
from specula.tuning.metrics import RuntimeMetrics, window_delta
from specula.tuning.policy import Decision, TuningPolicy, decide
from specula.tuning.state import TuningSettings, TuningState
from specula.tuning.utilization import (
    QueueGauges,
    Utilization,
    compute_utilization,
    predicted_capacity,
    utilization_from_state,
)

__all__ = [
    "DEFAULT_COST_PARAMS",
    "AcceptanceEstimate",
    "AcceptancePrior",
    "BatchDistribution",
    "CostObservation",
    "CostParams",
    "Decision",
    "QueueGauges",
    "RuntimeMetrics",
    "SpecDecodeCounters",
    "StepCostModel",
    "StepTimeHistogram",
    "TuningPolicy",
    "TuningSettings",
    "TuningState",
    "Utilization",
    "best_k",
    "compute_utilization",
    "counter_delta",
    "decide",
    "expected_accepted_length",
    "goodput",
    "optimal_schedule",
    "parse_samples",
    "predicted_capacity",
    "sum_counters",
    "utilization_from_state",
    "wilson_interval",
    "window_delta",
]
