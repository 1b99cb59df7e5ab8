"""Pure functions for ``engine: vllm``, whose pods take k from their arguments.

vLLM cannot change k in a running server, so the k (or per-batch-size schedule) the
tuner has put in effect is rendered into the pod template: the reconciler and the
tuner both build the children from :func:`pod_speculation` of the stored status, and
a new k rolls the pods.  The tuner measures again only once the rollout has
finished (:func:`rollout_in_progress`), so no window mixes pods of two k.
"""

from __future__ import annotations

from typing import Any

from specula.api.models import SpeculativeModelSpec, SpeculativeModelStatus
from specula.api.render_vllm import PodSpeculation
from specula.operator.tuner import load_state


def pod_speculation(
    spec: SpeculativeModelSpec, status: SpeculativeModelStatus | None
) -> PodSpeculation | None:
    """What ``engine: vllm`` pods start with; ``None`` for ``engine: specula`` (its
    pods start at the spec's k and take the tuner's through their admin API).

    In ``Auto`` mode, once the tuner has a state, its k or schedule, even outside
    bounds the spec has just changed: the tuner's next window moves it into them
    (reason ``Bounds``), so the pods roll once, to the k it picks; otherwise the spec's k.
    """
    if spec.engine != "vllm":
        return None
    tuner = status.tuner if status is not None else None
    if spec.tuning.mode != "Auto" or tuner is None or not tuner.state:
        return PodSpeculation(spec.speculator.num_speculative_tokens)
    state = load_state(spec, tuner)
    return PodSpeculation(state.num_speculative_tokens, state.schedule)


def rollout_in_progress(deployment: dict[str, Any] | None) -> bool:
    """Whether the Deployment's controller has not yet replaced every pod with one of
    the current template: its ``observedGeneration`` lags, or fewer pods than desired
    are updated, or old pods remain.  Fields the controller has not written are not
    held against it (a Deployment it has never seen counts as settled)."""
    if deployment is None:
        return False
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    if observed is not None and generation is not None and observed < generation:
        return True
    desired = (deployment.get("spec") or {}).get("replicas")
    updated, total = status.get("updatedReplicas"), status.get("replicas")
    if desired is not None and updated is not None and updated < desired:
        return True
    return updated is not None and total is not None and total > updated
