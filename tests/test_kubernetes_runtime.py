"""KubernetesRuntime against a fake API client: the objects it writes (each validated against
the Kubernetes and CRD schemas), images by recorded digest only, readiness waits, listing,
undeploy; and its HTTP client against a fake API transport."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
from k8s_schemas import validate

from fleet.catalog.policies.loader import load_policies
from fleet.catalog.registry import Registry
from fleet.errors import ConfigError, IntegrityError, InvalidInput, NotFound
from fleet.planning.placement import GPU_RESOURCE, MODEL_NODE_TOLERATION
from fleet.planning.planner import plan
from fleet.planning.stack import placement_inputs, read_stack_file
from fleet.runtime import images, open_runtime
from fleet.runtime.base import DeployFailed
from fleet.runtime.kubernetes.api import FIELD_MANAGER, HttpKubeApi, KubeApiError
from fleet.runtime.kubernetes.manifests import CONFIG_MAP, NAMESPACE, config_map_data, object_name
from fleet.runtime.kubernetes.runtime import KubernetesRuntime
from fleet.store import MemoryStore
from fleet.types import ObjectStore
from tests.test_registry import META

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = "http://kps-prometheus.monitoring.svc:9090"
IMAGES = {
    "llm": "123456789012.dkr.ecr.us-east-1.amazonaws.com/serving-fleet-prod/llm",
    "text-embed": "123456789012.dkr.ecr.us-east-1.amazonaws.com/serving-fleet-prod/text-embed",
    "tabular-mlp": "123456789012.dkr.ecr.us-east-1.amazonaws.com/serving-fleet-prod/tabular-mlp",
}


@pytest.fixture(scope="module")
def prod_plan():  # noqa: ANN201
    """The placement of the prod example stack, as infra/ writes it into the cluster."""
    policies = load_policies(ROOT / "policies")
    return plan(policies, *placement_inputs(read_stack_file(ROOT / "Pulumi.prod.yaml"), "prod", policies)), policies


class FakeKube:
    """The API server, as far as the runtime sees it; every applied object is schema-checked."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.calls: list[tuple[str, str, str]] = []

    def apply(self, obj: dict) -> dict:
        validate(obj)
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.calls.append(("apply", *key[::2]))
        self.objects[key] = copy.deepcopy(obj)
        return obj

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def list(self, api_version: str, kind: str, namespace: str, selector: dict[str, str]) -> list[dict]:
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in sorted(self.objects.items())
            if k == kind
            and ns == namespace
            and all(o["metadata"].get("labels", {}).get(a) == b for a, b in selector.items())
        ]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.calls.append(("delete", kind, name))
        self.objects.pop((kind, namespace, name), None)

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict) -> dict | None:
        """A JSON merge patch (two levels deep is all the runtime sends; null removes a key), the
        result schema-checked."""
        self.calls.append(("patch", kind, name))
        obj = self.objects.get((kind, namespace, name))
        if obj is None:
            return None
        for key, value in patch.items():
            if isinstance(value, dict):
                merged = {**obj.get(key, {}), **value}
                obj[key] = {k: v for k, v in merged.items() if v is not None}
            else:
                obj[key] = value
        validate(obj)
        return copy.deepcopy(obj)

    # -- what the controllers would do --------------------------------------------------------

    def pods(self, model: str, version: str, ready: int, pending: str | None = None) -> None:
        """Give the version's Deployment ``ready`` ready pods (and one pending, if given why)."""
        deployment = self.objects[("Deployment", NAMESPACE, object_name(model, version))]
        template = deployment["spec"]["template"]
        for i in range(ready + (1 if pending else 0)):
            ok = i < ready
            name = f"{deployment['metadata']['name']}-{i}"
            if ok:
                status = {"podIP": f"10.0.{len(model)}.{i + 10}", "conditions": [{"type": "Ready", "status": "True"}]}
            else:
                status = {
                    "conditions": [
                        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": pending}
                    ]
                }
            self.objects[("Pod", NAMESPACE, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "spec": template["spec"],
                "status": status,
                "metadata": {"name": name, "namespace": NAMESPACE, "labels": template["metadata"]["labels"]},
            }

    def scale_up(self) -> None:
        """KEDA and the scheduler: every Deployment gets its ScaledObject's floor of ready pods."""
        for (kind, _, _name), scaler in list(self.objects.items()):
            if kind == "ScaledObject":
                labels = scaler["metadata"]["labels"]
                version = scaler["metadata"]["annotations"]["fleet.io/version"]
                self.pods(labels["fleet.io/model"], version, ready=scaler["spec"]["minReplicaCount"])


@pytest.fixture
def kube(prod_plan, fleet_store: ObjectStore) -> FakeKube:  # noqa: ANN001
    result, policies = prod_plan
    fake = FakeKube()
    fake.store = fleet_store  # the fleet's store, beside the cluster: manifests and image digests
    timeouts = {m: policies.models[m].timeout_ms for m in policies.models}
    fake.objects[("ConfigMap", NAMESPACE, CONFIG_MAP)] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIG_MAP, "namespace": NAMESPACE},
        "data": config_map_data(result, IMAGES, PROMETHEUS, timeouts),
    }
    validate(fake.objects[("ConfigMap", NAMESPACE, CONFIG_MAP)])
    return fake


