"""The ``specula`` command: ``operator``, ``serve``, ``download``, ``demo`` and ``crd``.

Each subcommand imports its implementation lazily so that, for example,
``specula crd`` and ``specula operator`` never import torch.
"""

from __future__ import annotations

import argparse
import sys


def _add_operator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the SpeculativeModel operator (kopf)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=None,
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (cluster-wide)",
    )
    p.add_argument("--standalone", action="store_true", default=True,
                   help="no peering with other operator instances (default)")
    p.add_argument("--liveness", default=None,
                   help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--verbose", action="store_true")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model with speculative decoding (OpenAI-compatible API)")
    p.add_argument("--config", default=None, help="runtime config JSON (as the operator writes it)")
    p.add_argument("--model", default=None, help="target checkpoint URI: hf://, pvc:// or file://")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--speculator-method", default=None,
                   choices=["eagle3", "mtp", "gemma4_mtp", "dflash", "draft_model", "ngram"])
    p.add_argument("--speculator-model", default=None, help="draft checkpoint URI")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k the server starts with")
    p.add_argument("--max-num-speculative-tokens", type=int, default=None,
                   help="largest k PUT /v1/speculative_config may set (default: the start k)")
    p.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse the KV blocks of cached prompt prefixes (default on)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template for /v1/chat/completions, instead of the model's")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--admin-port", type=int, default=None,
                   help="port of the admin API (GET/PUT /v1/speculative_config); none: no admin API")
    p.add_argument("--admin-token-file", default=None,
                   help="file holding the admin API's bearer token (else $SPECULA_ADMIN_TOKEN)")
    p.add_argument("--admin-insecure-no-token", action="store_true",
                   help="local development only: serve the admin API without a token")
    p.add_argument("--api-key", default=None,
                   help="bearer key the OpenAI routes require (else $SPECULA_API_KEY); "
                        "/health and /metrics stay open")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train the demo models if needed, serve them, and report acceptance")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k of the measured speculative runs (default 3; --compare: 4)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--retrain", action="store_true", help="train again even if cached")
    p.add_argument("--no-tune", dest="tune", action="store_false",
                   help="skip the tuning phase (the tuner choosing k as prompts switch "
                        "between code and prose)")
    p.add_argument("--tune-intervals", type=int, default=18,
                   help="tuning intervals, split into code, prose and code phases")
    p.add_argument("--compare", action="store_true",
                   help="instead: serve the target with each of draft_model, eagle3, mtp and "
                        "ngram in turn and print their acceptance side by side")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--runtime-only", action="store_true",
                       help="serve on this machine only, without the local Kubernetes node "
                            "(the default where a node cannot run: not Linux, or not root)")
    where.add_argument("--cluster", action="store_true",
                       help="require the local Kubernetes node (fail instead of falling back)")


def _add_download(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "download",
        help="download the hf:// checkpoints of a runtime config into the Hugging Face cache",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="runtime config JSON (as the operator writes it)")
    source.add_argument("--model", help="one hf://org/name URI")
    p.add_argument("--revision", default=None, help="branch, tag or commit (with --model)")


def _add_crd(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("crd", help="print the SpeculativeModel CRD (YAML) generated from specula.api")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specula", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_operator(sub)
    _add_serve(sub)
    _add_demo(sub)
    _add_download(sub)
    _add_crd(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "crd":
        from specula.api.crd import crd_yaml

        sys.stdout.write(crd_yaml())
        return 0
    if args.command == "operator":
        from specula.operator.main import run_operator

        return run_operator(args)
    if args.command == "serve":
        from specula.runtime.server.cli import serve

        return serve(args)
    if args.command == "download":
        from specula.runtime.download import run_download

        return run_download(args)
    if args.command == "demo":
        return _demo(args)
    raise AssertionError(args.command)


def _demo(args: argparse.Namespace) -> int:
    """The cluster demo where a local node can run, else the runtime-only demo (saying
    why); ``--compare`` and ``--runtime-only`` always run on this machine alone."""
    from specula.demo.run import run_demo

    if args.compare or args.runtime_only:
        return run_demo(args)
    from specula.devcluster.cluster import host_support

    reason = host_support()
    if reason is None:
        from specula.demo.cluster import run_cluster_demo

        return run_cluster_demo(args)
    if args.cluster:
        print(f"specula demo: no local Kubernetes node here: {reason}")
        return 1
    print(f"specula demo: running on this machine alone, without Kubernetes: {reason}")
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
