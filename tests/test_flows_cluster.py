"""Flows in the cluster: the deployments on the ``fleet-kubernetes`` work pool, the Job the
Prefect Kubernetes worker makes of one, what the flows namespace gives that Job, and the
Prefect server's database (RDS) and API auth.

The Job is rendered by prefect-kubernetes 0.8.0's own code, as the worker does for a flow run:
``fleet flows deploy`` registers the deployments on a real Prefect server (``prefect_api``),
a flow run is created from one, ``KubernetesWorkerJobConfiguration.resolve_for_flow_run``
fills the work pool's base job template (infra/flow_jobs.py) with the deployment's job
variables, and ``KubernetesWorker._create_job`` makes the last changes (the API auth string as
a secretKeyRef) before it posts the manifest: only that post, the Kubernetes API, is faked.
The manifest is then checked against Kubernetes' schema and against the ConfigMap and
Secrets the infra program (under Pulumi's mocks) makes in the flows namespace.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from infra_harness import ADMIN_TOKEN, PROJECT, ROOT, SECRET_CONFIG, Build, example, stack_config
from k8s_schemas import validate

from flows.serve import ENV_FROM, JOB_RESOURCES, WORK_POOL, module_entrypoint
from infra.flow_jobs import JOB_TEMPLATE, flow_run_job_template
from infra.flows_cluster import ADMIN_TOKEN_ITEM, AUTH_ITEM, prefect_api_auth
from infra.namespaces import (
    FLOWS_ENV_CONFIG,
    FLOWS_ENV_SECRET,
    FLOWS_NS,
    FLOWS_POLICIES,
    FLOWS_SA,
    PREFECT_AUTH_SECRET,
    WORKER_SA,
)

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/serving-fleet-dev/flows:0.1.0"
DB_PASSWORD = SECRET_CONFIG[f"{PROJECT}:prefectDbPassword"]
AUTH = prefect_api_auth(DB_PASSWORD)
# What prefect-worker's templates/deployment.yaml (chart 2026.8.18172642) sets on the worker
# when selfHostedServerApiConfig.basicAuth.existingSecret is given: the key is fixed there.
CHART_AUTH_KEY = "auth-string"

# Every FLEET_* variable the flows' code can reach (``reachable_variables``), and whether a
# flow-run Job is given it. One read by none of these is a new variable: say which it is.
IN_THE_JOB = {
    "FLEET_STORE",
    "FLEET_POLICIES",
    "FLEET_RUNTIME",
    "FLEET_KUBE_NAMESPACE",
    "FLEET_METRICS",
    "FLEET_PROMETHEUS_URL",
    "FLEET_ADMIN_TOKEN",
    "FLEET_LOG_CATALOG",
    "FLEET_LOG_RETENTION_DAYS",
    "FLEET_GATEWAY_NETWORKS",
    "FLEET_CACHE_DIR",
    "FLEET_ACTOR",
}
NOT_IN_THE_JOB = {
    "FLEET_KUBE_API": "outside a pod only (kubectl proxy); a Job uses its service account's token",
    "FLEET_KUBE_TOKEN": "with FLEET_KUBE_API only",
    "FLEET_RUN_DIR": "the local runtime's",
    "FLEET_STATIC_ENDPOINTS": "the static runtime's",
    "FLEET_REDIS_URL": "the change bus is optional: the flows push route changes to the gateways themselves",
}


def reachable_variables() -> dict[str, set[str]]:
    """FLEET_* variable → modules reading it, over every module of fleet/ and flows/ that the
    flows' modules import, at the top or inside a function (their imports are mostly lazy)."""

    def source(module: str) -> Path | None:
        path = ROOT / Path(*module.split("."))
        return next((p for p in (path / "__init__.py", path.with_suffix(".py")) if p.is_file()), None)

    def imported(module: str, path: Path) -> set[str]:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                names |= {base, *(f"{base}.{a.name}" for a in node.names)}
        return names

    todo = [f"flows.{p.stem}" for p in (ROOT / "flows").glob("*.py") if p.stem != "serve"]
    seen: dict[str, Path] = {}
    while todo:
        module = todo.pop()
        path = source(module) if module.split(".")[0] in ("fleet", "flows") else None
        if module in seen or path is None:
            continue
        seen[module] = path
        parts = module.split(".")
        todo += [*imported(module, path), *(".".join(parts[:k]) for k in range(1, len(parts)))]
    read = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\(|envvar=)\s*["'](FLEET_[A-Z0-9_]+)""")
    found: dict[str, set[str]] = {}
    for module, path in seen.items():
        for name in read.findall(path.read_text()):
            found.setdefault(name, set()).add(module)
    return found