# What the tests deploy, each registered with its image built, pushed and its digest recorded.
VERSIONS = (
    ("llm-70b", "1.0.0"),
    ("llm-7b", "1.0.0"),
    ("llm-7b", "2.0.0"),
    ("embed-small", "1.0.0"),
    ("demo-classifier", "1.0.0"),
)


def digest_of(model: str, version: str) -> str:
    return "sha256:" + hashlib.sha256(f"image of {model}:{version}".encode()).hexdigest()


@pytest.fixture
def fleet_store(tmp_path_factory: pytest.TempPathFactory) -> ObjectStore:
    store = MemoryStore()
    registry = Registry(store)
    for model, version in VERSIONS:
        folder = tmp_path_factory.mktemp("artifact")
        (folder / "model.pt").write_text(f"weights of {model}:{version}")
        mv = registry.register(model, version, folder, META)
        images.record(store, mv, digest_of(model, version), f"{model}:{version}", who="ci")
    return store


def runtime(kube: FakeKube, on_sleep=None, timeout_s: float = 60.0) -> KubernetesRuntime:  # noqa: ANN001
    """A runtime whose waits advance a fake clock; ``on_sleep(n)`` plays the controllers."""
    now = [0.0]
    sleeps = [0]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        sleeps[0] += 1
        if on_sleep:
            on_sleep(sleeps[0])

    return KubernetesRuntime(kube, kube.store, ready_timeout_s=timeout_s, poll_s=5, sleep=sleep, clock=lambda: now[0])


def objects_of(kube: FakeKube, model: str, version: str) -> dict[str, dict]:
    name = object_name(model, version)
    return {k: o for (k, _, n), o in kube.objects.items() if n == name}


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    (tmp_path / "model.pt").write_bytes(b"weights")
    return tmp_path


# --- deploy ---------------------------------------------------------------------------------


