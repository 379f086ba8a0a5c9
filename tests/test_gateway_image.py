"""The gateway image (the repository's Dockerfile) against the pod infra/ runs it in: the
image's numeric user is the pod's runAsUser (runAsNonRoot cannot check a user name), its
entry point plus the pod's args is a command line `fleet gateway` accepts, and it installs
the project from the lock. No Docker here: the Dockerfile is read, not built."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

import pytest
import typer
from infra_harness import ROOT, example
from typer._click.exceptions import UsageError  # typer vendors click: its own exception classes

from infra.gateway import POLICY_DIR


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    found, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        found.append((word.upper(), rest.strip()))
        pending = ""
    return found


def exec_form(argument: str) -> list[str]:
    value = json.loads(argument)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not the exec form: {argument}"
    return value


def gateway_container() -> dict:
    resource = example("prod").one("kubernetes:apps/v1:Deployment", "gateway")
    (container,) = resource.inputs["spec"]["template"]["spec"]["containers"]
    return container


def test_the_image_runs_as_the_numeric_user_the_gateway_pod_names() -> None:
    steps = instructions(ROOT / "Dockerfile")
    (user,) = [arg for word, arg in steps if word == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit() and int(uid) != 0, f"USER {user}: the kubelet needs numbers, not root"
    creates = " ".join(arg for word, arg in steps if word == "RUN")
    assert f"--uid {uid}" in creates and f"--gid {gid}" in creates  # the user exists in the image
    context = gateway_container()["securityContext"]
    assert context["runAsNonRoot"] is True
    assert (context["runAsUser"], context["runAsGroup"]) == (int(uid), int(gid))
    assert context["readOnlyRootFilesystem"] is True
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(arg for word, arg in steps if word == "ENV")))
    assert env["HOME"] == "/tmp" and env["FLEET_POLICIES"] == POLICY_DIR  # the writable emptyDir; the ConfigMap


def test_entry_point_and_pod_args_are_a_command_line_fleet_gateway_accepts() -> None:
    from fleet.cli import app

    steps = dict(instructions(ROOT / "Dockerfile"))
    entry = exec_form(steps["ENTRYPOINT"])
    assert entry == ["fleet", "gateway"]
    container = gateway_container()
    assert "command" not in container  # the image's entry point runs
    command = typer.main.get_command(app)
    gateway = command.commands["gateway"]  # type: ignore[attr-defined]
    for args in (container["args"], exec_form(steps["CMD"])):
        ctx = gateway.make_context(
            "gateway", [a.replace("$(POD_IP)", "10.0.0.1") for a in args], resilient_parsing=False
        )
        assert ctx.params["host"] == "0.0.0.0" and ctx.params["grpc_port"] == 8001
    with pytest.raises(UsageError, match="unexpected extra argument"):  # the mistake this guards against
        gateway.make_context("gateway", ["fleet", "gateway", *container["args"]])


def test_the_image_installs_the_lock_then_the_project_without_resolving() -> None:
    steps = instructions(ROOT / "Dockerfile")
    runs = [arg for word, arg in steps if word == "RUN"]
    lock = next(i for i, r in enumerate(runs) if "pip install -r requirements.lock" in r)
    project = next(i for i, r in enumerate(runs) if "pip install --no-deps ." in r)
    assert lock < project
    assert steps[0][0] == "FROM" and re.search(r"python:3\.11[\w.-]*$", steps[0][1])
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    for word, arg in steps:
        if word == "COPY":
            *sources, _ = shlex.split(arg)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert not any(fnmatch.fnmatch(source, p) for p in ignored), f"COPY {source}: excluded by .dockerignore"
