"""Karpenter's objects as the guardrails read them: whether a NodePool can launch GPU nodes,
its GPU limit, and an EC2NodeClass's instance metadata options with the CRD's defaults.

The program applies them as kubernetes CustomResources (infra/karpenter.py), so their
Pulumi types are ``kubernetes:<group>/<version>:<Kind>`` and their props the object itself
(``metadata``, ``spec``). Karpenter 1.x serves only the v1 APIs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from fleet_guardrails._common import GPU_RESOURCE, as_list, get, gpus_of, is_gpu_family

NODE_POOL = "kubernetes:karpenter.sh/v1:NodePool"
NODE_CLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
# spec.metadataOptions' defaults in the karpenter.k8s.aws/v1 CRD (Karpenter 1.14.1,
# tests/fixtures/karpenter/ec2nodeclass.schema.json): the API server fills an absent field
# with them, so an EC2NodeClass that says nothing gets IMDSv2 with a hop limit of 1.
NODE_CLASS_METADATA_DEFAULTS = {
    "httpEndpoint": "enabled",
    "httpProtocolIPv6": "disabled",
    "httpPutResponseHopLimit": 1,
    "httpTokens": "required",
}
# The requirement keys (well-known labels Karpenter puts on its instance types) by which a
# NodePool can keep itself off NVIDIA GPU instance types. Any other key leaves them possible.
INSTANCE_TYPE_KEYS = ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type")
FAMILY_KEY = "karpenter.k8s.aws/instance-family"
CATEGORY_KEY = "karpenter.k8s.aws/instance-category"
GPU_COUNT_KEY = "karpenter.k8s.aws/instance-gpu-count"  # only GPU types carry it
GPU_MANUFACTURER_KEY = "karpenter.k8s.aws/instance-gpu-manufacturer"
GPU_CATEGORIES = frozenset({"g", "p"})  # EC2's accelerated-computing categories with NVIDIA GPUs
_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?$")
_SUFFIX = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate("kMGTPE")},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
}


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity (``"16"``, ``16``, ``16.0``, ``"1500m"``, ``"2k"``), or
    None when ``value`` is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    match = _QUANTITY.match(str(value).strip())
    if not match:
        return None
    number, suffix = match.groups()
    try:
        if suffix and suffix[0] in "eE":
            return Decimal(number + suffix)
        return Decimal(number) * _SUFFIX.get(suffix or "", Decimal(1))
    except InvalidOperation:
        return None


def pool_name(props: Mapping[str, Any], fallback: str) -> str:
    """The NodePool's (or EC2NodeClass's) name in the cluster, else its Pulumi name."""
    return get(props, "metadata", "name") or fallback


def requirements(props: Mapping[str, Any]) -> list:
    return as_list(get(props, "spec", "template", "spec", "requirements"))


def taints(props: Mapping[str, Any]) -> list:
    """The taints every node of the pool carries (not ``startupTaints``: those are lifted)."""
    return as_list(get(props, "spec", "template", "spec", "taints"))


def gpu_limit(props: Mapping[str, Any]) -> tuple[bool, Decimal | None]:
    """(whether ``spec.limits`` names nvidia.com/gpu, its value or None if unreadable)."""
    limits = get(props, "spec", "limits", default={})
    if GPU_RESOURCE not in limits:
        return False, None
    return True, quantity(limits[GPU_RESOURCE])


def _excludes_gpus(requirement: Mapping[str, Any]) -> bool:
    """Does this one requirement keep every NVIDIA GPU instance type out? (Requirements are
    ANDed: one that does is enough.)"""
    key, op = requirement.get("key"), requirement.get("operator")
    values = [str(v) for v in as_list(requirement.get("values"))]
    if key in INSTANCE_TYPE_KEYS and op == "In":
        return all(gpus_of(v) == 0 for v in values)
    if key == FAMILY_KEY and op == "In":
        return not any(is_gpu_family(v) for v in values)
    if key == CATEGORY_KEY:
        return (op == "In" and not GPU_CATEGORIES & set(values)) or (op == "NotIn" and GPU_CATEGORIES <= set(values))
    if key == GPU_COUNT_KEY:
        numbers = [quantity(v) for v in values]
        if op == "DoesNotExist":
            return True
        if op == "In":
            return all(n is not None and n < 1 for n in numbers)
        if op in ("Lt", "Lte") and numbers and numbers[0] is not None:
            return numbers[0] <= (1 if op == "Lt" else 0)
        return False
    if key == GPU_MANUFACTURER_KEY:
        return op == "DoesNotExist" or (op == "In" and "nvidia" not in values) or (op == "NotIn" and "nvidia" in values)
    return False


def launches_gpus(props: Mapping[str, Any]) -> bool:
    """Can this NodePool launch NVIDIA GPU nodes? Yes unless one of its requirements keeps every
    GPU instance type out, or its nvidia.com/gpu limit is 0. A GPU type the pack does not know
    counts as a GPU type; a NodePool that says nothing about instance types may launch any."""
    named, limit = gpu_limit(props)
    if named and limit is not None and limit <= 0:
        return False  # Karpenter launches no node whose GPUs would pass the limit
    return not any(_excludes_gpus(r) for r in requirements(props))


def instance_types(props: Mapping[str, Any]) -> list[str] | None:
    """The instance types the pool's requirements name with ``In``, or None if they name none
    (then any type its other requirements allow may be launched)."""
    for r in requirements(props):
        if r.get("key") in INSTANCE_TYPE_KEYS and r.get("operator") == "In":
            return [str(v) for v in as_list(r.get("values"))]
    return None


def gpus_per_node(props: Mapping[str, Any]) -> int | None:
    """The most GPUs one node of the pool can have, from the instance types it names; None when
    it names none or one the pack cannot count."""
    types = instance_types(props)
    counts = [gpus_of(t) for t in types or []]
    if not counts or None in counts:
        return None
    return max(counts)


def node_limit(props: Mapping[str, Any]) -> int | None:
    limits = get(props, "spec", "limits", default={})
    n = quantity(limits["nodes"]) if "nodes" in limits else None
    return None if n is None else math.floor(n)
