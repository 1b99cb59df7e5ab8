"""What the Specula runtime can do today.

The CRD accepts every speculation method named in the API so that manifests written
for a later release still validate; the operator compares a resource's method with
this set and reports ``Degraded`` / ``MethodNotSupported`` for the others instead of
starting pods that would fail.
"""

from __future__ import annotations

IMPLEMENTED_METHODS: frozenset[str] = frozenset(
    {"dflash", "draft_model", "eagle3", "gemma4_mtp", "mtp", "ngram"}
)
"""Speculation methods the runtime implements (vLLM ``speculative_config.method`` names)."""


RUNTIME_METHODS_WITHOUT_DRAFT_MODEL: frozenset[str] = frozenset({"ngram"})
"""Methods the Specula runtime runs without ``speculator.model``. The API also lets
``mtp`` omit it because vLLM reads MTP layers from the target checkpoint; the Specula
runtime loads MTP layers from a ``speculators``-format checkpoint only."""


def is_method_implemented(method: str) -> bool:
    """Whether ``specula serve`` can run the speculation method ``method``."""
    return method in IMPLEMENTED_METHODS
