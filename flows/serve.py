"""The deployments of the fleet's flows, and the two ways they run.

Locally, ``fleet flows serve`` (and ``fleet up``) registers them with the Prefect server and
this process executes their runs. In the cluster, ``fleet flows deploy`` registers the same
deployments, schedules included, on the ``fleet-kubernetes`` work pool: the Prefect worker
(infra/charts.py) starts each run as a Job of the flows image (Dockerfile.flows) in the
flows namespace, with the job variables ``job_variables`` gives. Either way they appear in
the Prefect UI, where runs can be started, watched and approved; ``fleet rollout``,
``fleet rollback`` and ``fleet experiment start`` start them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import PurePath
from typing import Any

ROLLOUT = "canary-rollout/rollout"
ROLLBACK = "rollback/rollback"
EXPERIMENT = "experiment/experiment"
# How often the runner asks the server for runs to start (Prefect's default is 10 s; a
# rollout or rollback started from the CLI should not wait that long to begin).
POLL_S = 1.0

# The cluster's side of a flow run (infra/flows_cluster.py makes these objects; infra imports
# the names from here so the two cannot drift apart).
WORK_POOL = "fleet-kubernetes"
FLOWS_NAMESPACE = "flows"
JOB_SERVICE_ACCOUNT = "fleet-flows"  # the jobs' account: the flows' IAM role (IRSA), may deploy models
FLOWS_CONFIG = "fleet-flows"  # ConfigMap: FLEET_STORE, FLEET_RUNTIME, FLEET_METRICS, ... (envFrom)
FLOWS_SECRET = "fleet-flows"  # Secret: FLEET_ADMIN_TOKEN (envFrom)
ENV_FROM = [{"configMapRef": {"name": FLOWS_CONFIG}}, {"secretRef": {"name": FLOWS_SECRET}}]
# Requests and limits per deployment; the rest take the work pool's defaults (infra/charts.py
# FLOW_JOB_DEFAULTS). Retraining fits a model on CPU (the flows namespace has no GPU quota).
JOB_RESOURCES: dict[str, dict[str, str]] = {
    "retrain": {"cpu_request": "2", "cpu_limit": "4", "memory_request": "6Gi", "memory_limit": "8Gi"},
}


def deployments() -> list:
    from flows.experiment import experiment
    from flows.rollback import rollback
    from flows.rollout import canary_rollout

    return [
        canary_rollout.to_deployment(
            name="rollout", description="Canary rollout of a model version", tags=["fleet"], concurrency_limit=None
        ),
        rollback.to_deployment(name="rollback", description="Immediate rollback of a model", tags=["fleet"]),
        experiment.to_deployment(
            name="experiment", description="A/B experiment of two versions on an outcome", tags=["fleet"]
        ),
        *_monitoring_deployments(),
        _idle_unload(),
        _commit_logs(),
    ]


def _commit_logs():  # noqa: ANN202 - a prefect RunnerDeployment
    from flows.logs import EVERY_S, commit_logs

    return commit_logs.to_deployment(
        name="commit-logs",
        interval=EVERY_S,
        tags=["fleet"],
        description="Commit the gateways' staged logs into the log tables; compact and expire them",
    )


def _idle_unload():  # noqa: ANN202 - a prefect RunnerDeployment
    """On a schedule only when a model is lazy: with none, there is nothing it could stop."""
    from fleet.catalog.policies.loader import load_policies
    from fleet.runtime.packaged import policies_path
    from flows.unload import EVERY_S, idle_unload

    lazy = any(spec.loading == "lazy" for spec in load_policies(policies_path()).models.values())
    return idle_unload.to_deployment(
        name="idle-unload",
        interval=EVERY_S if lazy else None,
        tags=["fleet"],
        description="Stop lazy versions idle past their idle_unload_s",
    )


def _monitoring_deployments() -> list:
    """Monitoring (scheduled from each model's policy) and retraining."""
    from flows.monitor import deployments as monitor_deployments

    return monitor_deployments()


def job_variables(deployment: str, image: str) -> dict[str, Any]:
    """What the Kubernetes worker fills its base job template with for ``deployment``'s runs:
    the flows image, the flows namespace and its jobs' service account, the ConfigMap and Secret
    the flows read their environment from, and the deployment's resources."""
    return {
        "image": image,
        "namespace": FLOWS_NAMESPACE,
        "service_account_name": JOB_SERVICE_ACCOUNT,
        "env_from": ENV_FROM,
        **JOB_RESOURCES.get(deployment, {}),
    }


def module_entrypoint(entrypoint: str) -> str:
    """``flows/rollout.py:canary_rollout`` (a path relative to wherever the deployment was made)
    → ``flows.rollout.canary_rollout``, which the flows image imports whatever its directory.

    A path entrypoint made on a laptop names the laptop's checkout; the module is the same
    everywhere the project is installed."""
    path, sep, function = entrypoint.rpartition(":")
    parts = PurePath(path).parts
    if not sep or not path.endswith(".py") or "flows" not in parts:
        raise ValueError(f"entrypoint {entrypoint!r}: expected flows/<module>.py:<function>")
    package = parts[len(parts) - 1 - parts[::-1].index("flows") :]
    return ".".join([*package[:-1], PurePath(package[-1]).stem, function])


def deploy(image: str, work_pool: str = WORK_POOL) -> list[Any]:  # noqa: ANN401 - RunnerDeployments
    """Register every deployment of ``deployments()`` on ``work_pool`` (it must exist, with an
    ``image`` variable: the Kubernetes worker creates it) to run in ``image``; returns them."""
    made = deployments()
    for d in made:
        d.entrypoint = module_entrypoint(d.entrypoint)
        d.job_variables = {**(d.job_variables or {}), **job_variables(d.name, image)}
        d.apply(work_pool_name=work_pool, image=image)
    return made


def schedules(deployment: Any) -> Iterable[str]:  # noqa: ANN401 - a RunnerDeployment
    """Each schedule of ``deployment`` in words: ``every 60 s`` or ``cron 0 * * * *``."""
    for s in deployment.schedules or []:
        rule = s.schedule
        if getattr(rule, "interval", None) is not None:
            yield f"every {rule.interval.total_seconds():g} s"
        elif getattr(rule, "cron", None):
            yield f"cron {rule.cron}"
        else:
            yield str(rule)


def serve() -> None:
    """Register the deployments and run their flow runs until interrupted."""
    from prefect import serve as prefect_serve

    prefect_serve(*deployments(), print_starting_message=True, query_seconds=POLL_S)
