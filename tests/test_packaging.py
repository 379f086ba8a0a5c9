"""Packaging: one Bento per version, labelled with its artifact and holding code only (no
weights: a replica takes them from the node cache, fetched from the store at start); a Bento
built from another artifact under the same tag is rebuilt. A served model whose files differ
from the manifest never starts; the image digest Kubernetes deploys by is recorded by
``fleet package``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from bentos.tabular_mlp.train import TrainConfig, train_and_register
from fleet.catalog.policies.loader import load_policies
from fleet.catalog.registry import Registry
from fleet.runtime.cache import ArtifactCache
from fleet.store import FileStore
from tests.quiet import assert_quiet
from tests.serving_env import FLEET, FleetEnv, free_port

ROOT = Path(__file__).resolve().parents[1]


def test_a_bento_of_another_artifact_under_the_same_tag_is_rebuilt(
    tmp_path: Path,
) -> None:
    from fleet.runtime.bento import bentoml_home, package

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
    # code only: BentoML's model store gets nothing, the Bento names no model and carries no weights
    held = bentoml.bentos.get(rebuilt.bento)
    assert held.info.models == [] and not list(Path(held.path).rglob("model.pt"))
    assert not any(m.tag.name == model for m in bentoml.models.list())
    build = json.loads((Path(held.path) / "src" / "fleet_build.json").read_text())
    assert (
        build["artifact_sha256"] == b.artifact_sha256 and build["artifact_prefix"] == f"models/{model}/1.0.0/artifact/"
    )
    assert (tmp_path / "cache" / b.artifact_sha256 / "model.pt").is_file()  # cached for a replica on this machine
    # the same artifact under another policy is another build: fleet_build.json is what the service reads
    changed = spec.model_copy(update={"concurrency": spec.concurrency + 1})
    lines.clear()
    again = package(Registry(second), model, "1.0.0", changed, ArtifactCache(tmp_path / "cache"), log=lines.append)
    assert again.built and any("built from another policy" in line for line in lines)
    assert (
        json.loads((Path(bentoml.bentos.get(again.bento).path) / "src" / "fleet_build.json").read_text())["traffic"][
            "concurrency"
        ]
        == changed.concurrency
    )
    assert not package(Registry(second), model, "1.0.0", changed, ArtifactCache(tmp_path / "cache")).built


def test_a_changed_byte_in_the_cache_or_the_store_stops_the_service_before_it_is_ready(tmp_path: Path) -> None:
    """As a user meets it: `fleet deploy` verifies the cached artifact and repairs a changed
    byte before a replica starts; a replica whose cached files changed anyway refuses them
    at import, naming the file, both hashes and the fix; the Bento started as its container
    image starts (no weights in it) fetches them from the store and refuses a changed object
    there the same way; the image digest is recorded for Kubernetes."""
    env = FleetEnv(tmp_path)
    model = "demo-classifier"
    try:
        env.fleet("models", "train", model, "1.0.0", "--rows", "500", "--epochs", "1")
        env.fleet("package", model, "1.0.0")
        mv = Registry(FileStore(tmp_path / "store")).get(model, "1.0.0")
        weights = tmp_path / "cache" / mv.artifact_sha256 / "model.pt"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
        expected, actual = mv.files["model.pt"].sha256, hashlib.sha256(data).hexdigest()

        deployed = subprocess.run(
            [FLEET, "deploy", model, "1.0.0"], env=env.env, cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert deployed.returncode == 0, deployed.stderr
        assert_quiet(deployed.stdout + deployed.stderr, "fleet deploy")
        assert f"model.pt: expected sha256 {expected} ({len(data)} bytes), got {actual}" in deployed.stderr
        assert "removing it and downloading it again" in deployed.stderr
        answer = httpx.post(f"{env.fleet_json('deploy', model, '1.0.0')['endpoints'][0]}/metadata", json={}, timeout=10)
        assert answer.json()["artifact_sha256"] == mv.artifact_sha256
        env.fleet("undeploy", model, "1.0.0")

        # changed after the check: the replica itself refuses (as `fleet up` starts it: no store)
        weights.write_bytes(bytes(data))
        started = time.monotonic()
        code, output = _serve_as_its_image(
            env, f"{model}:1.0.0", tmp_path / "local", FLEET_CACHE_DIR=str(tmp_path / "cache"), FLEET_STORE=None
        )
        assert code == 1 and time.monotonic() - started < 60, output[-3000:]
        assert f"model.pt: expected sha256 {expected} ({len(data)} bytes), got {actual} ({len(data)} bytes)" in output
        assert "`fleet package` caches them again" in output

        # The image's start-up: `bentoml containerize` copies the Bento (code only) and the
        # container serves it with BENTOML_CONTAINERIZED set; its replica fetches from the store
        stored = tmp_path / "store" / "models" / model / "1.0.0" / "artifact" / "model.pt"
        registered = stored.read_bytes()
        stored.write_bytes(bytes(data))  # changed after registration
        code, output = _serve_as_its_image(env, f"{model}:1.0.0", tmp_path / "image")
        assert not [p for p in (tmp_path / "image" / "models").rglob("*") if p.is_file()]  # BentoML's models: none
        assert code == 1 and "model.pt: the store's copy fails its checksum" in output, output[-3000:]
        assert f"expected sha256 {expected} ({len(data)} bytes) as the manifest lists, got sha256 {actual}" in output
        assert not (tmp_path / "node-cache" / mv.artifact_sha256).exists()
        # the fetch phase began and never ended: no worker, no /readyz
        assert re.search(r"fleet-phase \d+ fetch ", output) and not re.search(r"fleet-phase \d+ fetched ", output)
        stored.write_bytes(registered)

        digest = "sha256:" + hashlib.sha256(b"the pushed image").hexdigest()
        repo = "123456789012.dkr.ecr.us-east-1.amazonaws.com/serving-fleet-prod/tabular-mlp"
        packaged = env.fleet_json("package", model, "1.0.0", "--image-digest", digest, "--repository", repo)
        assert packaged["built"] is False and packaged["image"]["digest"] == digest
        record = json.loads((tmp_path / "store" / "images" / model / "1.0.0.json").read_text())
        assert (
            record["digest"],
            record["repository"],
            record["bento"],
            record["artifact_sha256"],
            record["recorded_by"],
        ) == (digest, repo, f"{model}:1.0.0", mv.artifact_sha256, "e2e")
    finally:
        env.stop()


def _serve_as_its_image(env: FleetEnv, bento: str, folder: Path, **overrides: str | None) -> tuple[int, str]:
    """Serve ``bento`` as its container would: exported into ``folder`` and started from there,
    with an empty BentoML home, respawning off, the store to fetch its weights from and an empty
    node cache (``node-cache`` beside ``folder``), as the model Deployment gives it; ``overrides``
    set (or, as None, remove) variables. Returns its exit code and output; one still serving
    after 120 s is stopped and fails the test."""
    import tarfile

    from fleet.processes import stop_group

    subprocess.run(
        [str(Path(FLEET).with_name("bentoml")), "export", bento, str(folder.with_suffix(".bento"))],
        env=env.env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    with tarfile.open(folder.with_suffix(".bento")) as archive:
        archive.extractall(folder, filter="data")
    container = {
        **env.env,
        "BENTOML_HOME": str(folder.parent / "empty-home"),
        "BENTOML_CONTAINERIZED": "true",
        "FLEET_CACHE_DIR": str(folder.parent / "node-cache"),
    }
    for name, value in overrides.items():
        if value is None:
            container.pop(name, None)
        else:
            container[name] = value
    proc = subprocess.Popen(
        [
            str(Path(FLEET).with_name("python")),
            "-m",
            "bentoml",
            "serve",
            str(folder),
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
        ],
        env=container,
        cwd=folder,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        stop_group(proc.pid)
        raise AssertionError(f"{bento} served from {folder} for 120 s instead of refusing its model files") from None
    return proc.returncode, output


def _dockerfile_user(dockerfile: str) -> tuple[str, dict[str, str]]:
    """The last ``USER`` of a Dockerfile and its ``ARG`` defaults."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    users = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert users, "the Dockerfile sets no USER"
    return users[-1], args


