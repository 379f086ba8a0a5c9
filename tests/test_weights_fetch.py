"""Weights out of images: a replica fetches its version's files from the store (moto's S3 server
on 127.0.0.1) into the node's cache at start, verified against the manifest before it is ready;
two replicas on a node download once, a killed fetch resumes, the budget evicts what no replica
uses; the model Deployment mounts that cache and gives a tensor-parallel replica /dev/shm."""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import boto3
import pytest
from k8s_schemas import validate

from bentos import weights
from bentos.fetch import FetchError, S3Source
from bentos.weights import NodeCache, model_dir
from fleet.catalog.registry import ModelVersion, Registry, TensorSpec, VersionMetadata
from fleet.runtime.cache import ArtifactCache, manifest_listing
from fleet.store import open_store

ROOT = Path(__file__).resolve().parents[1]
WITHIN_S = 30.0
META = VersionMetadata(
    framework="test",
    inputs=[TensorSpec(name="x", datatype="FP32", shape=[-1, 1])],
    outputs=[TensorSpec(name="y", datatype="FP32", shape=[-1, 1])],
)
CHUNK = 64 << 10  # small ranges, so one file is several GETs


class Counting:
    """A source that records every ranged GET (key, start, end) it is asked for."""

    def __init__(self, inner: S3Source) -> None:
        self.inner, self.url, self.ranges = inner, inner.url, []

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def read(self, key: str, start: int, end: int) -> Iterator[bytes]:
        self.ranges.append((key, start, end))
        yield from self.inner.read(key, start, end)


def _register(url: str, tmp: Path, version: str, weights_bytes: int, seed: int) -> ModelVersion:
    folder = tmp / f"artifact-{version}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"seed": seed}))
    (folder / "model.safetensors").write_bytes(bytes((seed * 7 + i * 13) % 251 for i in range(weights_bytes)))
    return Registry(open_store(url)).register("m", version, folder, META, who="test")


def _source(url: str) -> Counting:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return Counting(S3Source(bucket, prefix))


def _fetch(cache: NodeCache, mv: ModelVersion, source: Counting | None) -> Path:
    prefix = f"models/{mv.model}/{mv.version}/artifact/"
    return cache.ensure(mv.artifact_sha256, manifest_listing(mv), source, prefix, what=mv.ref)