def test_every_variable_the_flows_can_read_is_either_given_to_their_jobs_or_known_not_needed() -> None:
    found = reachable_variables()
    unknown = {v: sorted(m) for v, m in found.items() if v not in IN_THE_JOB and v not in NOT_IN_THE_JOB}
    assert not unknown, f"read by the flows' code but not classified here (IN_THE_JOB or NOT_IN_THE_JOB): {unknown}"
    assert IN_THE_JOB <= set(found), f"no longer read: {sorted(IN_THE_JOB - set(found))}"


# --- the work pool's template and the deployments ---------------------------------------------


def test_the_template_file_is_prefect_kubernetes_own_default() -> None:
    """The base job template starts from the worker's default of the pinned version: a bump of
    prefect-kubernetes shows here, with the new default to take."""
    from prefect_kubernetes.worker import KubernetesWorker

    assert json.loads(JOB_TEMPLATE.read_text()) == KubernetesWorker.get_default_base_job_template()


def test_entrypoints_name_modules_whatever_the_directory_the_deployment_was_made_in() -> None:
    assert module_entrypoint("flows/rollout.py:canary_rollout") == "flows.rollout.canary_rollout"
    assert module_entrypoint("../venv/lib/site-packages/flows/logs.py:commit_logs") == "flows.logs.commit_logs"
    with pytest.raises(ValueError, match="expected flows/<module>.py:<function>"):
        module_entrypoint("flows.rollout.canary_rollout")


