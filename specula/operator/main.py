"""``specula operator``: run the SpeculativeModel operator until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse

import kopf

from specula.operator.handlers import build_registry, make_memo
from specula.operator.settings import OperatorSettings


def run_operator(args: argparse.Namespace) -> int:
    """Run kopf with the operator's handlers; returns the exit code.

    ``args.namespace`` (repeatable) restricts the watch to those namespaces; without
    it (or with ``-A``) the operator watches the whole cluster.  Credentials: the
    in-cluster service account, else ``$KUBECONFIG``/``~/.kube/config``.

    Raises:
        ValueError: a ``SPECULA_*`` environment variable does not parse.
    """
    settings = OperatorSettings.from_env()
    kopf.configure(verbose=bool(getattr(args, "verbose", False)), log_prefix=True)
    namespaces = list(getattr(args, "namespace", None) or [])
    kopf.run(
        registry=build_registry(settings),
        memo=make_memo(settings),
        standalone=bool(getattr(args, "standalone", True)),
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=getattr(args, "liveness", None),
    )
    return 0