def test_model_pods_run_as_the_numeric_user_of_the_image_bentoml_builds(
    tmp_path: Path,
) -> None:
    """`bentoml containerize` images end in ``USER bentoml`` (a name): with runAsNonRoot alone the
    kubelet refuses them (non-numeric user). The runtime's pods must name that user's numbers."""
    from fleet.planning.placement import ModelPlacement
    from fleet.runtime.bento import bentoml_home, package
    from fleet.runtime.kubernetes.manifests import manifests

    bentoml_home()
    import bentoml

    spec = load_policies(ROOT / "policies").model("demo-classifier")
    model = f"user-{os.getpid()}"
    store = FileStore(tmp_path / "store")
    train_and_register(store, model, "1.0.0", TrainConfig(rows=300, epochs=1, seed=3))
    built = package(Registry(store), model, "1.0.0", spec, ArtifactCache(tmp_path / "cache"))
    dockerfile = (Path(bentoml.bentos.get(built.bento).path) / "env" / "docker" / "Dockerfile").read_text()
    user, args = _dockerfile_user(dockerfile)
    assert user == args["BENTO_USER"] and not user.isdigit()  # a name: the kubelet cannot check it
    placement = ModelPlacement(
        model=model,
        family="tabular-mlp",
        node_group="cpu",
        pool="cpu",
        instance_type="m7i.large",
        gpus=0,
        tensor_parallel=0,
        shared_gpu=False,
        gpu_memory_gib=0,
        cpu=1,
        memory_gib=1,
        min_replicas=1,
        max_replicas=1,
        target_qps_per_replica=10,
        target_p99_ms=100,
    )
    deployment = manifests(model, "1.0.0", "repo@sha256:" + "0" * 64, placement, floor=1, prometheus_url="http://p")[0]
    pod = deployment["spec"]["template"]["spec"]
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == int(args["BENTO_USER_UID"]) and context["runAsUser"] != 0
    assert context["runAsGroup"] == int(args["BENTO_USER_GID"])
    assert all("runAsUser" not in c.get("securityContext", {}) for c in pod["containers"])  # nothing overrides it