def _corrupt(url: str, key: str) -> bytes:
    """Flip one byte of ``key`` in the bucket (same size); the new bytes."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3")
    data = bytearray(s3.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read())
    data[len(data) // 2] ^= 0x01
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=bytes(data))
    return bytes(data)


def test_a_cold_fetch_lands_verified_files_and_a_warm_start_reads_nothing(s3_url: str, tmp_path: Path) -> None:
    mv = _register(s3_url, tmp_path, "1.0.0", 300_000, seed=1)
    lines: list[str] = []
    cache = NodeCache(tmp_path / "node", chunk_bytes=CHUNK, log=lines.append)
    cold = _source(s3_url)
    folder = _fetch(cache, mv, cold)
    assert folder == tmp_path / "node" / mv.artifact_sha256
    source_dir = tmp_path / "artifact-1.0.0"
    for rel in mv.files:
        assert (folder / rel).read_bytes() == (source_dir / rel).read_bytes()
    # 300,000 bytes in 64 KiB ranges: 5 GETs, and one for config.json; each range asked once
    assert sorted(cold.ranges) == sorted(
        [("models/m/1.0.0/artifact/config.json", 0, mv.files["config.json"].size)]
        + [("models/m/1.0.0/artifact/model.safetensors", s, min(s + CHUNK, 300_000)) for s in range(0, 300_000, CHUNK)]
    )
    assert any("MiB/s" in line and "done in" in line for line in lines)  # progress with its rate, in the log
    assert not list((tmp_path / "node").glob(".fetch-*"))  # the staging folder became the entry
    warm = _source(s3_url)
    assert _fetch(cache, mv, warm) == folder and warm.ranges == []


def test_a_fetched_entry_is_hashed_once_not_again_by_the_services_check_or_the_next_process(
    s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """130 GiB hashed at ~1.5 GB/s is a minute and a half: the fetch hashes each file once, and
    the service's check (same process) and BentoML's worker (the next process) trust that."""
    from bentos import integrity

    mv = _register(s3_url, tmp_path, "1.0.0", 100_000, seed=8)
    folder = _fetch(NodeCache(tmp_path / "node", chunk_bytes=CHUNK, log=lambda _: None), mv, _source(s3_url))
    opened: list[str] = []
    monkeypatch.setattr(integrity, "open", lambda p, *a, **k: opened.append(str(p)) or open(p, *a, **k), raising=False)
    integrity.verify_folder(folder, manifest_listing(mv), mv.artifact_sha256)
    assert opened == []
    integrity._MEMO.clear()  # a new process: only the node cache's record of verified files
    _fetch(NodeCache(tmp_path / "node", log=lambda _: None), mv, None)
    integrity.verify_folder(folder, manifest_listing(mv), mv.artifact_sha256)
    assert opened == []
    (folder / "config.json").write_text('{"seed": 9}')  # a changed file moves its ctime: hashed, refused
    with pytest.raises(FetchError, match="config.json: expected sha256"):
        _fetch(NodeCache(tmp_path / "node", log=lambda _: None), mv, None)
    assert opened == [str(folder / "config.json")]


def test_a_corrupted_object_in_the_store_is_refused_before_ready_naming_the_file_and_both_digests(
    s3_url: str, tmp_path: Path
) -> None:
    mv = _register(s3_url, tmp_path, "1.0.0", 200_000, seed=2)
    bad = _corrupt(s3_url, "models/m/1.0.0/artifact/model.safetensors")
    build = {
        "model": "m",
        "version": "1.0.0",
        "artifact_sha256": mv.artifact_sha256,
        "files": manifest_listing(mv),
        "artifact_prefix": "models/m/1.0.0/artifact/",
    }
    env = {"FLEET_STORE": s3_url, "FLEET_CACHE_DIR": str(tmp_path / "node"), "FLEET_FETCH_CHUNK_BYTES": str(CHUNK)}
    with pytest.raises(FetchError) as refused:
        model_dir(build, env)  # what the service calls at import, before /readyz can answer
    message = str(refused.value)
    assert "model.safetensors: the store's copy fails its checksum" in message
    assert f"expected sha256 {mv.files['model.safetensors'].sha256} (200000 bytes)" in message
    assert f"got sha256 {hashlib.sha256(bad).hexdigest()} (200000 bytes)" in message
    assert not (tmp_path / "node" / mv.artifact_sha256).exists()  # nothing a later start could take as verified


# A fetch in a process of its own, as a replica's: prints the ranges it asked for as JSON. With
# BLOCK_AFTER=n it stops before its (n+1)th GET, says so, and waits on the FIFO (to be killed
# or let go): a point in the middle of a fetch that a test can act on without sleeping.
WORKER = """
import json, os, sys
from bentos.fetch import S3Source
from bentos.weights import NodeCache

root, url, sha, prefix, listing = sys.argv[1:6]
block_after, fifo = int(os.environ.get("BLOCK_AFTER", "-1")), os.environ.get("FIFO", "")
bucket, _, store_prefix = url.removeprefix("s3://").partition("/")
inner, ranges = S3Source(bucket, store_prefix), []

class Source:
    url = inner.url
    size = staticmethod(inner.size)
    def read(self, key, start, end):
        if len(ranges) == block_after:
            print(json.dumps({"blocked": ranges}), flush=True)
            open(fifo).read()
        ranges.append([key, start, end])
        yield from inner.read(key, start, end)

