"""ClusterAddons: the cluster's own components as EKS managed add-ons, versioned per Kubernetes version.

vpc-cni (with its network policy agent on: infra/netpol.py) and kube-proxy are what a node needs
to turn Ready, so they come before the node
groups; coredns, the EBS CSI driver (volumes for Prometheus and Prefect's database) and
metrics-server (the gateway's HPA reads CPU through it) run as pods and come after. EKS
installs vpc-cni, kube-proxy and coredns itself when it creates a cluster, unmanaged;
``resolve_conflicts_on_create=OVERWRITE`` takes them over, so ``eksctl``-style manual
upgrades are never needed and a cluster version bump is followed by an add-on update.

Each add-on's version is the one EKS names as the default for the cluster's Kubernetes
version (``aws eks describe-addon-versions``, through ``aws.eks.get_addon_version`` with
``most_recent=False``): a lookup at ``pulumi up``, not a version from memory. AWS moves that
default now and then (a new eksbuild), and the next ``up`` then upgrades the add-on; a stack
that wants every change reviewed pins versions in ``addonVersions`` (add-on → version, e.g.
``{"vpc-cni": "v1.19.5-eksbuild.1"}``), which ``pulumi preview`` shows as a diff when changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra import waited_for
from infra.identity import IrsaRole, IrsaRoleArgs
from infra.netpol import VPC_CNI_CONFIGURATION

BEFORE_NODES = ("vpc-cni", "kube-proxy")  # keep ADDONS in infra/config.py the union of both
AFTER_NODES = ("coredns", "aws-ebs-csi-driver", "metrics-server")
# add-on → its configuration values (the add-on's JSON schema: `aws eks describe-addon-configuration`)
CONFIGURATION = {"vpc-cni": VPC_CNI_CONFIGURATION}  # the node agent enforces NetworkPolicies
# add-on → (namespace, service account, AWS managed policy) of its IRSA role
IRSA = {
    "aws-ebs-csi-driver": (
        "kube-system",
        "ebs-csi-controller-sa",
        "arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy",
    ),
}


@dataclass
class ClusterAddonsArgs:
    cluster_name: pulumi.Input[str]
    kubernetes_version: pulumi.Input[str]  # the cluster's: add-on versions follow it
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer: pulumi.Input[str]
    names: tuple[str, ...]
    tags: dict[str, str]
    pinned: dict[str, str] = field(default_factory=dict)  # add-on → version, instead of EKS's default


class ClusterAddons(pulumi.ComponentResource):
    addons: dict[str, aws.eks.Addon]

    def __init__(self, name: str, args: ClusterAddonsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:ClusterAddons", name, None, opts)
        child = pulumi.ResourceOptions(parent=self, depends_on=waited_for(opts))
        self.addons = {}
        for addon in args.names:
            version = (
                args.pinned.get(addon)
                or aws.eks.get_addon_version_output(
                    addon_name=addon,
                    kubernetes_version=args.kubernetes_version,
                    most_recent=False,
                    opts=pulumi.InvokeOutputOptions(parent=self),
                ).version
            )
            role = None
            if addon in IRSA:
                namespace, account, managed = IRSA[addon]
                role = IrsaRole(
                    f"{name}-{addon}",
                    IrsaRoleArgs(
                        args.oidc_provider_arn,
                        args.oidc_issuer,
                        namespace,
                        account,
                        None,
                        args.tags,
                        managed_policies=(managed,),
                    ),
                    opts=child,
                )
            self.addons[addon] = aws.eks.Addon(
                f"{name}-{addon}",
                cluster_name=args.cluster_name,
                addon_name=addon,
                addon_version=version,
                service_account_role_arn=role.arn if role else None,
                configuration_values=json.dumps(CONFIGURATION[addon]) if addon in CONFIGURATION else None,
                resolve_conflicts_on_create="OVERWRITE",
                resolve_conflicts_on_update="OVERWRITE",
                tags=args.tags,
                opts=child,
            )
        self.register_outputs({"addons": {k: a.addon_version for k, a in self.addons.items()}})
