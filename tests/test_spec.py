"""fleet.catalog.policies: the shipped policies load, and every bad file gets a precise, complete report."""

from __future__ import annotations

import copy
import re
import typing
from pathlib import Path

import pydantic
import pytest
import yaml

from fleet.catalog.policies.loader import Policies, load_policies
from fleet.catalog.policies.models import ModelSpec
from fleet.errors import ConfigError, NotFound

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "policies"

# The smallest valid policy set; each test breaks one thing in a copy of it.
BASE = {
    "models": {
        "m": {
            "family": "tabular-mlp",
            "size_class": "small",
            "params_millions": 0.01,
            "autoscaling": {"max_replicas": 2, "target_qps_per_replica": 10, "target_p99_ms": 100},
            "slo": {"p99_ms": 250, "error_rate": 0.01},
        }
    },
    "tenants": {"t": {"entitlements": {"m": ["*"]}, "quota": {"rps": 5, "burst": 10}}},
    "rollout": {
        "default": {
            "steps": [10, 50, 100],
            "analysis_window_s": 60,
            "min_samples": 200,
            "hold_deadline_s": 600,
            "gates": {
                "max_error_rate_increase": 0.01,
                "confidence": 0.95,
                "max_p99_ratio": 1.2,
                "max_prediction_psi": 0.2,
            },
        }
    },
    "monitoring": {"default": {"schedule": "*/15 * * * *", "window_hours": 24, "min_rows": 100}},
}


def base() -> dict:
    return copy.deepcopy(BASE)


def write(directory: Path, name: str, content: dict | str) -> Path:
    text = content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False)
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def problems(path: Path) -> str:
    """The ConfigError message for loading ``path`` (which must fail)."""
    with pytest.raises(ConfigError) as caught:
        load_policies(path)
    return str(caught.value)


# --- the shipped policies ---------------------------------------------------------------


def test_shipped_policies_load():
    policies = load_policies(POLICIES)
    demo = policies.model("demo-classifier")
    assert demo.family == "tabular-mlp" and demo.size_class == "small"
    assert demo.resources.gpu == 0
    assert (demo.autoscaling.min_replicas, demo.autoscaling.max_replicas) == (1, 2)
    assert (demo.slo.p99_ms, demo.slo.error_rate) == (250, 0.01)
    assert demo.cache.enabled and demo.inference_log.sample_rate == 0.2
    assert set(policies.tenants) >= {"acme", "globex"}
    assert policies.tenants["acme"].entitlements["demo-classifier"] == ["*"]
    assert (policies.tenants["acme"].quota.rps, policies.tenants["acme"].quota.burst) == (50, 100)
    assert policies.tenants["globex"].entitlements["demo-classifier"] == ["1.0.0", "1.1.0"]
    rollout = policies.rollout_for("demo-classifier")
    named = policies.rollout["default"].model_dump()
    assert rollout.model_dump() == {**named, "gates": {**named["gates"], "bake_latency_floor_ms": 250}}
    assert rollout.gates.bake_latency_floor_ms == 250  # unset: the model's SLO p99
    assert policies.rollout_for("demo-lm").gates.bake_latency_floor_ms == policies.model("demo-lm").slo.p99_ms
    assert rollout.steps == [10, 50, 100] and rollout.min_samples == 20 and rollout.method == "sequential"
    assert rollout.gates.confidence == 0.95
    assert policies.monitoring_for("demo-classifier").schedule == "*/15 * * * *"


def test_shipped_policy_file_loads_alone():
    assert "demo-classifier" in load_policies(POLICIES / "fleet.yaml").models


def test_unknown_model_is_not_found_and_names_known_models():
    with pytest.raises(NotFound, match="nope.*demo-classifier"):
        load_policies(POLICIES).model("nope")


def test_specs_are_frozen():
    demo = load_policies(POLICIES).model("demo-classifier")
    with pytest.raises(pydantic.ValidationError):
        demo.timeout_ms = 1


def test_defaults_fill_what_a_file_leaves_out(tmp_path):
    spec = load_policies(write(tmp_path, "p.yaml", base())).model("m")
    assert spec.dtype == "fp32" and spec.timeout_ms == 5000 and spec.concurrency == 32
    assert spec.batching.max_batch_size == 32 and spec.cache.enabled is False
    assert spec.rollout == spec.monitoring == "default"


def test_sections_merge_across_files_and_subfolders_are_ignored(tmp_path):
    data = base()
    write(tmp_path, "a.yaml", {"models": data["models"], "tenants": data["tenants"]})
    write(tmp_path, "b.yml", {"rollout": data["rollout"], "monitoring": data["monitoring"]})
    (tmp_path / "guardrails").mkdir()
    write(tmp_path / "guardrails", "broken.yaml", "models: [not, a, mapping")
    write(tmp_path, "notes.txt", "not yaml: [")
    policies = load_policies(tmp_path)
    assert set(policies.models) == {"m"} and set(policies.rollout) == {"default"}