@pytest.fixture(scope="module")
def deployed(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``fleet flows deploy`` (the CLI, a subprocess) against the real Prefect server, on a
    Kubernetes work pool made there with the chart's base job template; a model with a
    registered version, so that its scheduled monitor is among the deployments."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from fleet.catalog.policies.loader import load_policies
    from fleet.catalog.registry import Registry
    from fleet.store import open_store
    from tests.test_registry import META

    root = tmp_path_factory.mktemp("flows-deploy")
    store_url = f"file://{root / 'store'}"
    model = sorted(load_policies(ROOT / "policies").models)[0]
    (root / "artifact").mkdir()
    (root / "artifact" / "w").write_text("w")
    Registry(open_store(store_url)).register(model, "1.0.0", root / "artifact", META)

    async def make_pools() -> None:
        async with get_client() as client:
            template = flow_run_job_template()
            await client.create_work_pool(WorkPoolCreate(name=WORK_POOL, type="kubernetes", base_job_template=template))
            await client.create_work_pool(WorkPoolCreate(name="local-processes", type="process"))

    asyncio.run(make_pools())
    env = {**os.environ, "FLEET_STORE": store_url, "FLEET_POLICIES": str(ROOT / "policies"), "COLUMNS": "200"}
    command = [sys.executable, "-m", "fleet", "flows", "deploy", "--image", IMAGE, "--work-pool", WORK_POOL, "--json"]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    refused = subprocess.run(
        [*command[:-3], "--work-pool", "local-processes"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    return {"printed": json.loads(out.stdout), "model": model, "refused": refused, "env": env}


def _read_deployments() -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    async def read() -> list[Any]:
        async with get_client() as client:
            return await client.read_deployments(
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[WORK_POOL]))
            )

    return asyncio.run(read())


def test_every_served_deployment_is_on_the_work_pool_with_the_image_schedule_and_job_variables(
    deployed: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.logs import EVERY_S
    from flows.serve import deployments

    monkeypatch.setenv("FLEET_STORE", deployed["env"]["FLEET_STORE"])
    made = {f"{d.flow_name}/{d.name}" for d in deployments()}  # what `fleet flows serve` serves
    read = {}
    for d in _read_deployments():
        flow = asyncio.run(_flow_name(d.flow_id))
        read[f"{flow}/{d.name}"] = d
    assert set(read) == made and {r["deployment"] for r in deployed["printed"]["deployments"]} == made
    assert f"monitor/monitor-{deployed['model']}" in read  # scheduled from the model's policy
    for name, d in read.items():
        assert d.work_pool_name == WORK_POOL, name
        variables = d.job_variables
        assert variables["image"] == IMAGE and variables["namespace"] == FLOWS_NS, name
        assert variables["service_account_name"] == FLOWS_SA and variables["env_from"] == ENV_FROM, name
        assert {k: variables[k] for k in JOB_RESOURCES.get(d.name, {})} == JOB_RESOURCES.get(d.name, {}), name
        assert re.fullmatch(r"flows\.\w+\.\w+", d.entrypoint), (name, d.entrypoint)  # a module: any directory
    commit = read["commit-logs/commit-logs"]
    assert [s.schedule.interval.total_seconds() for s in commit.schedules] == [EVERY_S]
    monitor = read[f"monitor/monitor-{deployed['model']}"]
    assert [s.schedule.cron for s in monitor.schedules] == [_monitor_cron(deployed["model"])]
    assert read["retrain/retrain"].job_variables["memory_limit"] == JOB_RESOURCES["retrain"]["memory_limit"]


def test_a_work_pool_that_is_not_kubernetes_is_refused_with_what_was_expected(deployed: dict[str, Any]) -> None:
    refused = deployed["refused"]
    assert refused.returncode != 0
    assert "'local-processes' is of type 'process'; expected 'kubernetes'" in refused.stderr


async def _flow_name(flow_id: Any) -> str:  # noqa: ANN401
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return (await client.read_flow(flow_id)).name


def _monitor_cron(model: str) -> str:
    from fleet.catalog.policies.loader import load_policies

    return load_policies(ROOT / "policies").monitoring_for(model).schedule


# --- the Job the worker makes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def dev() -> Build:
    return example("dev")


class _PostedJobs:
    """Stands in for kubernetes_asyncio's BatchV1Api: keeps what the worker posts."""

    posted: list[tuple[str, dict]] = []

    def __init__(self, client: Any) -> None:  # noqa: ANN401
        pass

    async def create_namespaced_job(self, namespace: str, body: dict) -> Any:  # noqa: ANN401
        from kubernetes_asyncio.client import V1Job, V1ObjectMeta

        self.posted.append((namespace, json.loads(json.dumps(body))))
        return V1Job(metadata=V1ObjectMeta(name="posted", namespace=namespace))


def render_job(
    deployment: str, parameters: dict[str, Any], worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict]:
    """(namespace, manifest) the Kubernetes worker would post for a run of ``deployment``,
    with the environment the prefect-worker chart gives the worker pod."""
    import prefect_kubernetes.worker as worker_module
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    for key, value in worker_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(worker_module, "BatchV1Api", _PostedJobs)
    _PostedJobs.posted = []

    async def run() -> None:
        with temporary_settings(updates={PREFECT_API_AUTH_STRING: AUTH}):  # the worker's, from the Secret
            async with get_client() as client:
                pool = await client.read_work_pool(WORK_POOL)
                found = await client.read_deployment_by_name(deployment)
                flow_run = await client.create_flow_run_from_deployment(found.id, parameters=parameters)
                configuration = await KubernetesWorkerJobConfiguration.resolve_for_flow_run(
                    flow_run, client=client, work_pool=pool, worker_name="prefect-worker-0"
                )
            await KubernetesWorker(work_pool_name=WORK_POOL)._create_job(configuration, client=None)

    asyncio.run(run())
    (posted,) = _PostedJobs.posted
    return posted


def _worker_env(dev: Build) -> dict[str, str]:
    worker = next(r for r in dev.of_type("kubernetes:helm.sh/v3:Release") if r.inputs["chart"] == "prefect-worker")
    auth = worker.inputs["values"]["worker"]["selfHostedServerApiConfig"]["basicAuth"]
    assert auth["enabled"] is True and auth["existingSecret"] == PREFECT_AUTH_SECRET
    return {
        "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_NAME": auth["existingSecret"],
        "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_KEY": CHART_AUTH_KEY,
    }


def _flows_object(dev: Build, kind: str, name: str) -> Any:  # noqa: ANN401
    (found,) = [
        r
        for r in dev.of_type(f"kubernetes:core/v1:{kind}")
        if r.inputs["metadata"].get("name") == name and r.inputs["metadata"].get("namespace") == FLOWS_NS
    ]
    return found


@pytest.mark.parametrize("deployment", ["canary-rollout/rollout", "retrain/retrain", "commit-logs/commit-logs"])
def test_the_job_the_worker_renders_is_valid_and_carries_everything_the_flows_read_and_no_secret(
    deployed: dict[str, Any], dev: Build, deployment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parameters = {"model": deployed["model"], "version": "1.0.0"} if "rollout" in deployment else {}
    if deployment.startswith("retrain"):
        parameters = {"model": deployed["model"]}
    namespace, job = render_job(deployment, parameters, _worker_env(dev), monkeypatch)
    validate(job)  # Kubernetes' own schema (strict: an unknown field fails)
    assert namespace == FLOWS_NS == job["metadata"]["namespace"] and job["kind"] == "Job"
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == IMAGE and pod["serviceAccountName"] == FLOWS_SA
    assert container["args"][:3] == ["prefect", "flow-run", "execute"]  # the image has no entry point before it

    # the flows' variables: from the ConfigMap and the Secret the program makes, through envFrom
    config = _flows_object(dev, "ConfigMap", FLOWS_ENV_CONFIG).inputs["data"]
    secret = _flows_object(dev, "Secret", FLOWS_ENV_SECRET)
    assert container["envFrom"] == [
        {"configMapRef": {"name": FLOWS_ENV_CONFIG}},
        {"secretRef": {"name": FLOWS_ENV_SECRET}},
    ]
    env = {e["name"]: e for e in container["env"]}
    given = set(env) | set(config) | set(secret.inputs["stringData"])
    assert IN_THE_JOB <= given, f"not given to the Job: {sorted(IN_THE_JOB - given)}"
    assert not IN_THE_JOB & set(env), "the flows' variables come from the namespace's objects, not the deployment"
    assert config["FLEET_RUNTIME"] == "kubernetes" and config["FLEET_STORE"] == dev.outputs["storeUrl"]
    assert config["FLEET_LOG_CATALOG"] == f"glue:{dev.outputs['logDatabase']}"
    retention = json.loads(stack_config("dev").get(f"{PROJECT}:logs", "{}")).get("retention_days", 30)
    assert config["FLEET_LOG_RETENTION_DAYS"] == str(retention)
    assert config["FLEET_METRICS"] == "prometheus" and config["FLEET_PROMETHEUS_URL"].startswith(
        "http://kps-prometheus."
    )
    (vpc,) = dev.of_type("aws:ec2/vpc:Vpc")
    assert config["FLEET_GATEWAY_NETWORKS"] == vpc.inputs["cidrBlock"]
    assert secret.inputs["stringData"] == {ADMIN_TOKEN_ITEM: ADMIN_TOKEN} and "stringData" in secret.secret_inputs
    policies = _flows_object(dev, "ConfigMap", FLOWS_POLICIES).inputs["data"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts[config["FLEET_POLICIES"]]]["configMap"]["name"] == FLOWS_POLICIES and policies
    assert mounts["/tmp"] == "tmp" and config["HOME"] == "/tmp" and config["FLEET_CACHE_DIR"].startswith("/tmp/")

    # Prefect's own: where the API is, and its auth string only as a reference to the Secret
    assert env["PREFECT_API_URL"]["value"] == os.environ["PREFECT_API_URL"]
    assert env["PREFECT_API_AUTH_STRING"] == {
        "name": "PREFECT_API_AUTH_STRING",
        "valueFrom": {"secretKeyRef": {"name": PREFECT_AUTH_SECRET, "key": CHART_AUTH_KEY}},
    }
    assert _flows_object(dev, "Secret", PREFECT_AUTH_SECRET).inputs["stringData"] == {AUTH_ITEM: AUTH}
    text = json.dumps(job)
    for value in (*SECRET_CONFIG.values(), AUTH, AUTH.partition(":")[2]):
        assert value not in text, "a secret in plain text in the Job manifest"
    wanted = JOB_RESOURCES.get(deployment.partition("/")[2], {})
    if wanted:
        assert container["resources"]["limits"]["memory"] == wanted["memory_limit"]
    assert pod["securityContext"]["runAsNonRoot"] is True and container["securityContext"]["readOnlyRootFilesystem"]


def test_a_worker_without_the_charts_secret_settings_would_put_the_auth_string_in_the_manifest(
    deployed: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the worker's basicAuth names an existing Secret: without it, the worker copies its
    auth string into every Job as a value."""
    monkeypatch.delenv("PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_NAME", raising=False)
    _, job = render_job("rollback/rollback", {"model": deployed["model"]}, {}, monkeypatch)
    assert AUTH in json.dumps(job)


# --- the flows namespace's accounts ------------------------------------------------------------


def test_the_worker_and_the_jobs_run_as_different_accounts_and_only_the_jobs_may_deploy_models(dev: Build) -> None:
    worker = next(r for r in dev.of_type("kubernetes:helm.sh/v3:Release") if r.inputs["chart"] == "prefect-worker")
    account = worker.inputs["values"]["serviceAccount"]
    assert account == {"create": True, "name": WORKER_SA} and WORKER_SA != FLOWS_SA  # no IAM role on the worker
    jobs = _flows_object(dev, "ServiceAccount", FLOWS_SA)
    (flows_role,) = [r for r in dev.of_type("aws:iam/role:Role") if r.name.endswith("-flows")]
    assert jobs.inputs["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": flows_role.state["arn"]}
    trust = json.loads(flows_role.inputs["assumeRolePolicy"])["Statement"][0]["Condition"]["StringEquals"]
    assert f"system:serviceaccount:{FLOWS_NS}:{FLOWS_SA}" in trust.values()
    bindings = {
        r.inputs["metadata"]["name"]: r.inputs
        for r in dev.of_type("kubernetes:rbac.authorization.k8s.io/v1:RoleBinding")
    }
    assert bindings["model-deployer"]["subjects"] == [
        {"kind": "ServiceAccount", "name": FLOWS_SA, "namespace": FLOWS_NS}
    ]
    assert all(s.get("name") != WORKER_SA for b in bindings.values() for s in b["subjects"]), (
        "the worker's account is bound to nothing of ours: the chart's Role (Jobs in its namespace) is all it has"
    )


# --- the flows image ----------------------------------------------------------------------------


def test_the_flows_image_is_the_gateway_image_plus_the_pinned_torch_and_prefect_kubernetes() -> None:
    from test_gateway_image import instructions

    steps = instructions(ROOT / "Dockerfile.flows")
    assert steps[0] == ("ARG", "GATEWAY_IMAGE") and steps[1] == ("FROM", "${GATEWAY_IMAGE}")
    runs = " ".join(arg for word, arg in steps if word == "RUN")
    torch = re.search(r"^TORCH\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    kubernetes = re.search(r'"(prefect-kubernetes==[^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f" {torch} " in f" {runs} " and f" {kubernetes} " in f" {runs} ", runs
    assert "whl/cpu" in runs  # the flows namespace has no GPU: the CPU build, not 3 GB of CUDA
    (user,) = [arg for word, arg in steps if word == "USER" and arg != "root"]
    pod = flow_run_job_template()["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert user == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    assert ("ENTRYPOINT", "[]") in steps  # the worker's args are the whole command
