"""Registry: checksums, tampering, bad and duplicate versions, the lifecycle."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from fleet import audit, leases, records
from fleet.catalog.registry import Registry, State, TensorSpec, VersionMetadata
from fleet.errors import Conflict, IntegrityError, InvalidInput, NotFound
from fleet.store import MemoryStore
from fleet.types import ObjectStore

META = VersionMetadata(
    framework="torch",
    inputs=[TensorSpec(name="features", datatype="FP32", shape=[-1, 4])],
    outputs=[TensorSpec(name="probabilities", datatype="FP32", shape=[-1, 2])],
    hyperparameters={"hidden": 16},
    metrics={"accuracy": 0.9},
)


def register_demo(store: ObjectStore, tmp_path: Path, versions: tuple[str, ...] = ("1.0.0", "1.1.0")) -> Registry:
    """Versions of model ``demo``, a one-file artifact each: the start of the multi-process tests."""
    (tmp_path / "a").mkdir(exist_ok=True)
    (tmp_path / "a" / "w").write_text("w")
    reg = Registry(store)
    for v in versions:
        reg.register("demo", v, tmp_path / "a", META)
    return reg


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    root = tmp_path / "artifact"
    (root / "weights").mkdir(parents=True)
    (root / "config.json").write_text('{"hidden": 16}')
    (root / "weights" / "model.pt").write_bytes(bytes(range(256)) * 40)
    return root


def test_register_records_sha256_of_every_file_and_commits_a_manifest(store: ObjectStore, artifact: Path) -> None:
    reg = Registry(store)
    seen: list[str] = []
    mv = reg.register("demo", "1.0.0", artifact, META, who="ann", progress=lambda rel, _: seen.append(rel))
    assert set(mv.files) == {"config.json", "weights/model.pt"}
    assert seen == ["config.json", "weights/model.pt"]
    import hashlib

    assert (
        mv.files["weights/model.pt"].sha256 == hashlib.sha256((artifact / "weights/model.pt").read_bytes()).hexdigest()
    )
    assert mv.files["config.json"].size == len('{"hidden": 16}')
    assert (mv.state, mv.created_by) == (State.REGISTERED, "ann")
    assert reg.get("demo", "1.0.0") == mv
    assert "models/demo/1.0.0/manifest.json" in set(store.list("models/demo/"))
    assert not any(k.endswith("registering.json") for k in store.list())


def test_fetch_round_trips_the_artifact(store: ObjectStore, artifact: Path, tmp_path: Path) -> None:
    reg = Registry(store)
    reg.register("demo", "1.0.0", artifact, META)
    out = reg.fetch("demo", "1.0.0", tmp_path / "out")
    assert (out / "weights" / "model.pt").read_bytes() == (artifact / "weights" / "model.pt").read_bytes()
    assert (out / "config.json").read_text() == '{"hidden": 16}'


def test_tampered_file_is_refused_by_name_and_nothing_lands(artifact: Path, tmp_path: Path) -> None:
    store = MemoryStore()
    reg = Registry(store)
    reg.register("demo", "1.0.0", artifact, META)
    store.put("models/demo/1.0.0/artifact/weights/model.pt", b"evil weights")
    with pytest.raises(IntegrityError, match=r"'weights/model.pt' of demo:1.0.0 fails its checksum"):
        reg.fetch("demo", "1.0.0", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    with pytest.raises(IntegrityError, match="weights/model.pt"):
        reg.verify("demo", "1.0.0")


def test_missing_and_extra_artifact_files_are_refused(artifact: Path) -> None:
    store = MemoryStore()
    reg = Registry(store)
    reg.register("demo", "1.0.0", artifact, META)
    store.put("models/demo/1.0.0/artifact/backdoor.py", b"import os")
    with pytest.raises(IntegrityError, match="backdoor.py"):
        reg.verify("demo", "1.0.0")
    store.delete("models/demo/1.0.0/artifact/config.json")
    with pytest.raises(IntegrityError, match="'config.json' of demo:1.0.0 is missing"):
        reg.verify("demo", "1.0.0")


@pytest.mark.parametrize("version", ["1.0", "v1.0.0", "latest", "1.0.0.0", ""])
def test_non_semver_versions_are_refused(version: str, artifact: Path) -> None:
    with pytest.raises(InvalidInput, match="not a semantic version"):
        Registry(MemoryStore()).register("demo", version, artifact, META)


@pytest.mark.parametrize("name", ["Demo", "demo_model", "-demo", "a" * 64, "demo/x"])
def test_bad_model_names_are_refused(name: str, artifact: Path) -> None:
    with pytest.raises(InvalidInput, match="model name"):
        Registry(MemoryStore()).register(name, "1.0.0", artifact, META)


def test_duplicate_version_is_refused_and_the_original_kept(artifact: Path) -> None:
    store = MemoryStore()
    reg = Registry(store)
    first = reg.register("demo", "1.0.0", artifact, META)
    (artifact / "config.json").write_text("changed")
    with pytest.raises(Conflict, match="already registered"):
        reg.register("demo", "1.0.0", artifact, META)
    assert reg.verify("demo", "1.0.0") == first


def _lease(who: str, at: str) -> bytes:
    return (f'{{"id": "x", "who": "{who}", "acquired_at": "{at}", "renewed_at": "{at}"}}').encode()


def test_a_registration_in_progress_blocks_a_second_one(artifact: Path) -> None:
    store = MemoryStore()
    store.put("models/demo/1.0.0/registering.json", _lease("bob", audit.now().isoformat()))
    with pytest.raises(Conflict, match="registration of demo:1.0.0 is in progress by bob"):
        Registry(store).register("demo", "1.0.0", artifact, META)
    assert not records.exists(store, "models/demo/1.0.0/manifest.json")


def test_a_stale_lease_from_a_crash_is_taken_over_and_its_debris_removed(artifact: Path) -> None:
    store = MemoryStore()
    store.put("models/demo/1.0.0/registering.json", _lease("bob", "2020-01-01T00:00:00Z"))
    store.put("models/demo/1.0.0/artifact/old-shard.bin", b"half-written leftover")
    mv = Registry(store).register("demo", "1.0.0", artifact, META)
    assert Registry(store).verify("demo", "1.0.0") == mv
    assert not records.exists(store, "models/demo/1.0.0/artifact/old-shard.bin")
    assert not records.exists(store, "models/demo/1.0.0/registering.json")


def test_a_registration_that_loses_the_race_leaves_the_winner_intact(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B passes the duplicate check, then A commits before B takes the lease."""
    store = MemoryStore()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("B's different bytes")
    acquire = leases.acquire

    def a_commits_first(*args, **kwargs):
        if kwargs["who"] == "bob":
            Registry(store).register("demo", "1.0.0", artifact, META, who="ann")
        return acquire(*args, **kwargs)

    monkeypatch.setattr(leases, "acquire", a_commits_first)
    with pytest.raises(Conflict, match="already registered"):
        Registry(store).register("demo", "1.0.0", other, META, who="bob")
    assert Registry(store).verify("demo", "1.0.0").created_by == "ann"