cache = NodeCache(root, chunk_bytes=int(os.environ["CHUNK"]), concurrency=1)
folder = cache.ensure(sha, json.loads(listing), Source(), prefix, what="worker")
print(json.dumps({"ranges": ranges, "folder": str(folder)}), flush=True)
"""


def _worker(mv: ModelVersion, url: str, root: Path, **env: str) -> subprocess.Popen[str]:
    listing = json.dumps(manifest_listing(mv))
    prefix = f"models/{mv.model}/{mv.version}/artifact/"
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(root), url, mv.artifact_sha256, prefix, listing],
        env={**os.environ, "PYTHONPATH": str(ROOT), "CHUNK": str(CHUNK), **env},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _line(stream: IO[str], wanted: str) -> str:
    """The first line of ``stream`` holding ``wanted``, read within WITHIN_S."""
    found: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            if wanted in line:
                found.put(line)
                return
        found.put("")

    threading.Thread(target=read, daemon=True).start()
    line = found.get(timeout=WITHIN_S)
    assert line, f"the stream ended without a line holding {wanted!r}"
    return line


def test_two_replicas_fetching_one_version_at_once_download_each_range_once(s3_url: str, tmp_path: Path) -> None:
    mv = _register(s3_url, tmp_path, "1.0.0", 200_000, seed=3)
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    root = tmp_path / "node"
    first = _worker(mv, s3_url, root, BLOCK_AFTER="1", FIFO=str(fifo))
    second = None
    try:
        _line(first.stdout, '"blocked"')  # the first is mid-fetch, holding the version's lock
        second = _worker(mv, s3_url, root)
        _line(second.stderr, "being fetched or checked by another process on this node: waiting")
        with open(fifo, "w"):
            pass  # let the first go on
        a, b = (json.loads(_line(p.stdout, '"ranges"')) for p in (first, second))
        assert first.wait(WITHIN_S) == 0 and second.wait(WITHIN_S) == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    expected = {("models/m/1.0.0/artifact/config.json", 0, mv.files["config.json"].size)} | {
        ("models/m/1.0.0/artifact/model.safetensors", s, min(s + CHUNK, 200_000)) for s in range(0, 200_000, CHUNK)
    }
    assert sorted(map(tuple, a["ranges"])) == sorted(expected)  # every range once, by one process
    assert b["ranges"] == []  # the other waited, then shared the verified entry
    assert a["folder"] == b["folder"] == str(root / mv.artifact_sha256)
    assert (root / mv.artifact_sha256 / "model.safetensors").read_bytes() == (
        tmp_path / "artifact-1.0.0" / "model.safetensors"
    ).read_bytes()


def test_a_fetch_killed_mid_file_resumes_without_downloading_what_it_had(s3_url: str, tmp_path: Path) -> None:
    size = 16 * CHUNK + 1000
    mv = _register(s3_url, tmp_path, "1.0.0", size, seed=4)
    fifo = tmp_path / "never-opened"
    os.mkfifo(fifo)
    root = tmp_path / "node"
    # config.json is fetched first (sorted), then model.safetensors' ranges 0..3: stopped at the 6th GET
    proc = _worker(mv, s3_url, root, BLOCK_AFTER="5", FIFO=str(fifo))
    try:
        had = json.loads(_line(proc.stdout, '"blocked"'))["blocked"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    weights_key = "models/m/1.0.0/artifact/model.safetensors"
    assert [r[1] for r in had if r[0] == weights_key] == [0, CHUNK, 2 * CHUNK, 3 * CHUNK]
    assert (root / f".fetch-{mv.artifact_sha256}" / "model.safetensors.part").is_file()

    resumed = _source(s3_url)
    folder = _fetch(NodeCache(root, chunk_bytes=CHUNK, log=lambda _: None), mv, resumed)
    assert sorted(resumed.ranges) == [(weights_key, s, min(s + CHUNK, size)) for s in range(4 * CHUNK, size, CHUNK)]
    assert (folder / "model.safetensors").read_bytes() == (
        tmp_path / "artifact-1.0.0" / "model.safetensors"
    ).read_bytes()


def test_resumed_bytes_that_fail_the_hash_are_downloaded_again_from_the_start(s3_url: str, tmp_path: Path) -> None:
    """A range torn by a kill mid-write is in the record but not on disk as fetched: the whole
    file's SHA-256 catches it, and the file is fetched once more from zero."""
    size = 4 * CHUNK
    mv = _register(s3_url, tmp_path, "1.0.0", size, seed=5)
    staging = tmp_path / "node" / f".fetch-{mv.artifact_sha256}"
    staging.mkdir(parents=True)
    (staging / "model.safetensors.part").write_bytes(b"\0" * size)  # "done" ranges of zeros
    (staging / "model.safetensors.part.done").write_text(f"chunk {CHUNK}\n0\n1\n")
    source = _source(s3_url)
    lines: list[str] = []
    folder = _fetch(NodeCache(tmp_path / "node", chunk_bytes=CHUNK, log=lines.append), mv, source)
    weights_key = "models/m/1.0.0/artifact/model.safetensors"
    got = [r[1] for r in source.ranges if r[0] == weights_key]
    # the ranges it lacked, then (the hash failed) the whole file again
    assert sorted(got[:2]) == [2 * CHUNK, 3 * CHUNK] and sorted(got[2:]) == [0, CHUNK, 2 * CHUNK, 3 * CHUNK]
    assert any("resumed bytes do not match the manifest" in line for line in lines)
    assert (folder / "model.safetensors").read_bytes() == (
        tmp_path / "artifact-1.0.0" / "model.safetensors"
    ).read_bytes()