def test_deploy_writes_a_gpu_deployment_from_the_placement_and_waits_for_ready_pods(kube: FakeKube) -> None:
    rt = runtime(kube, on_sleep=lambda n: n == 2 and kube.pods("llm-70b", "1.0.0", ready=1))
    deployment = rt.deploy("llm-70b", "1.0.0")
    assert deployment.endpoints == ("http://10.0.7.10:3000",)
    objs = objects_of(kube, "llm-70b", "1.0.0")
    assert set(objs) == {"Deployment", "Service", "PodDisruptionBudget", "ScaledObject"}
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    (bento,) = pod["containers"]
    assert bento["image"] == IMAGES["llm"] + "@" + digest_of("llm-70b", "1.0.0")  # by digest, never a tag
    assert bento["resources"]["limits"][GPU_RESOURCE] == bento["resources"]["requests"][GPU_RESOURCE] == "8"  # TP 8
    assert {"name": "FLEET_TENSOR_PARALLEL", "value": "8"} in bento["env"]
    assert pod["nodeSelector"] == {"fleet.io/node-group": "a100-8"}
    assert pod["tolerations"] == [
        MODEL_NODE_TOLERATION,
        {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert (
        bento["readinessProbe"]["httpGet"]["path"] == "/readyz"
        and bento["livenessProbe"]["httpGet"]["path"] == "/livez"
    )
    assert bento["startupProbe"]["failureThreshold"] * bento["startupProbe"]["periodSeconds"] == 900
    assert bento["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert pod["terminationGracePeriodSeconds"] == 60 + 15  # llm-70b's timeout_ms is 60000
    assert "replicas" not in objs["Deployment"]["spec"]  # the HPA owns it
    scaler = objs["ScaledObject"]["spec"]
    assert (scaler["minReplicaCount"], scaler["maxReplicaCount"]) == (1, 2)
    qps, p99 = scaler["triggers"]
    assert qps["metadata"]["threshold"] == "1" and qps["metricType"] == "AverageValue"
    assert 'fleet_version_requests_total{model="llm-70b",version="1.0.0"}' in qps["metadata"]["query"]
    assert p99["metadata"]["threshold"] == "15000" and p99["metricType"] == "Value"
    assert p99["metadata"]["serverAddress"] == PROMETHEUS


def test_an_isolated_model_tolerates_its_dedicated_taint_and_a_shared_one_gets_a_slice(kube: FakeKube) -> None:
    rt = runtime(kube, on_sleep=lambda n: kube.scale_up())
    rt.deploy("llm-7b", "2.0.0")
    rt.deploy("embed-small", "1.0.0")
    llm = objects_of(kube, "llm-7b", "2.0.0")["Deployment"]["spec"]["template"]["spec"]
    assert llm["nodeSelector"] == {"fleet.io/node-group": "a10g-1-llm-7b"}
    assert {"key": "fleet.io/dedicated", "operator": "Equal", "value": "llm-7b", "effect": "NoSchedule"} in llm[
        "tolerations"
    ]
    embed = objects_of(kube, "embed-small", "1.0.0")["Deployment"]["spec"]["template"]["spec"]
    assert embed["containers"][0]["resources"]["limits"][GPU_RESOURCE] == "1"  # one time-sliced share
    assert embed["nodeSelector"] == {"fleet.io/node-group": "a10g-1"}


def test_cpu_model_asks_for_no_gpu_and_tolerates_only_the_model_node_taint(kube: FakeKube) -> None:
    rt = runtime(kube, on_sleep=lambda n: kube.scale_up())
    assert len(rt.deploy("demo-classifier", "1.0.0", replicas=2).endpoints) == 2
    spec = objects_of(kube, "demo-classifier", "1.0.0")["Deployment"]["spec"]["template"]["spec"]
    assert GPU_RESOURCE not in spec["containers"][0]["resources"]["limits"]
    assert spec["tolerations"] == [MODEL_NODE_TOLERATION]  # a model node, not a GPU one


def test_replicas_raise_the_scaling_floor_within_the_policy_bounds(kube: FakeKube) -> None:
    rt = runtime(kube, on_sleep=lambda n: kube.scale_up())
    rt.deploy("llm-7b", "1.0.0", replicas=3)
    assert objects_of(kube, "llm-7b", "1.0.0")["ScaledObject"]["spec"]["minReplicaCount"] == 3
    with pytest.raises(InvalidInput, match=r"replicas must be 1..4 \(max_replicas of llm-7b\), got 5"):
        rt.deploy("llm-7b", "1.0.0", replicas=5)


def test_release_hands_a_raised_floor_back_to_keda_and_the_disruption_budget(kube: FakeKube) -> None:
    """Blue-green raises a floor (green started at blue's count, blue held through the bake);
    release puts both the scaler's and the PodDisruptionBudget's back to what a one-replica
    deploy writes, and leaves the Deployment's own count to KEDA (no replica taken at once)."""
    rt = runtime(kube, on_sleep=lambda n: kube.scale_up())
    rt.deploy("llm-7b", "1.0.0", replicas=3)
    one = objects_of(kube, "llm-7b", "1.0.0")
    assert (
        one["ScaledObject"]["spec"]["minReplicaCount"] == 3 and one["PodDisruptionBudget"]["spec"]["minAvailable"] == 3
    )
    deployment = copy.deepcopy(one["Deployment"])
    kube.calls.clear()
    rt.release("llm-7b", "1.0.0")
    after = objects_of(kube, "llm-7b", "1.0.0")
    assert (
        after["ScaledObject"]["spec"]["minReplicaCount"] == 1
        and after["PodDisruptionBudget"]["spec"]["minAvailable"] == 1
    )
    assert after["Deployment"] == deployment and [c[0] for c in kube.calls] == ["patch", "patch"]  # merge patches only
    pdb = kube.objects[("PodDisruptionBudget", NAMESPACE, object_name("llm-7b", "1.0.0"))]["spec"]
    pdb.pop("minAvailable")
    pdb["maxUnavailable"] = 1  # as a lazy version's is written: the release replaces one with the other
    rt.release("llm-7b", "1.0.0")
    assert objects_of(kube, "llm-7b", "1.0.0")["PodDisruptionBudget"]["spec"]["minAvailable"] == 1
    assert "maxUnavailable" not in objects_of(kube, "llm-7b", "1.0.0")["PodDisruptionBudget"]["spec"]
    rt.release("llm-7b", "9.9.9")  # not deployed: nothing to release, and no error
    assert ("PodDisruptionBudget", NAMESPACE, object_name("llm-7b", "9.9.9")) not in kube.objects


def test_deploy_is_idempotent(kube: FakeKube) -> None:
    rt = runtime(kube, on_sleep=lambda n: kube.scale_up())
    rt.deploy("embed-small", "1.0.0")
    first = copy.deepcopy(objects_of(kube, "embed-small", "1.0.0"))
    assert rt.deploy("embed-small", "1.0.0").endpoints  # already ready: no wait
    assert objects_of(kube, "embed-small", "1.0.0") == first


def test_a_deploy_that_never_gets_ready_says_why(kube: FakeKube) -> None:
    why = "0/6 nodes are available: 6 Insufficient nvidia.com/gpu."
    rt = runtime(kube, on_sleep=lambda n: n == 1 and kube.pods("llm-70b", "1.0.0", ready=0, pending=why), timeout_s=30)
    with pytest.raises(
        DeployFailed, match=r"llm-70b:1.0.0 has 0 of 1 replicas ready after 30 s; .*PodScheduled: 0/6 nodes"
    ):
        rt.deploy("llm-70b", "1.0.0")


def test_a_version_without_a_recorded_image_digest_is_refused_before_anything_is_written(
    kube: FakeKube, artifact
) -> None:  # noqa: ANN001
    mv = Registry(kube.store).register("embed-small", "3.0.0", artifact, META)
    with pytest.raises(
        NotFound,
        match=r"no image digest is recorded for embed-small:3.0.0; Kubernetes deploys model images by "
        r"digest only\. .*bentoml containerize embed-small:3.0.0 -t "
        + IMAGES["text-embed"]
        + r":embed-small-3\.0\.0.*fleet package embed-small 3\.0\.0 --image-digest sha256:",
    ):
        runtime(kube).deploy("embed-small", "3.0.0")
    assert not [c for c in kube.calls if c[0] == "apply"]
    with pytest.raises(NotFound, match="model version embed-small:9.9.9 is not registered"):
        runtime(kube).deploy("embed-small", "9.9.9")
    stale = mv.model_copy(update={"files": {"other.pt": mv.files["model.pt"]}})  # a record made for another artifact
    images.record(kube.store, stale, digest_of("embed-small", "3.0.0"), "embed-small:3.0.0")
    with pytest.raises(
        IntegrityError,
        match=rf"image recorded for embed-small:3.0.0 .* was built from artifact {stale.artifact_sha256}, "
        rf"but the manifest's artifact is {mv.artifact_sha256}",
    ):
        runtime(kube).deploy("embed-small", "3.0.0")
    assert not [c for c in kube.calls if c[0] == "apply"]


def test_a_recorded_digest_deploys_and_a_new_record_rolls_the_pods(kube: FakeKube, artifact) -> None:  # noqa: ANN001
    mv = Registry(kube.store).register("embed-small", "4.0.0", artifact, META)
    images.record(kube.store, mv, digest_of("embed-small", "4.0.0"), "embed-small:4.0.0")
    rt = runtime(kube, on_sleep=lambda n: kube.scale_up())
    rt.deploy("embed-small", "4.0.0")
    container = objects_of(kube, "embed-small", "4.0.0")["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"{IMAGES['text-embed']}@{digest_of('embed-small', '4.0.0')}"
    rebuilt = "sha256:" + "0f" * 32  # the same artifact, rebuilt on a patched base image
    images.record(kube.store, mv, rebuilt, "embed-small:4.0.0")
    rt.deploy("embed-small", "4.0.0")
    container = objects_of(kube, "embed-small", "4.0.0")["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"{IMAGES['text-embed']}@{rebuilt}"


def test_a_pod_whose_model_files_fail_their_check_never_turns_ready_and_the_deploy_says_why(kube: FakeKube) -> None:
    refusal = (
        "integrity.ArtifactMismatch: model files in /home/bentoml/bento/models/embed-small/1.0.0 do not match the "
        f"manifest, refusing to load them: model.pt: expected sha256 {'a' * 64} (7 bytes), got {'b' * 64} (7 bytes)"
    )

    def crash_loop(n: int) -> None:
        kube.pods("embed-small", "1.0.0", ready=0, pending="containers with unready status: [bento]")
        (pod,) = [
            o
            for (k, _, name), o in kube.objects.items()
            if k == "Pod" and name.startswith(object_name("embed-small", "1.0.0"))
        ]
        pod["status"]["containerStatuses"] = [
            {
                "name": "bento",
                "ready": False,
                "restartCount": n,
                "image": "x",
                "imageID": "",
                "started": False,
                "state": {
                    "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}
                },
                "lastState": {
                    "terminated": {"exitCode": 1, "reason": "Error", "message": f"Traceback ...\n{refusal}\n"}
                },
            }
        ]

    with pytest.raises(
        DeployFailed,
        match=r"embed-small:1.0.0 has 0 of 1 replicas ready after 30 s; .*CrashLoopBackOff: back-off "
        r"40s restarting failed container; exited 1: integrity.ArtifactMismatch: .*model.pt: "
        rf"expected sha256 {'a' * 64} \(7 bytes\), got {'b' * 64}",
    ):
        runtime(kube, on_sleep=crash_loop, timeout_s=30).deploy("embed-small", "1.0.0")
    container = objects_of(kube, "embed-small", "1.0.0")["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"  # the kubelet keeps the log's end


def test_unknown_model_and_missing_cluster_config_are_clear(kube: FakeKube) -> None:
    with pytest.raises(NotFound, match="model 'nope' is not in this cluster's placement plan"):
        runtime(kube).deploy("nope", "1.0.0")
    del kube.objects[("ConfigMap", NAMESPACE, CONFIG_MAP)]
    with pytest.raises(ConfigError, match="ConfigMap models/fleet-runtime not found; it is created by `pulumi up`"):
        runtime(kube).deploy("llm-7b", "1.0.0")


# --- list, health, undeploy -----------------------------------------------------------------


def test_list_and_health_report_ready_pods_only(kube: FakeKube) -> None:
    rt = runtime(kube, on_sleep=lambda n: kube.scale_up())
    rt.deploy("embed-small", "1.0.0")
    kube.pods("embed-small", "1.0.0", ready=1, pending="pulling image")  # a second pod, not ready yet
    health = rt.health("embed-small", "1.0.0")
    assert list(health.values()) == [True]  # the pending pod has no IP yet: not an endpoint
    rt_list = rt.list()
    assert [(d.model, d.version, d.endpoints) for d in rt_list] == [("embed-small", "1.0.0", tuple(health))]
    assert rt.health("embed-small", "9.9.9") == {}


def test_undeploy_removes_the_scaler_first_and_tolerates_missing_objects(kube: FakeKube) -> None:
    rt = runtime(kube, on_sleep=lambda n: kube.scale_up())
    rt.deploy("embed-small", "1.0.0")
    rt.undeploy("embed-small", "1.0.0")
    rt.undeploy("embed-small", "1.0.0")
    deletes = [c[1] for c in kube.calls if c[0] == "delete"]
    assert deletes[:4] == ["ScaledObject", "PodDisruptionBudget", "Deployment", "Service"]
    assert not {"Deployment", "Service", "PodDisruptionBudget", "ScaledObject"} & set(
        objects_of(kube, "embed-small", "1.0.0")
    )


# --- names, schemas, factory ----------------------------------------------------------------


def test_object_names_are_dns_labels_unique_per_exact_version() -> None:
    a, b = object_name("demo", "1.2.0-rc.1"), object_name("demo", "1.2.0-rc-1")
    assert a != b and a.startswith("demo-1-2-0-rc-1-")
    long = object_name("m" * 63, "1.0.0-" + "x" * 80)
    assert len(long) <= 63 and long[0].isalpha()
    assert object_name("9lives", "1.0.0").startswith("m-9lives-")


def test_the_schema_check_has_teeth() -> None:
    good = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": 80}]}}
    validate(good)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate({**good, "spec": {"ports": [{"port": 80, "targetPrt": 8000}]}})
    scaler = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "cpu", "metadata": {"value": "50"}}]},
    }
    validate(scaler)
    with pytest.raises(jsonschema.ValidationError):
        validate({**scaler, "spec": {**scaler["spec"], "minReplicas": 1}})  # the field is minReplicaCount


def test_factory_opens_the_kubernetes_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("FLEET_KUBE_API", raising=False)
    with pytest.raises(ConfigError, match="needs to run in a pod, or FLEET_KUBE_API"):
        open_runtime("kubernetes")
    monkeypatch.setenv("FLEET_KUBE_API", "http://127.0.0.1:8001")
    assert isinstance(open_runtime("kubernetes"), KubernetesRuntime)


# --- the HTTP client ------------------------------------------------------------------------


def test_http_client_speaks_server_side_apply_and_maps_errors() -> None:
    seen: list[httpx.Request] = []

    def api(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "GET" and request.url.path.endswith("/deployments/missing"):
            return httpx.Response(404, json={"kind": "Status", "message": "not found"})
        if request.method == "DELETE":
            return httpx.Response(404, json={"kind": "Status"})
        if request.url.path.endswith("/scaledobjects/denied"):
            return httpx.Response(
                403, json={"kind": "Status", "message": 'scaledobjects.keda.sh "denied" is forbidden'}
            )
        if request.method == "GET":
            return httpx.Response(200, json={"items": [{"metadata": {"name": "p"}}]})
        return httpx.Response(200, json=json.loads(request.content))

    client = HttpKubeApi("https://k8s.test", token=lambda: "tok", transport=httpx.MockTransport(api))
    obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "models"}}
    assert client.apply(obj) == obj
    patch = seen[-1]
    assert (patch.method, patch.url.path) == ("PATCH", "/apis/apps/v1/namespaces/models/deployments/d")
    assert patch.url.params["fieldManager"] == FIELD_MANAGER and patch.url.params["force"] == "true"
    assert patch.headers["content-type"] == "application/apply-patch+yaml"
    assert patch.headers["authorization"] == "Bearer tok"
    assert client.get("apps/v1", "Deployment", "models", "missing") is None
    assert client.list("v1", "Pod", "models", {"b": "2", "a": "1"}) == [{"metadata": {"name": "p"}}]
    assert seen[-1].url.path == "/api/v1/namespaces/models/pods" and seen[-1].url.params["labelSelector"] == "a=1,b=2"
    client.delete("v1", "Service", "models", "gone")  # 404: already gone, not an error
    denied = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "denied", "namespace": "models"},
    }
    with pytest.raises(
        KubeApiError, match=r'PATCH .*/scaledobjects/denied: 403 Forbidden: scaledobjects.keda.sh "denied" is forbidden'
    ):
        client.apply(denied)


