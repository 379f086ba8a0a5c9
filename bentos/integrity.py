"""A model's files against its manifest, at load: each listed file's SHA-256 and size.

``fleet package`` copies this module into every Bento beside the family's service and
writes the manifest's listing into ``fleet_build.json``; the service checks its model
folder with ``verify_folder`` before it loads anything, so a missing or changed file stops
``bentoml serve`` (locally, or a pod's container) before it ever reports ready. It imports
nothing of ``fleet`` (a Bento does not carry it); ``fleet.runtime.cache`` uses the same
functions for its entries.

Listings are the manifest's form: ``{"model.pt": {"sha256": "<64 hex>", "size": 1234}}``.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
Listing = Mapping[str, Mapping[str, Any]]

# path → (stat signature, (sha256, size)). A file is hashed again only when its signature
# changes; any write moves its ctime, which no call can set back (utime sets mtime only),
# so restoring size and mtime after a change does not fool the memo.
_MEMO: dict[str, tuple[tuple[int, ...], tuple[str, int]]] = {}


class ArtifactMismatch(Exception):
    """Files of a model differ from its manifest; the message lists every difference."""

    def __init__(self, folder: str | os.PathLike[str], problems: list[str], remedy: str = "") -> None:
        self.folder, self.problems = str(folder), problems
        super().__init__(
            f"model files in {folder} do not match the manifest, refusing to load them: "
            + "; ".join(problems)
            + (f"; {remedy}" if remedy else "")
        )


@dataclass(frozen=True)
class Mismatch:
    """One listed file whose bytes are not the ones the manifest names (``actual`` None: missing)."""

    path: str
    sha256: str
    size: int
    actual: tuple[str, int] | None

    def __str__(self) -> str:
        expected = f"expected sha256 {self.sha256} ({self.size} bytes)"
        if self.actual is None:
            return f"{self.path}: missing, {expected}"
        return f"{self.path}: {expected}, got {self.actual[0]} ({self.actual[1]} bytes)"


def compare(listing: Listing, actual: Mapping[str, tuple[str, int] | None]) -> list[Mismatch]:
    """The listed files whose actual (sha256, size) differs, in path order (pure).

    >>> compare({"w": {"sha256": "ab", "size": 2}}, {"w": ("ab", 2)})
    []
    >>> [str(m) for m in compare({"w": {"sha256": "ab", "size": 2}}, {"w": None})]
    ['w: missing, expected sha256 ab (2 bytes)']
    """
    found = []
    for path in sorted(listing):
        want = (listing[path]["sha256"], int(listing[path]["size"]))
        got = actual.get(path)
        if got != want:
            found.append(Mismatch(path, want[0], want[1], got))
    return found


def listing_sha256(listing: Listing) -> str:
    """One hash for a whole listing, as ``ModelVersion.artifact_sha256`` computes it: SHA-256
    over the sorted ``path NUL sha256 LF`` lines."""
    lines = "".join(f"{path}\0{listing[path]['sha256']}\n" for path in sorted(listing))
    return hashlib.sha256(lines.encode()).hexdigest()


def file_digest(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """(sha256, size) of a regular file, None when it is missing or not a regular file.

    Streams in 1 MiB chunks (weights can be larger than memory) and remembers the answer
    for this process until the file's stat signature changes.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    key = os.path.abspath(path)
    memo = _MEMO.get(key)
    if memo is not None and memo[0] == signature:
        return memo[1]
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    result = (digest.hexdigest(), size)
    _MEMO[key] = (signature, result)
    return result


def remember(path: str | os.PathLike[str], signature: tuple[int, ...], digest: tuple[str, int]) -> None:
    """Take ``digest`` as ``path``'s (sha256, size) while its stat signature is ``signature``:
    what another process verified (``weights.py``'s record), so it is not hashed again here.
    A file changed since has another signature (its ctime moved) and is hashed."""
    _MEMO[os.path.abspath(path)] = (tuple(signature), (digest[0], int(digest[1])))


def check_folder(folder: str | os.PathLike[str], listing: Listing, *, exact: bool = False) -> list[str]:
    """Every difference between ``folder`` and ``listing``, as readable lines; [] when they match.

    ``exact`` also reports files the listing does not name (a cache entry holds exactly the
    manifest's files; a BentoML model folder also holds BentoML's own ``model.yaml``).
    """
    root = Path(folder)
    problems = [str(m) for m in compare(listing, {p: file_digest(root.joinpath(*p.split("/"))) for p in listing})]
    if exact:
        problems += [f"{p}: not in the manifest" for p in _files(root) if p not in listing]
    return problems


def verify_folder(
    folder: str | os.PathLike[str], listing: Listing, artifact_sha256: str | None = None, *, remedy: str = ""
) -> None:
    """Raise ``ArtifactMismatch`` unless every listed file is in ``folder`` with its SHA-256 and size.

    With ``artifact_sha256`` the listing itself is checked first: it must be the one that
    hash names (the hash the registry, the Bento's labels and the image record carry).
    """
    if artifact_sha256 is not None and listing_sha256(listing) != artifact_sha256:
        raise ArtifactMismatch(
            folder,
            [f"the file listing hashes to {listing_sha256(listing)}, expected artifact sha256 {artifact_sha256}"],
            remedy,
        )
    if not listing:
        raise ArtifactMismatch(folder, ["the manifest lists no files"], remedy)
    if problems := check_folder(folder, listing):
        raise ArtifactMismatch(folder, problems, remedy)


def _files(root: Path) -> Iterable[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink())