def test_the_budget_evicts_the_least_recently_used_version_not_in_use_and_never_one_in_use(
    s3_url: str, tmp_path: Path
) -> None:
    one = 100_000
    versions = {v: _register(s3_url, tmp_path, v, one, seed=i) for i, v in enumerate(["1.0.0", "1.1.0", "1.2.0"])}
    sha = {v: mv.artifact_sha256 for v, mv in versions.items()}
    root = tmp_path / "node"
    cache = NodeCache(root, max_bytes=int(2.5 * one), chunk_bytes=CHUNK, log=lambda _: None)
    for at, v in enumerate(["1.0.0", "1.1.0"]):
        _fetch(cache, versions[v], _source(s3_url))
        os.utime(root / sha[v], (1_000_000 + at, 1_000_000 + at))  # 1.0.0 is the least recently used
    with cache.using(sha["1.0.0"]):  # a replica serves 1.0.0
        _fetch(cache, versions["1.2.0"], _source(s3_url))
        assert {p.name for p in root.iterdir() if not p.name.startswith(".")} == {sha["1.0.0"], sha["1.2.0"]}
    # nobody serves 1.0.0 now: it is the least recently used, and goes for 1.1.0
    os.utime(root / sha["1.2.0"], (2_000_000, 2_000_000))
    _fetch(cache, versions["1.1.0"], _source(s3_url))
    assert {p.name for p in root.iterdir() if not p.name.startswith(".")} == {sha["1.1.0"], sha["1.2.0"]}