# --- one precise line per problem -------------------------------------------------------


def test_negative_max_batch_size(tmp_path):
    data = base()
    data["models"]["m"]["batching"] = {"max_batch_size": -1}
    path = write(tmp_path, "fleet.yaml", data)
    assert f"{path}: models.m.batching.max_batch_size: got -1 — expected an integer >= 1" in problems(path)


def test_error_rate_above_one(tmp_path):
    data = base()
    data["models"]["m"]["slo"]["error_rate"] = 1.5
    path = write(tmp_path, "fleet.yaml", data)
    assert f"{path}: models.m.slo.error_rate: got 1.5 — expected a finite number >= 0 and <= 1" in (problems(path))


def test_unknown_key_lists_the_accepted_keys(tmp_path):
    data = base()
    data["models"]["m"]["batching"] = {"max_batch_sise": 8}
    path = write(tmp_path, "fleet.yaml", data)
    message = problems(path)
    assert (
        f"{path}: models.m.batching: unknown key 'max_batch_sise'"
        " — expected one of max_batch_size, max_latency_ms" in message
    )
    assert "did you mean 'max_batch_size'?" in message


@pytest.mark.parametrize("steps", [[10, 5, 100], [10, 10, 100], [10, 50], [50]])
def test_canary_steps_must_increase_to_100(tmp_path, steps):
    data = base()
    data["rollout"]["default"]["steps"] = steps
    path = write(tmp_path, "fleet.yaml", data)
    expected = f"{path}: rollout.default.steps: got {steps!r} — expected strictly increasing"
    assert expected in problems(path)


def test_canary_step_out_of_range_names_the_index(tmp_path):
    data = base()
    data["rollout"]["default"]["steps"] = [0, 100]
    path = write(tmp_path, "fleet.yaml", data)
    expected = "rollout.default.steps[0]: got 0 — expected an integer >= 1 and <= 100"
    assert expected in problems(path)


@pytest.mark.parametrize("schedule", ["*/15 * * * *", "0 3 * * 1-5", "0,30 8-18/2 1 1,6 0", "59 23 31 12 7"])
def test_good_cron_schedules_load(tmp_path, schedule):
    data = base()
    data["monitoring"]["default"]["schedule"] = schedule
    assert load_policies(write(tmp_path, "fleet.yaml", data)).monitoring["default"].schedule == schedule


@pytest.mark.parametrize(
    "schedule",
    [
        "*/15 * * *",
        "every 15 minutes",
        "*/15 * * * MON",
        "61 * * * *",
        "- - - - -",
        "5-1 * * * *",
        "5,,6 * * * *",
        "*/0 * * * *",
        "0 0 0 * *",
    ],
)
def test_bad_cron_schedule(tmp_path, schedule):
    data = base()
    data["monitoring"]["default"]["schedule"] = schedule
    path = write(tmp_path, "fleet.yaml", data)
    where = f"{path}: monitoring.default.schedule"
    assert f"{where}: got {schedule!r} — expected a 5-field cron expression" in problems(path)


def test_min_replicas_above_max(tmp_path):
    data = base()
    data["models"]["m"]["autoscaling"]["min_replicas"] = 3
    path = write(tmp_path, "fleet.yaml", data)
    where = f"{path}: models.m.autoscaling.min_replicas"
    assert f"{where}: got 3 — expected an integer <= max_replicas (2)" in problems(path)


def test_gpu_needs_gpu_memory(tmp_path):
    data = base()
    data["models"]["m"]["resources"] = {"gpu": 1, "gpu_memory_gib": 0}
    path = write(tmp_path, "fleet.yaml", data)
    assert f"{path}: models.m.resources.gpu_memory_gib: got 0.0 — expected a number > 0 when gpu > 0" in problems(path)


def test_strings_are_not_coerced_into_numbers_or_booleans(tmp_path):
    data = base()
    data["models"]["m"]["timeout_ms"] = "5000"
    data["models"]["m"]["cache"] = {"enabled": "yes"}
    message = problems(write(tmp_path, "fleet.yaml", data))
    assert "models.m.timeout_ms: got '5000' — expected an integer > 0" in message
    assert "models.m.cache.enabled: got 'yes' — expected true or false" in message


def test_missing_required_key(tmp_path):
    data = base()
    del data["models"]["m"]["slo"]["p99_ms"]
    message = problems(write(tmp_path, "fleet.yaml", data))
    assert "models.m.slo.p99_ms: missing required key — expected a finite number > 0" in message


