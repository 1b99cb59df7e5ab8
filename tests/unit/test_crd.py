"""The generated CRD: structural, complete, deterministic, and equal to the checked-in file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specula.api.crd import crd_manifest, crd_yaml, structural_violations, to_structural
from specula.api.models import DNS_SUBDOMAIN_PATTERN, QUANTITY_PATTERN

CHECKED_IN = Path(__file__).resolve().parents[2] / "crds" / "speculativemodel.yaml"


@pytest.fixture(scope="module")
def crd():
    return yaml.safe_load(crd_yaml())


@pytest.fixture(scope="module")
def version(crd):
    (v,) = crd["spec"]["versions"]
    return v


@pytest.fixture(scope="module")
def schema(version):
    return version["schema"]["openAPIV3Schema"]


def walk(node, path=""):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_checked_in_file_is_current():
    assert CHECKED_IN.read_text() == crd_yaml(), (
        "crds/speculativemodel.yaml is out of date; regenerate it with "
        "`specula crd > crds/speculativemodel.yaml`"
    )


def test_output_is_deterministic():
    assert crd_yaml() == crd_yaml()


def test_names_and_scope(crd, version):
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == "speculativemodels.specula.dev"
    spec = crd["spec"]
    assert spec["group"] == "specula.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "SpeculativeModel",
        "listKind": "SpeculativeModelList",
        "plural": "speculativemodels",
        "singular": "speculativemodel",
        "shortNames": ["specmodel", "sm"],
    }
    assert version["name"] == "v1alpha1"
    assert version["served"] is True and version["storage"] is True


def test_schema_is_structural(schema):
    assert structural_violations(schema) == []
    for path, node in walk(schema):
        for key in ("$ref", "anyOf", "oneOf", "allOf", "nullable", "title", "const"):
            assert key not in node, f"{path} has {key}"


def test_structural_check_catches_violations():
    assert structural_violations({"type": "object", "properties": {"a": {}}}) == [".a: no type"]
    assert structural_violations({"anyOf": [{"type": "string"}]}) != []
    with pytest.raises(ValueError, match="union"):
        to_structural({"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}, {})


def test_field_constraints(schema):
    spec = schema["properties"]["spec"]
    model = spec["properties"]["model"]
    assert spec["required"] == ["model", "speculator"]
    assert model["required"] == ["uri"]
    assert model["properties"]["uri"]["pattern"] == "^(hf|pvc|file)://.+"
    assert model["properties"]["dtype"]["enum"] == ["auto", "bfloat16", "float16", "float32"]
    assert model["properties"]["dtype"]["default"] == "auto"
    assert model["properties"]["maxModelLen"]["minimum"] == 16
    tp = model["properties"]["tensorParallelSize"]
    assert (tp["minimum"], tp["maximum"], tp["default"]) == (1, 8, 1)

    spec_props = spec["properties"]
    speculator = spec_props["speculator"]
    assert speculator["required"] == ["method"]
    assert speculator["properties"]["method"]["enum"] == [
        "eagle3", "mtp", "gemma4_mtp", "dflash", "draft_model", "ngram",
    ]
    k = speculator["properties"]["numSpeculativeTokens"]
    assert (k["minimum"], k["maximum"], k["default"]) == (1, 16, 3)
    assert speculator["properties"]["draftTensorParallelSize"]["default"] == 1
    draft_uri = speculator["properties"]["model"]["properties"]["uri"]
    assert draft_uri["pattern"] == "^(hf|pvc|file)://.+"

    assert spec_props["replicas"]["minimum"] == 0 and spec_props["replicas"]["default"] == 1
    resources = spec_props["resources"]["properties"]
    assert resources["gpu"]["properties"]["resourceName"]["default"] == "nvidia.com/gpu"
    # No stored default: an omitted count follows model.tensorParallelSize.
    count = resources["gpu"]["properties"]["count"]
    assert "default" not in count
    assert (count["minimum"], count["maximum"], count["type"]) == (0, 8, "integer")
    assert resources["cpu"] == {
        "description": resources["cpu"]["description"],
        "x-kubernetes-int-or-string": True,
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-validations": [{
            "rule": "type(self) != int || self >= 0",
            "message": "must be a non-negative quantity",
            "reason": "FieldValueInvalid",
        }],
    }
    assert resources["memory"]["x-kubernetes-int-or-string"] is True
    assert resources["memory"]["pattern"] == QUANTITY_PATTERN
    for selector in ("apiKeySecret", "hfTokenSecret"):
        secret = spec_props[selector]["properties"]
        assert secret["name"]["pattern"] == DNS_SUBDOMAIN_PATTERN
        assert secret["key"]["pattern"] == "^[-._a-zA-Z0-9]+$"
    assert spec_props["serviceAccountName"]["pattern"] == DNS_SUBDOMAIN_PATTERN
    assert spec_props["nodeSelector"]["additionalProperties"] == {"type": "string"}
    assert spec_props["tolerations"]["items"]["type"] == "object"
    env = spec_props["env"]
    assert env["x-kubernetes-list-type"] == "map"
    assert env["x-kubernetes-list-map-keys"] == ["name"]
    value_from = env["items"]["properties"]["valueFrom"]
    assert value_from["x-kubernetes-preserve-unknown-fields"] is True
    assert spec_props["serviceAccountName"]["type"] == "string"
    assert spec_props["image"]["type"] == "string"


def test_cel_rules(schema):
    spec = schema["properties"]["spec"]
    speculator_rules = [
        r["rule"] for r in spec["properties"]["speculator"]["x-kubernetes-validations"]
    ]
    assert speculator_rules == [
        "self.method in ['mtp', 'ngram'] || has(self.model)",
        "!has(self.promptLookupMin) || !has(self.promptLookupMax)"
        " || self.promptLookupMin <= self.promptLookupMax",
        "!has(self.nPredict) || self.method in ['mtp', 'gemma4_mtp']",
        "!has(self.nPredict) || self.numSpeculativeTokens <= self.nPredict"
        " || self.numSpeculativeTokens % self.nPredict == 0",
    ]
    tp_rule, k_rule, mtp_rule, hub_rule, autoscaling_rule, gpu_rule = (
        spec["x-kubernetes-validations"]
    )
    assert gpu_rule["fieldPath"] == ".resources.gpu.count"
    assert "self.resources.gpu.count >= self.model.tensorParallelSize" in gpu_rule["rule"]
    assert "!has(self.resources.gpu.count)" in gpu_rule["rule"]
    (env_rule,) = spec["properties"]["env"]["items"]["x-kubernetes-validations"]
    assert env_rule["fieldPath"] == ".valueFrom"
    (toleration_rule,) = spec["properties"]["tolerations"]["items"]["x-kubernetes-validations"]
    assert toleration_rule["fieldPath"] == ".value"
    assert "self.model.uri.startsWith('hf://')" in hub_rule["rule"]
    (cache_rule,) = spec["properties"]["modelCache"]["x-kubernetes-validations"]
    assert cache_rule["rule"] == "!has(self.claimName) || !has(self.sizeLimit)"
    assert mtp_rule["fieldPath"] == ".tuning.maxSpeculativeTokens"
    assert "<= self.speculator.nPredict" in mtp_rule["rule"]
    assert autoscaling_rule["rule"] == (
        "!has(self.autoscaling) || !has(self.tuning) || self.tuning.mode != 'Off'"
    )
    autoscaling = spec["properties"]["autoscaling"]
    (min_max_replicas,) = autoscaling["x-kubernetes-validations"]
    assert min_max_replicas["rule"] == "self.minReplicas <= self.maxReplicas"
    target = autoscaling["properties"]["targetUtilization"]
    assert (target["minimum"], target["exclusiveMinimum"], target["maximum"]) == (0, True, 1)
    assert autoscaling["properties"]["provider"]["enum"] == ["keda", "hpa"]
    assert autoscaling["required"] == ["maxReplicas"]
    assert spec["properties"]["engine"] == {
        "description": spec["properties"]["engine"]["description"],
        "default": "specula",
        "enum": ["specula", "vllm"],
        "type": "string",
    }
    assert "self.speculator.draftTensorParallelSize == 1" in tp_rule["rule"]
    assert "self.model.tensorParallelSize" in tp_rule["rule"]
    assert k_rule["fieldPath"] == ".speculator.numSpeculativeTokens"
    assert "self.tuning.minSpeculativeTokens <= self.speculator.numSpeculativeTokens" in (
        " ".join(k_rule["rule"].split())
    )
    assert "self.speculator.numSpeculativeTokens <= self.tuning.maxSpeculativeTokens" in (
        " ".join(k_rule["rule"].split())
    )
    tuning = spec["properties"]["tuning"]
    min_max, interval, per_batch = tuning["x-kubernetes-validations"]
    assert "<= self.maxSpeculativeTokens" in min_max["rule"]
    assert "duration(self.interval) >= duration('1s')" in interval["rule"]
    assert per_batch["fieldPath"] == ".perBatchSize"
    assert "self.mode == 'Auto'" in per_batch["rule"]
    assert per_batch["message"].startswith("tuning.perBatchSize applies to tuning.mode Auto")
    assert tuning["properties"]["perBatchSize"] == {
        "type": "boolean", "default": False,
        "description": tuning["properties"]["perBatchSize"]["description"],
    }
    (name_rule,) = schema["x-kubernetes-validations"]
    assert name_rule["rule"] == "size(self.metadata.name) <= 63"


def test_every_list_is_bounded(schema):
    """CEL cost estimation multiplies by list sizes: lists carry maxItems."""
    for path, node in walk(schema):
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path} has no maxItems"


def test_status_schema(schema):
    status = schema["properties"]["status"]["properties"]
    assert set(status) == {
        "observedGeneration", "replicas", "readyReplicas", "selector", "conditions", "speculation",
        "tuningHistory", "tuner", "autoscaling",
    }
    conditions = status["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    item = conditions["items"]
    assert set(item["properties"]) == {
        "type", "status", "reason", "message", "lastTransitionTime", "observedGeneration",
    }
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"
    speculation = status["speculation"]["properties"]
    assert speculation["numSpeculativeTokens"]["type"] == "integer"
    for name in (
        "acceptanceRate", "meanAcceptanceLength", "goodputTokensPerSecond",
        "predictedGoodputTokensPerSecond",
    ):
        assert speculation[name]["type"] == "number", name
    assert speculation["perPositionAcceptanceRate"]["items"] == {"type": "number"}
    assert speculation["schedule"]["items"]["items"] == {"type": "integer"}
    assert speculation["sampledDrafts"]["type"] == "integer"
    assert speculation["lastUpdateTime"]["format"] == "date-time"
    history = status["tuningHistory"]
    assert history["maxItems"] == 10
    assert set(history["items"]["required"]) == {"time", "from", "to", "reason"}
    assert history["items"]["properties"]["predictedGain"]["type"] == "number"
    tuner = status["tuner"]["properties"]
    assert tuner["state"]["x-kubernetes-preserve-unknown-fields"] is True
    assert tuner["baselines"]["x-kubernetes-preserve-unknown-fields"] is True


def test_tuning_schema(schema):
    tuning = schema["properties"]["spec"]["properties"]["tuning"]["properties"]
    assert tuning["mode"]["enum"] == ["Off", "Recommend", "Auto"]
    assert tuning["mode"]["default"] == "Recommend"
    assert (tuning["minSpeculativeTokens"]["minimum"], tuning["minSpeculativeTokens"]["default"]) == (
        0, 0
    )
    assert tuning["maxSpeculativeTokens"]["maximum"] == 16
    assert "default" not in tuning["maxSpeculativeTokens"]
    assert tuning["interval"]["default"] == "30s" and tuning["cooldown"]["default"] == "2m"
    assert tuning["minGain"] == {
        "type": "number", "default": 0.05, "minimum": 0.0, "maximum": 1.0,
        "description": tuning["minGain"]["description"],
    }


def test_subresources(version):
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }


def test_printer_columns(version):
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == [
        "Method", "K", "K-Per-Batch", "Accept-Len", "Ready", "Replicas", "Age",
    ]
    # The schedule only with -o wide: it is long, and blank unless tuning.perBatchSize.
    assert columns["K-Per-Batch"]["priority"] == 1
    assert columns["K-Per-Batch"]["jsonPath"] == (
        ".status.speculation.numSpeculativeTokensPerBatchSize"
    )
    assert all("priority" not in c for n, c in columns.items() if n != "K-Per-Batch")
    assert columns["Accept-Len"]["jsonPath"] == ".status.speculation.meanAcceptanceLength"
    assert columns["Accept-Len"]["type"] == "number"
    assert columns["Method"]["jsonPath"] == ".spec.speculator.method"
    assert columns["K"]["jsonPath"] == ".status.speculation.numSpeculativeTokens"
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Replicas"]["jsonPath"] == ".spec.replicas"
    assert columns["Age"] == {
        "name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp",
    }


def test_manifest_matches_yaml():
    assert yaml.safe_load(crd_yaml()) == crd_manifest()
