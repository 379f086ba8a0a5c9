"""Model registry: immutable, checksummed model versions and their lifecycle state.

``models/<model>/<version>/manifest.json`` is the commit point of a registration: artifact
files are uploaded first, the manifest last (must-not-exist), so a version is either fully
registered or absent. A lease (``registering.json``) keeps two registrations of one
version from interleaving their uploads. Every download verifies each file's SHA-256.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fleet import audit, leases, records
from fleet.errors import Conflict, IntegrityError, InvalidInput, NotFound, PreconditionFailed
from fleet.names import check_name, check_version, version_key
from fleet.types import ObjectStore

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
]  # the Open Inference Protocol's tensor datatypes

# A registration that uploaded no file for this long is taken to have crashed.
REGISTRATION_LEASE = timedelta(hours=1)


class State(StrEnum):
    REGISTERED = "registered"
    CANARY = "canary"
    STABLE = "stable"
    RETIRED = "retired"
    REJECTED = "rejected"


# registered → canary → stable → retired, or rejected. Three more edges, all deliberate:
# registered → stable bootstraps a model that has no stable version yet (routing refuses it
# otherwise), retired → stable is a rollback to the previous stable, and canary → registered
# is a canary taken out of its slot by hand (replaced or cleared) without a verdict: it may
# be rolled out again. States follow the route table (``Router._reconcile_states``).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.REGISTERED: frozenset({State.CANARY, State.STABLE, State.REJECTED}),
    State.CANARY: frozenset({State.STABLE, State.REGISTERED, State.REJECTED}),
    State.STABLE: frozenset({State.RETIRED}),
    State.RETIRED: frozenset({State.STABLE}),
    State.REJECTED: frozenset(),
}
SERVABLE = frozenset({State.REGISTERED, State.CANARY, State.STABLE})


class _Frozen(BaseModel):
    # JSON has no inf or NaN: a metric of nan would be stored as null and refused on every read
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class TensorSpec(_Frozen):
    name: str = Field(min_length=1, max_length=128)
    datatype: Datatype
    shape: list[int] = Field(description="-1 marks a variable dimension (e.g. the batch)")

    def model_post_init(self, _: Any) -> None:
        if any(d < -1 or d == 0 for d in self.shape):
            raise ValueError(f"shape {self.shape} has a dimension < 1 other than -1")


class FileDigest(_Frozen):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class TrainingData(_Frozen):
    uri: str
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class VersionMetadata(_Frozen):
    """What the registrant states about a version (the rest is computed)."""

    framework: str = Field(min_length=1)
    inputs: list[TensorSpec] = Field(min_length=1)
    outputs: list[TensorSpec] = Field(min_length=1)
    hyperparameters: dict[str, Any] = {}
    training_data: TrainingData | None = None
    metrics: dict[str, float] = {}
    baseline_profile: dict[str, Any] | None = None
    parent_version: str | None = None
    description: str = ""


class ModelVersion(VersionMetadata):
    model: str
    version: str
    files: dict[str, FileDigest] = Field(min_length=1)
    created_at: datetime
    created_by: str
    state: State = State.REGISTERED
    state_changed_at: datetime
    state_reason: str = ""

    @property
    def ref(self) -> str:
        return f"{self.model}:{self.version}"

    @property
    def artifact_sha256(self) -> str:
        """One hash for the whole artifact: SHA-256 over the sorted (path, file hash) list."""
        listing = "".join(f"{rel}\0{d.sha256}\n" for rel, d in sorted(self.files.items()))
        return hashlib.sha256(listing.encode()).hexdigest()


def _prefix(model: str, version: str) -> str:
    return f"models/{model}/{version}"


class Registry:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    # -- reading ---------------------------------------------------------------------
    def get(self, model: str, version: str) -> ModelVersion:
        key = f"{_prefix(model, version)}/manifest.json"
        try:
            mv = records.load(self.store, key, ModelVersion)[0]
            if (mv.model, mv.version) != (model, version):
                raise IntegrityError(f"{key!r} in {self.store.url} names {mv.ref}, not {model}:{version}")
            return mv
        except NotFound:
            known = self.versions(model)
            hint = f"registered: {', '.join(known)}" if known else "it has no versions"
            raise NotFound(f"model version {model}:{version} is not registered ({hint})") from None

    def models(self) -> list[str]:
        return sorted({k.split("/")[1] for k in self.store.list("models/") if k.endswith("/manifest.json")})

    def versions(self, model: str) -> list[str]:
        found = [
            parts[2]
            for key in self.store.list(f"models/{model}/")
            if len(parts := key.split("/")) == 4 and parts[3] == "manifest.json"
        ]
        return sorted(found, key=version_key)

    def list(self, model: str | None = None) -> list[ModelVersion]:
        """Every readable version (of ``model``, or of all models); bad manifests are skipped."""
        return self.scan(model)[0]

    def scan(self, model: str | None = None) -> tuple[list[ModelVersion], list[records.BadRecord]]:
        """Every version's manifest, and the manifests that cannot be read (reported once).

        One corrupt or tampered manifest never hides the others: listing commands, the
        gateway and placement read through here. A manifest whose model or version differs
        from its key is bad too (a copied file must not pose as another version).
        """
        good, bad = records.load_all(
            self.store,
            f"models/{check_name('model', model)}/" if model else "models/",
            ModelVersion,
            keep=_is_manifest,
        )
        found = []
        for key, mv in good.items():
            _, model_name, version, _ = key.split("/")
            if (mv.model, mv.version) != (model_name, version):
                wrong = records.BadRecord(
                    key, f"{key!r} in {self.store.url} names {mv.ref}, not {model_name}:{version}", "ModelVersion"
                )
                records.report(wrong)
                bad.append(wrong)
            else:
                found.append(mv)
        return sorted(found, key=lambda mv: (mv.model, version_key(mv.version))), bad

    def states(self, model: str) -> dict[str, State]:
        return {mv.version: mv.state for mv in self.list(model)}

    # -- registering -----------------------------------------------------------------
    def check_new(self, model: str, version: str, *, parent: str | None = None) -> None:
        """Refuse now what ``register`` would refuse at its end, before a caller trains or
        uploads: a bad name or version, a version registered already, a parent that is not.
        (``register`` checks again: another registration may commit in between.)"""
        check_name("model", model)
        check_version(version)
        if parent is not None:
            self.get(model, parent)
        if records.exists(self.store, f"{_prefix(model, version)}/manifest.json"):
            raise Conflict(self._duplicate(model, version))

    def _duplicate(self, model: str, version: str) -> str:
        known = set(self.versions(model))
        nxt = version_key(version)
        for _ in range(1000):
            nxt = nxt.bump_prerelease() if nxt.prerelease else nxt.bump_patch()
            if str(nxt) not in known:
                break
        return (
            f"{model}:{version} is already registered (versions are immutable); expected a new version, "
            f"e.g. {nxt} (see `fleet models list {model}`)"
        )

    def register(
        self,
        model: str,
        version: str,
        artifact_dir: str | os.PathLike[str],
        meta: VersionMetadata,
        *,
        who: str | None = None,
        progress: Callable[[str, int], None] | None = None,
    ) -> ModelVersion:
        """Upload every file under ``artifact_dir`` and commit the manifest.

        ``progress(relative_path, bytes)`` is called after each file is uploaded.
        """
        check_name("model", model)
        check_version(version)
        who = who or audit.actor()
        files = _artifact_files(Path(artifact_dir))
        if meta.parent_version is not None:
            self.get(model, meta.parent_version)  # the parent must exist
        prefix = _prefix(model, version)
        duplicate = (
            f"{model}:{version} is already registered, by another registration meanwhile (versions are immutable); "
            f"expected a new version (see `fleet models list {model}`)"
        )
        if records.exists(self.store, f"{prefix}/manifest.json"):
            raise Conflict(self._duplicate(model, version))
        lease = leases.acquire(
            self.store,
            f"{prefix}/registering.json",
            what=f"registration of {model}:{version}",
            who=who,
            stale_after=REGISTRATION_LEASE,
        )
        try:
            # Checked again under the lease: another registration may have committed
            # between the first check and the lease.
            if records.exists(self.store, f"{prefix}/manifest.json"):
                raise Conflict(duplicate)
            for key in list(self.store.list(f"{prefix}/artifact/")):
                self.store.delete(key)  # debris of a registration that crashed before its manifest
            digests: dict[str, FileDigest] = {}
            for rel, path in files:
                data = path.read_bytes()
                self.store.put(f"{prefix}/artifact/{rel}", data)
                digests[rel] = FileDigest(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
                lease.renew()  # progress; fails if a takeover happened, before the commit
                if progress:
                    progress(rel, len(data))
            at = audit.now()
            mv = ModelVersion(
                **meta.model_dump(),
                model=model,
                version=version,
                files=digests,
                created_at=at,
                created_by=who,
                state_changed_at=at,
            )
            try:
                records.create(self.store, f"{prefix}/manifest.json", mv)
            except PreconditionFailed:
                raise Conflict(duplicate) from None
        finally:
            lease.release()
        audit.append(
            self.store,
            audit.AuditEvent(
                model=model,
                kind="state",
                at=at,
                who=who,
                why="registered",
                version=version,
                before=None,
                after=State.REGISTERED.value,
            ),
        )
        return mv

    # -- verifying and downloading ---------------------------------------------------
    def verify(self, model: str, version: str) -> ModelVersion:
        """Check every stored artifact file against the manifest; raise on any difference."""
        mv = self.get(model, version)
        for _ in self._verified_files(mv):
            pass  # each file is checked as it is read
        prefix = f"{_prefix(model, version)}/artifact/"
        extra = [k[len(prefix) :] for k in self.store.list(prefix) if k[len(prefix) :] not in mv.files]
        if extra:
            raise IntegrityError(
                f"{mv.ref} has artifact files that are not in its manifest: {', '.join(extra)}; "
                "the stored artifact was changed after registration"
            )
        return mv

    def fetch(
        self,
        model: str,
        version: str,
        dest: str | os.PathLike[str],
        *,
        progress: Callable[[str, int], None] | None = None,
    ) -> Path:
        """Download the verified artifact into ``dest`` (which must not exist yet).

        Files land in a temporary folder beside ``dest`` that is renamed into place only
        after every checksum matched, so ``dest`` never holds a partial or tampered copy.
        ``progress(relative_path, bytes)`` is called after each file is written.
        """
        dest = Path(dest)
        if dest.exists():
            raise InvalidInput(f"download target {dest} already exists; expected a new path")
        mv = self.get(model, version)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            for rel, data in self._verified_files(mv):
                target = tmp.joinpath(*rel.split("/"))
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                if progress:
                    progress(rel, len(data))
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest

    def _verified_files(self, mv: ModelVersion) -> Iterator[tuple[str, bytes]]:
        prefix = f"{_prefix(mv.model, mv.version)}/artifact"
        for rel, digest in sorted(mv.files.items()):
            try:
                data = self.store.get(f"{prefix}/{rel}").data
            except NotFound:
                raise IntegrityError(f"artifact file {rel!r} of {mv.ref} is missing from the store") from None
            actual = hashlib.sha256(data).hexdigest()
            if actual != digest.sha256 or len(data) != digest.size:
                raise IntegrityError(
                    f"artifact file {rel!r} of {mv.ref} fails its checksum: expected sha256 "
                    f"{digest.sha256} ({digest.size} bytes), got {actual} ({len(data)} bytes); "
                    "refusing to use a file changed after registration"
                )
            yield rel, data

    # -- lifecycle -------------------------------------------------------------------
    def transition(
        self,
        model: str,
        version: str,
        to: State | str,
        *,
        why: str,
        who: str | None = None,
        expect: State | None = None,
    ) -> ModelVersion:
        """Move a version to state ``to`` if the lifecycle allows it; audit the change.

        ``expect``: move only from this state (``Conflict`` otherwise), for a caller that
        decided the move from a state it read earlier.
        """
        to = _state(to)
        who = who or audit.actor()
        self.get(model, version)  # a clear NotFound before the update loop

        def change(mv: ModelVersion | None) -> ModelVersion:
            assert mv is not None
            if expect is not None and mv.state != expect:
                raise Conflict(f"{mv.ref} is {mv.state}, no longer {expect}; not moved to {to}")
            if to not in TRANSITIONS[mv.state]:
                allowed = ", ".join(sorted(TRANSITIONS[mv.state])) or "none (final state)"
                raise Conflict(f"{mv.ref} cannot go from {mv.state} to {to}; allowed from {mv.state}: {allowed}")
            return mv.model_copy(update={"state": to, "state_changed_at": audit.now(), "state_reason": why})

        before, after = records.update(self.store, f"{_prefix(model, version)}/manifest.json", ModelVersion, change)
        audit.append(
            self.store,
            audit.AuditEvent(
                model=model,
                kind="state",
                at=after.state_changed_at,
                who=who,
                why=why,
                version=version,
                before=before.state.value if before else None,
                after=to.value,
            ),
        )
        return after


def _is_manifest(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 4 and parts[3] == "manifest.json"


def _state(value: State | str) -> State:
    try:
        return State(value)
    except ValueError:
        raise InvalidInput(f"state {value!r} is not valid; expected one of {', '.join(State)}") from None


def _artifact_files(root: Path) -> list[tuple[str, Path]]:
    if not root.is_dir():
        raise InvalidInput(f"artifact folder {root} does not exist or is not a folder")
    files: list[tuple[str, Path]] = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            raise InvalidInput(f"artifact folder {root} holds a symbolic link {path}; expected regular files only")
        if path.is_file():
            files.append((path.relative_to(root).as_posix(), path))
    if not files:
        raise InvalidInput(f"artifact folder {root} holds no files; expected the model's files")
    return files