def test_unknown_rollout_policy_reference(tmp_path):
    data = base()
    data["models"]["m"]["rollout"] = "fast"
    path = write(tmp_path, "fleet.yaml", data)
    assert f"{path}: models.m.rollout: got 'fast' — expected a rollout policy name (default)" in problems(path)


def test_missing_default_policy_when_a_model_names_none(tmp_path):
    data = base()
    data["monitoring"] = {"nightly": data["monitoring"]["default"]}
    path = write(tmp_path, "fleet.yaml", data)
    assert (
        f"{path}: models.m.monitoring: not set, and no monitoring policy 'default' exists"
        " — expected a monitoring policy name (nightly)" in problems(path)
    )


def test_tenant_entitled_to_unknown_model(tmp_path):
    data = base()
    data["tenants"]["t"]["entitlements"]["ghost"] = ["1.0.0"]
    path = write(tmp_path, "fleet.yaml", data)
    expected = f"{path}: tenants.t.entitlements: got 'ghost' — expected a model name (m)"
    assert expected in problems(path)


@pytest.mark.parametrize(
    ("section", "name", "key", "value", "accepted"),
    [
        # pins are routing state (`fleet route pin`), read by the router from the route table only
        ("tenants", "t", "pins", {"m": "1.0.0"}, "entitlements, quota, weight, isolation"),
        # the 100 % step's analysis and rollback_window_s are the bake; nothing read this
        (
            "rollout",
            "default",
            "bake_time_s",
            300,
            "strategy, steps, bake_s, analysis_window_s, min_samples, gates, shadow_percent, shadow_duration_s, "
            "manual_approval, rollback_window_s, hold_deadline_s, offline_tolerance",
        ),
    ],
)
def test_keys_that_nothing_reads_are_refused(tmp_path, section, name, key, value, accepted):
    data = base()
    data[section][name][key] = value
    path = write(tmp_path, "fleet.yaml", data)
    assert f"{path}: {section}.{name}: unknown key {key!r} — expected one of {accepted}" in problems(path)


def test_entitled_versions_must_be_star_or_semver_and_non_empty(tmp_path):
    data = base()
    data["tenants"]["t"]["entitlements"]["m"] = ["1.0.0", 1.0]
    data["tenants"]["u"] = {"entitlements": {"m": []}, "quota": {"rps": 1, "burst": 1}}
    message = problems(write(tmp_path, "fleet.yaml", data))
    expected = "'*' (any version) or a semver version like '1.2.3'"
    assert f"tenants.t.entitlements.m[1]: got 1.0 — expected {expected}" in message
    assert "tenants.u.entitlements.m: got [] — expected a non-empty list" in message


def test_entry_names_are_dns_labels(tmp_path):
    data = base()
    data["tenants"]["Big_Corp"] = data["tenants"].pop("t")
    message = problems(write(tmp_path, "fleet.yaml", data))
    expected = "1-63 lowercase letters, digits or '-'"
    assert f"tenants: got name 'Big_Corp' — expected {expected}" in message


def test_same_name_in_two_files_names_both(tmp_path):
    first = write(tmp_path, "a.yaml", base())
    second = write(tmp_path, "b.yaml", {"models": base()["models"]})
    expected = "each name defined in one file only"
    assert f"{second}: models.m: already defined in {first} — expected {expected}" in (problems(tmp_path))


def test_same_name_twice_in_one_file(tmp_path):
    text = yaml.safe_dump(base(), sort_keys=False) + "tenants:\n  x: {}\n"
    path = write(tmp_path, "fleet.yaml", text)
    message = problems(path)
    assert f"{path}: line " in message and "duplicate key 'tenants'" in message


def test_unknown_top_level_section(tmp_path):
    data = base()
    data["modles"] = data.pop("models")
    path = write(tmp_path, "fleet.yaml", data)
    assert (
        f"{path}: unknown top-level key 'modles'"
        " — expected one of models, tenants, rollout, monitoring, gateway, runtime (did you mean 'models'?)"
        in problems(path)
    )


def test_yaml_syntax_error_names_the_line(tmp_path):
    text = "models:\n  m:\n    family: [tabular\n    size_class: small\n"
    path = write(tmp_path, "fleet.yaml", text)
    message = problems(path)
    assert message.startswith(f"{path}: line ") and "invalid YAML" in message
    path = write(tmp_path, "fleet.yaml", "models:\n  m:\n    family: x\n   size_class: small\n")
    assert f"{path}: line 4, column 4: invalid YAML" in problems(path)


