"""Stack configuration: every ``serving-fleet:*`` key of Pulumi.<stack>.yaml, read and checked once.

``load()`` reads the stack's config through Pulumi, ``parse()`` validates it (pure, so tests
and ``fleet plan`` see the same rules). A problem names the stack file, the key, the bad
value and what was expected, all problems at once; an unknown key is an error, since a typo
would otherwise silently fall back to a default. The placement plan is computed here, from
the policies and the node pools, because every component sizes itself from it.

Four keys are secrets (set with ``pulumi config set --secret``): ``gatewayAdminToken``, the
gateway's admin token; ``grafanaAdminPassword``; ``prefectDbPassword``, the password of
Prefect server's database; ``redisAuthToken``, the AUTH token of the gateways' quota store
(infra/quota_store.py). ``parse`` checks that each is there and long enough without ever
keeping or showing it; ``load`` hands them on only as secret Outputs (``require_secret``), so
Pulumi encrypts them wherever they go and they never reach a stack output in plain text.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleet.catalog.policies.loader import Policies, load_policies
from fleet.errors import ConfigError
from fleet.logs.committer import RETENTION_DAYS
from fleet.planning.placement import PlacementPlan
from fleet.planning.planner import plan
from fleet.planning.stack import PROJECT, NodePool, RedisNodes, SystemNodes, models_from_config, pools_from_config
from fleet.validation import checked, expected, explain, hint, problem

ROOT = Path(__file__).resolve().parent.parent  # where Pulumi.yaml is
ADDONS = Literal["vpc-cni", "kube-proxy", "coredns", "aws-ebs-csi-driver", "metrics-server"]  # infra/addons.py

# Stack output names: scripts (`pulumi stack output NAME`) and other stacks read these.
OUT_CLUSTER_NAME = "clusterName"
OUT_KUBECONFIG = "kubeconfig"
OUT_VPC_ID = "vpcId"
OUT_MODELS_BUCKET = "modelsBucket"
OUT_LOGS_BUCKET = "logsBucket"
OUT_STORE_URL = "storeUrl"
OUT_REPOSITORIES = "imageRepositories"
OUT_LOAD_BALANCER_DNS = "loadBalancerDns"
OUT_GATEWAY_URL = "gatewayUrl"
OUT_GATEWAY_ROLE = "gatewayRoleArn"
OUT_FLOWS_ROLE = "flowsRoleArn"
OUT_PLACEMENT = "placement"
OUT_MAX_GPUS = "maxGpus"
OUT_USD_PER_HOUR = "usdPerHour"
OUT_REDIS_ENDPOINT = "redisEndpoint"  # the quota store's primary endpoint (host name; the token is not in it)
OUT_LOG_DATABASE = "logDatabase"  # the Glue database of the logs' Iceberg tables (FLEET_LOG_CATALOG=glue:<it>)
OUT_ATHENA_WORKGROUP = "athenaWorkgroup"  # where to query them: `aws athena start-query-execution --work-group`
OUT_ATHENA_RESULTS_BUCKET = "athenaResultsBucket"  # that workgroup's query results (expire after a week)

ADMIN_TOKEN_KEY = "gatewayAdminToken"  # secret: FLEET_ADMIN_TOKEN of every gateway (turns on its admin API)
GRAFANA_PASSWORD_KEY = "grafanaAdminPassword"  # secret: Grafana's admin password (kube-prometheus-stack)
PREFECT_DB_PASSWORD_KEY = "prefectDbPassword"  # secret: the password of Prefect server's PostgreSQL
REDIS_AUTH_TOKEN_KEY = "redisAuthToken"  # secret: the quota store's AUTH token, in every gateway's FLEET_REDIS_URL
SECRETS = {  # key → what it is; each set with `pulumi config set --secret`, never shown
    ADMIN_TOKEN_KEY: "the gateway's admin token",
    GRAFANA_PASSWORD_KEY: "Grafana's admin password",
    PREFECT_DB_PASSWORD_KEY: "the password of Prefect server's database",
    REDIS_AUTH_TOKEN_KEY: "the AUTH token of the gateways' quota store (ElastiCache)",
}
SECRET_MIN_CHARS = ADMIN_TOKEN_MIN_CHARS = 32  # `openssl rand -hex 32` gives 64
REDIS_AUTH_TOKEN_MAX_CHARS = 128  # ElastiCache's limit


def set_secret(key: str) -> str:
    return f'pulumi config set --secret {key} "$(openssl rand -hex 32)"'


SET_ADMIN_TOKEN = set_secret(ADMIN_TOKEN_KEY)


def _is_cidr(value: str) -> bool:
    try:
        ipaddress.ip_network(value)
        return True
    except ValueError:
        return False


def _is_vpc_cidr(value: str) -> bool:
    # /16../20: room for one /19 private subnet per AZ (pods take VPC addresses) and small public ones
    return (
        _is_cidr(value)
        and ipaddress.ip_network(value).version == 4
        and 16 <= ipaddress.ip_network(value).prefixlen <= 20
    )


Cidr = checked(str, "a CIDR block like '203.0.113.0/24'", _is_cidr)
VpcCidr = checked(str, "an IPv4 CIDR block from /16 to /20, like '10.0.0.0/16'", _is_vpc_cidr)
CertificateArn = checked(
    str,
    "an ACM certificate ARN like 'arn:aws:acm:us-east-1:123456789012:certificate/<id>'",
    re.compile(r"arn:aws[a-z-]*:acm:[a-z0-9-]+:\d{12}:certificate/[A-Za-z0-9-]+").fullmatch,
)
KubernetesVersion = checked(str, "a Kubernetes minor version like '1.33'", re.compile(r"1\.\d{2}").fullmatch)
AddonVersion = checked(
    str, "an EKS add-on version like 'v1.19.5-eksbuild.1'", re.compile(r"v\d+\.\d+\.\d+-eksbuild\.\d+").fullmatch
)
Label = checked(
    str, "1-63 lowercase letters, digits or '-'", re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?").fullmatch
)


class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class GatewaySettings(_Cfg):
    image_tag: str = Field("0.1.0", min_length=1)  # in the gateway's ECR repository (tags are immutable)
    min_replicas: int = Field(2, ge=1)  # >= 2 so a node drain never takes the whole gateway
    max_replicas: int = Field(6, ge=1)
    # processes per pod on one SO_REUSEPORT socket (FLEET_GATEWAY_WORKERS, the default of
    # `fleet gateway --workers`); they share quotas through the quota store
    workers: int = Field(2, ge=1, le=16)
    cpu: float = Field(gt=0.0)  # the pod's CPU request; default one per worker, and never less
    memory_gib: float = Field(1.0, gt=0.0)
    node_port: int = Field(30080, ge=30000, le=32767)  # the load balancer's target port on the nodes

    @model_validator(mode="before")
    @classmethod
    def _cpu_per_worker_by_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and "cpu" not in data:
            default = cls.model_fields["workers"].default
            workers = data.get("workers", default)
            valid = isinstance(workers, int) and not isinstance(workers, bool)  # else its own error says so
            return {**data, "cpu": float(workers if valid else default)}
        return data

    @model_validator(mode="after")
    def _min_below_max(self) -> GatewaySettings:
        if self.min_replicas > self.max_replicas:
            raise expected(
                f"an integer <= max_replicas ({self.max_replicas})", field="min_replicas", got=self.min_replicas
            )
        return self

    @model_validator(mode="after")
    def _one_cpu_per_worker(self) -> GatewaySettings:
        # each worker is a single-threaded event loop that can keep a CPU busy; the scheduler
        # places pods by this request, so less would put more workers on a node than it has CPUs
        if self.cpu < self.workers:
            raise expected(
                f"a number >= workers ({self.workers}): one CPU per worker process", field="cpu", got=self.cpu
            )
        return self


ATHENA_MIN_CUTOFF_BYTES = 10 * 2**20  # Athena's smallest per-query cutoff: 10 MB (its MB and GB are binary)
AthenaLimitGb = checked(
    float,
    f"a number of GB >= {ATHENA_MIN_CUTOFF_BYTES / 2**30} (10 MB, Athena's smallest cutoff)",
    lambda gb: math.isfinite(gb) and gb * 2**30 >= ATHENA_MIN_CUTOFF_BYTES,
)


class LogSettings(_Cfg):
    """``serving-fleet:logs``: the Iceberg tables of the inference log, feedback, outcomes and
    usage (the models bucket's ``logs/``, infra/storage.py) and the Athena workgroup that
    queries them (infra/analytics.py)."""

    # rows older are dropped by the committer, which must be run with the same number (its
    # default is this one's); lifecycle expires the tables' data files a week after that
    retention_days: int = Field(RETENTION_DAYS, ge=1)
    # what one query may scan before Athena cancels it (it bills per byte scanned)
    athena_bytes_scanned_limit_gb: AthenaLimitGb = 10.0

    @property
    def athena_bytes_scanned_limit(self) -> int:
        """The cutoff in bytes, as Athena takes it."""
        return round(self.athena_bytes_scanned_limit_gb * 2**30)


class Settings(_Cfg):
    """The ``serving-fleet:<key>`` entries; field names are the config keys."""

    env: Literal["dev", "staging", "prod"]
    team: Label  # cost tag on every resource
    certificateArn: CertificateArn  # the HTTPS listener's certificate (ACM, same region)
    vpcCidr: VpcCidr = "10.0.0.0/16"
    azCount: int = Field(2, ge=2, le=6)
    singleNatGateway: bool = False  # one NAT for all AZs: cheaper, but one AZ's outage cuts egress
    kubernetesVersion: KubernetesVersion = "1.33"
    apiAccessCidrs: list[Cidr] = Field(default_factory=lambda: ["0.0.0.0/0"], min_length=1)  # Kubernetes API
    allowedCidrs: list[Cidr] = Field(default_factory=lambda: ["0.0.0.0/0"], min_length=1)  # the HTTPS listener
    systemNodes: SystemNodes
    nodePools: list[Any]  # validated by fleet.planning.stack.pools_from_config
    models: list[str] | None = None  # served by this stack; default every model in the policies
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    redis: RedisNodes = Field(default_factory=RedisNodes)  # the gateways' shared quota store (fleet.planning.stack)
    rootVolumeGib: int = Field(200, ge=50, le=16384)  # model node disks: images and weights are large
    logRetentionDays: int = Field(30, ge=1)  # logs bucket expiry (access logs; the log tables: logs.retention_days)
    logs: LogSettings = Field(default_factory=LogSettings)  # the log tables and Athena (infra/analytics.py)
    noncurrentVersionDays: int = Field(30, ge=1)  # overwritten or deleted objects kept this long
    policies: str = "policies"  # policy folder, relative to the project root
    addonVersions: dict[ADDONS, AddonVersion] = Field(default_factory=dict)  # pins; default: EKS's for the version

    @model_validator(mode="after")
    def _prod_api_is_not_open(self) -> Settings:
        """A prod cluster's Kubernetes API is reachable only from the CIDRs someone wrote down."""
        open_ = [c for c in self.apiAccessCidrs if ipaddress.ip_network(c, strict=False).prefixlen == 0]
        if self.env == "prod" and open_:
            raise expected(
                "the CIDRs of your office, VPN or CI (required for env prod; the API is open to the "
                "internet otherwise)",
                field="apiAccessCidrs",
                got=open_,
            )
        return self

    @model_validator(mode="after")
    def _prod_quota_store_fails_over(self) -> Settings:
        """A prod quota store survives the loss of a node or an AZ: a replica to fail over to."""
        if self.env == "prod" and self.redis.nodes < 2:
            raise expected(
                "an integer >= 2 (required for env prod: Multi-AZ with automatic failover needs a replica)",
                field=("redis", "nodes"),
                got=self.redis.nodes,
            )
        return self


@dataclass(frozen=True)
class StackConfig:
    stack: str
    region: str
    settings: Settings
    pools: tuple[NodePool, ...]
    policies: Policies
    plan: PlacementPlan
    policy_files: dict[str, str]  # file name → text of the policy files, for the gateway's ConfigMap
    secrets: dict[str, Any] = dataclasses.field(default_factory=dict)  # key → secret pulumi.Output[str]; load() only

    @property
    def admin_token(self) -> Any:
        return self.secrets.get(ADMIN_TOKEN_KEY)

    @property
    def name(self) -> str:
        """Prefix of physical names (cluster, roles): unique per stack in one account."""
        return f"{PROJECT}-{self.stack}"

    @property
    def tags(self) -> dict[str, str]:
        """Cost tags every taggable resource carries; components override ``model``."""
        return {
            "team": self.settings.team,
            "env": self.settings.env,
            "model": "shared",
            "project": PROJECT,
            "stack": self.stack,
        }

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(sorted({self.policies.models[m.model].family for m in self.plan.models}))


def _is_text(annotation: Any) -> bool:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation is str


def _secret_problem(name: str, value: Any, where: str) -> str | None:
    """What is wrong with the secret ``name``, never saying what it is."""
    key = f"{where}: {PROJECT}:{name}"
    if not isinstance(value, str) or not value.strip():
        return problem(key, "not set", f"{SECRETS[name]}, as a secret: `{set_secret(name)}`")
    if len(value) < SECRET_MIN_CHARS:
        return problem(
            key,
            f"got {len(value)} characters (value not shown)",
            f"at least {SECRET_MIN_CHARS}, e.g. `{set_secret(name)}`",
        )
    if name == PREFECT_DB_PASSWORD_KEY and not re.fullmatch(r"[A-Za-z0-9_.~-]+", value):
        # the Prefect chart writes it into postgresql+asyncpg://user:PASSWORD@host/db unescaped
        return problem(
            key,
            "has characters a URL would need escaped (value not shown)",
            f"letters, digits and - _ . ~ only, e.g. `{set_secret(name)}`",
        )
    if name == REDIS_AUTH_TOKEN_KEY:
        # ElastiCache takes 16-128 printable characters, of the symbols only ! & # $ ^ < > -;
        # it goes into rediss://:TOKEN@host:6379/0, where all of those but - need escaping
        if len(value) > REDIS_AUTH_TOKEN_MAX_CHARS:
            return problem(
                key,
                f"got {len(value)} characters (value not shown)",
                f"at most {REDIS_AUTH_TOKEN_MAX_CHARS} (ElastiCache's limit), e.g. `{set_secret(name)}`",
            )
        if not re.fullmatch(r"[A-Za-z0-9-]+", value):
            return problem(
                key,
                "has characters ElastiCache refuses or a URL would need escaped (value not shown)",
                f"letters, digits and - only, e.g. `{set_secret(name)}`",
            )
    return None


def policy_files(path: Path) -> dict[str, str]:
    """File name → text of the policy files at ``path``: a file, or the *.yaml / *.yml directly
    in a folder (what ``fleet.catalog.policies.loader.load_policies`` reads)."""
    files = (
        [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml"))
    )
    return {f.name: f.read_text() for f in files}


def parse(raw: dict[str, str], stack: str, region: str | None) -> StackConfig:
    """Validate ``raw`` (config key without namespace → value as Pulumi stores it: a string,
    JSON for lists and mappings) into a StackConfig."""
    where = f"Pulumi.{stack}.yaml"
    problems = []
    if not region:
        problems.append(
            problem(f"{where}: aws:region", "not set", "the AWS region, e.g. `pulumi config set aws:region us-east-1`")
        )
    problems += [bad for name in SECRETS if (bad := _secret_problem(name, raw.get(name), where))]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECRETS:
            continue  # checked above; the value stays out of Settings and every message
        field = Settings.model_fields.get(key)
        if field is None:
            known = [*Settings.model_fields, *SECRETS]
            problems.append(
                problem(f"{where}: {PROJECT}:{key}", "unknown key", f"one of {', '.join(known)}{hint(key, known)}")
            )
            continue
        try:
            values[key] = value if _is_text(field.annotation) else json.loads(value)
        except (TypeError, ValueError):
            values[key] = value  # pydantic names the type it expected
    try:
        settings = Settings.model_validate(values)
    except ValidationError as exc:
        problems += [f"{where}: {PROJECT}:{line}" for line in explain(exc, Settings)]
    if problems:
        raise ConfigError("\n".join(problems))
    policies = load_policies(ROOT / settings.policies)
    pools = pools_from_config(settings.nodePools, f"{where}: {PROJECT}")
    models = models_from_config(settings.models, f"{where}: {PROJECT}", policies)
    placed = plan(policies, pools, models)
    return StackConfig(stack, region, settings, pools, policies, placed, policy_files(ROOT / settings.policies))


def load() -> StackConfig:
    """The current stack's config (inside a Pulumi program or under mocks)."""
    import pulumi
    from pulumi.runtime.config import CONFIG, get_config_env

    everything = {**get_config_env(), **CONFIG.get()}  # every key, to catch the unknown ones
    raw = {}
    for full, value in everything.items():
        namespace, _, key = full.partition(":")
        if namespace == PROJECT:
            raw[key.removeprefix("config:")] = value  # old-style keys read "project:config:key"
    stack = parse(raw, pulumi.get_stack(), pulumi.Config("aws").get("region"))
    config = pulumi.Config(PROJECT)
    return dataclasses.replace(stack, secrets={name: config.require_secret(name) for name in SECRETS})
