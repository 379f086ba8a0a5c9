"""Every Helm release of the infra program at an exact chart version, and the values it
renders checked against that chart's own files: its values.schema.json where it ships one
(validated as Helm does, after merging with the chart's defaults), otherwise its default
values.yaml (every key we set exists there, unless it sits under a map the chart leaves
free-form). The fixtures are the charts' files at those versions (tests/fixtures/charts,
sources in SOURCES.json)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from infra_harness import Build, example

from infra.charts import CHARTS
from infra.flow_jobs import FLOW_JOB_DEFAULTS, WORK_POOL
from infra.namespaces import FLOWS_NS, FLOWS_SA

FIXTURES = Path(__file__).parent / "fixtures" / "charts"
SOURCES = json.loads((FIXTURES / "SOURCES.json").read_text())


@pytest.fixture(scope="module", params=("dev", "prod"))
def stack(request: pytest.FixtureRequest) -> Build:
    return example(request.param)


def releases(stack: Build) -> dict[str, dict]:
    """The stack's Helm releases from chart repositories, by chart. Karpenter's comes from an OCI
    registry, its files vendored with its CRDs: tests/test_karpenter.py checks it the same way."""
    found = stack.of_type("kubernetes:helm.sh/v3:Release")
    return {r.inputs["chart"]: r.inputs for r in found if not r.inputs["chart"].startswith("oci://")}


def chart_files(chart: str) -> Path:
    return FIXTURES / f"{chart}-{SOURCES[chart]['version']}"


def chart_defaults(chart: str) -> dict:
    """The chart's default values, its vendored subcharts' under their keys (the parent's
    values for a subchart override the subchart's own, as in Helm)."""
    defaults = yaml.safe_load((chart_files(chart) / "values.yaml").read_text())
    for sub, source in SOURCES.items():
        if source.get("subchart_of") == chart:
            key = source["values_key"]
            own = yaml.safe_load((chart_files(sub) / "values.yaml").read_text())
            defaults[key] = merged(own, defaults.get(key) or {})
    return defaults


def merged(defaults: Any, ours: Any) -> Any:
    """Helm's coalescing of a release's values over the chart's: maps merge, anything else is replaced."""
    if isinstance(defaults, dict) and isinstance(ours, dict):
        out = copy.deepcopy(defaults)
        for key, value in ours.items():
            out[key] = merged(defaults.get(key), value)
        return out
    return copy.deepcopy(ours)


# Maps a chart passes on as they are (flags, labels), whose keys its values.yaml documents in
# comments only: each key we set there must at least appear in that file's text.
FREE_FORM = {"cluster-autoscaler": {".extraArgs"}}  # rendered as --key=value flags of the binary


def unknown_keys(
    defaults: Any, ours: Any, path: str = "", free: frozenset[str] = frozenset(), text: str = ""
) -> list[str]:
    """Keys of ``ours`` the chart's defaults do not have; a map the chart leaves empty (or a
    list, or a commented-out ``null``) is free-form and not looked into; under a ``free`` path
    a key must be named somewhere in the chart's values.yaml ``text``."""
    if path in free:
        return [f"{path}.{key}" for key in ours if f"{key}:" not in text]
    if not isinstance(ours, dict) or not isinstance(defaults, dict) or not defaults:
        return []
    found = []
    for key, value in ours.items():
        if key not in defaults:
            found.append(f"{path}.{key}")
        else:
            found += unknown_keys(defaults[key], value, f"{path}.{key}", free, text)
    return found


def test_every_release_is_pinned_to_a_version_whose_chart_files_are_vendored(stack: Build) -> None:
    found = releases(stack)
    assert set(found) == set(CHARTS)
    for chart, inputs in found.items():
        repo, version = CHARTS[chart]
        assert inputs.get("version") == version, f"{chart} floats: no exact version"
        assert inputs["repositoryOpts"]["repo"] == repo == SOURCES[chart]["repo"]
        assert SOURCES[chart]["version"] == version, (
            f"{chart} {version}: the vendored files are of {SOURCES[chart]['version']}"
        )
        meta = yaml.safe_load((chart_files(chart) / "Chart.yaml").read_text())
        assert meta["name"] == chart
        assert inputs["atomic"] is True  # a release that fails rolls back instead of half-installing


@pytest.mark.parametrize("chart", sorted(CHARTS))
def test_the_rendered_values_are_what_the_chart_accepts(stack: Build, chart: str) -> None:
    ours = releases(stack)[chart]["values"]
    files = chart_files(chart)
    text = (files / "values.yaml").read_text()
    defaults = chart_defaults(chart)
    schema_file = files / "values.schema.json"
    if SOURCES[chart]["schema"]:
        schema = json.loads(schema_file.read_text())
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)
        errors = sorted(validator.iter_errors(merged(defaults, ours)), key=lambda e: list(e.absolute_path))
        assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    else:
        assert not schema_file.exists()
        free = frozenset(FREE_FORM.get(chart, ()))
        assert unknown_keys(defaults, ours, free=free, text=text) == [], f"{chart}: keys its values.yaml does not have"


