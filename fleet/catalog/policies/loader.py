"""The policies of a fleet (``Policies``): the sections of every file merged, names
cross-checked (a model's rollout and monitoring policy, a tenant's models), and the loader
that reports every problem of every file at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from fleet.catalog.policies.budgets import GatewaySpec, RuntimeSpec
from fleet.catalog.policies.models import ModelSpec
from fleet.catalog.policies.monitoring import MonitoringPolicy
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.catalog.policies.spec import Spec
from fleet.catalog.policies.tenants import TenantSpec
from fleet.errors import ConfigError, NotFound
from fleet.names import NAME_RE
from fleet.validation import explain, hint, problem, read_yaml, show


def _reference_problems(models: dict, tenants: dict, rollout: dict, monitoring: dict) -> list[tuple[str, str, str]]:
    """(section, entry name, report line) for each name that points nowhere."""
    problems = []
    for name, spec in models.items():
        for kind, policies in (("rollout", rollout), ("monitoring", monitoring)):
            ref = getattr(spec, kind)
            if ref not in policies:
                set_ = kind in spec.model_fields_set
                what = f"got {ref!r}" if set_ else f"not set, and no {kind} policy 'default' exists"
                known = f"a {kind} policy name ({', '.join(policies) or 'none defined'})"
                problems.append(("models", name, problem(f"models.{name}.{kind}", what, known)))
    for name, spec in tenants.items():
        for model in spec.entitlements:
            if model not in models:
                known = f"a model name ({', '.join(models) or 'none defined'})"
                where = f"tenants.{name}.entitlements"
                problems.append(("tenants", name, problem(where, f"got {model!r}", known)))
    return problems


class Policies(Spec):
    models: dict[str, ModelSpec] = Field(default_factory=dict)
    tenants: dict[str, TenantSpec] = Field(default_factory=dict)
    rollout: dict[str, RolloutPolicy] = Field(default_factory=dict)
    monitoring: dict[str, MonitoringPolicy] = Field(default_factory=dict)
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)

    @model_validator(mode="after")
    def _references_resolve(self) -> Policies:
        problems = _reference_problems(self.models, self.tenants, self.rollout, self.monitoring)
        if problems:
            raise ValueError("; ".join(line for _, _, line in problems))
        return self

    def model(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(sorted(self.models)) or "none"
            raise NotFound(f"unknown model {name!r}; known models: {known}") from None

    def rollout_for(self, model_name: str) -> RolloutPolicy:
        """The model's rollout policy, its 100 % step's latency floor defaulting to the model's SLO."""
        spec = self.model(model_name)
        policy = self.rollout[spec.rollout]
        if policy.gates.bake_latency_floor_ms is not None:
            return policy
        gates = policy.gates.model_copy(update={"bake_latency_floor_ms": spec.slo.p99_ms})
        return policy.model_copy(update={"gates": gates})

    def monitoring_for(self, model_name: str) -> MonitoringPolicy:
        return self.monitoring[self.model(model_name).monitoring]


SECTIONS: dict[str, type[Spec]] = {
    "models": ModelSpec,
    "tenants": TenantSpec,
    "rollout": RolloutPolicy,
    "monitoring": MonitoringPolicy,
}


SINGLETONS: dict[str, type[Spec]] = {"gateway": GatewaySpec, "runtime": RuntimeSpec}


def load_policies(path: str | Path = "policies") -> Policies:
    """Load one YAML file, or every ``*.yaml``/``*.yml`` directly in a directory (sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml"))
        if not files:
            raise ConfigError(f"{path}: no policy files (*.yaml, *.yml) in this directory")
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(
            f"{path}: not found; expected a policy directory or YAML file (run from the fleet's folder, "
            "which holds policies/, or name one with --policies or FLEET_POLICIES)"
        )
    entries: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    origin: dict[tuple[str, str], Path] = {}
    gateway: dict[str, Spec] = {}  # the one-per-fleet sections (SINGLETONS) that a file set
    problems = [line for file in files for line in _load_file(file, entries, origin, gateway)]
    if not problems:  # references are only worth checking once every entry parsed
        problems = [f"{origin[s, n]}: {line}" for s, n, line in _reference_problems(**entries)]
    if problems:
        raise ConfigError("\n".join(problems))
    return Policies(**entries, **gateway)


def _load_file(file: Path, entries: dict[str, dict], origin: dict[tuple, Path], gateway: dict[str, Spec]) -> list[str]:
    """Validate one file's entries into ``entries`` (and its ``gateway:`` and ``runtime:``
    sections into ``gateway``); return its problems as report lines."""
    data, unreadable = read_yaml(file)
    if unreadable:
        return [unreadable]
    if data is None:
        return []  # an empty (or all-comments) file defines nothing
    known = [*SECTIONS, *SINGLETONS]
    accepted = ", ".join(known)
    if not isinstance(data, dict):
        return [problem(file, f"got {show(data)}", f"a mapping with sections {accepted}")]
    problems = []
    for section, named in data.items():
        if section in SINGLETONS:
            problems += _load_singleton(file, section, named, origin, gateway)
        elif section not in SECTIONS:
            what = f"unknown top-level key {section!r}"
            problems.append(problem(file, what, f"one of {accepted}{hint(section, known)}"))
        elif isinstance(named, dict):
            problems += _load_section(file, section, named, entries[section], origin)
        elif named is not None:  # an empty section is fine
            where = f"{file}: {section}"
            problems.append(problem(where, f"got {show(named)}", "a mapping of name -> spec"))
    return problems


def _load_singleton(file: Path, section: str, raw: Any, origin: dict, into: dict[str, Spec]) -> list[str]:
    """A ``gateway:`` or ``runtime:`` section: one mapping of settings for the fleet, in one file only."""
    if raw is None:
        return []
    if (section, "") in origin:
        return [
            problem(
                f"{file}: {section}", f"already defined in {origin[section, '']}", f"one {section} section in one file"
            )
        ]
    origin[section, ""] = file
    cls = SINGLETONS[section]
    try:
        into[section] = cls.model_validate(raw)
    except ValidationError as e:
        return [f"{file}: {line}" for line in explain(e, cls, (section,))]
    return []


def _load_section(file: Path, section: str, named: dict, into: dict, origin: dict) -> list[str]:
    problems = []
    for name, raw in named.items():
        where = f"{file}: {section}.{name}"
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            expected = "1-63 lowercase letters, digits or '-', starting and ending with one"
            problems.append(problem(f"{file}: {section}", f"got name {name!r}", expected))
        elif (section, name) in origin:
            what = f"already defined in {origin[section, name]}"
            problems.append(problem(where, what, "each name defined in one file only"))
        else:
            origin[section, name] = file
            try:
                into[name] = SECTIONS[section].model_validate(raw)
            except ValidationError as e:
                lines = explain(e, SECTIONS[section], (section, name))
                problems += [f"{file}: {line}" for line in lines]
    return problems
