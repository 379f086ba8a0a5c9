"""The Pulumi program of the serving fleet: ``__main__.py`` wires the components of this package."""

from __future__ import annotations

import pulumi


def waited_for(opts: pulumi.ResourceOptions | None) -> list[pulumi.Resource]:
    """What a component's ``depends_on`` names, to hand to its children: Pulumi does not pass
    a component's ``depends_on`` on to the resources it creates, so without this they would
    not wait for it (node groups for their role, charts for any node)."""
    if opts is None or opts.depends_on is None:
        return []
    if isinstance(opts.depends_on, pulumi.Resource):
        return [opts.depends_on]
    return list(opts.depends_on)  # type: ignore[arg-type]


def from_nodes_only(
    name: str,
    vpc_id: pulumi.Input[str],
    port: int,
    node_security_group_id: pulumi.Input[str],
    what: str,
    tags: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> pulumi.Output[str]:
    """A security group for a managed service in the VPC (the quota store, Prefect's database)
    that admits TCP ``port`` from the cluster's nodes (their security group, which every pod
    carries) and nothing else; returns its ID."""
    import pulumi_aws as aws

    sg = aws.ec2.SecurityGroup(
        name,
        vpc_id=vpc_id,
        description=f"{what} on {port} from the cluster's nodes",
        tags={**tags, "Name": name},
        opts=opts,
    )
    aws.vpc.SecurityGroupIngressRule(
        f"{name}-from-nodes",
        security_group_id=sg.id,
        ip_protocol="tcp",
        from_port=port,
        to_port=port,
        referenced_security_group_id=node_security_group_id,
        description=f"{what} from the cluster's nodes",
        tags=tags,
        opts=opts,
    )
    return sg.id
