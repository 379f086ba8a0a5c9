"""Stack config: the node pools and models of a ``Pulumi.<stack>.yaml``, parsed once, and
what the stack may scale to (its guardrails' GPU ceiling); what it costs is ``fleet.planning.costs``.

Pure and Pulumi-free, so ``fleet plan`` (reading the stack file), ``infra/config.py``
(reading the config the engine hands the program) and the tests check the same rules. A
problem names the file, the key, the bad value and what was expected, every problem of a
list at once::

    Pulumi.dev.yaml: serving-fleet: nodePools[1].gpus: got 'one' — expected an integer >= 0
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleet.catalog.policies.loader import Policies
from fleet.errors import ConfigError
from fleet.names import NAME_RE
from fleet.validation import checked, expected, explain, problem, read_yaml, show

PROJECT = "serving-fleet"  # the name in Pulumi.yaml, and so the namespace of the config keys
STACK_POOLS_KEY = "nodePools"
STACK_MODELS_KEY = "models"

DnsLabel = checked(str, "1-63 lowercase letters, digits or '-', starting and ending with one", NAME_RE.fullmatch)


# The NVIDIA GPU of each EC2 GPU instance family (aws.amazon.com/ec2/instance-types, accelerated
# computing): a pool's gpu_type when its stack file does not state one. Memory is in the name
# where a GPU comes in two sizes.
GPU_TYPES = {
    "g4dn": "T4",
    "g5": "A10G",
    "g6": "L4",
    "gr6": "L4",
    "g6e": "L40S",
    "p3": "V100-16GB",
    "p3dn": "V100-32GB",
    "p4d": "A100-40GB",
    "p4de": "A100-80GB",
    "p5": "H100-80GB",
    "p5e": "H200",
    "p5en": "H200",
}


def gpu_type_of(instance_type: str) -> str | None:
    """``g5.12xlarge`` → ``A10G``; None for a family not in GPU_TYPES."""
    return GPU_TYPES.get(instance_type.split(".")[0])


class NodePool(BaseModel):
    """One kind of node a stack can run, from ``serving-fleet:nodePools`` in Pulumi.<stack>.yaml."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: DnsLabel
    instance_type: str = Field(min_length=1)  # EC2 type, e.g. g5.12xlarge
    gpus: int = Field(0, ge=0)  # per node; 0 for a CPU pool
    gpu_memory_gib: float = Field(0.0, ge=0.0)  # per GPU
    # the GPU's model, e.g. A10G: what each replica placed here is told it runs on
    # (FLEET_GPU_TYPE); default from the instance family (GPU_TYPES)
    gpu_type: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    vcpu: int = Field(gt=0)
    memory_gib: float = Field(gt=0.0)
    hourly_usd: float = Field(ge=0.0)  # on-demand price of one node, for choosing and cost
    gpu_slices: int = Field(1, ge=1, le=16)  # replicas sharing one GPU (time-slicing); 1 = whole GPUs
    min_nodes: int = Field(0, ge=0)
    max_nodes: int = Field(10, ge=1)  # cap on all node groups made from this pool
    # Karpenter's capacity types for the NodePools made from this pool (fleet.planning.karpenter):
    # None (default): by the models' class, spot allowed for small models, on-demand for large;
    # ON_DEMAND: never spot; SPOT: spot allowed, though never for a large model
    capacity_type: Literal["ON_DEMAND", "SPOT"] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> NodePool:
        if self.gpus > 0 and self.gpu_memory_gib <= 0:
            raise expected("a number > 0 when gpus > 0", field="gpu_memory_gib", got=self.gpu_memory_gib)
        if self.gpus == 0 and self.gpu_slices > 1:
            raise expected("1 for a pool without GPUs", field="gpu_slices", got=self.gpu_slices)
        if self.gpus == 0 and self.gpu_type is not None:
            raise expected("no gpu_type for a pool without GPUs", field="gpu_type", got=self.gpu_type)
        if self.gpus > 0 and self.gpu_type is None:
            derived = gpu_type_of(self.instance_type)
            if derived is None:
                families = ", ".join(GPU_TYPES)
                raise expected(
                    f"the GPU model of {self.instance_type}, e.g. A10G (known without it for the families {families})",
                    field="gpu_type",
                    got=None,
                )
            object.__setattr__(self, "gpu_type", derived)
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
    problems += [
        problem(key, f"pool name {n!r} appears twice", "unique names") for n in sorted(set(names)) if names.count(n) > 1
    ]
    if problems:
        raise ConfigError("\n".join(problems))
    return tuple(pools)


