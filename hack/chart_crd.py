"""Write the Helm chart's CRD template from crds/speculativemodel.yaml.

crds/speculativemodel.yaml (the output of ``specula crd``) is the source of truth; the
chart ships the same CustomResourceDefinition as a template so that it can sit behind
``crds.enabled`` and carry ``helm.sh/resource-policy: keep`` when ``crds.keep`` is set
(Helm's ``crds/`` directory allows neither).  Only ``metadata`` is templated: the
chart's labels replace the ``app.kubernetes.io/*`` ones; ``spec`` is copied as data.

Usage:
    python hack/chart_crd.py          # (re)write the template
    python hack/chart_crd.py --check  # exit 1 if the template is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "crds" / "speculativemodel.yaml"
TARGET = ROOT / "charts" / "specula" / "templates" / "crd-speculativemodel.yaml"

_CHART_LABEL_PREFIXES = ("app.kubernetes.io/", "helm.sh/")
"""Label keys the chart's ``specula.labels`` helper owns; the source's values for these
are dropped rather than repeated (a duplicated key is a YAML error)."""


def _escape_template(text: str) -> str:
    """Quote Go-template delimiters so Helm emits them literally."""
    return re.sub(r"\{\{|\}\}", lambda m: "{{ " + f'"{m.group(0)}"' + " }}", text)


def _block(mapping: dict[str, str], indent: int) -> str:
    text = yaml.safe_dump(mapping, default_flow_style=False, sort_keys=True, width=1 << 16)
    pad = " " * indent
    return "".join(f"{pad}{line}\n" for line in text.splitlines())


def render(source_text: str) -> str:
    """The chart template for the CRD in ``source_text`` (YAML of one CRD).

    Raises:
        ValueError: the source is not a single CustomResourceDefinition, or its metadata
            holds more than ``name``, ``labels`` and ``annotations``.
    """
    doc = yaml.safe_load(source_text)
    if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
        raise ValueError("source is not a CustomResourceDefinition")
    meta = doc["metadata"]
    extra = set(meta) - {"name", "labels", "annotations"}
    if extra:
        raise ValueError(f"unexpected metadata fields: {sorted(extra)}")
    labels = {
        k: v for k, v in (meta.get("labels") or {}).items()
        if not k.startswith(_CHART_LABEL_PREFIXES)
    }
    annotations = dict(meta.get("annotations") or {})
    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
    body_text = yaml.safe_dump(body, default_flow_style=False, sort_keys=False, width=1 << 16)

    out = [
        "{{- /* Generated from crds/speculativemodel.yaml by hack/chart_crd.py"
        " (`make crd`); do not edit. */}}\n",
        "{{- if .Values.crds.enabled }}\n",
        f"apiVersion: {doc['apiVersion']}\n",
        f"kind: {doc['kind']}\n",
        "metadata:\n",
        f"  name: {meta['name']}\n",
        "  labels:\n",
        '    {{- include "specula.labels" . | nindent 4 }}\n',
    ]
    if labels:
        out.append(_escape_template(_block(labels, 4)))
    if annotations:
        out.append("  annotations:\n")
        out.append(_escape_template(_block(annotations, 4)))
        out.append("    {{- if .Values.crds.keep }}\n")
    else:
        out.append("  {{- if .Values.crds.keep }}\n")
        out.append("  annotations:\n")
    out.append("    helm.sh/resource-policy: keep\n")
    out.append("  {{- end }}\n" if not annotations else "    {{- end }}\n")
    out.append(_escape_template(body_text))
    out.append("{{- end }}\n")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the template is stale")
    args = parser.parse_args(argv)
    wanted = render(SOURCE.read_text())
    rel = TARGET.relative_to(ROOT)
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != wanted:
            print(f"{rel} is stale: run 'make crd'", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
