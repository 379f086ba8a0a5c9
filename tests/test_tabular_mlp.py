"""The tabular-mlp family: deterministic training, the int8 variant, faults built in on purpose."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from bentos.tabular_mlp import data
from bentos.tabular_mlp.model import Predictor
from bentos.tabular_mlp.train import TrainConfig, generated_training_set, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("mlp") / "artifact"
    return out, train(TrainConfig(rows=4000, epochs=8), out)


def test_training_is_byte_for_byte_deterministic_and_its_data_reproducible(trained, tmp_path: Path) -> None:
    out, meta = trained
    again = train(TrainConfig(rows=4000, epochs=8), tmp_path / "again")
    digest = lambda p: hashlib.sha256((p / "model.pt").read_bytes()).hexdigest()  # noqa: E731
    assert digest(out) == digest(tmp_path / "again") and again.metrics == meta.metrics
    x, y = generated_training_set(meta.training_data.uri)
    assert data.digest(x, y) == meta.training_data.sha256  # the URI names exactly what was trained on
    assert meta.metrics["accuracy"] > 0.9


def test_the_int8_variant_answers_like_fp32(trained) -> None:
    out, _ = trained
    x, _ = data.generate(2000, seed=3)
    fp32 = Predictor(out, device="cpu").predict_proba(x)
    int8 = Predictor(out, device="cpu", quantize=True).predict_proba(x)
    assert (fp32.argmax(1) == int8.argmax(1)).mean() > 0.98
    gap = np.abs(fp32 - int8)
    assert gap.mean() < 0.01 and np.quantile(gap, 0.99) < 0.1  # int8 weights: small gaps, rare larger ones
    with pytest.raises(ValueError, match="CPU only"):
        Predictor(out, device="meta", quantize=True)


def test_a_version_built_with_faults_says_so_in_its_config(tmp_path: Path) -> None:
    train(TrainConfig(rows=1000, epochs=1, fault_error_rate=0.1, fault_latency_ms=25), tmp_path / "faulty")
    assert Predictor(tmp_path / "faulty", device="cpu").faults == {"error_rate": 0.1, "latency_ms": 25}
    train(TrainConfig(rows=1000, epochs=1), tmp_path / "clean")
    assert Predictor(tmp_path / "clean", device="cpu").faults == {}
