"""``retrain(model)``: registered training data plus labelled feedback → quality gate → train →
evaluate against the champion → register (a minor bump, with lineage) → package → canary rollout.

Every gate that fails ends the run Failed with its reason, and nothing is registered or
rolled out: bad data (Great Expectations against the champion's baseline), too little
feedback, and a candidate worse than the champion on the same holdout beyond the rollout
policy's ``offline_tolerance``. The exact rows trained on are stored under
``datasets/<model>/<version>.parquet`` and named in the manifest, so the next retrain
starts from them.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import semver
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed, State

from fleet.analysis.quality import build_expectations, quality_markdown, validate
from fleet.catalog.registry import ModelVersion, Registry, TrainingData
from fleet.catalog.routes.store import Router
from fleet.logs.feedback import labelled
from fleet.logs.inference import feature_names
from fleet.runtime.bento import family_module
from fleet.runtime.packaged import artifact_cache, package_version
from fleet.types import ObjectStore, score_bins
from flows._context import emit, fleet_context


class GateFailed(Exception):
    """A retrain gate refused; the message is the reason the run ends Failed with."""


def dataset_key(model: str, version: str) -> str:
    return f"datasets/{model}/{version}.parquet"


def training_rows(store: ObjectStore, family: Any, champion: ModelVersion) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN401
    """The rows the champion was trained on, checked against the hash in its manifest."""
    td = champion.training_data
    if td is None:
        raise GateFailed(f"{champion.ref} names no training data; cannot retrain from it")
    if td.uri.startswith("store://"):
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(store.get(td.uri.removeprefix("store://")).data))
        names = [n for n in table.column_names if n != "label"]
        x = np.stack([table.column(n).to_numpy() for n in names], axis=1).astype(np.float32)
        y = table.column("label").to_numpy().astype(np.int64)
    else:
        x, y = family.train.generated_training_set(td.uri)
    if td.sha256 and family.data.digest(x, y) != td.sha256:
        raise GateFailed(f"the training data of {champion.ref} ({td.uri}) does not match the SHA-256 in its manifest")
    return x, y


@task(name="gather training data", cache_policy=NO_CACHE)
def gather(
    store: ObjectStore, model: str, champion: ModelVersion, family: Any, window_hours: float, min_feedback: int
) -> tuple[Any, int]:  # noqa: ANN401
    import pandas as pd

    x0, y0 = training_rows(store, family, champion)
    names = list(feature_names(champion.baseline_profile, x0.shape[1]))
    end = datetime.now(UTC)
    window = labelled(store, model, end - timedelta(hours=window_hours), end)
    fb = window[window["label"].notna()] if len(window) else window
    if len(fb) < min_feedback:
        raise GateFailed(
            f"only {len(fb)} labelled feedback rows in the last {window_hours:g} h; retraining needs "
            f"at least {min_feedback} (monitoring policy retrain.min_feedback_rows)"
        )
    base = pd.DataFrame(x0, columns=names).assign(label=y0, source="registered")
    feedback = fb[names].astype("float64").assign(label=fb["label"].astype("int64"), source="feedback")
    return pd.concat([base, feedback], ignore_index=True), len(feedback)


@task(name="validate training data", cache_policy=NO_CACHE)
def quality_gate(frame: Any, champion: ModelVersion, policy: Any) -> None:  # noqa: ANN401
    """The new rows (labelled feedback) against the champion's baseline. The registered rows
    were checked when they were registered and match their hash; mixed in, they would dilute
    a broken batch below every threshold."""
    new = frame[frame["source"] == "feedback"].drop(columns=["source", "label"])
    result = validate(
        new,
        build_expectations(champion.inputs, champion.baseline_profile, policy.quality),
        name=f"labelled feedback for a retrain of {champion.model}",
    )
    create_markdown_artifact(key=f"retrain-quality-{champion.model}", markdown=quality_markdown(result))
    if not result.passed:
        failed = "; ".join(f"{o.expectation} on {o.column}: {o.observed}" for o in result.failures[:5])
        raise GateFailed(f"training data failed its quality checks, nothing was trained: {failed}")


@task(name="train and evaluate", cache_policy=NO_CACHE)
def train_candidate(
    store: ObjectStore,
    frame: Any,
    family: Any,
    champion: ModelVersion,
    overrides: dict,
    out: Path,
    tolerance: float,
    cache_mib: float | None = None,
) -> tuple[Any, dict[str, float]]:  # noqa: ANN401
    names = [c for c in frame.columns if c not in ("label", "source")]
    rng = np.random.default_rng(int(champion.artifact_sha256[:8], 16))
    holdout = np.zeros(len(frame), bool)
    for _, group in frame.groupby("source"):  # the holdout has recent and registered rows alike
        idx = rng.permutation(group.index.to_numpy())
        holdout[idx[: max(1, len(idx) // 5)]] = True
    x, y = frame[names].to_numpy(np.float32), frame["label"].to_numpy(np.int64)
    base_config = family.train.TrainConfig(
        **{k: v for k, v in champion.hyperparameters.items() if k in family.train.TrainConfig.__dataclass_fields__}
    )
    unknown = set(overrides) - set(family.train.TrainConfig.__dataclass_fields__)
    if unknown:
        raise GateFailed(
            f"unknown hyperparameter(s) {sorted(unknown)}; known: {sorted(family.train.TrainConfig.__dataclass_fields__)}"
        )
    config = replace(
        base_config, **{"seed": base_config.seed + 1, "fault_error_rate": 0.0, "fault_latency_ms": 0.0, **overrides}
    )
    uri = "store://pending"
    meta = family.train.fit(
        x[~holdout],
        y[~holdout],
        x[holdout],
        y[holdout],
        config,
        out,
        TrainingData(uri=uri, sha256=family.data.digest(x, y)),
    )
    with artifact_cache(cache_mib).use(Registry(store), champion.model, champion.version) as champion_dir:
        champion_predictor = family.model.Predictor(champion_dir, device="cpu")  # its weights are in memory after this
    champion_proba = champion_predictor.predict_proba(x[holdout])
    champion_metrics = family.train.evaluate(champion_proba, y[holdout])
    # how far the candidate's predictions move from the champion's on recent traffic: the
    # shift its canary will show live, which the prediction gate must allow (that is the fix)
    recent = holdout & (frame["source"] == "feedback").to_numpy()
    champion_metrics["expected_prediction_psi"] = _score_psi(
        family.model.Predictor(out, device="cpu").predict_proba(x[recent]), champion_predictor.predict_proba(x[recent])
    )
    if meta.metrics["accuracy"] < champion_metrics["accuracy"] - tolerance:
        raise GateFailed(
            f"the candidate regresses: accuracy {meta.metrics['accuracy']:.4f} vs champion {champion.version} "
            f"{champion_metrics['accuracy']:.4f} on the same {int(holdout.sum())}-row holdout "
            f"(tolerance {tolerance:g}); nothing was registered"
        )
    return meta, champion_metrics


def _score_psi(candidate: np.ndarray, champion: np.ndarray) -> float:
    """PSI of two models' scores (last-class probabilities) on the same rows, binned and
    compared exactly as the canary's prediction gate will see them live; no rows: 0."""
    from fleet.analysis.drift.stats import psi  # scipy: paid when a retrain runs, not when flows load

    if not len(candidate):
        return 0.0
    return float(psi(score_bins(candidate[:, -1]), score_bins(champion[:, -1])))