def test_each_scaling_trigger_of_the_policy_becomes_a_keda_trigger(prod_plan) -> None:  # noqa: ANN001
    import dataclasses

    from fleet.runtime.kubernetes.manifests import manifests, object_name

    result, _ = prod_plan
    llm = next(m for m in result.models if m.model == "llm-7b")
    assert llm.triggers == ("queue_depth", "gpu_utilization", "p99_ms")  # policies/models-gpu.yaml
    every = dataclasses.replace(llm, triggers=("qps", "p99_ms", "queue_depth", "gpu_utilization"))
    scaler = manifests("llm-7b", "2.0.0", "repo@sha256:" + "0" * 64, every, floor=1, prometheus_url=PROMETHEUS)[3]
    validate(scaler)  # against KEDA's ScaledObject schema
    triggers = {t["name"]: t for t in scaler["spec"]["triggers"]}
    assert list(triggers) == ["qps", "p99-ms", "queue-depth", "gpu-utilization"]
    match = 'model="llm-7b",version="2.0.0"'
    queue = triggers["queue-depth"]
    assert queue["metricType"] == "AverageValue" and queue["metadata"]["threshold"] == "12"  # per replica
    assert queue["metadata"]["query"] == f"sum(fleet_version_in_flight{{{match}}}) + sum(fleet_queue_depth{{{match}}})"
    gpu = triggers["gpu-utilization"]
    assert gpu["metricType"] == "Value" and gpu["metadata"]["threshold"] == "75"  # an average, not divided
    pods = object_name("llm-7b", "2.0.0")
    assert gpu["metadata"]["query"] == f'avg(DCGM_FI_DEV_GPU_UTIL{{namespace="models",pod=~"{pods}-.+"}})'
    assert all(t["type"] == "prometheus" and t["metadata"]["serverAddress"] == PROMETHEUS for t in triggers.values())