def test_a_gpu_models_bento_installs_vllm_and_a_cpu_models_does_not() -> None:
    """vLLM's wheel is CUDA-only: declared for the GPU image (the family's ``GPU_PACKAGES``),
    never in the project's lock, and only in the Bentos of models whose policy asks for a GPU."""
    from fleet.runtime.bento import family_module, python_packages

    spec = load_policies(ROOT / "policies").model("demo-lm")
    assert spec.resources.gpu == 0
    family = family_module(spec.family)
    gpu = spec.model_copy(update={"resources": spec.resources.model_copy(update={"gpu": 1, "gpu_memory_gib": 8.0})})
    cpu_packages, gpu_packages = python_packages(family, spec), python_packages(family, gpu)
    assert not any(p.startswith("vllm") for p in cpu_packages)
    assert "vllm==0.33.0" in gpu_packages and gpu_packages[: len(cpu_packages)] == cpu_packages
    torch_pin = next(p for p in cpu_packages if p.startswith("torch=="))
    assert torch_pin == "torch==2.13.0"  # what vLLM 0.33.0 pins: the GPU image resolves
    assert "vllm_engine.py" in family.BENTO_FILES
    for locked in ("requirements.lock", "pyproject.toml"):
        assert "vllm" not in (ROOT / locked).read_text().lower(), f"vllm must never be in {locked}"


@pytest.mark.parametrize("family_name", ["tabular-mlp", "tiny-lm"])
def test_every_module_a_bentos_files_import_from_their_folder_is_shipped_in_it(family_name: str) -> None:
    """A Bento holds its family's ``BENTO_FILES`` and the shared files at its root, and its
    modules import each other flat (``from scheduler import ...``; in the repo, relatively):
    a module split out of a served one and left off ``BENTO_FILES`` fails only in the Bento."""
    import ast

    from fleet.runtime.bento import SHARED_FILES, family_module

    family = family_module(family_name)
    folder = Path(family.__file__).parent
    local = {p.stem for p in folder.glob("*.py")} | {p.stem for p in folder.parent.glob("*.py")}
    shipped = {Path(n).stem for n in (*family.BENTO_FILES, *SHARED_FILES)}
    for name in family.BENTO_FILES:
        for node in ast.walk(ast.parse((folder / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                wanted = [node.module.split(".")[0]] if node.level <= 1 else []
            elif isinstance(node, ast.Import):
                wanted = [a.name.split(".")[0] for a in node.names]
            else:
                continue
            for module in wanted:
                if module in local and module != "__init__":
                    assert module in shipped, f"{name} imports {module}, which {family_name}'s Bento does not carry"


def test_bentos_of_two_families_build_one_after_the_other_in_one_process(
    tmp_path: Path,
) -> None:
    """A flow packages in-process: after a tiny-lm Bento was built, the next tabular build was
    handed tiny-lm's ``service`` module by the import cache and failed; and a service that
    registered metrics at import failed its second build (and left the process in the deleted
    build folder)."""
    from bentos.tiny_lm.config import PRESETS
    from bentos.tiny_lm.train import train_and_register as train_lm
    from fleet.runtime.bento import bentoml_home, package

    bentoml_home()
    policies = load_policies(ROOT / "policies")
    store = FileStore(tmp_path / "store")
    lm, tab = f"lm-{os.getpid()}", f"tab-{os.getpid()}"
    config = dataclasses.replace(PRESETS["test"], steps=5, train_examples=200, holdout_examples=8)
    for version in ("1.0.0", "1.1.0"):
        train_lm(store, lm, version, config, log=lambda *_: None)
    train_and_register(store, tab, "1.0.0", TrainConfig(rows=500, epochs=1, seed=1))
    cache, cwd = ArtifactCache(tmp_path / "cache"), os.getcwd()
    assert package(Registry(store), lm, "1.0.0", policies.model("demo-lm"), cache).built
    assert package(Registry(store), tab, "1.0.0", policies.model("demo-classifier"), cache).built
    # the same family again: its service module is imported anew, and registers nothing twice
    assert package(Registry(store), lm, "1.1.0", policies.model("demo-lm"), cache).built
    assert os.getcwd() == cwd
