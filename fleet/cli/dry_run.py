"""``fleet rollout --dry-run``: simulated rollouts of a policy at the model's own traffic."""

from __future__ import annotations

import time
from typing import Any

from fleet.cli._output import emit_json, err_console
from fleet.errors import ConfigError, InvalidInput, NotFound

DRY_RUN_WINDOW_S = 300  # the stable's recent traffic the dry run simulates


def dry_run(model: str, version: str, policy: Any, rps: float | None, json: bool) -> None:  # noqa: ANN401
    """Simulated rollouts under the policy (fleet.analysis.simulate, as bench/rollout.py runs them)."""
    from fleet.analysis.simulate import BASE_ERR, NOT_SIMULATED, estimate, switch_waits
    from fleet.cli._output import table

    rate, seen_errors, source = _traffic(model, policy, rps)
    base_errors = BASE_ERR if seen_errors is None else seen_errors
    if not json:
        err_console.print(
            f"simulating rollouts of {model}:{version} at {rate:.3g} req/s ({source}), stable errors "
            f"{base_errors:.2%}{'' if seen_errors is not None else ' (assumed)'}, method "
            f"{policy.method}..."
        )
    found = estimate(policy, rate, base_errors)
    if json:
        emit_json(
            {
                "model": model,
                "version": version,
                "rps": rate,
                "traffic_from": source,
                "stable_errors": base_errors,
                "method": policy.method,
                "strategy": policy.strategy,
                "estimates": [e.__dict__ for e in found],
                "switch_waits": switch_waits(policy, rate),
                "not_simulated": NOT_SIMULATED,
            }
        )
        return
    rows = []
    for e in found:
        share = e.rolled_back if e.bad else e.promoted
        when = "-" if e.median_s is None else f"{e.median_s:.0f} s (p90 {e.p90_s:.0f} s)"
        rows.append(
            [
                e.canary,
                f"{'caught' if e.bad else 'promoted'} {share:.0%}",
                when,
                f"{e.canary_requests:.0f}",
                f"{e.canary_failures:.1f}",
            ]
        )
    shape = (
        f"blue-green, one switch then a {policy.bake_s:g} s bake"
        if policy.strategy == "blue-green"
        else f"steps {policy.steps} %"
    )
    table(
        f"{model}: {policy.method} method, {shape}, {found[0].runs} simulated rollouts each",
        ["canary", "ends as it should", "median time", "canary requests", "of them failed"],
        rows,
    )
    if waits := switch_waits(policy, rate):
        err_console.print(f"[yellow]{waits}[/]")
    err_console.print(f"[dim]{NOT_SIMULATED}[/]")


def _traffic(model: str, policy: Any, rps: float | None) -> tuple[float, float | None, str]:  # noqa: ANN401
    """(requests/s, the stable's error rate if seen, where the figure comes from)."""
    if rps is not None:
        return rps, None, "--rps"
    from fleet.analysis.sources import MetricsUnavailable, open_metrics
    from fleet.catalog.routes.store import Router
    from fleet.store import open_store

    store = open_store()
    try:
        stable = Router(store).get(model).stable
    except NotFound:  # planning before the first version: the policy's estimate is all there is
        stable = None
    seen = None
    if stable is not None:
        now = time.time()
        try:
            seen = open_metrics(store=store).window(model, stable, now - DRY_RUN_WINDOW_S, now)
        except (MetricsUnavailable, ConfigError) as exc:  # the estimate falls back on the policy's figure
            err_console.print(f"[dim]the stable's traffic could not be read ({exc})[/]")
            seen = None
    if seen is not None and seen.requests > 0:
        return (
            seen.requests / DRY_RUN_WINDOW_S,
            seen.error_count / seen.requests,
            f"{model}:{stable}'s last {DRY_RUN_WINDOW_S // 60} minutes",
        )
    if policy.expected_rps is not None:
        return policy.expected_rps, None, "the rollout policy's expected_rps: no traffic seen in the last 5 minutes"
    raise InvalidInput(
        f"{model} served no traffic in the last {DRY_RUN_WINDOW_S // 60} minutes and its rollout policy "
        "sets no expected_rps; expected --rps N (requests/s) to simulate"
    )