def models_from_config(raw: Any, where: str, policies: Policies) -> tuple[str, ...] | None:
    """Validate the optional ``models`` list of a stack config (None: every model)."""
    if raw is None:
        return None
    known = ", ".join(sorted(policies.models)) or "none"
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise ConfigError(
            problem(f"{where}: {STACK_MODELS_KEY}", f"got {show(raw)}", f"a list of model names ({known})")
        )
    bad = [m for m in raw if m not in policies.models]
    if bad:
        raise ConfigError(
            problem(f"{where}: {STACK_MODELS_KEY}", f"got unknown model {bad[0]!r}", f"a model name ({known})")
        )
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


def placement_inputs(
    config: dict[str, Any], where: str, policies: Policies
) -> tuple[tuple[NodePool, ...], tuple[str, ...] | None]:
    """(node pools, models or None for all) of a stack file's ``config`` mapping."""
    pools = pools_from_config(config.get(f"{PROJECT}:{STACK_POOLS_KEY}"), f"{where}: {PROJECT}")
    return pools, models_from_config(config.get(f"{PROJECT}:{STACK_MODELS_KEY}"), f"{where}: {PROJECT}", policies)


# --- what the stack costs besides its model nodes, and its GPU ceiling ----------------------

STACK_SYSTEM_KEY = "systemNodes"
STACK_AZ_KEY = "azCount"
STACK_SINGLE_NAT_KEY = "singleNatGateway"
STACK_REDIS_KEY = "redis"
STACK_GATEWAY_KEY = "gateway"
STACK_K8S_KEY = "kubernetesVersion"
STACK_PREFECT_DB_KEY = "prefectDatabase"
# The default Kubernetes minor of a stack (infra/config.py's too): in EKS standard support
# until 2027-03-27 (fleet.planning.costs.EKS_VERSIONS, which prices the control plane by it).
KUBERNETES_VERSION = "1.35"

# ElastiCache for Valkey, on-demand, per node-hour (aws.amazon.com/elasticache/pricing; Valkey
# is listed 20 % below Redis OSS for the same node type): the gateways' shared quota store
# (infra/quota_store.py). As recorded when this entry was written, from the pricing page as
# remembered rather than fetched (the build machine cannot reach it), and not re-checked:
# check them. Another node type states its price in the stack file (redis.hourly_usd).
VALKEY_NODE_USD = {"cache.t4g.micro": 0.0128, "cache.t4g.small": 0.0256, "cache.t4g.medium": 0.0520}
# RDS for PostgreSQL, on-demand, single-AZ, per instance-hour (aws.amazon.com/rds/postgresql/pricing,
# us-east-1); Multi-AZ (one standby) is twice that. Prefect's database (infra/prefect_db.py).
# Recorded as remembered, like VALKEY_NODE_USD: another class states its price (prefectDatabase.hourly_usd).
RDS_POSTGRES_USD = {"db.t4g.micro": 0.016, "db.t4g.small": 0.032, "db.t4g.medium": 0.065, "db.t4g.large": 0.129}
# The CrossGuard pack policies/guardrails refuses a stack whose GPU node groups can scale past
# this config value (policies/guardrails/fleet_guardrails/compute.py, gpu-ceiling).
GUARDRAIL_CEILING_POLICY = "gpu-ceiling"
GUARDRAIL_CEILING_KEY = "maxGpus"