def test_the_schema_check_has_teeth() -> None:
    """The value this issue found rejected in a real release, and an unknown key, both fail."""
    files = chart_files("prefect-worker")
    schema = json.loads((files / "values.schema.json").read_text())
    defaults = yaml.safe_load((files / "values.yaml").read_text())
    validator = jsonschema.Draft7Validator(schema)
    old = {"worker": {"apiConfig": "server", "serverApiConfig": {"apiUrl": "http://prefect-server:4200/api"}}}
    messages = [e.message for e in validator.iter_errors(merged(defaults, old))]
    assert any("'server' is not one of" in m for m in messages), messages
    assert any("'serverApiConfig' was unexpected" in m for m in messages), messages
    kps = chart_defaults("kube-prometheus-stack")
    assert unknown_keys(kps, {"grafana": {"adminPasswort": "x"}}) == [
        ".grafana.adminPasswort"
    ]  # the subchart's keys too
    autoscaler = (chart_files("cluster-autoscaler") / "values.yaml").read_text()
    flags = {"extraArgs": {"balance-similar-node-groups": True, "balance-similar-nodegroups": True}}
    assert unknown_keys(yaml.safe_load(autoscaler), flags, free=frozenset({".extraArgs"}), text=autoscaler) == [
        ".extraArgs.balance-similar-nodegroups"
    ]


def test_the_worker_reaches_the_server_and_flow_runs_start_in_the_flows_namespace(stack: Build) -> None:
    worker = releases(stack)["prefect-worker"]["values"]["worker"]
    assert worker["apiConfig"] == "selfHostedServer"
    assert (
        worker["selfHostedServerApiConfig"]["apiUrl"] == f"http://prefect-server.{FLOWS_NS}.svc.cluster.local:4200/api"
    )
    assert worker["config"]["workPool"] == WORK_POOL and worker["config"]["type"] == "kubernetes"
    template = json.loads(worker["config"]["baseJobTemplate"]["configuration"])
    variables = template["variables"]["properties"]
    assert variables["namespace"]["default"] == FLOWS_NS == releases(stack)["prefect-worker"]["namespace"]
    assert variables["service_account_name"]["default"] == FLOWS_SA
    for name, value in FLOW_JOB_DEFAULTS.items():
        assert variables[name]["default"] == value
        jsonschema.validate(value, {k: v for k, v in variables[name].items() if k not in ("default", "title")})
    manifest = template["job_configuration"]["job_manifest"]
    (container,) = manifest["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "{{ cpu_request }}", "memory": "{{ memory_request }}"}
    assert manifest["metadata"]["namespace"] == "{{ namespace }}"
    assert manifest["spec"]["template"]["spec"]["serviceAccountName"] == "{{ service_account_name }}"


def test_the_cluster_autoscaler_chart_grants_what_its_image_reads(stack: Build) -> None:
    """cluster-autoscaler 1.33+ lists VolumeAttachments (to count a node's attached volumes);
    chart 9.43.1 ran image v1.33 without that permission (added in chart 9.46), so the
    autoscaler logged forbidden errors on every loop. The image follows the cluster's minor:
    the pinned chart must be released for at least that minor, and its ClusterRole (vendored
    from the chart's own template) must let it read VolumeAttachments."""
    chart = yaml.safe_load((chart_files("cluster-autoscaler") / "Chart.yaml").read_text())
    tag = releases(stack)["cluster-autoscaler"]["values"]["image"]["tag"]
    cluster = tuple(int(p) for p in tag.removeprefix("v").split(".")[:2])
    assert tuple(int(p) for p in chart["appVersion"].split(".")[:2]) >= cluster, (chart["appVersion"], tag)
    role = (chart_files("cluster-autoscaler") / "templates" / "clusterrole.yaml").read_text()
    rules = yaml.safe_load("\n".join(line for line in role.splitlines() if "{{" not in line))["rules"]
    reads = {r for rule in rules if "storage.k8s.io" in rule.get("apiGroups", []) for r in rule["resources"]}
    assert "volumeattachments" in reads and {"list", "watch"} <= {
        v for rule in rules if "volumeattachments" in rule.get("resources", []) for v in rule["verbs"]
    }
