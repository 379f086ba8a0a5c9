"""PrefectDatabase: the Prefect server's PostgreSQL, on RDS or a database the stack names.

The Prefect server keeps every flow run, deployment, schedule and log in it; the chart's
bundled PostgreSQL (a frozen bitnamilegacy image on one volume) is not what to run that on.
By default an RDS PostgreSQL instance: in the private subnets (its subnet group), reachable on
5432 only from the EKS cluster security group (every node and so every pod carries it: the
VPC CNI without security groups for pods), never public, encrypted at rest, TLS available,
with automated backups; Multi-AZ (a standby in another AZ) and deletion protection with a
final snapshot for env prod. Its master user is ``prefect`` with the stack's secret
``prefectDbPassword``.

With ``prefectDatabase.external_host`` in the stack config, no instance is made: the server
connects to that host instead (same user, database and password).

``connection_url`` is ``postgresql+asyncpg://prefect:<password>@<host>:<port>/prefect``, a
secret Output: the key ``connection-string`` of the Secret the server chart reads
(infra/flows_cluster.py). asyncpg negotiates TLS by default, which RDS PostgreSQL 15+ requires
(``rds.force_ssl`` is on in its default parameter group).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

import pulumi
import pulumi_aws as aws

from infra import from_nodes_only
from infra.config_sections import PrefectDatabaseSettings

PORT = 5432
ENGINE = "postgres"
# The major version only: RDS applies minor versions itself (auto_minor_version_upgrade), and a
# pinned minor would make the next `up` after one try to downgrade. 17 is in RDS standard
# support until 2030 (PostgreSQL's own: November 2029) and is a version Prefect 3 supports.
ENGINE_VERSION = "17"
USER = DATABASE = "prefect"
STORAGE_TYPE = "gp3"
PROD_BACKUP_DAYS = 14  # at least, for env prod: two weeks of point-in-time recovery
BACKUP_WINDOW, MAINTENANCE_WINDOW = "03:00-04:00", "sun:04:30-sun:05:30"  # UTC, back to back, not overlapping


def connection_url(password: str, host: str, port: int = PORT) -> str:
    """The server's PREFECT_SERVER_DATABASE_CONNECTION_URL (the password escaped, though
    infra/config.py allows only characters that need none)."""
    return f"postgresql+asyncpg://{USER}:{quote(password, safe='')}@{host}:{port}/{DATABASE}"


@dataclass
class PrefectDatabaseArgs:
    vpc_id: pulumi.Input[str]
    private_subnet_ids: list[pulumi.Input[str]]
    node_security_group_id: pulumi.Input[str]  # the EKS cluster security group the nodes (and their pods) use
    settings: PrefectDatabaseSettings
    prod: bool  # Multi-AZ, deletion protection, a final snapshot, longer backups
    password: pulumi.Input[str]  # a secret Output: the stack's prefectDbPassword
    tags: dict[str, str]


class PrefectDatabase(pulumi.ComponentResource):
    instance: aws.rds.Instance | None  # None: the stack names an external database
    connection_url: pulumi.Output[str]  # secret
    host: pulumi.Output[str]

    def __init__(self, name: str, args: PrefectDatabaseArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:PrefectDatabase", name, None, opts)
        s = args.settings
        if s.external_host:
            self.instance = None
            self.host = pulumi.Output.from_input(s.external_host)
            port: pulumi.Input[int] = s.external_port
        else:
            self.instance = self._rds(name, args)
            self.host, port = self.instance.address, self.instance.port
        self.connection_url = pulumi.Output.secret(
            pulumi.Output.all(args.password, self.host, port).apply(lambda v: connection_url(v[0], v[1], int(v[2])))
        )
        self.register_outputs({"host": self.host, "connection_url": self.connection_url})

    def _rds(self, name: str, args: PrefectDatabaseArgs) -> aws.rds.Instance:
        child = pulumi.ResourceOptions(parent=self)
        s, tags = args.settings, args.tags
        sg_id = from_nodes_only(
            f"{name}-prefect-db",
            args.vpc_id,
            PORT,
            args.node_security_group_id,
            "Prefect server database: PostgreSQL",
            tags,
            child,
        )
        subnets = aws.rds.SubnetGroup(
            f"{name}-prefect-db",
            subnet_ids=args.private_subnet_ids,
            description="Prefect server database: the private subnets",
            tags=tags,
            opts=child,
        )
        return aws.rds.Instance(
            f"{name}-prefect-db",
            # RDS's limit is 63: lowercase letters, digits, single hyphens (serving-fleet-prod-prefect)
            identifier=f"{name}-prefect",
            engine=ENGINE,
            engine_version=ENGINE_VERSION,
            auto_minor_version_upgrade=True,
            instance_class=s.instance_class,
            allocated_storage=s.storage_gib,
            max_allocated_storage=s.max_storage_gib,
            storage_type=STORAGE_TYPE,
            storage_encrypted=True,  # with the account's aws/rds key
            db_name=DATABASE,
            username=USER,
            password=pulumi.Output.secret(args.password),
            port=PORT,
            db_subnet_group_name=subnets.name,
            vpc_security_group_ids=[sg_id],
            publicly_accessible=False,
            multi_az=args.prod,
            backup_retention_period=max(s.backup_days, PROD_BACKUP_DAYS) if args.prod else s.backup_days,
            backup_window=BACKUP_WINDOW,
            maintenance_window=MAINTENANCE_WINDOW,
            copy_tags_to_snapshot=True,
            deletion_protection=args.prod,
            # prod keeps a last snapshot when the instance goes; dev's history is not worth one
            skip_final_snapshot=not args.prod,
            final_snapshot_identifier=f"{name}-prefect-final" if args.prod else None,
            apply_immediately=not args.prod,  # prod's changes wait for the maintenance window
            tags=tags,
            opts=child,
        )