def test_gpu_utilization_on_a_cpu_model_and_repeated_triggers_are_refused() -> None:
    from fleet.catalog.policies.models import Autoscaling
    from fleet.errors import FleetError

    policies = load_policies(ROOT / "policies")
    demo = policies.models["demo-classifier"]
    cpu_gpu_util = demo.model_copy(
        update={"autoscaling": demo.autoscaling.model_copy(update={"triggers": ["gpu_utilization"]})}
    )
    broken = policies.model_copy(update={"models": {**policies.models, "demo-classifier": cpu_gpu_util}})
    stack = read_stack_file(ROOT / "Pulumi.prod.yaml")
    with pytest.raises(
        FleetError, match="demo-classifier: autoscaling trigger gpu_utilization needs GPUs of its own.*no GPU"
    ):
        plan(broken, *placement_inputs(stack, "prod", broken))
    embed = policies.models["embed-small"]  # on a time-sliced A10G: the GPU's utilisation is its neighbours' too
    shared = embed.model_copy(
        update={"autoscaling": embed.autoscaling.model_copy(update={"triggers": ["gpu_utilization"]})}
    )
    broken = policies.model_copy(update={"models": {**policies.models, "embed-small": shared}})
    with pytest.raises(FleetError, match="embed-small: .* time-sliced share of a GPU"):
        plan(broken, *placement_inputs(stack, "prod", broken))
    for triggers in ([], ["qps", "qps"]):
        with pytest.raises(Exception, match="at least one trigger, each once"):
            Autoscaling(max_replicas=2, target_qps_per_replica=1, target_p99_ms=10, triggers=triggers)
    with pytest.raises(Exception, match="triggers"):
        Autoscaling(max_replicas=2, target_qps_per_replica=1, target_p99_ms=10, triggers=["cpu"])


