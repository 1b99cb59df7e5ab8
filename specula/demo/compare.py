"""``specula demo --compare``: every speculative-decoding method on the demo target, side by side.

The target is served alone first (the greedy reference), then once per method — the distilled
draft model (``draft_model``), the EAGLE-3 and MTP heads trained on the target
(:mod:`specula.demo.train_heads`), and n-gram prompt lookup (``ngram``) — one ``specula serve``
process at a time, each sent the same prompts at temperature 0 with the same k. Per method the
table gives the per-position acceptance rate (accepted tokens at draft position i per draft, from
``specula:spec_decode_num_accepted_tokens_per_pos`` and ``specula:spec_decode_num_drafts``), the
mean acceptance length, tokens/s and whether the greedy output equals the target's, token for
token (it must: Leviathan et al., arXiv 2211.17192).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from specula.demo.measure import per_position_acceptance
from specula.demo.run import PROMPTS, TIMED_ROUNDS, ServedRun, measure_servers
from specula.demo.server_process import ServerError, ServerProcess

#: Methods in the order they are served and listed.
COMPARE_METHODS: tuple[str, ...] = ("draft_model", "eagle3", "mtp", "ngram")


def serve_args(
    method: str | None, model_dir: Path, heads_dir: Path, num_speculative_tokens: int
) -> list[str]:
    """``specula serve`` flags for the demo target with ``method`` (``None``: target alone).

    Raises:
        ValueError: an unknown method.
    """
    args = ["--model", f"file://{model_dir / 'target'}"]
    if method is None:
        return args
    drafts = {"draft_model": model_dir / "draft", "eagle3": heads_dir / "eagle3",
              "mtp": heads_dir / "mtp", "ngram": None}
    if method not in drafts:
        raise ValueError(f"unknown method {method!r}; expected one of {sorted(drafts)}")
    args += ["--speculator-method", method, "--num-speculative-tokens",
             str(num_speculative_tokens)]
    if drafts[method] is not None:
        args += ["--speculator-model", f"file://{drafts[method]}"]
    return args


def compare_row(method: str, run: ServedRun, base: ServedRun) -> dict:
    """One table row: acceptance figures from ``run``'s counters (vLLM's definitions),
    throughput against the target alone, greedy identity with ``base``'s completions."""
    c = run.counters
    return {
        "method": method,
        "num_drafts": c.num_drafts,
        "num_draft_tokens": c.num_draft_tokens,
        "num_accepted_tokens": c.num_accepted_tokens,
        "per_position_acceptance_rate": per_position_acceptance(c),
        "acceptance_rate": c.acceptance_rate,
        "mean_acceptance_length": c.mean_acceptance_length,
        "tokens_per_s": run.tokens_per_s,
        "speedup": run.tokens_per_s / base.tokens_per_s if base.tokens_per_s else None,
        "greedy_outputs_identical": run.completions == base.completions,
        "error": None,
    }


def failed_row(method: str, error: str) -> dict:
    """A row for a method whose server did not come up (``error``: the reason)."""
    return {"method": method, "per_position_acceptance_rate": [], "acceptance_rate": None,
            "mean_acceptance_length": None, "tokens_per_s": None, "speedup": None,
            "greedy_outputs_identical": None, "error": error}


def format_table(rows: list[dict], base_tokens_per_s: float, k: int) -> str:
    """The comparison as aligned text: one line per method plus the target-only line."""
    def num(x, spec):
        return "-" if x is None else format(x, spec)

    header = ("method", f"acceptance rate per position (k={k})", "mean acc. len",
              "tokens/s", "speedup", "identical")
    lines = [header, ("target only", "", "", num(base_tokens_per_s, ".1f"), "1.00x", "")]
    for r in rows:
        if r["error"] is not None:
            lines.append((r["method"], f"FAILED: {r['error']}", "", "", "", ""))
            continue
        same = r["greedy_outputs_identical"]
        lines.append((
            r["method"],
            " ".join(f"{a:.2f}" for a in r["per_position_acceptance_rate"]) or "no drafts",
            num(r["mean_acceptance_length"], ".2f"),
            num(r["tokens_per_s"], ".1f"),
            num(r["speedup"], ".2f") + "x" if r["speedup"] is not None else "-",
            "yes" if same else "NO",
        ))
    widths = [max(len(line[i]) for line in lines if not line[i].startswith("FAILED"))
              for i in range(len(header))]
    out = []
    for line in lines:
        cells = [cell.ljust(w) if i < 2 else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(line, widths, strict=True))]
        out.append("  " + "  ".join(cells).rstrip())
    return "\n".join(out)


