"""What a model version is in the cluster: its Deployment, Service, PodDisruptionBudget and
KEDA ScaledObject (``manifests``, pure), named and labelled per exact version.

Where a version runs comes from the placement plan that ``infra/`` writes into the ConfigMap
``fleet-runtime`` (``config_map_data``: keys ``placement.json``, ``images.json``,
``prometheus_url``, ``timeouts.json``): GPUs per replica, node selector and tolerations of its
node group, replica bounds, and what the engine is told in its env (``engine_env``: GPU type,
tensor-parallel degree, memory share, KV cache). KEDA scales between the floor and
``max_replicas`` on the placement's triggers from Prometheus (``scaling_triggers``).

The image holds code only: the replica fetches its weights from the store (``FLEET_STORE``,
read through the model service account's IAM role) into the node's cache, a hostPath shared
by the replicas on the node (``fleet.runtime.kubernetes.node_cache``), verified before it
reports ready. A tensor-parallel replica gets a memory-backed ``/dev/shm``, counted in its
memory request and limit (a memory emptyDir is charged to the container's memory).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from fleet.planning.placement import GPU_RESOURCE, ModelPlacement, PlacementPlan
from fleet.runtime.kubernetes.node_cache import (
    CACHE_MOUNT,
    NODE_CACHE_PATH,
    cache_budget_bytes,
    fetch_concurrency,
    shm_bytes,
)

NAMESPACE = "models"
CONFIG_MAP = "fleet-runtime"
MANAGED = {"app.kubernetes.io/managed-by": "serving-fleet"}
BENTO_PORT = 3000
# The user `bentoml containerize` images run as: the Dockerfile `bentoml build` writes ends in
# `USER bentoml`, a name the kubelet cannot check against runAsNonRoot, created with
# `ARG BENTO_USER_UID=1034` / `BENTO_USER_GID=1034`. Pods say the numbers (tests read them
# back from a built Bento's Dockerfile).
BENTO_UID = BENTO_GID = 1034
LOADING_LABEL = "fleet.io/loading"  # on a ScaledObject: eager or lazy (infra/admission.py reads it)
VERSION_ANNOTATION = "fleet.io/version"  # the exact semver ('+' is not allowed in label values)
COOLDOWN_S = 300  # KEDA's cooldownPeriod for an eager model (whose floor is at least 1: never scaled to zero)
LAZY_COOLDOWN_S = 60  # a lazy one's: its activity trigger already waited idle_unload_s
ACTIVITY_ONLY = "1000000000"  # the activity trigger's target: never reached, so it never adds replicas
# The model pods' service account: infra/ binds it (IRSA) to a role that may read the models
# bucket's artifacts and manifests only — what a replica fetches its weights with.
MODEL_SERVICE_ACCOUNT = "fleet-model"


def config_map_data(
    plan: PlacementPlan, images: dict[str, str], prometheus_url: str, timeouts_ms: dict[str, int]
) -> dict[str, str]:
    """The data of the ``fleet-runtime`` ConfigMap (written by infra/, read by ``KubernetesRuntime.deploy``)."""
    return {
        "placement.json": json.dumps(plan.to_dict(), sort_keys=True),
        "images.json": json.dumps(images, sort_keys=True),  # family → ECR repository URL
        "prometheus_url": prometheus_url,
        "timeouts.json": json.dumps(timeouts_ms, sort_keys=True),  # model → timeout_ms (grace period)
    }


def object_name(model: str, version: str) -> str:
    """A DNS-1035 name for ``model:version``, unique per exact version.

    >>> object_name("demo-classifier", "1.2.0+build.5")
    'demo-classifier-1-2-0-build-5-598416'
    """
    tag = re.sub(r"[^a-z0-9]+", "-", version.lower()).strip("-")[:40].rstrip("-")
    digest = hashlib.sha256(version.encode()).hexdigest()[:6]  # "1.2.0-rc.1" and "1.2.0-rc-1" differ
    head = model if model[0].isalpha() else f"m-{model}"
    return f"{head[: 63 - len(tag) - 8].rstrip('-')}-{tag}-{digest}"


def labels(model: str, version: str) -> dict[str, str]:
    return {
        **MANAGED,
        "app.kubernetes.io/name": model,
        "app.kubernetes.io/instance": object_name(model, version),
        "fleet.io/model": model,
        "fleet.io/version": version.replace("+", "_"),
    }


def engine_env(placement: ModelPlacement) -> list[dict[str, str]]:
    """What the placement tells the serving engine, as container env (pure).

    ``FLEET_TENSOR_PARALLEL``: GPUs one replica spans (1 on CPU or a shared GPU), vLLM's
    ``tensor_parallel_size``. On GPUs, ``FLEET_GPU_TYPE`` (the pool's, e.g. A100-40GB) and
    ``FLEET_GPU_MEMORY_UTILIZATION`` (the share of each GPU placement reserved for the
    replica, vLLM's ``gpu_memory_utilization``: on a time-sliced GPU it keeps to its slice).
    For a generative model, ``FLEET_KV_CACHE_GIB`` (the KV cache placement sized, over all its
    GPUs: for operators and dashboards; vLLM sizes its paged cache from the memory share)
    and, when it was sized from the architecture, ``FLEET_KV_CACHE_TOKENS`` (max_running ×
    context_tokens) and ``FLEET_CONTEXT_TOKENS`` (caps vLLM's ``max_model_len``).
    """
    env = {"FLEET_TENSOR_PARALLEL": str(max(placement.tensor_parallel, 1))}
    if placement.gpus:
        env["FLEET_GPU_TYPE"] = placement.gpu_type or "unknown"
        if placement.gpu_memory_utilization:
            env["FLEET_GPU_MEMORY_UTILIZATION"] = f"{placement.gpu_memory_utilization:g}"
    if placement.kv_source != "none":
        env["FLEET_KV_CACHE_GIB"] = f"{round(placement.kv_cache_gib, 3):g}"
    if placement.kv_tokens is not None and placement.context_tokens is not None:
        env["FLEET_KV_CACHE_TOKENS"] = str(placement.kv_tokens)
        env["FLEET_CONTEXT_TOKENS"] = str(placement.context_tokens)
    return [{"name": k, "value": v} for k, v in env.items()]


def manifests(
    model: str,
    version: str,
    image: str,
    placement: ModelPlacement,
    *,
    floor: int,
    prometheus_url: str,
    namespace: str = NAMESPACE,
    timeout_ms: int = 5000,
    store_url: str | None = None,
    cache_bytes: int | None = None,
) -> list[dict]:
    """Deployment, Service, PodDisruptionBudget and ScaledObject of one version (pure).

    ``store_url``: where the replica fetches its weights (``FLEET_STORE``; without it the
    node's cache must already hold them). ``cache_bytes``: the node cache's budget
    (``node_cache.cache_budget_bytes`` over the node group's placements; default: this one's).
    """
    name, selector = object_name(model, version), {"app.kubernetes.io/instance": object_name(model, version)}
    meta = {
        "name": name,
        "namespace": namespace,
        "labels": labels(model, version),
        "annotations": {VERSION_ANNOTATION: version},
    }
    shm = shm_bytes(placement)
    memory_mib = math.ceil(placement.memory_gib * 1024) + shm // 2**20  # /dev/shm's pages are the container's
    requests: dict[str, Any] = {"cpu": f"{placement.cpu:g}", "memory": f"{memory_mib}Mi"}
    limits: dict[str, Any] = {"memory": requests["memory"]}  # no CPU limit: throttling hurts latency
    if placement.gpus:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(placement.gpus)  # extended resources: limits == requests
    probe = {
        "httpGet": {"path": "/readyz", "port": "http"},
        "periodSeconds": 5,
        "timeoutSeconds": 3,
        "failureThreshold": 3,
    }
    container = {
        "name": "bento",
        "image": image,
        "ports": [{"name": "http", "containerPort": BENTO_PORT}],
        "env": [
            {"name": "FLEET_MODEL", "value": model},
            {"name": "FLEET_VERSION", "value": version},
            *engine_env(placement),
            *weights_env(placement, store_url, cache_bytes),
        ],
        "volumeMounts": [
            {"name": "weights", "mountPath": CACHE_MOUNT},
            *([{"name": "shm", "mountPath": "/dev/shm"}] if shm else []),
        ],
        "resources": {"requests": requests, "limits": limits},
        # weights are fetched and loaded before /readyz answers: allow up to 15 minutes before liveness counts
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 90},
        "readinessProbe": probe,
        "livenessProbe": {
            "httpGet": {"path": "/livez", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        # keep serving while endpoints drop this pod, then let BentoML drain on SIGTERM
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        # a container that exits (e.g. model files that fail their SHA-256) reports its log's end
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    volumes: list[dict[str, Any]] = [
        # DirectoryOrCreate: the kubelet makes it (root's); the init container hands it to the image's user
        {"name": "weights", "hostPath": {"path": NODE_CACHE_PATH, "type": "DirectoryOrCreate"}}
    ]
    if shm:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm // 2**20}Mi"}})
    pod = {
        "serviceAccountName": MODEL_SERVICE_ACCOUNT,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": BENTO_UID,
            "runAsGroup": BENTO_GID,
            "fsGroup": BENTO_GID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [_cache_owner(image)],
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": placement.node_selector,
        "tolerations": placement.tolerations,
        "terminationGracePeriodSeconds": math.ceil(timeout_ms / 1000) + 15,  # the longest request, then some
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector},
            }
        ],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector},
            "revisionHistoryLimit": 2,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels(model, version)}, "spec": pod},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"selector": selector, "ports": [{"name": "http", "port": BENTO_PORT, "targetPort": "http"}]},
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta,
        # an eviction (a node drain, Karpenter's consolidation or drift) never takes the version
        # below its floor: a replica back costs minutes of fetching and loading weights. A lazy
        # version (floor 0) may lose one at a time.
        "spec": {
            **({"minAvailable": floor} if floor > 0 else {"maxUnavailable": 1}),
            "selector": {"matchLabels": selector},
        },
    }
    # the admission policy lets the gateway wake only a lazy model's scaler: it reads this label
    scaler_meta = {**meta, "labels": {**meta["labels"], LOADING_LABEL: placement.loading}}
    scaler = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": scaler_meta,
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": floor,
            "maxReplicaCount": placement.max_replicas,
            # lazy: once the floor is 0 (fleet.control.lazy), KEDA takes the last replica away a
            # cooldown after its triggers went quiet (the activity trigger: idle_unload_s)
            "pollingInterval": 15,
            "cooldownPeriod": LAZY_COOLDOWN_S if placement.loading == "lazy" else COOLDOWN_S,
            "advanced": {
                "horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}
            },
            "triggers": scaling_triggers(model, version, placement, prometheus_url, namespace),
        },
    }
    return [deployment, service, budget, scaler]


def weights_env(placement: ModelPlacement, store_url: str | None, cache_bytes: int | None) -> list[dict[str, str]]:
    """Where the replica finds its weights (``bentos/weights.py`` reads these): the node cache
    in the container, its budget, and the store to fetch from."""
    budget = cache_bytes if cache_bytes is not None else cache_budget_bytes([placement], placement.node_group)
    env = [
        {"name": "FLEET_CACHE_DIR", "value": CACHE_MOUNT},
        {"name": "FLEET_CACHE_MAX_BYTES", "value": str(budget)},
        {"name": "FLEET_FETCH_CONCURRENCY", "value": str(fetch_concurrency(placement))},
    ]
    if store_url:
        env.append({"name": "FLEET_STORE", "value": store_url})
    return env


def cache_owner_script(folder: str) -> str:
    """The init container's shell: the folder to the image's user, mode 0750, unless it is already theirs."""
    owner = f"{BENTO_UID}:{BENTO_GID}"
    return f'[ "$(stat -c %u:%g {folder})" = "{owner}" ] || {{ chmod 0750 {folder} && chown {owner} {folder}; }}'


def _cache_owner(image: str) -> dict:
    """An init container that gives the node's cache folder to the image's user. A hostPath the
    kubelet creates is root's 0755, and fsGroup does not apply to hostPath volumes; it runs as
    root with CHOWN alone, on that folder alone. Every pod on the node runs it, so it changes
    nothing once the folder is the user's (root may not chmod a folder it does not own without
    FOWNER, which it does not have)."""
    return {
        "name": "weights-cache-owner",
        "image": image,
        "command": ["sh", "-c", cache_owner_script(CACHE_MOUNT)],
        "volumeMounts": [{"name": "weights", "mountPath": CACHE_MOUNT}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "16Mi"}},
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
    }


def scaling_triggers(
    model: str, version: str, placement: ModelPlacement, prometheus_url: str, namespace: str = NAMESPACE
) -> list[dict]:
    """KEDA's Prometheus triggers for the placement's ``triggers``. What divides over replicas
    (requests per second, requests in flight or waiting) is an AverageValue; what does not
    (latency, GPU utilisation averaged over the version's pods) is a Value."""
    match = f'model="{model}",version="{version}"'
    pods = (
        f'namespace="{namespace}",pod=~"{object_name(model, version)}-.+"'  # DCGM labels a GPU's metrics with its pod
    )
    queries = {
        "qps": ("AverageValue", f"sum(rate(fleet_version_requests_total{{{match}}}[1m]))"),
        "p99_ms": (
            "Value",
            f"1000 * histogram_quantile(0.99, sum(rate(fleet_upstream_duration_seconds_bucket{{{match}}}[2m]))"
            " by (le))",
        ),
        # in flight and waiting at every gateway, per replica (like Knative's concurrency)
        "queue_depth": ("AverageValue", f"sum(fleet_version_in_flight{{{match}}}) + sum(fleet_queue_depth{{{match}}})"),
        "gpu_utilization": ("Value", f"avg(DCGM_FI_DEV_GPU_UTIL{{{pods}}})"),
    }
    triggers = []
    for name in placement.triggers:
        metric_type, query = queries[name]
        triggers.append(
            {
                "type": "prometheus",
                "name": name.replace("_", "-"),
                "metricType": metric_type,
                "metadata": {
                    "serverAddress": prometheus_url,
                    "query": query,
                    "threshold": f"{placement.target(name):g}",
                },
            }
        )
    if placement.loading == "lazy":
        # active while any gateway holds a request for the version or sent it one within
        # idle_unload_s: KEDA then keeps its last replica (and never takes one the gateway is
        # waking away). Its target is out of reach on purpose: it only says active or not, and
        # the policy's own triggers alone decide how many replicas run.
        window = f"{math.ceil(placement.idle_unload_s or COOLDOWN_S)}s"
        activity = (
            f"sum(increase(fleet_version_requests_total{{{match}}}[{window}])) or vector(0)) + "
            f"(sum(fleet_requests_held{{{match}}}) or vector(0)"
        )
        triggers.append(
            {
                "type": "prometheus",
                "name": "activity",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": prometheus_url,
                    "query": f"({activity})",
                    "threshold": ACTIVITY_ONLY,
                    "activationThreshold": "0",
                },
            }
        )
    return triggers


def placement_from_dict(raw: dict) -> ModelPlacement:
    """A ModelPlacement from its JSON form in placement.json (Plan.to_dict)."""
    fields = {k: raw[k] for k in ModelPlacement.__dataclass_fields__ if k in raw}
    fields["isolated_for"] = tuple(fields.get("isolated_for", ()))
    if "triggers" in fields:
        fields["triggers"] = tuple(fields["triggers"])
    return ModelPlacement(**fields)