# --- lazy loading: scaled to zero, woken by the gateway ------------------------------------------


@pytest.fixture
def lazy_kube(prod_plan, fleet_store: ObjectStore) -> FakeKube:  # noqa: ANN001
    """The prod cluster with embed-small made lazy (scale to zero after 600 s idle)."""
    _, policies = prod_plan
    lazy = policies.models["embed-small"].model_copy(update={"loading": "lazy", "idle_unload_s": 600.0})
    policies = policies.model_copy(update={"models": {**policies.models, "embed-small": lazy}})
    result = plan(policies, *placement_inputs(read_stack_file(ROOT / "Pulumi.prod.yaml"), "prod", policies))
    fake = FakeKube()
    fake.store = fleet_store
    fake.objects[("ConfigMap", NAMESPACE, CONFIG_MAP)] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIG_MAP, "namespace": NAMESPACE},
        "data": config_map_data(
            result, IMAGES, PROMETHEUS, {m: policies.models[m].timeout_ms for m in policies.models}
        ),
    }
    return fake


def test_a_lazy_models_scaler_cools_down_after_its_idle_time_and_stays_active_while_requests_wait(
    lazy_kube: FakeKube,
) -> None:
    runtime(lazy_kube, on_sleep=lambda n: lazy_kube.scale_up()).deploy("embed-small", "1.0.0")
    scaler_object = objects_of(lazy_kube, "embed-small", "1.0.0")["ScaledObject"]
    scaler = scaler_object["spec"]
    assert scaler_object["metadata"]["labels"]["fleet.io/loading"] == "lazy"  # what the admission policy reads
    assert scaler["cooldownPeriod"] == 60  # after the activity trigger's own idle_unload_s
    activity = scaler["triggers"][-1]
    assert activity["name"] == "activity" and activity["metadata"]["activationThreshold"] == "0"
    assert float(activity["metadata"]["threshold"]) >= 1e9  # it only wakes and keeps; the policy's triggers scale
    query = activity["metadata"]["query"]
    assert query == (
        '(sum(increase(fleet_version_requests_total{model="embed-small",version="1.0.0"}[600s])) or vector(0))'
        ' + (sum(fleet_requests_held{model="embed-small",version="1.0.0"}) or vector(0))'
    )
    eager = runtime(lazy_kube, on_sleep=lambda n: lazy_kube.scale_up())
    eager.deploy("demo-classifier", "1.0.0")
    eager_scaler = objects_of(lazy_kube, "demo-classifier", "1.0.0")["ScaledObject"]["spec"]
    assert eager_scaler["cooldownPeriod"] == 300 and all(t["name"] != "activity" for t in eager_scaler["triggers"])
    assert (
        objects_of(lazy_kube, "demo-classifier", "1.0.0")["ScaledObject"]["metadata"]["labels"]["fleet.io/loading"]
        == "eager"
    )