def _family(name: str) -> Any:  # noqa: ANN401
    """A model family's retraining contract: its ``train`` (TrainConfig, fit, evaluate,
    generated_training_set), ``model`` (Predictor) and ``data`` (digest) modules."""
    import importlib
    from types import SimpleNamespace

    package = family_module(name).__name__
    return SimpleNamespace(**{m: importlib.import_module(f"{package}.{m}") for m in ("train", "model", "data")})


def next_version(registry: Registry, model: str) -> str:
    latest = max((semver.Version.parse(v) for v in registry.versions(model)), default=semver.Version(1, 0, 0))
    return str(latest.bump_minor())


@flow(name="retrain", flow_run_name="retrain {model}")
def retrain(
    model: str,
    reason: str = "requested",
    hyperparameters: dict | None = None,
    rollout: bool = True,
    window_hours: float | None = None,
    **rollout_overrides: Any,
) -> State:
    """Train a new version of ``model`` on its training data plus feedback; roll it out if it is not worse.

    ``hyperparameters`` override the champion's (e.g. ``{"epochs": 40}``); ``rollout_overrides``
    go to ``canary_rollout``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    logger = get_run_logger()
    ctx = fleet_context()
    spec, policy = ctx.policies.model(model), ctx.policies.monitoring_for(model)
    registry = Registry(ctx.store)
    stable = Router(ctx.store).get(model).stable
    if stable is None:
        return Failed(message=f"{model} has no stable version to retrain from")
    champion = registry.get(model, stable)
    family = _family(spec.family)
    tolerance = ctx.policies.rollout_for(model).offline_tolerance
    try:
        frame, feedback_rows = gather(
            ctx.store, model, champion, family, window_hours or policy.window_hours, policy.retrain.min_feedback_rows
        )
        quality_gate(frame, champion, policy)
        with tempfile.TemporaryDirectory(prefix="fleet-retrain-") as tmp:
            meta, champion_metrics = train_candidate(
                ctx.store,
                frame,
                family,
                champion,
                hyperparameters or {},
                Path(tmp) / "artifact",
                tolerance,
                ctx.policies.runtime.artifact_cache_mib,
            )
            version = next_version(registry, model)
            out = io.BytesIO()
            pq.write_table(pa.Table.from_pandas(frame.drop(columns=["source"]), preserve_index=False), out)
            ctx.store.put(dataset_key(model, version), out.getvalue(), if_none_match=True)
            meta = meta.model_copy(
                update={
                    "parent_version": champion.version,
                    "training_data": TrainingData(
                        uri=f"store://{dataset_key(model, version)}", sha256=meta.training_data.sha256
                    ),
                    "hyperparameters": {
                        **meta.hyperparameters,
                        "retrain_reason": reason,
                        "feedback_rows": feedback_rows,
                        "rows": len(frame),
                    },
                    "metrics": {
                        **meta.metrics,
                        "champion_accuracy": champion_metrics["accuracy"],
                        "expected_prediction_psi": champion_metrics["expected_prediction_psi"],
                    },
                    "description": f"{meta.description}; retrained from {champion.version}: {reason}",
                }
            )
            registered = registry.register(model, version, Path(tmp) / "artifact", meta)
    except GateFailed as exc:
        emit("fleet.retrain.refused", {"model": model, "reason": str(exc)})
        return Failed(message=f"retrain of {model} refused: {exc}")
    logger.info(
        "registered %s: accuracy %.4f vs champion %.4f on the same holdout",
        registered.ref,
        registered.metrics["accuracy"],
        champion_metrics["accuracy"],
    )
    emit("fleet.retrain.registered", {"model": model, "version": version, "parent": champion.version, "reason": reason})
    package_version(model, version)
    if not rollout:
        from prefect.states import Completed

        return Completed(message=f"registered and packaged {registered.ref}; not rolled out")
    from flows.rollout import canary_rollout

    gates = dict(rollout_overrides.pop("gates", {}) or {})
    if "max_prediction_psi" not in gates:
        allowed = ctx.policies.rollout_for(model).gates.max_prediction_psi
        expected = champion_metrics["expected_prediction_psi"]
        gates["max_prediction_psi"] = round(max(allowed, 1.5 * expected + 0.05), 3)
        logger.info(
            "predictions are expected to move by PSI %.3f from %s's: the canary may move up to %g",
            expected,
            champion.version,
            gates["max_prediction_psi"],
        )
    rolled = canary_rollout(model, version, **rollout_overrides, gates=gates, return_state=True)
    from prefect.states import Completed

    said = f"registered {registered.ref} from {champion.version} ({reason}); rollout: {rolled.message}"
    return Completed(message=said) if rolled.is_completed() else Failed(message=said)
