"""Integrity at load: the check every Bento runs on its model files (bentos/integrity.py), the
artifact cache that re-verifies its entries and repairs broken ones, and the image digests
Kubernetes deploys by (fleet.runtime.images)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bentos import integrity
from bentos.integrity import (
    ArtifactMismatch,
    Mismatch,
    check_folder,
    compare,
    file_digest,
    listing_sha256,
    verify_folder,
)
from fleet.catalog.registry import ModelVersion, Registry
from fleet.errors import IntegrityError, InvalidInput, NotFound
from fleet.runtime import images
from fleet.runtime.cache import ArtifactCache, manifest_listing
from fleet.store import FileStore, MemoryStore
from tests.test_registry import META

WEIGHTS = bytes(range(256)) * 40
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    root = tmp_path / "artifact"
    (root / "weights").mkdir(parents=True)
    (root / "config.json").write_text('{"hidden": 16}')
    (root / "weights" / "model.pt").write_bytes(WEIGHTS)
    return root


@pytest.fixture
def version(tmp_path: Path, artifact: Path) -> tuple[Registry, ModelVersion]:
    registry = Registry(FileStore(tmp_path / "store"))
    return registry, registry.register("demo", "1.0.0", artifact, META)


def flip_a_byte(path: Path) -> None:
    """Change one byte in place: same size, same mtime afterwards (only ctime tells).

    Waits for the kernel's coarse file clock (a tick of at most 10 ms) first, so the change
    gets a ctime of its own even right after the file was written.
    """
    time.sleep(0.02)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# --- the pure comparison -----------------------------------------------------------------------


def test_compare_names_each_missing_or_different_file_with_expected_and_actual() -> None:
    listing = {"b.pt": {"sha256": "b" * 64, "size": 3}, "a.json": {"sha256": "a" * 64, "size": 1}}
    assert compare(listing, {"a.json": ("a" * 64, 1), "b.pt": ("b" * 64, 3)}) == []
    found = compare(listing, {"a.json": None, "b.pt": ("c" * 64, 3), "extra": ("d" * 64, 1)})
    assert found == [Mismatch("a.json", "a" * 64, 1, None), Mismatch("b.pt", "b" * 64, 3, ("c" * 64, 3))]
    assert str(found[0]) == f"a.json: missing, expected sha256 {'a' * 64} (1 bytes)"
    assert str(found[1]) == f"b.pt: expected sha256 {'b' * 64} (3 bytes), got {'c' * 64} (3 bytes)"
    assert compare(listing, {"a.json": ("a" * 64, 2), "b.pt": ("b" * 64, 3)})[0].actual == ("a" * 64, 2)  # size alone


def test_the_listing_hash_is_the_registry_s_artifact_sha256(version) -> None:  # noqa: ANN001
    _, mv = version
    assert listing_sha256(manifest_listing(mv)) == mv.artifact_sha256


# --- a model folder at load ---------------------------------------------------------------------


def test_a_folder_as_registered_passes_and_files_bentoml_adds_are_ignored(version, artifact: Path) -> None:  # noqa: ANN001
    _, mv = version
    (artifact / "model.yaml").write_text("name: demo\n")  # what bentoml.models.create writes beside the files
    verify_folder(artifact, manifest_listing(mv), mv.artifact_sha256)
    assert check_folder(artifact, manifest_listing(mv), exact=True) == ["model.yaml: not in the manifest"]


def test_one_changed_byte_is_refused_naming_the_file_and_both_hashes(version, artifact: Path) -> None:  # noqa: ANN001
    _, mv = version
    listing = manifest_listing(mv)
    verify_folder(artifact, listing, mv.artifact_sha256)  # hashed once: the memo now holds it
    flip_a_byte(artifact / "weights" / "model.pt")
    actual = hashlib.sha256((artifact / "weights" / "model.pt").read_bytes()).hexdigest()
    with pytest.raises(ArtifactMismatch) as caught:
        verify_folder(artifact, listing, mv.artifact_sha256, remedy="expected the registered files")
    message = str(caught.value)
    assert (
        f"weights/model.pt: expected sha256 {mv.files['weights/model.pt'].sha256} ({len(WEIGHTS)} bytes), got {actual}"
        in message
    )
    assert message.startswith(f"model files in {artifact} do not match the manifest, refusing to load them")
    assert message.endswith("; expected the registered files") and "config.json" not in message


def test_a_missing_file_and_a_listing_that_is_not_the_artifact_s_are_refused(version, artifact: Path) -> None:  # noqa: ANN001
    _, mv = version
    listing = manifest_listing(mv)
    with pytest.raises(
        ArtifactMismatch,
        match=r"the file listing hashes to [0-9a-f]{64}, expected artifact sha256 " + mv.artifact_sha256,
    ):
        verify_folder(
            artifact, {**listing, "weights/model.pt": {"sha256": "0" * 64, "size": len(WEIGHTS)}}, mv.artifact_sha256
        )
    (artifact / "config.json").unlink()
    with pytest.raises(ArtifactMismatch, match=r"config.json: missing, expected sha256 [0-9a-f]{64} \(14 bytes\)"):
        verify_folder(artifact, listing)
    with pytest.raises(ArtifactMismatch, match="the manifest lists no files"):
        verify_folder(artifact, {})


def test_the_memo_hashes_an_unchanged_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "w"
    path.write_bytes(WEIGHTS)
    opened: list[str] = []
    monkeypatch.setattr(integrity, "open", lambda p, *a, **k: opened.append(str(p)) or open(p, *a, **k), raising=False)
    first = file_digest(path)
    assert file_digest(path) == first and opened == [str(path)]
    flip_a_byte(path)  # mtime and size restored: ctime still moves
    assert file_digest(path) != first and len(opened) == 2
    assert file_digest(tmp_path / "nothing") is None and file_digest(tmp_path) is None


# --- the artifact cache -------------------------------------------------------------------------


def test_the_cache_re_verifies_and_replaces_a_changed_partial_or_padded_entry(version, tmp_path: Path) -> None:  # noqa: ANN001
    registry, mv = version
    cache = ArtifactCache(tmp_path / "cache")
    entry = cache.path(registry, "demo", "1.0.0")
    assert entry == tmp_path / "cache" / mv.artifact_sha256
    inode = entry.stat().st_ino
    assert cache.path(registry, "demo", "1.0.0").stat().st_ino == inode  # intact: served as it is, not fetched again

    for damage in (
        lambda: flip_a_byte(entry / "weights" / "model.pt"),
        lambda: (entry / "config.json").unlink(),
        lambda: (entry / "weights" / "model.pt").write_bytes(WEIGHTS[:100]),
        lambda: (entry / "stray.bin").write_bytes(b"x"),
    ):
        damage()
        lines: list[str] = []
        assert cache.path(registry, "demo", "1.0.0", log=lines.append) == entry
        assert check_folder(entry, manifest_listing(mv), exact=True) == [], (
            "a damaged entry must be replaced, not served"
        )
        assert (entry / "weights" / "model.pt").read_bytes() == WEIGHTS
        assert len(lines) == 1 and lines[0].startswith(
            f"cached artifact of demo:1.0.0 at {entry} does not match its manifest ("
        )
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        ".locks",
        mv.artifact_sha256,
    ]  # nothing left aside


def test_a_corrupt_store_is_never_cached(version, tmp_path: Path) -> None:  # noqa: ANN001
    registry, mv = version
    blob = tmp_path / "store" / "models" / "demo" / "1.0.0" / "artifact" / "weights" / "model.pt"
    flip_a_byte(blob)
    with pytest.raises(IntegrityError, match="artifact file 'weights/model.pt' of demo:1.0.0 fails its checksum"):
        ArtifactCache(tmp_path / "cache").path(registry, "demo", "1.0.0")
    assert not (tmp_path / "cache" / mv.artifact_sha256).exists()


def test_processes_repairing_one_entry_at_once_all_get_the_intact_files(version, tmp_path: Path) -> None:  # noqa: ANN001
    registry, mv = version
    cache = ArtifactCache(tmp_path / "cache")
    entry = cache.path(registry, "demo", "1.0.0")
    flip_a_byte(entry / "weights" / "model.pt")
    integrity._MEMO.clear()  # as a fresh process would start
    results: list[object] = []
    barrier = threading.Barrier(4)

    def use() -> None:
        barrier.wait()
        try:
            results.append(ArtifactCache(tmp_path / "cache").path(registry, "demo", "1.0.0"))
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            results.append(exc)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [entry] * 4
    assert check_folder(entry, manifest_listing(mv), exact=True) == []


def _versions(tmp_path: Path, n: int, size: int) -> tuple[Registry, list[ModelVersion]]:
    """``n`` versions of ``demo`` whose artifacts differ, each ``size`` bytes of weights."""
    registry = Registry(FileStore(tmp_path / "store"))
    out = []
    for i in range(n):
        folder = tmp_path / f"artifact-{i}"
        folder.mkdir()
        (folder / "model.pt").write_bytes(bytes([i]) * size)
        out.append(registry.register("demo", f"1.{i}.0", folder, META))
    return registry, out


def test_the_cache_stays_within_its_budget_removing_the_least_recently_used_entry(tmp_path: Path) -> None:
    registry, versions = _versions(tmp_path, 4, 40_000)
    cache = ArtifactCache(tmp_path / "cache", max_bytes=100_000)  # two entries fit, not three
    held = lambda: {sha for sha, _, _ in cache.entries()}  # noqa: E731
    entry = lambda i: tmp_path / "cache" / versions[i].artifact_sha256  # noqa: E731
    for i in (0, 1):
        with cache.use(registry, "demo", versions[i].version):
            pass
        os.utime(entry(i), (1_000 + i, 1_000 + i))  # recency made explicit (the file clock is coarse)
    with cache.use(registry, "demo", "1.0.0") as folder:  # used again: its entry becomes the most recent
        assert (folder / "model.pt").read_bytes() == bytes([0]) * 40_000
    assert entry(0).stat().st_mtime > 1_001  # a use touches its entry
    with cache.use(registry, "demo", "1.2.0"):  # a third entry: the least recently used (1.1.0) goes
        pass
    assert held() == {versions[0].artifact_sha256, versions[2].artifact_sha256}
    assert sum(size for _, size, _ in cache.entries()) <= 100_000
    os.utime(entry(0), (2_000, 2_000))  # 1.0.0 now older than 1.2.0
    with cache.use(registry, "demo", "1.1.0"):  # fetched again, verified, and 1.0.0 goes
        pass
    assert held() == {versions[2].artifact_sha256, versions[1].artifact_sha256}


def test_an_entry_in_use_by_another_process_is_never_evicted(tmp_path: Path) -> None:
    import subprocess
    import sys

    registry, versions = _versions(tmp_path, 3, 40_000)
    cache = ArtifactCache(tmp_path / "cache", max_bytes=50_000)  # one entry fits
    script = (
        "import sys, time; from pathlib import Path\n"
        "from fleet.catalog.registry import Registry; from fleet.store import FileStore; from fleet.runtime.cache import ArtifactCache\n"
        f"cache = ArtifactCache({str(tmp_path / 'cache')!r}, max_bytes=50_000)\n"
        f"with cache.use(Registry(FileStore({str(tmp_path / 'store')!r})), 'demo', '1.0.0') as folder:\n"
        "    print('using', flush=True); sys.stdin.readline()\n"
        "    print((folder / 'model.pt').stat().st_size, flush=True)\n"
    )
    user = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert user.stdout.readline().strip() == "using"  # type: ignore[union-attr]
        for v in versions[1:]:
            with cache.use(registry, "demo", v.version):
                pass
        entries = {sha for sha, _, _ in cache.entries()}
        assert versions[0].artifact_sha256 in entries  # in use over there: kept, though least recently used
        assert versions[1].artifact_sha256 not in entries  # what could go, went
        user.stdin.write("done\n")  # type: ignore[union-attr]
        user.stdin.flush()  # type: ignore[union-attr]
        assert user.stdout.readline().strip() == "40000"  # type: ignore[union-attr]  # its files were there throughout
        assert user.wait(30) == 0
    finally:
        if user.poll() is None:
            user.kill()
            user.wait()
    cache.evict()  # once nobody uses it, the budget holds again
    assert sum(size for _, size, _ in cache.entries()) <= 50_000


def test_prefetch_caches_and_verifies_ahead_of_the_first_use(version, tmp_path: Path) -> None:  # noqa: ANN001
    registry, mv = version
    folder, size, took = ArtifactCache(tmp_path / "cache").prefetch(registry, "demo", "1.0.0")
    assert (
        folder == tmp_path / "cache" / mv.artifact_sha256 and size == len(WEIGHTS) + len('{"hidden": 16}') and took >= 0
    )
    assert check_folder(folder, manifest_listing(mv), exact=True) == []


# --- image digests ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "sha256:" + "AB" * 32,
        "sha256:" + "ab" * 31,
        "ab" * 32,
        "sha512:" + "ab" * 64,
        f"repo@{DIGEST}",
        DIGEST + "\n",
        DIGEST + "0",
        "sha256: " + "ab" * 32,
    ],
)
def test_an_image_digest_must_be_sha256_and_64_lowercase_hex_digits(bad: str) -> None:
    with pytest.raises(
        InvalidInput, match=r"image digest .* is not valid; expected 'sha256:' followed by 64 lowercase hex digits"
    ):
        images.check_digest(bad)
    assert images.check_digest(DIGEST) == DIGEST


def test_repositories_are_checked_as_image_references_name_them() -> None:
    for good in (
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/serving-fleet-prod/tabular-mlp",
        "localhost:5000/m",
        "m",
    ):
        assert images.check_repository(good) == good
    for bad in ("repo:tag", f"repo@{DIGEST}", "Repo/Upper", "a//b", "-a/b"):
        with pytest.raises(InvalidInput, match="is not valid; expected a repository without tag or digest"):
            images.check_repository(bad)


def test_a_recorded_digest_is_what_deploys_and_another_artifact_s_record_is_refused(artifact: Path) -> None:
    store = MemoryStore()
    registry = Registry(store)
    mv = registry.register("demo", "1.0.0", artifact, META)
    with pytest.raises(
        NotFound, match=r"no image digest is recorded for demo:1.0.0; .*fleet package demo 1.0.0 --image-digest sha256:"
    ):
        images.reference(store, mv, "ecr/tabular-mlp")
    before, after = images.record(store, mv, DIGEST, "demo:1.0.0", repository="ecr/tabular-mlp", who="ci")
    assert before is None and (after.digest, after.artifact_sha256, after.recorded_by) == (
        DIGEST,
        mv.artifact_sha256,
        "ci",
    )
    assert images.get(store, "demo", "1.0.0") == after
    assert images.reference(store, mv, "ecr/tabular-mlp") == f"ecr/tabular-mlp@{DIGEST}"
    rebuilt = "sha256:" + "cd" * 32
    before, after = images.record(store, mv, rebuilt, "demo:1.0.0")
    assert before.digest == DIGEST and images.reference(store, mv, "r") == f"r@{rebuilt}"
    with pytest.raises(InvalidInput):
        images.record(store, mv, "latest", "demo:1.0.0")
    other = mv.model_copy(update={"files": {"x": mv.files["config.json"]}})  # what a different artifact would hash to
    with pytest.raises(
        IntegrityError,
        match=rf"the image recorded for demo:1.0.0 \({rebuilt}\) was built from artifact {mv.artifact_sha256}",
    ):
        images.reference(store, other, "r")


def test_fleet_package_refuses_a_bad_digest_before_building_anything() -> None:
    from fleet.cli import app

    result = CliRunner().invoke(app, ["package", "demo-classifier", "1.0.0", "--image-digest", "sha256:1234"])
    assert result.exit_code == 2 and "expected 'sha256:' followed by 64 lowercase hex digits" in result.output
    result = CliRunner().invoke(app, ["package", "demo-classifier", "1.0.0", "--repository", "ecr/x"])
    assert result.exit_code == 2 and "expected --image-digest too" in result.output
