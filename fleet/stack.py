"""Stack config: the node pools and models of a ``Pulumi.<stack>.yaml``, parsed once.

Pure and Pulumi-free, so ``fleet plan`` (reading the stack file), ``infra/config.py``
(reading the config the engine hands the program) and the tests check the same rules. A
problem names the file, the key, the bad value and what was expected, every problem of a
list at once::

    Pulumi.dev.yaml: serving-fleet: nodePools[1].gpus: got 'one' — expected an integer >= 0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleet.errors import ConfigError
from fleet.names import NAME_RE
from fleet.spec import Policies
from fleet.validation import checked, expected, explain, problem, read_yaml, show

PROJECT = "serving-fleet"  # the name in Pulumi.yaml, and so the namespace of the config keys
STACK_POOLS_KEY = "nodePools"
STACK_MODELS_KEY = "models"

DnsLabel = checked(str, "1-63 lowercase letters, digits or '-', starting and ending with one", NAME_RE.fullmatch)


class NodePool(BaseModel):
    """One kind of node a stack can run, from ``serving-fleet:nodePools`` in Pulumi.<stack>.yaml."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: DnsLabel
    instance_type: str = Field(min_length=1)  # EC2 type, e.g. g5.12xlarge
    gpus: int = Field(0, ge=0)  # per node; 0 for a CPU pool
    gpu_memory_gib: float = Field(0.0, ge=0.0)  # per GPU
    vcpu: int = Field(gt=0)
    memory_gib: float = Field(gt=0.0)
    hourly_usd: float = Field(ge=0.0)  # on-demand price of one node, for choosing and cost
    gpu_slices: int = Field(1, ge=1, le=16)  # replicas sharing one GPU (time-slicing); 1 = whole GPUs
    min_nodes: int = Field(0, ge=0)
    max_nodes: int = Field(10, ge=1)  # cap on all node groups made from this pool
    capacity_type: Literal["ON_DEMAND", "SPOT"] = "ON_DEMAND"

    @model_validator(mode="after")
    def _consistent(self) -> NodePool:
        if self.gpus > 0 and self.gpu_memory_gib <= 0:
            raise expected("a number > 0 when gpus > 0", field="gpu_memory_gib", got=self.gpu_memory_gib)
        if self.gpus == 0 and self.gpu_slices > 1:
            raise expected("1 for a pool without GPUs", field="gpu_slices", got=self.gpu_slices)
        if self.min_nodes > self.max_nodes:
            raise expected(f"an integer <= max_nodes ({self.max_nodes})", field="min_nodes", got=self.min_nodes)
        return self


def pools_from_config(raw: Any, where: str) -> tuple[NodePool, ...]:
    """Validate the ``nodePools`` list of a stack config; ``where`` prefixes each problem."""
    key = f"{where}: {STACK_POOLS_KEY}"
    if not isinstance(raw, list) or not raw:
        raise ConfigError(problem(key, f"got {show(raw)}", "a non-empty list of node pools"))
    pools, problems = [], []
    for i, item in enumerate(raw):
        try:
            pools.append(NodePool.model_validate(item))
        except ValidationError as exc:
            problems += [f"{where}: {line}" for line in explain(exc, NodePool, (STACK_POOLS_KEY, i))]
    names = [p.name for p in pools]
    problems += [problem(key, f"pool name {n!r} appears twice", "unique names") for n in sorted(set(names)) if names.count(n) > 1]
    if problems:
        raise ConfigError("\n".join(problems))
    return tuple(pools)


def models_from_config(raw: Any, where: str, policies: Policies) -> tuple[str, ...] | None:
    """Validate the optional ``models`` list of a stack config (None: every model)."""
    if raw is None:
        return None
    known = ", ".join(sorted(policies.models)) or "none"
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise ConfigError(problem(f"{where}: {STACK_MODELS_KEY}", f"got {show(raw)}", f"a list of model names ({known})"))
    bad = [m for m in raw if m not in policies.models]
    if bad:
        raise ConfigError(problem(f"{where}: {STACK_MODELS_KEY}", f"got unknown model {bad[0]!r}", f"a model name ({known})"))
    return tuple(raw)


def stack_file(stack: str) -> Path:
    """``dev`` → ``Pulumi.dev.yaml``; a path ending in .yaml or .yml is taken as it is."""
    path = Path(stack)
    return path if path.suffix in (".yaml", ".yml") else Path(f"Pulumi.{stack}.yaml")


def read_stack_file(path: Path) -> dict[str, Any]:
    """The ``config`` mapping of a stack file (keys as written: ``serving-fleet:nodePools``, ...)."""
    if not path.is_file():
        stacks = ", ".join(sorted(p.name for p in path.parent.glob("Pulumi.*.yaml"))) or "none here"
        raise ConfigError(f"{path}: not found; expected a stack file Pulumi.<stack>.yaml (found: {stacks})")
    data, bad = read_yaml(path)
    if bad:
        raise ConfigError(bad)
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        raise ConfigError(problem(f"{path}: config", f"got {show(config)}", "a mapping of config keys"))
    return config


def placement_inputs(config: dict[str, Any], where: str, policies: Policies) -> tuple[tuple[NodePool, ...], tuple[str, ...] | None]:
    """(node pools, models or None for all) of a stack file's ``config`` mapping."""
    pools = pools_from_config(config.get(f"{PROJECT}:{STACK_POOLS_KEY}"), f"{where}: {PROJECT}")
    return pools, models_from_config(config.get(f"{PROJECT}:{STACK_MODELS_KEY}"), f"{where}: {PROJECT}", policies)
