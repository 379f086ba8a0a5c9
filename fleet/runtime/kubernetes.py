"""KubernetesRuntime: each model version as a Deployment, Service, PodDisruptionBudget and KEDA
ScaledObject in the models namespace of the EKS cluster (``FLEET_RUNTIME=kubernetes``).

Where a version runs comes from the placement plan that ``infra/`` writes into the ConfigMap
``fleet-runtime`` (keys ``placement.json``, ``images.json``, ``prometheus_url``): GPUs per
replica, node selector and tolerations of its node group, replica bounds, and what the engine
is told in its env (``engine_env``: GPU type, tensor-parallel degree, memory share, KV cache).
The image is the family's ECR repository at the digest recorded for the version (``fleet
package MODEL VERSION --image-digest``, ``fleet.runtime.images``), never a tag: a version with
no recorded digest, or one recorded for another artifact, is refused. KEDA scales between
``max(replicas, min_replicas)`` and ``max_replicas`` on QPS and p99 latency from Prometheus,
so ``deploy(replicas=N)`` raises the floor and waits for N ready pods.

Objects are written with server-side apply (field manager ``serving-fleet``), so a deploy is
idempotent and never fights the HPA over ``spec.replicas`` (which it leaves alone). Endpoints
are the pods' own addresses: the gateway balances and health-checks per replica.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from fleet.catalog.registry import Registry
from fleet.errors import ConfigError, FleetError, InvalidInput, NotFound
from fleet.names import check_name, check_version
from fleet.planning.placement import GPU_RESOURCE, ModelPlacement, PlacementPlan
from fleet.runtime import images
from fleet.runtime.base import DeployFailed, Loaded
from fleet.types import Deployment, ObjectStore

NAMESPACE = "models"
CONFIG_MAP = "fleet-runtime"
FIELD_MANAGER = "serving-fleet"
MANAGED = {"app.kubernetes.io/managed-by": "serving-fleet"}
BENTO_PORT = 3000
# The user `bentoml containerize` images run as: the Dockerfile `bentoml build` writes ends in
# `USER bentoml`, a name the kubelet cannot check against runAsNonRoot, created with
# `ARG BENTO_USER_UID=1034` / `BENTO_USER_GID=1034`. Pods say the numbers (tests read them
# back from a built Bento's Dockerfile).
BENTO_UID = BENTO_GID = 1034
LOADING_LABEL = "fleet.io/loading"  # on a ScaledObject: eager or lazy (infra/admission.py reads it)
VERSION_ANNOTATION = "fleet.io/version"  # the exact semver ('+' is not allowed in label values)
READY_TIMEOUT_S = 900.0  # pulling a large image and loading weights onto GPUs takes minutes
COOLDOWN_S = 300  # KEDA's cooldownPeriod for an eager model (whose floor is at least 1: never scaled to zero)
LAZY_COOLDOWN_S = 60  # a lazy one's: its activity trigger already waited idle_unload_s
ACTIVITY_ONLY = "1000000000"  # the activity trigger's target: never reached, so it never adds replicas
# Kinds this runtime writes, in the order undeploy removes them (the scaler first, so KEDA
# does not scale a Deployment that is going away).
KINDS = (
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("policy/v1", "PodDisruptionBudget"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
)
_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "ScaledObject": "scaledobjects",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Pod": "pods",
    "ConfigMap": "configmaps",
}


class KubeApiError(FleetError):
    status = 502


class KubeApi(Protocol):
    """The few Kubernetes API calls the runtime makes (a fake in tests, HTTP in a cluster)."""

    def apply(self, obj: dict) -> dict:
        """Server-side apply ``obj`` (create or update the fields this manager owns)."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        """The object, or None when it does not exist."""

    def list(self, api_version: str, kind: str, namespace: str, selector: dict[str, str]) -> list[dict]:
        """Objects whose labels match every ``selector`` pair."""

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete; a missing object is not an error."""

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict) -> dict | None:
        """JSON merge patch (RFC 7386); None when the object does not exist."""


def config_map_data(
    plan: PlacementPlan, images: dict[str, str], prometheus_url: str, timeouts_ms: dict[str, int]
) -> dict[str, str]:
    """The data of the ``fleet-runtime`` ConfigMap (written by infra/, read by ``deploy``)."""
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
) -> list[dict]:
    """Deployment, Service, PodDisruptionBudget and ScaledObject of one version (pure)."""
    name, selector = object_name(model, version), {"app.kubernetes.io/instance": object_name(model, version)}
    meta = {
        "name": name,
        "namespace": namespace,
        "labels": labels(model, version),
        "annotations": {VERSION_ANNOTATION: version},
    }
    requests: dict[str, Any] = {"cpu": f"{placement.cpu:g}", "memory": f"{math.ceil(placement.memory_gib * 1024)}Mi"}
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
        ],
        "resources": {"requests": requests, "limits": limits},
        # weights load before /readyz answers: allow up to 15 minutes before liveness counts
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
    pod = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": BENTO_UID,
            "runAsGroup": BENTO_GID,
            "fsGroup": BENTO_GID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
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
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
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


