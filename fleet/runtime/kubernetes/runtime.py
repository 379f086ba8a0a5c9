"""KubernetesRuntime: each model version as a Deployment, Service, PodDisruptionBudget and KEDA
ScaledObject in the models namespace of the EKS cluster (``FLEET_RUNTIME=kubernetes``).

What is written is ``fleet.runtime.kubernetes.manifests``, from the placement of the
``fleet-runtime`` ConfigMap that ``infra/`` writes; the API calls are
``fleet.runtime.kubernetes.api``. The image is the family's ECR repository at the digest
recorded for the version (``fleet package MODEL VERSION --image-digest``,
``fleet.runtime.images``), never a tag: a version with no recorded digest, or one recorded for
another artifact, is refused. KEDA scales between ``max(replicas, min_replicas)`` and
``max_replicas``, so ``deploy(replicas=N)`` raises the floor and waits for N ready pods.
Endpoints are the pods' own addresses: the gateway balances and health-checks per replica.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable

from fleet.catalog.registry import Registry
from fleet.errors import ConfigError, InvalidInput, NotFound
from fleet.names import check_name, check_version
from fleet.planning.placement import ModelPlacement
from fleet.runtime import images
from fleet.runtime.base import DeployFailed, Loaded
from fleet.runtime.kubernetes.api import HttpKubeApi, KubeApi
from fleet.runtime.kubernetes.manifests import (
    BENTO_PORT,
    CONFIG_MAP,
    MANAGED,
    NAMESPACE,
    VERSION_ANNOTATION,
    manifests,
    object_name,
    placement_from_dict,
)
from fleet.runtime.kubernetes.node_cache import cache_budget_bytes
from fleet.types import Deployment, ObjectStore

READY_TIMEOUT_S = 900.0  # fetching weights into the node cache and loading them onto GPUs takes minutes
# Kinds this runtime writes, in the order undeploy removes them (the scaler first, so KEDA
# does not scale a Deployment that is going away).
KINDS = (
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("policy/v1", "PodDisruptionBudget"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
)


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
                "expected the keys of fleet.runtime.kubernetes.manifests.config_map_data, as infra/ writes them"
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
            store_url=self.store.url,  # the replica fetches its weights from the fleet's store
            cache_bytes=cache_budget_bytes(placements.values(), placement.node_group),
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

    def release(self, model: str, version: str) -> None:
        """The version's floor back to what a deploy of one replica writes (``max(1,
        min_replicas)``): a merge patch of the ScaledObject's ``minReplicaCount`` and the
        PodDisruptionBudget's ``minAvailable``, so KEDA scales it by load again, after its
        cooldown (nothing is taken away at once). A lazy version's idle clock lowers it to 0
        later, as after any wake. A version no longer deployed is left alone."""
        check_name("model", model)
        check_version(version)
        placement = self._settings()[0].get(model)
        if placement is None:
            return
        name, floor = object_name(model, version), max(1, placement.min_replicas)
        scaler = {"spec": {"minReplicaCount": floor}}
        if self.api.patch("keda.sh/v1alpha1", "ScaledObject", self.namespace, name, scaler) is None:
            return
        budget = {"spec": {"minAvailable": floor, "maxUnavailable": None}}  # a lazy version's may hold the latter
        self.api.patch("policy/v1", "PodDisruptionBudget", self.namespace, name, budget)

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