def test_a_registration_taken_over_midway_never_commits(artifact: Path) -> None:
    store = MemoryStore()

    def someone_takes_over(_rel: str, _size: int) -> None:
        store.put("models/demo/1.0.0/registering.json", _lease("carol", audit.now().isoformat()))

    with pytest.raises(Conflict, match="lost the lease"):
        Registry(store).register("demo", "1.0.0", artifact, META, progress=someone_takes_over)
    assert not records.exists(store, "models/demo/1.0.0/manifest.json")
    assert b"carol" in store.get("models/demo/1.0.0/registering.json").data  # not released by the loser


def test_empty_missing_or_symlinked_artifacts_are_refused(tmp_path: Path, artifact: Path) -> None:
    reg = Registry(MemoryStore())
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInput, match="holds no files"):
        reg.register("demo", "1.0.0", tmp_path / "empty", META)
    with pytest.raises(InvalidInput, match="does not exist"):
        reg.register("demo", "1.0.0", tmp_path / "nope", META)
    (artifact / "link").symlink_to("/etc/passwd")
    with pytest.raises(InvalidInput, match="symbolic link"):
        reg.register("demo", "1.0.0", artifact, META)
    assert list(reg.store.list()) == []


def test_parent_version_must_exist(artifact: Path) -> None:
    reg = Registry(MemoryStore())
    with pytest.raises(NotFound, match="demo:0.9.0 is not registered"):
        reg.register("demo", "1.0.0", artifact, META.model_copy(update={"parent_version": "0.9.0"}))


def test_versions_sort_by_semver_not_text(artifact: Path) -> None:
    reg = Registry(MemoryStore())
    for v in ["1.10.0", "1.9.0", "1.0.0-rc.1", "1.0.0"]:
        reg.register("demo", v, artifact, META)
    assert reg.versions("demo") == ["1.0.0-rc.1", "1.0.0", "1.9.0", "1.10.0"]
    assert reg.models() == ["demo"]


def test_lifecycle_allows_the_documented_path_and_audits_it(artifact: Path) -> None:
    reg = Registry(MemoryStore())
    reg.register("demo", "1.0.0", artifact, META)
    for to in (State.CANARY, State.STABLE, State.RETIRED):
        assert reg.transition("demo", "1.0.0", to, why=f"to {to}", who="ann").state == to
    events = audit.events(reg.store, "demo")
    assert [(e.before, e.after) for e in events] == [
        (None, "registered"),
        ("registered", "canary"),
        ("canary", "stable"),
        ("stable", "retired"),
    ]
    assert reg.get("demo", "1.0.0").state_reason == "to retired"


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        ([], State.RETIRED),  # registered → retired
        ([State.CANARY], State.RETIRED),
        ([State.CANARY, State.REGISTERED], State.RETIRED),
        ([State.REJECTED], State.CANARY),  # rejected is final
        ([State.CANARY, State.STABLE], State.CANARY),
    ],
)
def test_other_transitions_are_refused_and_change_nothing(artifact: Path, path: list[State], refused: State) -> None:
    reg = Registry(MemoryStore())
    reg.register("demo", "1.0.0", artifact, META)
    for to in path:
        reg.transition("demo", "1.0.0", to, why="setup")
    before = reg.get("demo", "1.0.0")
    with pytest.raises(Conflict, match=f"cannot go from {before.state} to {refused}; allowed"):
        reg.transition("demo", "1.0.0", refused, why="nope")
    assert reg.get("demo", "1.0.0") == before


def test_unknown_state_name_is_refused(artifact: Path) -> None:
    reg = Registry(MemoryStore())
    reg.register("demo", "1.0.0", artifact, META)
    with pytest.raises(InvalidInput, match="expected one of registered, canary"):
        reg.transition("demo", "1.0.0", "live", why="x")


def test_bad_tensor_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="dimension"):
        TensorSpec(name="x", datatype="FP32", shape=[-1, 0])


def test_metadata_that_json_cannot_hold_is_refused_before_any_upload(artifact: Path) -> None:
    store = MemoryStore()
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValidationError, match="finite number"):
            VersionMetadata.model_validate({**META.model_dump(), "metrics": {"accuracy": bad}})
    assert list(store.list()) == []
