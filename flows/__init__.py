"""Prefect flows: canary rollout, rollback, monitoring and retraining. They only compose
``fleet`` functions; ``fleet flows serve`` registers them as deployments."""
