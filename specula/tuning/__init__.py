"""Pure tuning logic (acceptance estimation, cost model, goodput optimiser); no Kubernetes, no torch.

- :mod:`~specula.tuning.acceptance`: counters, per-position Beta posteriors, E(k);
- :mod:`~specula.tuning.cost`: step-time histogram and the T(B, k) model;
- :mod:`~specula.tuning.goodput`: G(k) = B * E(k) / T(B, k), best k, per-batch schedules;
- :mod:`~specula.tuning.metrics`: a pod's scrape and windows summed over pods;
- :mod:`~specula.tuning.state` / :mod:`~specula.tuning.policy`: settings, the stored
  state and the decision policy (cooldown, hysteresis, exploration, revert).
"""

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

__all__ = [
    "DEFAULT_COST_PARAMS",
    "AcceptanceEstimate",
    "AcceptancePrior",
    "BatchDistribution",
    "CostObservation",
    "CostParams",
    "Decision",
    "RuntimeMetrics",
    "SpecDecodeCounters",
    "StepCostModel",
    "StepTimeHistogram",
    "TuningPolicy",
    "TuningSettings",
    "TuningState",
    "best_k",
    "counter_delta",
    "decide",
    "expected_accepted_length",
    "goodput",
    "optimal_schedule",
    "sum_counters",
    "wilson_interval",
    "window_delta",
]
