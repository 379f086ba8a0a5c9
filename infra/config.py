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
Three more are optional, each the secret of an alerting receiver (``infra.alerting.ALERT_SECRETS``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import Field, ValidationError, model_validator

from fleet.catalog.policies.loader import Policies, load_policies
from fleet.errors import ConfigError
from fleet.planning import system_pool
from fleet.planning.costs import EKS_VERSIONS, eks_support
from fleet.planning.placement import PlacementPlan
from fleet.planning.planner import plan
from fleet.planning.stack import (
    KUBERNETES_VERSION,
    PROJECT,
    NodePool,
    RedisNodes,
    SystemNodes,
    models_from_config,
    pools_from_config,
)
from fleet.validation import checked, expected, explain, hint, problem
from infra.alerting import ALERT_SECRETS, AlertingSettings, secret_problems
from infra.config_sections import GatewaySettings, LogSettings, PrefectDatabaseSettings, _Cfg

ROOT = Path(__file__).resolve().parent.parent  # where Pulumi.yaml is
# keys an older stack file may still have → what to do instead (an error, so nobody sets one
# and believes it took effect)
RETIRED = {
    "rootVolumeGib": "nothing: remove the key; each model NodePool's disk is sized from its models' weights "
    "and instance type (`fleet plan` prints it; fleet.planning.karpenter)",
}
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
KubernetesVersion = checked(str, "a Kubernetes minor version like '1.35'", re.compile(r"1\.\d{2}").fullmatch)
AddonVersion = checked(
    str, "an EKS add-on version like 'v1.19.5-eksbuild.1'", re.compile(r"v\d+\.\d+\.\d+-eksbuild\.\d+").fullmatch
)
# an IAM role (any path) or user: the principals an EKS access entry takes
IamPrincipalArn = checked(
    str,
    "an IAM role or user ARN like 'arn:aws:iam::123456789012:role/platform-admins'",
    re.compile(r"arn:aws[a-z-]*:iam::\d{12}:(role|user)/[\w+=,.@/-]{1,512}").fullmatch,
)
Label = checked(
    str, "1-63 lowercase letters, digits or '-'", re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?").fullmatch
)


class Settings(_Cfg):
    """The ``serving-fleet:<key>`` entries; field names are the config keys."""

    env: Literal["dev", "staging", "prod"]
    team: Label  # cost tag on every resource
    certificateArn: CertificateArn  # the HTTPS listener's certificate (ACM, same region)
    vpcCidr: VpcCidr = "10.0.0.0/16"
    azCount: int = Field(2, ge=2, le=6)
    singleNatGateway: bool = False  # one NAT for all AZs: cheaper, but one AZ's outage cuts egress
    kubernetesVersion: KubernetesVersion = (
        KUBERNETES_VERSION  # in EKS standard support: fleet.planning.costs.EKS_VERSIONS
    )
    apiAccessCidrs: list[Cidr] = Field(default_factory=lambda: ["0.0.0.0/0"], min_length=1)  # Kubernetes API
    allowedCidrs: list[Cidr] = Field(default_factory=lambda: ["0.0.0.0/0"], min_length=1)  # the HTTPS listener
    adminRoleArns: list[IamPrincipalArn] = Field(default_factory=list)  # cluster admins: EKS access entries
    systemNodes: SystemNodes
    nodePools: list[Any]  # validated by fleet.planning.stack.pools_from_config
    models: list[str] | None = None  # served by this stack; default every model in the policies
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    redis: RedisNodes = Field(default_factory=RedisNodes)  # the gateways' shared quota store (fleet.planning.stack)
    logRetentionDays: int = Field(30, ge=1)  # logs bucket expiry (access logs; the log tables: logs.retention_days)
    logs: LogSettings = Field(default_factory=LogSettings)  # the log tables and Athena (infra/analytics.py)
    prefectDatabase: PrefectDatabaseSettings = Field(default_factory=PrefectDatabaseSettings)  # infra/prefect_db.py
    noncurrentVersionDays: int = Field(30, ge=1)  # overwritten or deleted objects kept this long
    policies: str = "policies"  # policy folder, relative to the project root
    addonVersions: dict[ADDONS, AddonVersion] = Field(default_factory=dict)  # pins; default: EKS's for the version
    alerting: AlertingSettings = Field(default_factory=AlertingSettings)  # Alertmanager's receivers (infra/alerting.py)

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
    def _kubernetes_version_is_offered(self) -> Settings:
        """EKS creates clusters on versions in standard or extended support only; past both it
        upgrades them itself. Extended support is allowed, and priced (six times standard)."""
        support = eks_support(self.kubernetesVersion)
        if support.support == "ended":
            offered = [v for v in EKS_VERSIONS if eks_support(v).support in ("standard", "extended")]
            raise expected(
                f"a version EKS still supports: {', '.join(offered)} (standard support is $0.10 per hour, "
                "extended $0.60; fleet.planning.costs.EKS_VERSIONS)",
                field="kubernetesVersion",
                got=self.kubernetesVersion,
            )
        return self

    @model_validator(mode="after")
    def _system_pool_holds_the_platform(self) -> Settings:
        """The system nodes hold the platform's pods and the gateways, at the minimum and at the
        maximum (fleet.planning.system_pool); an undersized pool leaves pods pending at peak."""
        g, sys_ = self.gateway, self.systemNodes
        found = system_pool.problems(
            sys_.instance_type, sys_.min_size, sys_.max_size, (g.min_replicas, g.max_replicas), g.cpu, g.memory_gib
        )
        if found:
            raise expected(
                "a system pool that holds them: " + "; ".join(found), field="systemNodes", got=sys_.model_dump()
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
        if key in SECRETS or key in ALERT_SECRETS:
            continue  # checked above (alerting's below); the value stays out of Settings and every message
        field = Settings.model_fields.get(key)
        if key in RETIRED:
            problems.append(problem(f"{where}: {PROJECT}:{key}", "no longer used", RETIRED[key]))
            continue
        if field is None:
            known = [*Settings.model_fields, *SECRETS, *ALERT_SECRETS]
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
    else:
        problems += secret_problems(settings.alerting, raw, where)  # optional secrets, each for a receiver
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
    present = [*SECRETS, *(name for name in ALERT_SECRETS if name in raw)]  # the alerting ones are optional
    return dataclasses.replace(stack, secrets={name: config.require_secret(name) for name in present})