def test_unload_lets_keda_scale_to_zero_and_activate_scales_back_with_one_patch_of_the_floor(
    lazy_kube: FakeKube,
) -> None:
    rt = runtime(lazy_kube, on_sleep=lambda n: lazy_kube.scale_up())
    rt.deploy("embed-small", "1.0.0")
    told = []
    rt.unload([("embed-small", "1.0.0")], on_drain=lambda: told.append(True))
    assert objects_of(lazy_kube, "embed-small", "1.0.0")["ScaledObject"]["spec"]["minReplicaCount"] == 0 and told
    for key in [k for k in lazy_kube.objects if k[0] == "Pod"]:  # KEDA took the last pod away after the cooldown
        del lazy_kube.objects[key]
    assert all(d.model != "embed-small" for d in rt.list())
    lazy_kube.calls.clear()
    deployment, started = runtime(lazy_kube, on_sleep=lambda n: lazy_kube.scale_up()).activate("embed-small", "1.0.0")
    assert (
        started
        and deployment.endpoints
        and objects_of(lazy_kube, "embed-small", "1.0.0")["ScaledObject"]["spec"]["minReplicaCount"] == 1
    )
    assert [c for c in lazy_kube.calls if c[0] != "apply"] == [
        ("patch", "ScaledObject", object_name("embed-small", "1.0.0"))
    ]
    assert not [c for c in lazy_kube.calls if c[0] == "apply"]  # nothing else written: all the gateway's Role allows
    lazy_kube.calls.clear()
    again, started = rt.activate("embed-small", "1.0.0")
    assert again.endpoints == deployment.endpoints and not started and lazy_kube.calls == []  # running: no patch


