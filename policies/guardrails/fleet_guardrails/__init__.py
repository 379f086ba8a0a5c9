"""The serving fleet's CrossGuard policies, importable without starting a policy pack.

``POLICIES`` is what ``policies/guardrails/__main__.py`` hands to ``PolicyPack``; tests run
the same objects' ``validate`` functions over the resources the Pulumi program registers.
"""

from fleet_guardrails.cache import cache_encrypted
from fleet_guardrails.compute import gpu_ceiling, gpu_node_groups_tainted, gpu_pods_admission
from fleet_guardrails.edge import https_only_listeners
from fleet_guardrails.network import eks_api_cidrs, imds_hop_limit, no_open_ingress
from fleet_guardrails.storage import bucket_encrypted, bucket_never_public, bucket_versioned
from fleet_guardrails.tags import cost_tags

PACK_NAME = "serving-fleet-guardrails"
POLICIES = [
    bucket_encrypted,
    bucket_versioned,
    bucket_never_public,
    cache_encrypted,
    gpu_node_groups_tainted,
    gpu_pods_admission,
    https_only_listeners,
    eks_api_cidrs,
    imds_hop_limit,
    no_open_ingress,
    cost_tags,
    gpu_ceiling,
]