def test_a_local_replica_reads_the_fleets_artifact_cache_through_the_same_code(tmp_path: Path) -> None:
    """``fleet up``: the replica holds no store credentials; ``fleet package`` cached the
    artifact (ArtifactCache) and the service's ``model_dir`` finds it there, verified; a changed
    byte is refused naming both digests and the fix."""
    url = f"file://{tmp_path / 'store'}"
    mv = _register(url, tmp_path, "1.0.0", 50_000, seed=6)
    cached = ArtifactCache(tmp_path / "cache").path(Registry(open_store(url)), "m", "1.0.0")
    build = {"model": "m", "version": "1.0.0", "artifact_sha256": mv.artifact_sha256, "files": manifest_listing(mv)}
    env = {"FLEET_CACHE_DIR": str(tmp_path / "cache")}
    assert model_dir(build, env) == str(cached)
    assert model_dir(build, {**env, weights.BUILDING: "1"}) is None  # `bentoml build` importing the service
    data = bytearray((cached / "model.safetensors").read_bytes())
    data[7] ^= 0x01
    (cached / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(FetchError, match=r"model.safetensors: expected sha256 \w{64} \(50000 bytes\), got \w{64}"):
        model_dir(build, env)


def test_the_model_deployment_mounts_the_node_cache_and_gives_a_tensor_parallel_replica_shared_memory() -> None:
    from dataclasses import replace

    from fleet.runtime.kubernetes.manifests import MODEL_SERVICE_ACCOUNT, manifests
    from fleet.runtime.kubernetes.node_cache import CACHE_MOUNT, NODE_CACHE_PATH, node_cache_bytes, shm_bytes

    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/serving-fleet-prod/llm@sha256:" + "a" * 64
    tp = replace(  # llm-70b: tensor-parallel over a p4d's 8 A100s
        _single_gpu(),
        model="llm-70b",
        node_group="p4d",
        pool="a100",
        instance_type="p4d.24xlarge",
        gpus=8,
        tensor_parallel=8,
        gpu_memory_gib=300,
        cpu=40,
        memory_gib=200,
        gpu_type="A100-40GB",
        weights_gib=130,
    )
    deployment = manifests("llm-70b", "1.0.0", image, tp, floor=1, prometheus_url="http://p", store_url="s3://b/p")[0]
    validate(deployment)
    pod = deployment["spec"]["template"]["spec"]
    (bento,) = pod["containers"]
    assert bento["image"] == image  # the code-only image by digest: no weights path, no model tag
    env = {e["name"]: e["value"] for e in bento["env"]}
    assert env["FLEET_STORE"] == "s3://b/p" and env["FLEET_CACHE_DIR"] == CACHE_MOUNT
    assert "FLEET_MODEL_DIR" not in env  # fetched, never baked in
    assert env["FLEET_FETCH_CONCURRENCY"] == "64"  # 8 GPUs' instance: a 400 Gbps NIC
    assert int(env["FLEET_CACHE_MAX_BYTES"]) == math.ceil(130 * 2 * 1.1 * 2**30)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["weights"]["hostPath"] == {"path": NODE_CACHE_PATH, "type": "DirectoryOrCreate"}
    assert {"name": "weights", "mountPath": CACHE_MOUNT} in bento["volumeMounts"]
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8192Mi"}  # 1 GiB per GPU
    assert {"name": "shm", "mountPath": "/dev/shm"} in bento["volumeMounts"]
    memory = 200 * 1024 + 8 * 1024  # what the memory emptyDir may hold is the container's memory
    assert bento["resources"]["requests"]["memory"] == bento["resources"]["limits"]["memory"] == f"{memory}Mi"
    assert pod["serviceAccountName"] == MODEL_SERVICE_ACCOUNT
    (owner,) = pod["initContainers"]
    assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert "chown 1034:1034" in owner["command"][-1]

    single = manifests("llm-7b", "1.0.0", image, _single_gpu(), floor=1, prometheus_url="http://p")[0]
    validate(single)
    spec = single["spec"]["template"]["spec"]
    assert "shm" not in {v["name"] for v in spec["volumes"]} and shm_bytes(_single_gpu()) == 0
    assert spec["containers"][0]["resources"]["limits"]["memory"] == "12288Mi"
    assert {"name": "FLEET_FETCH_CONCURRENCY", "value": "16"} in spec["containers"][0]["env"]

    from fleet.planning.placement import PlacementPlan

    plan = PlacementPlan(models=(tp, _single_gpu()), node_groups=())
    assert node_cache_bytes(plan, "p4d") == math.ceil(130 * 2 * 1.1 * 2**30)
    assert node_cache_bytes(plan, "g5") == math.ceil(13 * 2 * 1.1 * 2**30)


def _single_gpu():  # noqa: ANN202 - a ModelPlacement
    from fleet.planning.placement import ModelPlacement

    return ModelPlacement(
        model="llm-7b",
        family="llm",
        node_group="g5",
        pool="a10g",
        instance_type="g5.xlarge",
        gpus=1,
        tensor_parallel=1,
        shared_gpu=False,
        gpu_memory_gib=20,
        cpu=3,
        memory_gib=12,
        min_replicas=1,
        max_replicas=2,
        target_qps_per_replica=2,
        target_p99_ms=5000,
        gpu_type="A10G",
        weights_gib=13,
    )


def test_coldstart_reports_the_fetch_phase_from_the_replicas_marks() -> None:
    from bench.coldstart import PHASES, phases

    server = [(1, "import", 1.0), (1, "imported", 2.0), (1, "fetch", 2.0), (1, "fetched", 5.0), (1, "verified", 5.5)]
    worker = [(2, "import", 6.0), (2, "imported", 7.0), (2, "fetch", 7.0), (2, "fetched", 7.25), (2, "verified", 7.5)]
    row = phases(0.5, 9.0, [*server, *worker, (2, "worker", 7.75), (2, "loaded", 8.0), (2, "warm", 8.5)])
    assert list(row) == list(PHASES)
    assert (row["server fetch"], row["server verify"], row["worker fetch"]) == (3.0, 0.5, 0.25)


def test_the_cache_owner_script_hands_the_folder_over_once_and_changes_nothing_after(tmp_path: Path) -> None:
    """The init container runs as root with CHOWN only, on every pod of the node: the second
    pod finds the folder the image user's, where a chmod would need FOWNER and fail."""
    import os
    import shutil
    import subprocess

    from fleet.runtime.kubernetes.manifests import BENTO_GID, BENTO_UID, cache_owner_script

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and util-linux's setpriv to drop every capability but CHOWN")
    folder = tmp_path / "weights"
    folder.mkdir(mode=0o755)
    as_init = ["setpriv", "--bounding-set=-all,+chown", "--inh-caps=-all", "sh", "-c", cache_owner_script(str(folder))]
    for attempt in ("first pod", "second pod"):
        done = subprocess.run(as_init, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{attempt}: {done.stderr}"
        st = folder.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (BENTO_UID, BENTO_GID, 0o750), attempt
    # the command before: on the folder the first pod handed over, chmod without FOWNER fails
    old = f"chmod 0750 {folder} && chown {BENTO_UID}:{BENTO_GID} {folder}"
    assert subprocess.run([*as_init[:3], "sh", "-c", old], capture_output=True, timeout=30).returncode != 0