def test_activating_a_version_never_deployed_says_what_to_do(lazy_kube: FakeKube) -> None:
    with pytest.raises(DeployFailed) as info:
        runtime(lazy_kube).activate("embed-small", "1.0.0")
    assert "not deployed in namespace models" in str(info.value) and "fleet deploy embed-small 1.0.0" in str(info.value)


def test_http_client_sends_merge_patches() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers["content-type"], json.loads(request.content)))
        return httpx.Response(404 if "missing" in request.url.path else 200, json={"kind": "ScaledObject"})

    api = HttpKubeApi("https://api", transport=httpx.MockTransport(handler))
    assert api.patch("keda.sh/v1alpha1", "ScaledObject", "models", "x", {"spec": {"minReplicaCount": 1}}) == {
        "kind": "ScaledObject"
    }
    assert api.patch("keda.sh/v1alpha1", "ScaledObject", "models", "missing", {"spec": {}}) is None
    assert seen[0] == (
        "PATCH",
        "/apis/keda.sh/v1alpha1/namespaces/models/scaledobjects/x",
        "application/merge-patch+json",
        {"spec": {"minReplicaCount": 1}},
    )


def test_the_idle_unload_controller_sets_an_idle_lazy_versions_floor_to_zero_and_leaves_eager_ones(
    lazy_kube: FakeKube, prod_plan
) -> None:  # noqa: ANN001
    from fleet.control.lazy import LoadController

    _, policies = prod_plan
    lazy = policies.models["embed-small"].model_copy(update={"loading": "lazy", "idle_unload_s": 600.0})
    policies = policies.model_copy(update={"models": {**policies.models, "embed-small": lazy}})
    rt = runtime(lazy_kube, on_sleep=lambda n: lazy_kube.scale_up())
    rt.deploy("embed-small", "1.0.0")
    rt.deploy("demo-classifier", "1.0.0")
    told = []
    controller = LoadController(lazy_kube.store, policies, rt, notify=lambda: told.append(True))
    assert controller.unload_idle() == []  # pods just started: not idle (the start counts as use)
    for (kind, _, _), pod in lazy_kube.objects.items():
        if kind == "Pod":
            pod["status"]["startTime"] = "2026-01-01T00:00:00Z"  # long ago, and no gateway asked since
    stopped = controller.unload_idle()
    assert [(u.model, u.version) for u in stopped] == [("embed-small", "1.0.0")] and told
    assert objects_of(lazy_kube, "embed-small", "1.0.0")["ScaledObject"]["spec"]["minReplicaCount"] == 0
    assert objects_of(lazy_kube, "demo-classifier", "1.0.0")["ScaledObject"]["spec"]["minReplicaCount"] == 1
