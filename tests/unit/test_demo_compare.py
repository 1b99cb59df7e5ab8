"""``specula demo --compare``: serve flags per method, table rows from the counters (vLLM's
definitions), greedy identity with the target alone, and the printed table."""

from __future__ import annotations

from pathlib import Path

import pytest

from specula.demo.compare import compare_row, failed_row, format_table, serve_args
from specula.demo.run import ServedRun
from specula.tuning import SpecDecodeCounters

MODELS = Path("/cache/demo/abc")
HEADS = MODELS / "heads-def"


def _run(label: str, completions: list[str], tokens: int, wall_s: float,
         counters: SpecDecodeCounters) -> ServedRun:
    return ServedRun(label=label, model_name="target", speculative_config=None,
                     completions=completions, completion_tokens=tokens, wall_s=wall_s,
                     counters=counters, generation_tokens=float(tokens))


def test_serve_args_name_each_methods_checkpoint() -> None:
    target = ["--model", f"file://{MODELS}/target"]
    assert serve_args(None, MODELS, HEADS, 4) == target
    spec = ["--num-speculative-tokens", "4"]
    assert serve_args("draft_model", MODELS, HEADS, 4) == [
        *target, "--speculator-method", "draft_model", *spec,
        "--speculator-model", f"file://{MODELS}/draft"]
    assert serve_args("eagle3", MODELS, HEADS, 4)[-1] == f"file://{HEADS}/eagle3"
    assert serve_args("mtp", MODELS, HEADS, 4)[-1] == f"file://{HEADS}/mtp"
    assert serve_args("ngram", MODELS, HEADS, 4) == [*target, "--speculator-method", "ngram",
                                                       *spec]
    with pytest.raises(ValueError, match="medusa"):
        serve_args("medusa", MODELS, HEADS, 4)


def test_rows_use_the_counters_and_compare_outputs_with_the_target() -> None:
    base = _run("target only", ["a", "b"], 100, 10.0, SpecDecodeCounters())
    good = _run("eagle3", ["a", "b"], 100, 5.0, SpecDecodeCounters(10, 30, 18, (9, 6, 3)))
    row = compare_row("eagle3", good, base)
    assert row["per_position_acceptance_rate"] == pytest.approx([0.9, 0.6, 0.3])
    assert row["acceptance_rate"] == pytest.approx(18 / 30)
    assert row["mean_acceptance_length"] == pytest.approx(1 + 18 / 10)
    assert row["tokens_per_s"] == pytest.approx(20.0) and row["speedup"] == pytest.approx(2.0)
    assert row["greedy_outputs_identical"] is True
    bad = _run("mtp", ["a", "c"], 100, 10.0, SpecDecodeCounters(10, 30, 3, (2, 1, 0)))
    assert compare_row("mtp", bad, base)["greedy_outputs_identical"] is False


def test_table_lists_every_method_and_flags_failures_and_mismatches() -> None:
    base = _run("target only", ["a"], 50, 10.0, SpecDecodeCounters())
    rows = [
        compare_row("draft_model", _run("d", ["a"], 50, 5.0,
                                        SpecDecodeCounters(4, 12, 6, (3, 2, 1))), base),
        compare_row("ngram", _run("n", ["x"], 50, 10.0, SpecDecodeCounters()), base),
        failed_row("eagle3", "ValueError: d2t has shape (3,)"),
    ]
    table = format_table(rows, base.tokens_per_s, 3)
    lines = table.splitlines()
    assert lines[0].split()[0] == "method" and "(k=3)" in lines[0]
    assert lines[1].split() == ["target", "only", "5.0", "1.00x"]
    assert lines[2].split() == ["draft_model", "0.75", "0.50", "0.25", "2.50", "10.0", "2.00x",
                                "yes"]
    assert lines[3].split() == ["ngram", "no", "drafts", "-", "5.0", "1.00x", "NO"]
    assert lines[4].split()[:2] == ["eagle3", "FAILED:"] and "d2t" in lines[4]
