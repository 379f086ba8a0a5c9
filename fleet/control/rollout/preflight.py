"""A rollout's preflight: what is checked of a candidate before anything runs or routes.

``checks`` is pure over the two registry entries (the executor verifies the checksums first:
``Registry.verify`` raises on any difference, so a tampered artifact never gets this far);
``fleet.control.rollout.machine`` decides on the result.
"""

from __future__ import annotations

from fleet.catalog.registry import ModelVersion, State


def checks(candidate: ModelVersion, champion: ModelVersion, tolerance: float) -> list[dict[str, str]]:
    """Checksums (verified by the caller), schema compatible with the champion, offline
    metrics not worse than it, and the candidate still a version a rollout may take."""
    found = [
        {"check": "checksums", "status": "pass", "detail": f"{len(candidate.files)} file(s) match the manifest"},
        _schema_check(candidate, champion),
        _offline_check(candidate, champion, tolerance),
    ]
    if candidate.state not in (State.REGISTERED, State.CANARY):
        found.append(
            {"check": "state", "status": "fail", "detail": f"{candidate.ref} is {candidate.state}; expected registered"}
        )
    return found


def _schema_check(candidate: ModelVersion, champion: ModelVersion) -> dict[str, str]:
    """The candidate must accept what the champion accepts and answer in the same shape."""
    problems = []
    for kind in ("inputs", "outputs"):
        mine, theirs = getattr(candidate, kind), getattr(champion, kind)
        by_name = {t.name: t for t in mine}
        for spec in theirs:
            got = by_name.get(spec.name)
            if got is None:
                problems.append(f"{kind} {spec.name!r} is missing")
            elif (
                got.datatype != spec.datatype
                or len(got.shape) != len(spec.shape)
                or any(a != -1 and a != b for a, b in zip(got.shape, spec.shape))
            ):
                problems.append(
                    f"{kind} {spec.name!r} is {got.datatype} {got.shape}, the champion's {spec.datatype} {spec.shape}"
                )
    if problems:
        return {
            "check": "schema",
            "status": "fail",
            "detail": f"not compatible with {champion.ref}: " + "; ".join(problems),
        }
    return {"check": "schema", "status": "pass", "detail": f"inputs and outputs compatible with {champion.ref}"}


def _offline_check(candidate: ModelVersion, champion: ModelVersion, tolerance: float) -> dict[str, str]:
    if candidate.parent_version == champion.version and "champion_accuracy" in candidate.metrics:
        # a retrain measured both on one holdout: that comparison is the fair one
        mine, theirs = candidate.metrics.get("accuracy", 0.0), candidate.metrics["champion_accuracy"]
        detail = f"accuracy {mine:.4f} vs champion {champion.version} {theirs:.4f} on the same holdout (tolerance {tolerance:g})"
        return {
            "check": "offline metrics",
            "status": "pass" if mine >= theirs - tolerance else "fail",
            "detail": detail,
        }
    # accuracy and f1 of classifiers, exact match of generative models (tiny-lm's holdout)
    metric = next(
        (m for m in ("accuracy", "f1", "exact_match") if m in candidate.metrics and m in champion.metrics), None
    )
    if metric is None:
        return {"check": "offline metrics", "status": "pass", "detail": "no metric both versions report; not compared"}
    mine, theirs = candidate.metrics[metric], champion.metrics[metric]
    detail = f"{metric} {mine:.4f} vs champion {champion.version} {theirs:.4f} (tolerance {tolerance:g})"
    return {"check": "offline metrics", "status": "pass" if mine >= theirs - tolerance else "fail", "detail": detail}