class KubernetesRuntime:
    """``fleet.runtime.base.Runtime`` on EKS: images are built by the pipeline, memory is the
    scheduler's business (no local budget), and a drain is Kubernetes' own (an endpoint leaves
    the Service before its pod is stopped)."""

    kind = "kubernetes"
    budgets_memory = False
    packages_here = False

    def __init__(
        self,
        api: KubeApi,
        store: ObjectStore,
        *,
        namespace: str = NAMESPACE,
        ready_timeout_s: float = READY_TIMEOUT_S,
        poll_s: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``store`` is the fleet's store: manifests and the image digests recorded for them."""
        self.api, self.store, self.namespace = api, store, namespace
        self.ready_timeout_s, self.poll_s, self.sleep, self.clock = ready_timeout_s, poll_s, sleep, clock

    @classmethod
    def from_environment(cls) -> KubernetesRuntime:
        from fleet.store import open_store

        return cls(
            HttpKubeApi.from_environment(), open_store(), namespace=os.environ.get("FLEET_KUBE_NAMESPACE", NAMESPACE)
        )

    def _settings(self) -> tuple[dict[str, ModelPlacement], dict[str, str], str, dict[str, int]]:
        """(placements, family → image repository, Prometheus URL, model → timeout) from infra's ConfigMap."""
        cm = self.api.get("v1", "ConfigMap", self.namespace, CONFIG_MAP)
        if cm is None:
            raise ConfigError(
                f"ConfigMap {self.namespace}/{CONFIG_MAP} not found; it is created by `pulumi up` (infra/)"
            )
        data = cm.get("data") or {}
        try:
            placement = json.loads(data["placement.json"])
            placements = {m["model"]: placement_from_dict(m) for m in placement["models"]}
            return (
                placements,
                json.loads(data["images.json"]),
                data["prometheus_url"],
                json.loads(data["timeouts.json"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"ConfigMap {self.namespace}/{CONFIG_MAP} is malformed ({type(exc).__name__}: {exc}); "
                "expected the keys of fleet.runtime.kubernetes.config_map_data, as infra/ writes them"
            ) from None

    def deploy(self, model: str, version: str, replicas: int = 1) -> Deployment:
        check_name("model", model)
        check_version(version)
        placements, repositories, prometheus, timeouts = self._settings()
        placement = placements.get(model)
        if placement is None:
            raise NotFound(
                f"model {model!r} is not in this cluster's placement plan ({', '.join(sorted(placements)) or 'empty'}); "
                "add it to the stack's models and run pulumi up"
            )
        if not 1 <= replicas <= placement.max_replicas:
            raise InvalidInput(
                f"replicas must be 1..{placement.max_replicas} (max_replicas of {model}), got {replicas}"
            )
        repository = repositories.get(placement.family)
        if repository is None:
            raise ConfigError(
                f"no image repository for family {placement.family!r} of {model} in {CONFIG_MAP}/images.json"
            )
        floor = max(replicas, placement.min_replicas)
        image = images.reference(self.store, Registry(self.store).get(model, version), repository)
        for obj in manifests(
            model,
            version,
            image,
            placement,
            floor=floor,
            prometheus_url=prometheus,
            namespace=self.namespace,
            timeout_ms=timeouts.get(model, 5000),
        ):
            self.api.apply(obj)
        return Deployment(model, version, self._wait_ready(model, version, floor))

    def _wait_ready(self, model: str, version: str, want: int) -> tuple[str, ...]:
        deadline = self.clock() + self.ready_timeout_s
        while True:
            ready = tuple(url for url, ok in self.health(model, version).items() if ok)
            if len(ready) >= want:
                return ready
            if self.clock() >= deadline:
                raise DeployFailed(
                    f"{model}:{version} has {len(ready)} of {want} replicas ready after "
                    f"{self.ready_timeout_s:.0f} s{self._why_pending(model, version)}",
                    summary=f"its replicas were not ready within {self.ready_timeout_s:.0f} s",
                )
            self.sleep(self.poll_s)

    def _why_pending(self, model: str, version: str) -> str:
        """What the scheduler or kubelet says about the pods that are not ready (for the error):
        unmet conditions, and why the container waits or last ended (an image that cannot be
        pulled, a service that refused its model files: the end of its log, see
        ``terminationMessagePolicy``)."""
        reasons = []
        for pod in self._pods(model, version):
            name, status = pod["metadata"]["name"], pod.get("status") or {}
            for cond in status.get("conditions") or []:
                if cond.get("status") != "True" and cond.get("message"):
                    reasons.append(f"{name}: {cond['type']}: {cond['message']}")
            for container in status.get("containerStatuses") or []:
                if container.get("ready"):
                    continue
                waiting = (container.get("state") or {}).get("waiting") or {}
                ended = (container.get("lastState") or {}).get("terminated") or {}
                if waiting.get("reason") or ended:
                    said = (ended.get("message") or "").strip().splitlines()
                    reasons.append(
                        f"{name}: {waiting.get('reason') or 'restarted'}"
                        + (f": {waiting['message']}" if waiting.get("message") else "")
                        + (f"; exited {ended.get('exitCode')}: {said[-1]}" if said else "")
                    )
        return "; " + "; ".join(sorted(set(reasons))[:5]) if reasons else ""

    def _pods(self, model: str, version: str) -> list[dict]:
        selector = {"app.kubernetes.io/instance": object_name(model, version)}
        return self.api.list("v1", "Pod", self.namespace, selector)

    def activate(
        self, model: str, version: str, before_start: Callable[[], None] | None = None
    ) -> tuple[Deployment, bool]:
        """A lazy version's ready pods, scaling it from zero first (``fleet.gateway.activate``),
        and whether this call scaled it.

        Raises the ScaledObject's floor to 1 with a merge patch of ``minReplicaCount`` alone —
        all the gateway's Role may do there (``patch scaledobjects``, and the admission policy
        ``fleet-gateway-scaling`` refuses any other change it makes) — so KEDA scales the
        Deployment up at once and cannot take the starting pod away for want of traffic;
        ``unload`` (the idle-unload flow) sets it back to 0. ``before_start`` is not called:
        the cluster's scheduler and autoscaler find room, not a local budget.
        """
        check_name("model", model)
        check_version(version)
        ready = tuple(url for url, ok in self.health(model, version).items() if ok)
        if ready:
            return Deployment(model, version, ready), False
        name = object_name(model, version)
        if (
            self.api.patch("keda.sh/v1alpha1", "ScaledObject", self.namespace, name, {"spec": {"minReplicaCount": 1}})
            is None
        ):
            raise DeployFailed(
                f"{model}:{version} is not deployed in namespace {self.namespace} (no ScaledObject {name}); "
                f"expected `fleet deploy {model} {version}` once: a lazy version then scales to zero when idle",
                summary="it is not deployed in the cluster",
            )
        return Deployment(model, version, self._wait_ready(model, version, 1)), True

    def footprint_mib(self, model: str, version: str) -> float | None:
        """Not measured here: requests and limits are the scheduler's, not a local budget's."""
        return None

    def unload(self, versions: list[tuple[str, str]], on_drain: Callable[[], object] = lambda: None) -> None:
        """Let KEDA scale the versions to zero: each floor goes to 0, and KEDA removes the last
        pod once no trigger has been active for its cooldown. The objects stay, so ``activate``
        brings a version back with one patch."""
        for model, version in versions:
            self.api.patch(
                "keda.sh/v1alpha1",
                "ScaledObject",
                self.namespace,
                object_name(model, version),
                {"spec": {"minReplicaCount": 0}},
            )
        on_drain()

    def undeploy(self, model: str, version: str) -> None:
        for api_version, kind in KINDS:
            self.api.delete(api_version, kind, self.namespace, object_name(model, version))

    def list(self) -> list[Deployment]:
        # two calls however many versions run: the gateway asks often
        by_instance: dict[str, list[dict]] = {}
        for pod in self.api.list("v1", "Pod", self.namespace, MANAGED):
            by_instance.setdefault(pod["metadata"].get("labels", {}).get("app.kubernetes.io/instance", ""), []).append(
                pod
            )
        found = []
        for d in self.api.list("apps/v1", "Deployment", self.namespace, MANAGED):
            meta = d["metadata"]
            model, version = meta["labels"]["fleet.io/model"], meta["annotations"][VERSION_ANNOTATION]
            urls = tuple(url for url, ok in _endpoints(by_instance.get(meta["name"], [])).items() if ok)
            if urls:
                found.append(Deployment(model, version, urls))
        return sorted(found, key=lambda d: (d.model, d.version))

    def health(self, model: str, version: str) -> dict[str, bool]:
        return _endpoints(self._pods(model, version))

    def loaded(self) -> list[Loaded]:
        """Versions with ready pods, for the idle clock (``fleet.control.lazy``): ``ready_at`` is the
        newest pod's start, so a version just woken is not idle; memory is not measured here."""
        from datetime import datetime

        started: dict[str, float] = {}
        for pod in self.api.list("v1", "Pod", self.namespace, MANAGED):
            at = (pod.get("status") or {}).get("startTime")
            instance = pod["metadata"].get("labels", {}).get("app.kubernetes.io/instance", "")
            if at:
                with contextlib.suppress(ValueError):
                    started[instance] = max(
                        started.get(instance, 0.0), datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
                    )
        out = []
        for d in self.list():
            scaler = self.api.get("keda.sh/v1alpha1", "ScaledObject", self.namespace, object_name(d.model, d.version))
            if scaler is not None and (scaler.get("spec") or {}).get("minReplicaCount") == 0:
                continue  # already unloaded: KEDA removes its pods once its triggers are quiet
            out.append(
                Loaded(
                    d.model, d.version, len(d.endpoints), 0.0, started.get(object_name(d.model, d.version), time.time())
                )
            )
        return out


def _endpoints(pods: list[dict]) -> dict[str, bool]:
    """Pod URL → ready, for pods that have an address and are not being deleted."""
    result = {}
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
            result[f"http://{status['podIP']}:{BENTO_PORT}"] = ready
    return dict(sorted(result.items()))


def placement_from_dict(raw: dict) -> ModelPlacement:
    """A ModelPlacement from its JSON form in placement.json (Plan.to_dict)."""
    fields = {k: raw[k] for k in ModelPlacement.__dataclass_fields__ if k in raw}
    fields["isolated_for"] = tuple(fields.get("isolated_for", ()))
    if "triggers" in fields:
        fields["triggers"] = tuple(fields["triggers"])
    return ModelPlacement(**fields)


def _path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{_PLURALS[kind]}" + (f"/{name}" if name else "")


class HttpKubeApi:
    """The Kubernetes REST API over httpx: in a pod with its service-account token, or at
    ``FLEET_KUBE_API`` (e.g. ``kubectl proxy``'s http://127.0.0.1:8001, which authenticates)."""

    TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    CA = Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")

    def __init__(
        self,
        base_url: str,
        *,
        token: Callable[[], str | None] = lambda: None,
        verify: Any = True,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.token = token
        self.client = httpx.Client(
            base_url=base_url, verify=verify, timeout=httpx.Timeout(10.0, connect=5.0), transport=transport
        )

    @classmethod
    def from_environment(cls) -> HttpKubeApi:
        if url := os.environ.get("FLEET_KUBE_API"):
            return cls(url, token=lambda: os.environ.get("FLEET_KUBE_TOKEN"))
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError(
                "FLEET_RUNTIME=kubernetes needs to run in a pod, or FLEET_KUBE_API set to the API "
                "server's URL (for example `kubectl proxy` at http://127.0.0.1:8001)"
            )
        # projected tokens rotate: read the file for every request
        return cls(f"https://{host}:{port}", token=lambda: cls.TOKEN.read_text().strip(), verify=str(cls.CA))

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        headers = kwargs.pop("headers", {})
        if token := self.token():
            headers["Authorization"] = f"Bearer {token}"
        try:
            response = self.client.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise KubeApiError(f"Kubernetes API {method} {path}: {type(exc).__name__}: {exc}") from None
        if response.status_code == 404:
            return None
        if response.is_error:
            try:
                message = response.json().get("message") or response.text
            except ValueError:
                message = response.text
            raise KubeApiError(
                f"Kubernetes API {method} {path}: {response.status_code} {response.reason_phrase}: {message}"
            )
        return response

    def apply(self, obj: dict) -> dict:
        meta = obj["metadata"]
        path = _path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        response = self._send(
            "PATCH",
            path,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        if response is None:  # 404 on apply: the kind itself is missing (KEDA not installed?)
            raise KubeApiError(f"Kubernetes API has no {obj['kind']} ({obj['apiVersion']}) in {meta['namespace']}")
        return response.json()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        response = self._send("GET", _path(api_version, kind, namespace, name))
        return None if response is None else response.json()

    def list(self, api_version: str, kind: str, namespace: str, selector: dict[str, str]) -> list[dict]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))}
        response = self._send("GET", _path(api_version, kind, namespace), params=params)
        return [] if response is None else response.json().get("items", [])

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self._send("DELETE", _path(api_version, kind, namespace, quote(name)), json={"propagationPolicy": "Background"})

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict) -> dict | None:
        response = self._send(
            "PATCH",
            _path(api_version, kind, namespace, quote(name)),
            content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return None if response is None else response.json()
