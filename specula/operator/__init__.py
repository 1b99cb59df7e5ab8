"""The SpeculativeModel operator: kopf handlers (thin) over pure builders.

``specula.operator.builders`` turns a parsed spec into manifests,
``specula.operator.status`` computes conditions, ``specula.operator.reconcile``
applies and records them, ``specula.operator.handlers`` wires it into kopf.
"""
