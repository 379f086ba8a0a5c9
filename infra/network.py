"""Network: a VPC with a public and a private subnet per AZ, and NAT for the private ones.

Nodes and pods live in the private subnets (the VPC CNI gives every pod a VPC address, so
those are the big ones: a /19 each); the load balancer and the NAT gateways live in the
public ones. The subnet tags are the ones EKS and its load-balancer integrations look for.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from fleet.planning.costs import INTERFACE_ENDPOINTS  # what pulling an image from ECR talks to besides S3; priced there


@dataclass
class NetworkArgs:
    cidr: str
    az_count: int
    single_nat_gateway: bool
    cluster_name: str
    tags: dict[str, str]


def subnet_cidrs(cidr: str, az_count: int) -> tuple[list[str], list[str]]:
    """(private, public) CIDRs: the VPC in eighths, one per AZ for private subnets, and the
    last eighth cut into sixteen small public subnets.

    >>> subnet_cidrs("10.0.0.0/16", 2)
    (['10.0.0.0/19', '10.0.32.0/19'], ['10.0.224.0/23', '10.0.226.0/23'])
    """
    eighths = list(ipaddress.ip_network(cidr).subnets(prefixlen_diff=3))
    public = list(eighths[-1].subnets(prefixlen_diff=4))
    return [str(n) for n in eighths[:az_count]], [str(n) for n in public[:az_count]]


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    private_subnet_ids: list[pulumi.Output[str]]
    public_subnet_ids: list[pulumi.Output[str]]
    private_subnet_zones: list[pulumi.Output[str]]  # the AZ of each private subnet, in the same order

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = args.tags

        def tagged(label: str, **extra: str) -> dict[str, str]:
            return {**tags, "Name": f"{name}-{label}", **extra}

        zones = aws.get_availability_zones_output(state="available", opts=pulumi.InvokeOutputOptions(parent=self))
        vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=args.cidr,
            enable_dns_hostnames=True,
            enable_dns_support=True,
            tags=tagged("vpc"),
            opts=child,
        )
        igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=vpc.id, tags=tagged("igw"), opts=child)
        public_rt = aws.ec2.RouteTable(
            f"{name}-public",
            vpc_id=vpc.id,
            routes=[{"cidr_block": "0.0.0.0/0", "gateway_id": igw.id}],
            tags=tagged("public"),
            opts=child,
        )
        cluster_tag = f"kubernetes.io/cluster/{args.cluster_name}"
        private_cidrs, public_cidrs = subnet_cidrs(args.cidr, args.az_count)
        self.public_subnet_ids, self.private_subnet_ids, self.private_subnet_zones = [], [], []
        nats: list[aws.ec2.NatGateway] = []
        private_route_tables: list[aws.ec2.RouteTable] = []
        for i, (private_cidr, public_cidr) in enumerate(zip(private_cidrs, public_cidrs)):
            az = zones.names.apply(lambda names, i=i: names[i])
            public = aws.ec2.Subnet(
                f"{name}-public-{i}",
                vpc_id=vpc.id,
                cidr_block=public_cidr,
                availability_zone=az,
                tags=tagged(f"public-{i}", **{"kubernetes.io/role/elb": "1", cluster_tag: "shared"}),
                opts=child,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-public-{i}", subnet_id=public.id, route_table_id=public_rt.id, opts=child
            )
            self.public_subnet_ids.append(public.id)
            if i == 0 or not args.single_nat_gateway:
                eip = aws.ec2.Eip(f"{name}-nat-{i}", domain="vpc", tags=tagged(f"nat-{i}"), opts=child)
                nats.append(
                    aws.ec2.NatGateway(
                        f"{name}-nat-{i}",
                        allocation_id=eip.id,
                        subnet_id=public.id,
                        tags=tagged(f"nat-{i}"),
                        opts=pulumi.ResourceOptions(parent=self, depends_on=[igw]),
                    )
                )
            private = aws.ec2.Subnet(
                f"{name}-private-{i}",
                vpc_id=vpc.id,
                cidr_block=private_cidr,
                availability_zone=az,
                tags=tagged(f"private-{i}", **{"kubernetes.io/role/internal-elb": "1", cluster_tag: "shared"}),
                opts=child,
            )
            # each AZ egresses through its own NAT, so losing one AZ leaves the others online
            private_rt = aws.ec2.RouteTable(
                f"{name}-private-{i}",
                vpc_id=vpc.id,
                routes=[{"cidr_block": "0.0.0.0/0", "nat_gateway_id": nats[-1].id}],
                tags=tagged(f"private-{i}"),
                opts=child,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-private-{i}", subnet_id=private.id, route_table_id=private_rt.id, opts=child
            )
            private_route_tables.append(private_rt)
            self.private_subnet_ids.append(private.id)
            self.private_subnet_zones.append(az)
        self._endpoints(name, args, vpc, private_route_tables, tagged)
        self.vpc_id = vpc.id
        self.nat_gateways = len(nats)
        self.register_outputs(
            {
                "vpc_id": vpc.id,
                "private_subnet_ids": self.private_subnet_ids,
                "public_subnet_ids": self.public_subnet_ids,
            }
        )

    def _endpoints(
        self,
        name: str,
        args: NetworkArgs,
        vpc: aws.ec2.Vpc,
        route_tables: list[aws.ec2.RouteTable],
        tagged: Callable[..., dict[str, str]],
    ) -> None:
        """Model weights (S3) and images (ECR) reach the nodes without the NAT: an S3 gateway
        endpoint on the private route tables (free; NAT processing is billed per GB), and ECR's
        API and registry as interface endpoints with private DNS (image layers themselves are
        served from S3, through the gateway endpoint)."""
        child = pulumi.ResourceOptions(parent=self)
        region = aws.get_region_output(opts=pulumi.InvokeOutputOptions(parent=self)).region
        aws.ec2.VpcEndpoint(
            f"{name}-s3",
            vpc_id=vpc.id,
            service_name=pulumi.Output.concat("com.amazonaws.", region, ".s3"),
            vpc_endpoint_type="Gateway",
            route_table_ids=[rt.id for rt in route_tables],
            tags=tagged("s3"),
            opts=child,
        )
        sg = aws.ec2.SecurityGroup(
            f"{name}-endpoints",
            vpc_id=vpc.id,
            description="interface endpoints: HTTPS from the VPC",
            tags=tagged("endpoints"),
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-endpoints-https",
            security_group_id=sg.id,
            ip_protocol="tcp",
            from_port=443,
            to_port=443,
            cidr_ipv4=args.cidr,
            description="HTTPS from the VPC",
            tags=tagged("endpoints-https"),
            opts=child,
        )
        for service in INTERFACE_ENDPOINTS:
            aws.ec2.VpcEndpoint(
                f"{name}-{service.replace('.', '-')}",
                vpc_id=vpc.id,
                service_name=pulumi.Output.concat("com.amazonaws.", region, f".{service}"),
                vpc_endpoint_type="Interface",
                subnet_ids=self.private_subnet_ids,
                security_group_ids=[sg.id],
                private_dns_enabled=True,
                tags=tagged(service.replace(".", "-")),
                opts=child,
            )
