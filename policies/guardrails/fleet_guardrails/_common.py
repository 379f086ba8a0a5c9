"""Helpers the guardrails share: nested reads, links between resources, GPU counts of instances."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pulumi_policy import PolicyResource

GPU_RESOURCE = "nvidia.com/gpu"  # the device plugin's resource name, and the taint's key
GPU_TAINT_VALUE = "present"
NVIDIA_AMIS = {
    "AL2_x86_64_GPU",
    "AL2023_x86_64_NVIDIA",
    "AL2023_ARM_64_NVIDIA",
    "BOTTLEROCKET_x86_64_NVIDIA",
    "BOTTLEROCKET_ARM_64_NVIDIA",
}
# NVIDIA GPUs per EC2 instance type (AWS's published specifications). A type of a GPU family
# missing here is refused by the ceiling rather than counted as zero.
GPUS_PER_INSTANCE = {
    **{f"g4dn.{s}": 1 for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "g4dn.12xlarge": 4,
    "g4dn.metal": 8,
    **{f"g5.{s}": 1 for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "g5.12xlarge": 4,
    "g5.24xlarge": 4,
    "g5.48xlarge": 8,
    **{f"g6.{s}": 1 for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "g6.12xlarge": 4,
    "g6.24xlarge": 4,
    "g6.48xlarge": 8,
    **{f"g6e.{s}": 1 for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "g6e.12xlarge": 4,
    "g6e.24xlarge": 4,
    "g6e.48xlarge": 8,
    "p3.2xlarge": 1,
    "p3.8xlarge": 4,
    "p3.16xlarge": 8,
    "p3dn.24xlarge": 8,
    "p4d.24xlarge": 8,
    "p4de.24xlarge": 8,
    "p5.4xlarge": 1,
    "p5.48xlarge": 8,
    "p5e.48xlarge": 8,
    "p5en.48xlarge": 8,
}
_GPU_FAMILY = re.compile(r"(g|p)r?\d+[a-z]*\.")  # g4dn., g5., g6e., gr6., p4d., p5en. ...


def get(value: Any, *path: str | int, default: Any = None) -> Any:
    """``value[path[0]][path[1]]...``, or ``default`` where a step is missing."""
    for step in path:
        try:
            value = value[step]
        except (KeyError, IndexError, TypeError):
            return default
        if value is None:
            return default
    return value


def as_list(value: Any) -> list:
    """A list of ``value``'s items (``[value]`` for a scalar). The engine hands policies its
    properties wrapped in pulumi_policy's proxies, which are Sequences and Mappings, not
    lists and dicts: both are read here."""
    if value is None:
        return []
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)
    return [value]


def plain(value: Any) -> Any:
    """``value`` with the engine's proxies turned into dicts and lists (reading an unknown
    value on the way raises pulumi_policy's UnknownValueError, as any read does)."""
    if isinstance(value, Mapping):
        return {k: plain(value[k]) for k in value}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(v) for v in value]
    return value


def gpus_of(instance_type: str) -> int | None:
    """GPUs of an instance type: 0 for a type without GPUs, None for an unknown GPU type."""
    if instance_type in GPUS_PER_INSTANCE:
        return GPUS_PER_INSTANCE[instance_type]
    return None if _GPU_FAMILY.match(instance_type) else 0


def is_gpu_family(family: str) -> bool:
    """``g5`` → True, ``m6i`` → False: the families whose types ``gpus_of`` counts as GPU types."""
    return _GPU_FAMILY.match(f"{family}.") is not None


def is_gpu_node_group(props: Mapping[str, Any]) -> bool:
    types = as_list(props.get("instanceTypes"))
    return props.get("amiType") in NVIDIA_AMIS or any(gpus_of(t) != 0 for t in types)


def linked(resource: PolicyResource, prop: str, target: PolicyResource, keys: Iterable[str] = ("bucket", "id")) -> bool:
    """Does ``resource.props[prop]`` point at ``target``? By the engine's property dependencies
    when it recorded them (values may still be unknown in a preview), else by value."""
    deps = resource.property_dependencies.get(prop) if resource.property_dependencies else None
    if deps:
        return any(d.urn == target.urn for d in deps)
    value = resource.props.get(prop)
    return value is not None and any(value == target.props.get(k) for k in keys)
