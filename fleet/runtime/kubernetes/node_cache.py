"""What a model node must give its replicas: the weights cache on its disk and shared memory (pure).

Images hold code only; a replica fetches its version's files into a folder of the node that
the replicas on it share (``bentos/weights.py``), mounted from the host at ``NODE_CACHE_PATH``.
That path is under the kubelet's root on purpose: on an instance with NVMe instance store,
AL2023's ``nodeadm`` (Karpenter's ``instanceStorePolicy: RAID0``) builds a RAID0 array, mounts
it at ``/mnt/k8s-disks/0`` and bind-mounts ``/var/lib/kubelet`` onto it, so the cache lands on
the array; on other instances it lands on the root volume, which the node class sizes with
``node_cache_bytes`` (gp3, with its throughput raised: see the README's time-to-ready figures).
The kubelet counts this filesystem as its ``nodefs``: the budget must leave its eviction
threshold (``nodefs.available<10%`` by default) free.

``node_cache_bytes`` is what one node needs for the models placed on its node group: each
model's weights twice (the stable version and a canary, or the old and the new one during a
rollout), with ``HEADROOM`` for tokenizer files and a fetch in progress. ``shm_bytes`` sizes
``/dev/shm`` for a tensor-parallel replica.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from fleet.planning.placement import ModelPlacement, PlacementPlan

NODE_CACHE_PATH = "/var/lib/kubelet/fleet-weights"  # on the host; the RAID0 array where there is instance store
CACHE_MOUNT = "/var/cache/fleet-weights"  # in the replica's container: its FLEET_CACHE_DIR
VERSIONS_PER_MODEL = 2  # stable + canary (or old + new during a rollout) on one node at once
HEADROOM = 1.10  # tokenizer and config files, a fetch's .part files
MIN_CACHE_BYTES = 8 * 2**30  # a node group of small CPU models still gets room for a few versions
# /dev/shm of a tensor-parallel replica: 1 GiB per GPU it spans, at least 2 GiB (vLLM's Kubernetes
# guide mounts a 2 GiB memory emptyDir "for tensor parallel inference"; NCCL's shared-memory
# transport, used between GPUs without NVLink P2P, keeps buffers per peer and channel there,
# and Docker's and the container runtime's 64 MiB default fails its first collective)
SHM_PER_GPU_BYTES = 2**30
MIN_SHM_BYTES = 2 * 2**30
# Ranged GETs a replica keeps in flight: S3 serves ~85-90 MB/s per connection (its performance
# guidelines), so 16 fill a 10 Gbps NIC (g5.xlarge's burst); a replica spanning more GPUs sits on
# a larger instance (p4d.24xlarge: 400 Gbps) and gets 16 per GPU, up to 64 (~5.7 GB/s, about
# what an 8-drive NVMe RAID0 writes).
FETCH_CONNECTIONS_PER_GPU, MAX_FETCH_CONNECTIONS = 16, 64


def cache_budget_bytes(placements: Iterable[ModelPlacement], node_group: str) -> int:
    """Bytes of weights cache one node of ``node_group`` needs for the models placed there.

    >>> from dataclasses import replace
    >>> p = ModelPlacement("m", "llm", "g5", "gpu", "g5.xlarge", 1, 1, False, 20, 3, 12, 1, 2, 1, 500, weights_gib=13)
    >>> round(cache_budget_bytes([p, replace(p, model="n", node_group="other")], "g5") / 2**30, 1)
    28.6
    """
    weights = sum(p.weights_gib for p in placements if p.node_group == node_group)
    return max(MIN_CACHE_BYTES, math.ceil(weights * VERSIONS_PER_MODEL * HEADROOM * 2**30))


def node_cache_bytes(plan: PlacementPlan, node_group: str) -> int:
    """``cache_budget_bytes`` for a node group of ``plan`` (what its node class must provide at
    ``NODE_CACHE_PATH``, beyond the images and the kubelet's own use)."""
    return cache_budget_bytes(plan.models, node_group)


def fetch_concurrency(placement: ModelPlacement) -> int:
    """Ranged GETs in flight while the replica fetches its weights (``FLEET_FETCH_CONCURRENCY``)."""
    return min(MAX_FETCH_CONNECTIONS, FETCH_CONNECTIONS_PER_GPU * max(1, placement.tensor_parallel))


def shm_bytes(placement: ModelPlacement) -> int:
    """``/dev/shm`` size of one replica: 0 (the runtime's default) unless it spans several GPUs."""
    if placement.tensor_parallel <= 1:
        return 0
    return max(MIN_SHM_BYTES, placement.tensor_parallel * SHM_PER_GPU_BYTES)
