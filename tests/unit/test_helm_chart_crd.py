"""The chart's CRD template is generated from crds/speculativemodel.yaml and current."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chart_crd():
    spec = importlib.util.spec_from_file_location("chart_crd", ROOT / "hack" / "chart_crd.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chart_crd", module)
    spec.loader.exec_module(module)
    return module


def test_template_is_current(chart_crd):
    assert chart_crd.TARGET.read_text() == chart_crd.render(chart_crd.SOURCE.read_text()), (
        "charts/specula/templates/crd-speculativemodel.yaml is stale: run `make crd`"
    )
    assert chart_crd.main(["--check"]) == 0


def test_template_carries_the_source_spec_as_data(chart_crd):
    source = yaml.safe_load(chart_crd.SOURCE.read_text())
    text = chart_crd.render(chart_crd.SOURCE.read_text())
    lines = text.splitlines()
    assert lines[1] == "{{- if .Values.crds.enabled }}" and lines[-1] == "{{- end }}"
    # Everything from `spec:` on is plain YAML, equal to the source's spec.
    body = "\n".join(lines[lines.index("spec:"):-1])
    assert yaml.safe_load(body) == {"spec": source["spec"]}
    assert "helm.sh/resource-policy: keep" in text


def test_template_delimiters_in_the_source_are_escaped(chart_crd):
    source = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "x.example.com", "labels": {"team": "a", "app.kubernetes.io/name": "x"}},
        "spec": {"group": "example.com", "description": "render {{ .Values }} literally"},
    }
    text = chart_crd.render(yaml.safe_dump(source))
    assert '{{ "{{" }} .Values {{ "}}" }}' in text
    # Labels the chart's helper sets are not repeated; others are kept.
    assert "team: a" in text and "app.kubernetes.io/name: x" not in text


def test_render_refuses_other_documents(chart_crd):
    with pytest.raises(ValueError):
        chart_crd.render("kind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(ValueError, match="unexpected metadata"):
        chart_crd.render(
            "kind: CustomResourceDefinition\napiVersion: v1\n"
            "metadata: {name: x, namespace: y}\nspec: {}\n"
        )
