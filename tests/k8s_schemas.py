"""Validate Kubernetes objects against real schemas: the API's own (kubernetes-validate ships
them, offline) and, for the custom resources this project writes, the CRDs' OpenAPI schemas
in tests/fixtures/. Unknown fields fail in both, as a strict apiserver (or a typo) would."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

KUBERNETES_VERSION = "1.35"  # kubernetesVersion of the example stacks
FIXTURES = Path(__file__).resolve().parent / "fixtures"
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject.schema.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.schema.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.schema.json",
}


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties: false wherever properties are listed (the CRDs
    leave objects open and the apiserver prunes unknown fields silently; here they fail)."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema and schema.get("type") == "object":
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    return schema


def json_ints(value: Any) -> Any:
    """Pulumi's mocks hand numbers over as floats (protobuf Struct); the engine sends JSON ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: json_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_ints(v) for v in value]
    return value


def validate(obj: dict) -> None:
    """Raise if ``obj`` is not a valid object of its apiVersion and kind."""
    obj = json_ints(copy.deepcopy(obj))
    crd = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if crd:
        jsonschema.validate(obj, _closed(json.loads((FIXTURES / crd).read_text())))
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
