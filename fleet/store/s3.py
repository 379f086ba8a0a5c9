"""S3 (or any S3-compatible endpoint) store through boto3, with S3's conditional writes.

``if_match`` maps to ``IfMatch`` and ``if_none_match`` to ``IfNoneMatch="*"``; S3 answers
412 (or 409 when two conditional writes overlap), both raised as ``PreconditionFailed`` so
the caller retries from a fresh read. The endpoint comes from ``endpoint_url`` or boto3's
own ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` variables.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fleet.errors import ConfigError, NotFound, PreconditionFailed, StoreUnavailable
from fleet.store._shared import check_key, check_prefix
from fleet.types import ObjectInfo, StoredObject

_PRECONDITION_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}


class S3Store:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        client: Any = None,
    ) -> None:
        if not bucket:
            raise ConfigError("S3 store needs a bucket; expected s3://<bucket>[/<prefix>]")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        if client is None:
            import boto3  # deferred: boto3 costs ~0.3 s to import
            from botocore.config import Config

            # A session of its own: the default one caches credentials process-wide.
            client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url,
                # Bounded: a CLI call against a silent endpoint fails in ~30 s, not minutes.
                config=Config(
                    retries={"total_max_attempts": 3, "mode": "standard"},
                    max_pool_connections=64,  # a gateway reads many records at once at start
                    connect_timeout=5,
                    read_timeout=10,
                ),
            )
        self._s3 = client

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def get(self, key: str) -> StoredObject:
        with self._errors(key):
            resp = self._s3.get_object(Bucket=self.bucket, Key=self._full(key))
            data = resp["Body"].read()
        return StoredObject(key, data, resp["ETag"])

    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        kwargs: dict[str, Any] = {}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        with self._errors(key, conditional=bool(kwargs)):
            resp = self._s3.put_object(Bucket=self.bucket, Key=self._full(key), Body=bytes(data), **kwargs)
        return resp["ETag"]

    def get_if_changed(self, key: str, etag: str | None) -> StoredObject | None:
        if etag is None:
            return self.get(key)
        resp = None
        with self._errors(key, not_modified=True):
            resp = self._s3.get_object(Bucket=self.bucket, Key=self._full(key), IfNoneMatch=etag)
            resp = {**resp, "Body": resp["Body"].read()}
        if resp is None:
            return None
        return StoredObject(key, resp["Body"], resp["ETag"])

    def list(self, prefix: str = "") -> Iterator[str]:
        yield from (info.key for info in self.scan(prefix))

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        with self._errors(prefix):
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            found = [
                ObjectInfo(obj["Key"][strip:], obj["ETag"], obj["LastModified"].timestamp())
                for page in pages
                for obj in page.get("Contents", [])
            ]
        yield from found

    def delete(self, key: str) -> None:
        with self._errors(key):
            self._s3.delete_object(Bucket=self.bucket, Key=self._full(key))

    def _errors(self, key: str, conditional: bool = False, not_modified: bool = False) -> _S3Errors:
        return _S3Errors(self, key, conditional, not_modified)


class _S3Errors:
    """Translate botocore's exceptions into the fleet's, naming the key and the bucket."""

    def __init__(self, store: S3Store, key: str, conditional: bool, not_modified: bool = False) -> None:
        self.store, self.key, self.conditional, self.not_modified = store, key, conditional, not_modified

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        where = f"{self.key!r} in {self.store.url}"
        endpoint = getattr(self.store._s3.meta, "endpoint_url", "?")
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            if self.not_modified and (code in ("304", "NotModified")):
                return True  # a conditional GET whose object is unchanged: the caller sees no answer
            if code in _PRECONDITION_CODES or (self.conditional and code == "NoSuchKey"):
                raise PreconditionFailed(
                    f"conditional write of {where} failed ({code}): it changed or exists"
                ) from None
            if code == "NoSuchKey":
                raise NotFound(f"no object at {where}") from None
            if code == "NoSuchBucket":
                raise ConfigError(
                    f"bucket {self.store.bucket!r} does not exist at {endpoint}; "
                    "create it or fix FLEET_STORE / AWS_ENDPOINT_URL_S3"
                ) from None
            # Anything else (a bare 404 included) means the endpoint is not answering as S3
            # does; treating it as "missing" would turn it into wrong answers.
            raise StoreUnavailable(
                f"S3 at {endpoint} refused {where}: {code} {err.get('Message', '')}".strip()
            ) from None
        if isinstance(exc, NoCredentialsError):
            raise ConfigError(
                f"no AWS credentials for {self.store.url}; set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or AWS_PROFILE (and AWS_ENDPOINT_URL_S3 for an "
                "S3-compatible store)"
            ) from None
        if isinstance(exc, BotoCoreError):
            raise StoreUnavailable(f"S3 at {endpoint} unreachable for {where}: {exc}") from None
        return False
