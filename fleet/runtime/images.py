"""Model images by digest: the exact container image a version runs as in Kubernetes.

A tag can be pushed again; a digest names one image, bytes and all. The image itself is
built and pushed outside the fleet (``bentoml containerize <model>:<version>``, then
``docker push``), so its digest is recorded afterwards with ``fleet package MODEL VERSION
--image-digest sha256:<64 hex>``, as ``images/<model>/<version>.json`` in the store: beside
the manifest, not in it (manifests are immutable, and an image can be rebuilt from the same
artifact). ``KubernetesRuntime.deploy`` runs ``<repository>@<digest>`` and refuses a version
with no record, or whose record was made for another artifact.
"""

from __future__ import annotations

import re
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from fleet import audit, records
from fleet.catalog.registry import ModelVersion
from fleet.errors import IntegrityError, InvalidInput, NotFound
from fleet.runtime.bento import bento_version
from fleet.types import ObjectStore

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# A repository as an image reference names it (the grammar of distribution/reference):
# an optional registry host[:port], then lowercase path components.
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*")


class ImageRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    version: str
    digest: str = Field(pattern=rf"^{DIGEST.pattern}$")
    repository: str | None = None  # where it was pushed (informational: the cluster pulls from its own)
    bento: str  # the Bento tag the image was containerized from
    artifact_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    recorded_at: datetime
    recorded_by: str


def key(model: str, version: str) -> str:
    return f"images/{model}/{version}.json"


def check_digest(value: str) -> str:
    """The digest, if it is one: ``sha256:`` and 64 lowercase hex digits, nothing else."""
    if not DIGEST.fullmatch(value):
        raise InvalidInput(
            f"image digest {value!r} is not valid; expected 'sha256:' followed by 64 lowercase hex digits, "
            "as `docker inspect --format '{{index .RepoDigests 0}}' IMAGE` prints after the '@'"
        )
    return value


def check_repository(value: str) -> str:
    """The repository, if an image reference could name it so (host[:port]/path, no tag, no digest)."""
    if len(value) > 255 or "@" in value or not REPOSITORY.fullmatch(value):
        raise InvalidInput(
            f"image repository {value!r} is not valid; expected a repository without tag or digest, "
            "e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/serving-fleet-prod/tabular-mlp"
        )
    return value


def record(
    store: ObjectStore,
    mv: ModelVersion,
    digest: str,
    bento: str,
    *,
    repository: str | None = None,
    who: str | None = None,
) -> tuple[ImageRecord | None, ImageRecord]:
    """Record ``digest`` as the image of ``mv`` (a conditional write); return (before, after).

    Recording again replaces the digest (a rebuilt image of the same artifact); the record
    before is returned so the caller can say what it replaced.
    """
    after = ImageRecord(
        model=mv.model,
        version=mv.version,
        digest=check_digest(digest),
        repository=check_repository(repository) if repository else None,
        bento=bento,
        artifact_sha256=mv.artifact_sha256,
        recorded_at=audit.now(),
        recorded_by=who or audit.actor(),
    )
    return records.update(store, key(mv.model, mv.version), ImageRecord, lambda _: after)


def get(store: ObjectStore, model: str, version: str) -> ImageRecord | None:
    return records.load_or_none(store, key(model, version), ImageRecord)[0]


def reference(store: ObjectStore, mv: ModelVersion, repository: str) -> str:
    """``<repository>@<digest>`` of the image recorded for ``mv``; refused when there is none,
    or when it was recorded for another artifact than the manifest's."""
    found = get(store, mv.model, mv.version)
    if found is None:
        raise NotFound(
            f"no image digest is recorded for {mv.ref}; Kubernetes deploys model images by digest only. Build and push "
            f"it (bentoml containerize {mv.model}:{bento_version(mv.version, False)} -t {repository}:{mv.model}-"
            f"{bento_version(mv.version, False)}, then docker push), then record its digest: fleet package {mv.model} "
            f"{mv.version} --image-digest sha256:<64 hex>"
        )
    if found.artifact_sha256 != mv.artifact_sha256:
        raise IntegrityError(
            f"the image recorded for {mv.ref} ({found.digest}) was built from artifact {found.artifact_sha256}, but "
            f"the manifest's artifact is {mv.artifact_sha256}; expected an image of the registered files: rebuild "
            f"it and record it again with fleet package {mv.model} {mv.version} --image-digest"
        )
    return f"{repository}@{found.digest}"
