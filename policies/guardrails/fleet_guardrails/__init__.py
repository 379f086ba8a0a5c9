"""The serving fleet's CrossGuard policies, importable without starting a policy pack.

``POLICIES`` is what ``policies/guardrails/__main__.py`` hands to ``PolicyPack``; tests run
the same objects' ``validate`` functions over the resources the Pulumi program registers.
"""

from fleet_guardrails.compute import gpu_ceiling, gpu_node_groups_tainted, gpu_pods_tolerate_and_limit
from fleet_guardrails.edge import https_only_listeners
from fleet_guardrails.storage import bucket_encrypted, bucket_never_public, bucket_versioned
from fleet_guardrails.tags import cost_tags

PACK_NAME = "serving-fleet-guardrails"
POLICIES = [
    bucket_encrypted,
    bucket_versioned,
    bucket_never_public,
    gpu_node_groups_tainted,
    gpu_pods_tolerate_and_limit,
    https_only_listeners,
    cost_tags,
    gpu_ceiling,
]