class SystemNodes(BaseModel):
    """The platform's node group (gateway, Prometheus, KEDA, Prefect), ``serving-fleet:systemNodes``.

    One model for both readers: infra/config.py takes it from here, so ``fleet plan`` refuses what
    ``pulumi up`` refuses.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    instance_type: str = Field(min_length=1)
    min_size: int = Field(2, ge=1)
    max_size: int = Field(4, ge=1)
    hourly_usd: float = Field(ge=0.0)
    root_volume_gib: int = Field(50, ge=20, le=16384)

    @model_validator(mode="after")
    def _min_below_max(self) -> SystemNodes:
        if self.min_size > self.max_size:
            raise expected(f"an integer <= max_size ({self.max_size})", field="min_size", got=self.min_size)
        return self


class PrefectDb(BaseModel):
    """What ``serving-fleet:prefectDatabase`` (infra/config.py's PrefectDatabaseSettings, which
    checks the rest) says about the price of Prefect's database: no instance with
    ``external_host``; Multi-AZ (two instances' price) when env is prod."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    instance_class: str = "db.t4g.small"
    external_host: str | None = None
    hourly_usd: float | None = Field(None, ge=0.0)  # single-AZ; default: the recorded list price

    @model_validator(mode="after")
    def _priced(self) -> PrefectDb:
        if self.external_host is None and self.hourly_usd is None and self.instance_class not in RDS_POSTGRES_USD:
            raise expected(
                f"the on-demand USD price of one {self.instance_class} instance per hour (a price is recorded "
                f"only for {', '.join(RDS_POSTGRES_USD)})",
                field="hourly_usd",
                got=None,
            )
        return self

    @property
    def usd_per_instance(self) -> float:
        return self.hourly_usd if self.hourly_usd is not None else RDS_POSTGRES_USD[self.instance_class]


class RedisNodes(BaseModel):
    """The gateways' shared quota store, ``serving-fleet:redis``: an ElastiCache replication
    group of Valkey (the Redis protocol; ``FLEET_REDIS_URL`` of every gateway pod).

    ``nodes`` is the primary and its replicas: 2 or more is Multi-AZ with automatic failover
    (infra/config.py requires it for env prod), 1 a single node that a failure or maintenance
    takes away until it is replaced. One model for ``fleet plan`` and ``pulumi up``, like
    SystemNodes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    node_type: str = Field("cache.t4g.small", min_length=1)
    nodes: int = Field(2, ge=1, le=6)  # primary + up to 5 replicas (num_cache_clusters)
    hourly_usd: float | None = Field(None, ge=0.0)  # per node; default: the recorded list price (VALKEY_NODE_USD)
    engine_version: str = Field("8.0", pattern=r"^\d+\.\d+$")  # Valkey major.minor
    # how `pulumi up` hands ElastiCache a changed AUTH token: ROTATE keeps the old one valid
    # too (while gateways roll onto the new one), SET afterwards drops it (infra/README.md)
    auth_token_update_strategy: Literal["ROTATE", "SET"] = "ROTATE"

    @model_validator(mode="after")
    def _priced(self) -> RedisNodes:
        if self.hourly_usd is None and self.node_type not in VALKEY_NODE_USD:
            raise expected(
                f"the on-demand USD price of one {self.node_type} node per hour (a price is recorded only "
                f"for {', '.join(VALKEY_NODE_USD)})",
                field="hourly_usd",
                got=None,
            )
        return self

    @property
    def usd_per_node(self) -> float:
        return self.hourly_usd if self.hourly_usd is not None else VALKEY_NODE_USD[self.node_type]


class GatewayProcesses(BaseModel):
    """How many gateway processes the stack runs (``serving-fleet:gateway``: pods × workers):
    what the control plane's store requests scale with. Its other keys are infra's own."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    min_replicas: int = Field(2, ge=1)
    max_replicas: int = Field(6, ge=1)
    workers: int = Field(2, ge=1, le=16)

    @property
    def processes(self) -> tuple[int, int]:
        return self.min_replicas * self.workers, self.max_replicas * self.workers


class StackBuild(BaseModel):
    """The keys of a stack file, besides the node pools, that decide what the stack pays for
    by the hour; names and defaults as in infra/config.py's Settings."""

    model_config = ConfigDict(frozen=True, strict=True)

    systemNodes: SystemNodes
    azCount: int = Field(2, ge=2, le=6)
    singleNatGateway: bool = False
    redis: RedisNodes = Field(default_factory=RedisNodes)
    gateway: GatewayProcesses = Field(default_factory=GatewayProcesses)
    kubernetesVersion: str = Field(KUBERNETES_VERSION, pattern=r"^1\.\d{2}$")  # prices the control plane
    prefectDatabase: PrefectDb = Field(default_factory=PrefectDb)
    env: str = "dev"  # prod: Prefect's database is Multi-AZ

    @property
    def nat_gateways(self) -> int:
        """What infra/network.py builds: one NAT gateway per AZ, or one for all."""
        return 1 if self.singleNatGateway else self.azCount


def build_inputs(config: dict[str, Any], where: str) -> StackBuild:
    """The system nodes and network shape of a stack file's ``config`` mapping.

    A value ``pulumi config set`` stored as text (``"3"``, ``"true"``, JSON) is read as Pulumi
    hands it to the program, so this agrees with ``pulumi up``.
    """
    keys = (
        STACK_SYSTEM_KEY,
        STACK_AZ_KEY,
        STACK_SINGLE_NAT_KEY,
        STACK_REDIS_KEY,
        STACK_GATEWAY_KEY,
        STACK_K8S_KEY,
        STACK_PREFECT_DB_KEY,
        "env",
    )
    values = {k: _as_pulumi_reads(config[f"{PROJECT}:{k}"]) for k in keys if f"{PROJECT}:{k}" in config}
    if "env" in values:
        values["env"] = str(config[f"{PROJECT}:env"])
    if STACK_K8S_KEY in values:  # text, as Pulumi hands a string key: "1.30" is not the number 1.3
        values[STACK_K8S_KEY] = str(config[f"{PROJECT}:{STACK_K8S_KEY}"])
    try:
        return StackBuild.model_validate(values)
    except ValidationError as exc:
        raise ConfigError("\n".join(f"{where}: {PROJECT}:{line}" for line in explain(exc, StackBuild))) from None


def _as_pulumi_reads(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value  # pydantic names the type it expected


@dataclass(frozen=True)
class GpuCeiling:
    """The guardrails' ``maxGpus`` for a stack (None: no pack config found) and where it was read."""

    max_gpus: int | None
    source: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def guardrail_config_file(stack_path: Path, policies: Path) -> Path | None:
    """``<policies>/guardrails/<stack>.json``, the ``--policy-pack-config`` of ``pulumi up``
    for ``Pulumi.<stack>.yaml``; None when the stack file's name does not say the stack."""
    name = stack_path.name
    if not (name.startswith("Pulumi.") and stack_path.suffix in (".yaml", ".yml")):
        return None
    folder = policies if policies.is_dir() else policies.parent
    return folder / "guardrails" / f"{name.removeprefix('Pulumi.').rsplit('.', 1)[0]}.json"


def gpu_ceiling(path: Path | None, *, required: bool = False) -> GpuCeiling:
    """The GPU ceiling in the guardrail pack config ``path``. A missing default file means no
    ceiling is known (``pulumi up`` without ``--policy-pack`` has none); a file asked for by
    name (``required``) must exist, and a malformed one is always an error."""
    if path is not None and required and not path.is_file():
        raise ConfigError(f"{path}: not found; expected a guardrail pack config like policies/guardrails/dev.json")
    if path is None or not path.is_file():
        return GpuCeiling(None, f"no guardrail config at {path}" if path else "no guardrail config for this stack file")
    key = f"{path}: {GUARDRAIL_CEILING_POLICY}.{GUARDRAIL_CEILING_KEY}"
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}) — expected a CrossGuard policy pack config") from None
    section = data.get(GUARDRAIL_CEILING_POLICY) if isinstance(data, dict) else None
    value = section.get(GUARDRAIL_CEILING_KEY) if isinstance(section, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(problem(key, f"got {show(value)}", "an integer >= 0 (the stack's GPU ceiling)"))
    return GpuCeiling(value, key)
