"""Train a tabular-mlp version on generated data, profile it, and register it.

    python -m bentos.tabular_mlp.train demo-classifier 1.0.0 [--seed 7] [--rows 20000]
    fleet models train demo-classifier 1.0.0            (the same, via the CLI)

Seeded and deterministic: the same arguments give the same weights, byte for byte.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bentos.tabular_mlp import data
from bentos.tabular_mlp.model import MLP, Predictor, save
from fleet.catalog.profile import baseline_profile
from fleet.catalog.registry import ModelVersion, Registry, TensorSpec, TrainingData, VersionMetadata
from fleet.types import ObjectStore

Progress = Callable[[int, int], None]  # (epochs done, epochs in all), after each epoch
PROGRESS_UNIT = "epochs"


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 7
    rows: int = 20_000
    epochs: int = 25
    hidden: tuple[int, ...] = (32, 32)
    lr: float = 0.01
    batch_size: int = 256
    holdout: float = 0.2
    data_shift: float = 0.0
    label_threshold: float = data.THRESHOLD
    # Faults built into the version, to rehearse a rollback (fleet demo, the rollout tests):
    # this share of requests fails with HTTP 500, and every answer waits this much longer.
    fault_error_rate: float = 0.0
    fault_latency_ms: float = 0.0


def train(config: TrainConfig, out: Path, *, progress: Progress | None = None) -> VersionMetadata:
    """Train into ``out`` (model.pt + config.json) on generated data; return the version's metadata."""
    x, y = data.generate(config.rows, config.seed, config.data_shift, config.label_threshold)
    split = int(len(x) * (1 - config.holdout))
    uri = f"generated://tabular-mlp?rows={config.rows}&seed={config.seed}&shift={config.data_shift}" + (
        f"&threshold={config.label_threshold}" if config.label_threshold != data.THRESHOLD else ""
    )
    training_data = TrainingData(uri=uri, sha256=data.digest(x, y))
    return fit(x[:split], y[:split], x[split:], y[split:], config, out, training_data, progress=progress)


def generated_training_set(uri: str) -> tuple[np.ndarray, np.ndarray]:
    """The exact rows a ``generated://tabular-mlp?...`` URI names (what a version was trained on)."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(uri)
    if parts.scheme != "generated" or parts.netloc != "tabular-mlp":
        raise ValueError(f"training data {uri!r} is not generated://tabular-mlp?rows=..&seed=..; cannot regenerate it")
    q = {k: v[0] for k, v in parse_qs(parts.query).items()}
    return data.generate(
        int(q["rows"]), int(q["seed"]), float(q.get("shift", 0.0)), float(q.get("threshold", data.THRESHOLD))
    )


def fit(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    config: TrainConfig,
    out: Path,
    training_data: TrainingData,
    *,
    progress: Progress | None = None,
) -> VersionMetadata:
    """Train on the given rows (seeded: the same rows give the same bytes), judge on the holdout."""
    torch.manual_seed(config.seed)
    torch.use_deterministic_algorithms(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions in one order: the same bytes every run
    try:
        x_train, x_test = x_train.astype(np.float32), x_test.astype(np.float32)
        mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1e-6
        net = MLP(x_train.shape[1], list(config.hidden), 2)
        opt = torch.optim.Adam(net.parameters(), lr=config.lr)
        xt = torch.from_numpy((x_train - mean) / std)
        yt = torch.from_numpy(y_train.astype(np.int64))
        gen = torch.Generator().manual_seed(config.seed)
        loss_fn = nn.CrossEntropyLoss()
        for epoch in range(config.epochs):
            order = torch.randperm(len(xt), generator=gen)
            for i in range(0, len(xt), config.batch_size):
                idx = order[i : i + config.batch_size]
                opt.zero_grad()
                loss_fn(net(xt[idx]), yt[idx]).backward()
                opt.step()
            if progress is not None:
                progress(epoch + 1, config.epochs)
        model_config = {
            "architecture": "mlp",
            "inputs": x_train.shape[1],
            "hidden": list(config.hidden),
            "classes": 2,
            "features": list(data.FEATURES),
            "mean": mean.tolist(),
            "std": std.tolist(),
        }
        if config.fault_error_rate or config.fault_latency_ms:
            model_config["faults"] = {"error_rate": config.fault_error_rate, "latency_ms": config.fault_latency_ms}
        save(out, net, model_config)
    finally:
        torch.set_num_threads(threads)
    predictor = Predictor(out, device="cpu")
    proba = predictor.predict_proba(x_test)
    return VersionMetadata(
        framework="torch",
        description="tabular-mlp: MLP classifier over income, debt_ratio, age, tenure",
        inputs=[TensorSpec(name="features", datatype="FP32", shape=[-1, x_train.shape[1]])],
        outputs=[TensorSpec(name="probabilities", datatype="FP32", shape=[-1, 2])],
        hyperparameters={k: list(v) if isinstance(v, tuple) else v for k, v in vars(config).items()},
        training_data=training_data,
        metrics=evaluate(proba, y_test),
        baseline_profile=baseline_profile(x_test, data.FEATURES, proba),
    )


def evaluate(proba: np.ndarray, y: np.ndarray) -> dict[str, float]:
    pred = proba.argmax(axis=1)
    tp = float(((pred == 1) & (y == 1)).sum())
    precision = tp / max(float((pred == 1).sum()), 1.0)
    recall = tp / max(float((y == 1).sum()), 1.0)
    eps = 1e-7
    log_loss = float(-np.mean(np.log(np.clip(proba[np.arange(len(y)), y], eps, 1.0))))
    return {
        "accuracy": float((pred == y).mean()),
        "f1": 2 * precision * recall / max(precision + recall, eps),
        "log_loss": log_loss,
        "holdout_rows": float(len(y)),
    }


def train_and_register(
    store: ObjectStore,
    model: str,
    version: str,
    config: TrainConfig = TrainConfig(),
    *,
    parent: str | None = None,
    progress: Progress | None = None,
) -> ModelVersion:
    Registry(store).check_new(model, version, parent=parent)  # refused now, not after the training
    with tempfile.TemporaryDirectory(prefix="fleet-train-") as tmp:
        meta = train(config, Path(tmp) / "artifact", progress=progress)
        if parent is not None:
            meta = meta.model_copy(update={"parent_version": parent})
        return Registry(store).register(model, version, Path(tmp) / "artifact", meta)


def main(argv: list[str] | None = None) -> None:
    from fleet.store import open_store

    parser = argparse.ArgumentParser(description="Train and register a tabular-mlp version.")
    parser.add_argument("model")
    parser.add_argument("version")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--rows", type=int, default=TrainConfig.rows)
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    parser.add_argument("--parent")
    args = parser.parse_args(argv)
    config = TrainConfig(seed=args.seed, rows=args.rows, epochs=args.epochs)
    mv = train_and_register(open_store(), args.model, args.version, config, parent=args.parent)
    print(f"registered {mv.ref}: accuracy {mv.metrics['accuracy']:.3f}")


if __name__ == "__main__":
    main()