def test_empty_directory(tmp_path):
    (tmp_path / "guardrails").mkdir()
    write(tmp_path / "guardrails", "extra.yaml", base())
    assert "no policy files (*.yaml, *.yml)" in problems(tmp_path)


def test_missing_path():
    assert "not found" in problems(Path("/nonexistent/policies"))


def test_top_level_must_be_a_mapping(tmp_path):
    path = write(tmp_path, "fleet.yaml", "- models\n")
    assert f"{path}: got ['models'] — expected a mapping with sections" in problems(path)


def test_every_problem_in_a_file_is_reported_at_once(tmp_path):
    data = base()
    model = data["models"]["m"]
    model["batching"] = {"max_batch_size": -1, "max_batch_sise": 8}
    model["slo"]["error_rate"] = 1.5
    model["autoscaling"]["min_replicas"] = 3
    data["rollout"]["default"]["steps"] = [50, 10]
    data["monitoring"]["default"]["schedule"] = "hourly"
    data["extra"] = {}
    path = write(tmp_path, "fleet.yaml", data)
    lines = problems(path).splitlines()
    assert len(lines) == 7 and all(line.startswith(f"{path}: ") for line in lines)
    for fragment in [
        "models.m.batching.max_batch_size: got -1",
        "models.m.batching: unknown key 'max_batch_sise'",
        "models.m.slo.error_rate: got 1.5",
        "models.m.autoscaling.min_replicas: got 3",
        "rollout.default.steps: got [50, 10]",
        "monitoring.default.schedule: got 'hourly'",
        "unknown top-level key 'extra'",
    ]:
        assert any(fragment in line for line in lines), fragment


def test_problems_in_several_files_come_in_one_error(tmp_path):
    data = base()
    data["models"]["m"]["slo"]["error_rate"] = 2
    first = write(tmp_path, "a.yaml", {"models": data["models"]})
    second = write(tmp_path, "b.yaml", {"tenants": base()["tenants"], "bogus": 1})
    message = problems(tmp_path)
    assert f"{first}: models.m.slo.error_rate: got 2" in message
    assert f"{second}: unknown top-level key 'bogus'" in message


def test_policies_built_in_code_are_cross_checked_too():
    data = base()
    model = ModelSpec.model_validate(data["models"]["m"])
    with pytest.raises(pydantic.ValidationError, match="rollout policy name"):
        Policies(models={"m": model})


# --- every key has a reader ----------------------------------------------------------------

# Keys nothing reads yet, and why each may stay. Remove an entry when its reader lands.
NOT_READ_YET = {
    "ModelSpec.size_class": "required by the shared design's schema; placement sizes from params_millions and dtype",
}
CODE = ("fleet", "flows", "infra", "bentos", "policies/guardrails")


def _policy_models(tp, found: list) -> list:
    """Every pydantic model a policy file can hold, from ``tp`` down (containers and unions opened)."""
    for arg in typing.get_args(tp):
        _policy_models(arg, found)
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel) and tp not in found:
        found.append(tp)
        for field in tp.model_fields.values():
            _policy_models(field.annotation, found)
    return found


def test_every_policy_key_is_read_somewhere():
    """A key that nothing reads is a promise the fleet does not keep, as ``bake_time_s`` was.

    Read means an attribute, subscript or ``.get`` of the key's name in the code outside
    fleet/catalog/policies/ (the models' own validators and properties are not readers). A name
    that other objects share passes on their reads: tenant ``pins`` would have, on the route
    table's. So this catches keys with no reader at all, not all."""
    own = ROOT / "fleet" / "catalog" / "policies"
    assert (own / "models.py").is_file(), "the policy models moved: point `own` at them"
    code = "\n".join(
        p.read_text(encoding="utf-8") for root in CODE for p in (ROOT / root).rglob("*.py") if own not in p.parents
    )
    unread = []
    for model in _policy_models(Policies, []):
        if model is Policies:
            continue  # its fields are the sections
        for key in model.model_fields:
            read = rf"\.{key}\b|\[\s*['\"]{key}['\"]\s*\]|\.get\(\s*['\"]{key}['\"]"
            if f"{model.__name__}.{key}" not in NOT_READ_YET and not re.search(read, code):
                unread.append(f"{model.__name__}.{key}")
    assert not unread, f"policy keys that no code reads: {', '.join(unread)}; read them, or remove them"


def test_thresholds_refuse_inf_and_nan(tmp_path):
    for value in (float("inf"), float("nan")):
        data = base()
        data["models"]["m"]["slo"]["p99_ms"] = value
        path = write(tmp_path, "fleet.yaml", data)
        assert f"{path}: models.m.slo.p99_ms: got {value} — expected a finite number > 0" in problems(path)
