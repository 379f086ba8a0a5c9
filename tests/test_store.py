"""One contract for every ObjectStore backend, plus the races two processes can run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.errors import ConfigError, InvalidInput, NotFound, PreconditionFailed, StoreUnavailable
from fleet.store import FileStore, open_store
from fleet.types import ObjectStore

WORKER = Path(__file__).with_name("race_worker.py")


def test_put_then_get_returns_bytes_and_etag(store: ObjectStore) -> None:
    etag = store.put("routes/demo.json", b'{"a": 1}')
    obj = store.get("routes/demo.json")
    assert obj.data == b'{"a": 1}'
    assert obj.etag == etag
    assert store.put("routes/demo.json", b'{"a": 2}') != etag


def test_get_missing_raises_not_found_naming_the_key(store: ObjectStore) -> None:
    with pytest.raises(NotFound, match="routes/nope.json"):
        store.get("routes/nope.json")


def test_if_none_match_refuses_existing_key(store: ObjectStore) -> None:
    store.put("a/b", b"first", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put("a/b", b"second", if_none_match=True)
    assert store.get("a/b").data == b"first"


def test_if_match_needs_the_current_etag(store: ObjectStore) -> None:
    old = store.put("k/v", b"1")
    new = store.put("k/v", b"2", if_match=old)
    with pytest.raises(PreconditionFailed):
        store.put("k/v", b"3", if_match=old)  # stale ETag: someone else wrote in between
    assert store.get("k/v").data == b"2"
    store.put("k/v", b"4", if_match=new)
    assert store.get("k/v").data == b"4"


def test_if_match_on_missing_key_fails(store: ObjectStore) -> None:
    with pytest.raises(PreconditionFailed):
        store.put("k/missing", b"x", if_match="0" * 64)
    with pytest.raises(NotFound):
        store.get("k/missing")


def test_list_is_sorted_and_filtered_by_prefix(store: ObjectStore) -> None:
    for key in ["models/b/1/manifest.json", "models/a/2/x", "models/a/1/x", "routes/a.json", "models2/z"]:
        store.put(key, b"")
    assert list(store.list("models/")) == ["models/a/1/x", "models/a/2/x", "models/b/1/manifest.json"]
    assert list(store.list("models/a")) == ["models/a/1/x", "models/a/2/x"]
    assert list(store.list("models")) == [
        "models/a/1/x",
        "models/a/2/x",
        "models/b/1/manifest.json",
        "models2/z",
    ]
    assert list(store.list("nothing/")) == []
    assert len(list(store.list())) == 5


def test_delete_removes_and_is_idempotent(store: ObjectStore) -> None:
    store.put("x/y", b"1")
    store.delete("x/y")
    store.delete("x/y")
    with pytest.raises(NotFound):
        store.get("x/y")
    assert list(store.list("x/")) == []


def test_binary_and_empty_objects_round_trip(store: ObjectStore) -> None:
    blob = bytes(range(256)) * 100
    store.put("blobs/bin", blob)
    store.put("blobs/empty", b"")
    assert store.get("blobs/bin").data == blob
    assert store.get("blobs/empty").data == b""


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a", ".locks/x", "a\\b", "a/."])
def test_bad_keys_are_refused_with_the_rule(store: ObjectStore, key: str) -> None:
    with pytest.raises(InvalidInput, match="expected"):
        store.put(key, b"x")


def test_racing_conditional_updates_lose_nothing(store_url: str) -> None:
    """Two processes increment one counter 40 times each: the result must be 80."""
    times = 40
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), store_url, "race/counter.json", str(times), name])
        for name in ("p1", "p2")
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    counter = json.loads(open_store(store_url).get("race/counter.json").data)
    assert counter["value"] == 2 * times
    assert sorted(set(counter["writers"])) == ["p1", "p2"]
    assert len(counter["writers"]) == 2 * times


def test_of_writers_racing_on_one_etag_exactly_one_wins(store: ObjectStore) -> None:
    """S3's conditional writes are atomic: eight writers that read the same ETag each PUT with
    ``If-Match`` at once, and exactly one is accepted, round after round. moto needs
    ``tests/moto_s3.py`` for that: it checks the ETag, then writes; with its write slowed by 5 ms,
    three of eight writers won the first round without the lock, one with it."""
    import threading

    etag = store.put("race/one.json", b"0")
    for round_ in range(1, 21):
        barrier, won, lock = threading.Barrier(8), [], threading.Lock()

        def write(n: int, etag: str = etag, round_: int = round_, barrier=barrier, won=won, lock=lock) -> None:  # noqa: ANN001
            barrier.wait()
            try:
                written = store.put("race/one.json", f"{round_}:{n}".encode(), if_match=etag)
            except PreconditionFailed:
                return
            with lock:
                won.append((n, written))

        threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1, f"round {round_}: {len(won)} writers won with the same If-Match"
        current = store.get("race/one.json")
        assert current.data == f"{round_}:{won[0][0]}".encode() and current.etag == won[0][1]
        etag = current.etag


def test_file_store_hides_its_own_files_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("a/b", b"x", if_none_match=True)
    store.put("a/b", b"y", if_match=store.get("a/b").etag)
    assert list(store.list()) == ["a/b"]
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_reading_a_missing_file_store_does_not_create_it(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path / 'typo'}")
    assert list(store.list("models/")) == []
    with pytest.raises(NotFound):
        store.get("routes/demo.json")
    assert not (tmp_path / "typo").exists()


def test_file_store_refuses_a_key_that_is_a_folder_of_other_keys(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("a/b", b"x")
    with pytest.raises(InvalidInput, match="other keys live under it"):
        store.put("a", b"y")
    with pytest.raises(InvalidInput, match="part of its path is already an object"):
        store.put("a/b/c", b"z")
    assert list(store.list()) == ["a/b"]


@pytest.mark.parametrize(
    ("url", "kind"),
    [("file:///tmp/x", "FileStore"), ("/tmp/y", "FileStore"), ("s3://bucket/pre/fix", "S3Store")],
)
def test_open_store_picks_the_backend_by_scheme(url: str, kind: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = url.replace("/tmp", str(tmp_path))
    assert type(open_store(url)).__name__ == kind


def test_open_store_defaults_to_the_embedded_file_store(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLEET_STORE", raising=False)
    store = open_store()
    assert isinstance(store, FileStore)
    assert store.root == tmp_path / ".fleet" / "store"


def test_s3_url_keeps_bucket_and_prefix() -> None:
    store = open_store("s3://models-bucket/fleet/prod")
    assert (store.bucket, store.prefix) == ("models-bucket", "fleet/prod")


@pytest.mark.parametrize("url", ["gs://bucket/x", "http://host/x", "s3:bucket", "s3://"])
def test_unknown_or_malformed_store_urls_name_the_accepted_ones(url: str) -> None:
    with pytest.raises(ConfigError, match=r"file://.*s3://"):
        open_store(url)


def test_s3_missing_bucket_is_a_clear_error(s3_endpoint: str) -> None:
    store = open_store("s3://no-such-bucket-here/x")
    with pytest.raises(ConfigError, match="no-such-bucket-here.*does not exist"):
        store.put("a", b"x")


# -- S3 error mapping: answers moto does not give, stubbed at the botocore layer -----------


def _stubbed(method: str, code: str, status: int):
    """An S3Store whose next ``method`` call answers with this error code and status."""
    import boto3
    from botocore.stub import Stubber

    from fleet.store.s3 import S3Store

    client = boto3.client("s3", endpoint_url="http://127.0.0.1:9")
    stub = Stubber(client)
    stub.add_client_error(method, service_error_code=code, http_status_code=status)
    stub.activate()
    return S3Store("bucket", "pre", client=client)


@pytest.mark.parametrize(
    ("method", "code", "status", "op", "raised", "message"),
    [
        ("get_object", "NoSuchKey", 404, "get", NotFound, "no object at 'k'"),
        ("get_object", "404", 404, "get", StoreUnavailable, "not|refused"),
        ("put_object", "ConditionalRequestConflict", 409, "cput", PreconditionFailed, "changed or exists"),
        ("put_object", "PreconditionFailed", 412, "cput", PreconditionFailed, "changed or exists"),
        ("put_object", "NoSuchKey", 404, "cput", PreconditionFailed, "changed or exists"),
        ("put_object", "AccessDenied", 403, "put", StoreUnavailable, "AccessDenied"),
        ("put_object", "NoSuchBucket", 404, "put", ConfigError, "'bucket' does not exist"),
    ],
)
def test_s3_error_codes_map_to_fleet_errors(method, code, status, op, raised, message) -> None:
    store = _stubbed(method, code, status)
    with pytest.raises(raised, match=message):
        if op == "get":
            store.get("k")
        elif op == "cput":
            store.put("k", b"x", if_match='"etag"')
        else:
            store.put("k", b"x")


def test_s3_without_credentials_names_the_variables(monkeypatch) -> None:
    from fleet.store.s3 import S3Store

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = S3Store("bucket", endpoint_url="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="no AWS credentials.*AWS_ACCESS_KEY_ID"):
        store.get("k")


def test_a_file_store_that_cannot_write_names_the_key_not_its_temporary_file(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    store.put("routes/a.json", b"{}")
    tmp = tmp_path / "s" / ".tmp"
    shutil.rmtree(tmp)
    tmp.write_text("not a folder")  # every write now fails below the store's own files
    with pytest.raises(StoreUnavailable) as caught:
        store.put("routes/a.json", b"{ }")
    message = str(caught.value)
    assert "'routes/a.json'" in message and ".tmp" not in message and ".locks" not in message
    assert store.get("routes/a.json").data == b"{}"  # nothing was changed
