"""The deployments ``fleet flows serve`` (and ``fleet up``) register with the Prefect server.

They appear in the Prefect UI, where runs can be started, watched and approved; this
process then executes their runs. ``fleet rollout``, ``fleet rollback`` and ``fleet experiment
start`` start them.
"""

from __future__ import annotations

ROLLOUT = "canary-rollout/rollout"
ROLLBACK = "rollback/rollback"
EXPERIMENT = "experiment/experiment"
# How often the runner asks the server for runs to start (Prefect's default is 10 s; a
# rollout or rollback started from the CLI should not wait that long to begin).
POLL_S = 1.0


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


def serve() -> None:
    """Register the deployments and run their flow runs until interrupted."""
    from prefect import serve as prefect_serve

    prefect_serve(*deployments(), print_starting_message=True, query_seconds=POLL_S)