def _serve_once(label: str, args: list[str], log: Path, max_tokens: int, port: int) -> ServedRun:
    with ServerProcess(args, log, port) as server:
        return measure_servers({label: server}, max_tokens)[label]


def run_compare(
    model_dir: Path, heads_dir: Path, k: int, max_tokens: int, port: int = 0,
    methods: tuple[str, ...] = COMPARE_METHODS,
) -> dict:
    """Serve the target alone, then with each of ``methods`` in turn, and compare.

    A method whose server fails to start (e.g. a runtime without it) gets a failed row and the
    comparison goes on.

    Returns:
        ``{"num_speculative_tokens", "max_tokens", "timed_rounds", "target_only", "rows",
        "runs", "table"}`` (``runs``: every server's completions and counters).

    Raises:
        ServerError: the target-only server failed (nothing to compare against).
        httpx.HTTPError: a request to a running server failed.
    """
    logs = model_dir / "logs"
    print(f"\ncompare: target alone, then {', '.join(methods)}, one server at a time "
          f"(k={k}); {len(PROMPTS)} prompts concurrently, greedy, max_tokens={max_tokens}, "
          f"{TIMED_ROUNDS} timed rounds each; logs in {logs}", flush=True)
    base = _serve_once("target only", serve_args(None, model_dir, heads_dir, k),
                       logs / "compare-target.log", max_tokens, port)
    print(f"  target only: {base.tokens_per_s:.1f} tokens/s", flush=True)
    rows, runs = [], [base]
    for method in methods:
        args = serve_args(method, model_dir, heads_dir, k)
        try:
            run = _serve_once(method, args, logs / f"compare-{method}.log", max_tokens, port)
        except ServerError as exc:
            first = str(exc).splitlines()[0]
            print(f"  {method}: server failed: {first}", flush=True)
            rows.append(failed_row(method, _last_error_line(exc) or first))
            continue
        runs.append(run)
        rows.append(compare_row(method, run, base))
        r = rows[-1]
        print(f"  {method}: mean acceptance length {r['mean_acceptance_length']:.2f}, "
              f"{r['tokens_per_s']:.1f} tokens/s", flush=True)
    table = format_table(rows, base.tokens_per_s, k)
    return {"num_speculative_tokens": k, "max_tokens": max_tokens, "timed_rounds": TIMED_ROUNDS,
            "target_only": {"tokens_per_s": base.tokens_per_s,
                            "completion_tokens": base.completion_tokens, "wall_s": base.wall_s},
            "rows": rows, "runs": [asdict(r) for r in runs], "table": table}


def _last_error_line(exc: ServerError) -> str:
    """The last line of the server log tail that names an error (its exception message)."""
    for line in reversed(str(exc).splitlines()):
        if "Error" in line or "error" in line:
            return line.strip()
    return ""


def compare_main(model_dir: Path, heads_dir: Path, k: int, max_tokens: int, port: int) -> int:
    """Run :func:`run_compare`, print the table, and store it under ``"compare"`` in
    ``model_dir/demo-results.json`` (other keys of that file are kept).

    Returns:
        0 when every method served and reproduced the target's greedy output, else 1.

    Raises:
        ServerError, httpx.HTTPError: as :func:`run_compare`.
    """
    result = run_compare(model_dir, heads_dir, k, max_tokens, port)
    print("\ncomparison (same prompts, greedy, one server at a time)")
    print(result["table"])
    out = model_dir / "demo-results.json"
    try:
        results = json.loads(out.read_text())
    except (OSError, ValueError):
        results = {}
    result["heads_dir"] = str(heads_dir)
    results["compare"] = result
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nfigures written to {out} (key \"compare\")")
    failed = [r["method"] for r in result["rows"] if r["error"] is not None]
    differ = [r["method"] for r in result["rows"] if r["greedy_outputs_identical"] is False]
    if failed:
        print(f"ERROR: no server for {', '.join(failed)}")
    if differ:
        print(f"ERROR: greedy output differs from the target's for {', '.join(differ)}")
    return 1 if failed or differ else 0
