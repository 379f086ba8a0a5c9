"""Packaging: one Bento per version, labelled with its artifact; BentoML's store is a cache of
the registry, so an entry built from another artifact under the same tag is replaced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bentos.tabular_mlp.train import TrainConfig, train_and_register
from fleet.registry import Registry
from fleet.runtime.cache import ArtifactCache
from fleet.spec import load_policies
from fleet.store import FileStore

ROOT = Path(__file__).resolve().parents[1]


def test_a_bento_of_another_artifact_under_the_same_tag_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.runtime.bento import bentoml_home, package

    if "bentoml" not in __import__("sys").modules:
        monkeypatch.setenv("BENTOML_HOME", str(tmp_path / "bentoml"))
    bentoml_home()
    spec = load_policies(ROOT / "policies").model("demo-classifier")
    model = f"pack-{os.getpid()}"  # a model name no other test's BentoML store holds
    first, second = FileStore(tmp_path / "a"), FileStore(tmp_path / "b")  # two stores, one BentoML home
    a = train_and_register(first, model, "1.0.0", TrainConfig(rows=500, epochs=1, seed=1))
    b = train_and_register(second, model, "1.0.0", TrainConfig(rows=500, epochs=1, seed=2))
    assert a.artifact_sha256 != b.artifact_sha256
    built = package(Registry(first), model, "1.0.0", spec, ArtifactCache(tmp_path / "cache"))
    assert built.built and built.artifact_sha256 == a.artifact_sha256
    assert not package(Registry(first), model, "1.0.0", spec, ArtifactCache(tmp_path / "cache")).built
    lines: list[str] = []
    rebuilt = package(Registry(second), model, "1.0.0", spec, ArtifactCache(tmp_path / "cache"), log=lines.append)
    import bentoml

    assert rebuilt.built and bentoml.bentos.get(rebuilt.bento).info.labels["artifact-sha256"] == b.artifact_sha256
    assert any("rebuilding it from the registry" in line for line in lines)
    assert bentoml.models.get(f"{model}:1.0.0").info.labels["artifact-sha256"] == b.artifact_sha256
