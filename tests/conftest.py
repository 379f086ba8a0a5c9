"""Shared fixtures: a real S3 API (moto's threaded server on 127.0.0.1) and stores."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest
import uvloop

from fleet.store import FileStore, MemoryStore
from fleet.types import ObjectStore

# boto3 must never find real credentials or reach AWS from the tests.
os.environ.update(
    AWS_ACCESS_KEY_ID="testing",
    AWS_SECRET_ACCESS_KEY="testing",
    AWS_SESSION_TOKEN="testing",
    AWS_DEFAULT_REGION="us-east-1",
    AWS_CONFIG_FILE=os.devnull,
    AWS_SHARED_CREDENTIALS_FILE=os.devnull,
)
os.environ.pop("FLEET_STORE", None)
# every gateway a test starts takes this scrape token for /metrics (tests/gateway_env.py's scrape)
os.environ["FLEET_METRICS_TOKEN"] = "test-metrics-token"

# pytest imports this file as ``conftest``; importing it again under another name (``from
# tests.conftest import ...``) would run it twice: a second Prefect port, a second BentoML home,
# and a server the fixtures no longer point at. Import shared helpers from modules whose import
# does nothing but define them (tests/fakes.py, tests/serving_env.py, ...).
if __name__ != "conftest":
    raise ImportError(
        f"tests/conftest.py imported as {__name__!r}; import shared helpers from tests/<module>.py instead"
    )

WITHIN_S = 10.0  # the most any test waits for something that should take milliseconds


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free port of 127.0.0.1, stopped when the session ends."""
    from tests.moto_s3 import start_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request
    server = start_server()  # with S3's atomic conditional writes (tests/moto_s3.py)
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    previous = os.environ.get("AWS_ENDPOINT_URL_S3")
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint  # read by boto3 in this and child processes
    yield endpoint
    if previous is None:
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    else:
        os.environ["AWS_ENDPOINT_URL_S3"] = previous
    server.stop()


@pytest.fixture
def s3_url(s3_endpoint: str) -> str:
    """A fresh bucket per test, returned as a store URL with a prefix."""
    import boto3

    bucket = f"fleet-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/state"


@pytest.fixture(params=["file", "s3", "memory"])
def store(request: pytest.FixtureRequest, tmp_path) -> ObjectStore:
    """The same contract, run against every backend."""
    if request.param == "file":
        return FileStore(tmp_path / "store")
    if request.param == "s3":
        from fleet.store import open_store

        return open_store(request.getfixturevalue("s3_url"))
    return MemoryStore()


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A store URL that several processes can share."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    return request.getfixturevalue("s3_url")


@pytest.fixture(autouse=True)
def _cli_runs_print_only_the_fleets_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every in-process run of the CLI (typer's CliRunner) is checked as the subprocess helpers
    check theirs: no line a library printed in its output (tests/quiet.py)."""
    from typer.testing import CliRunner

    from tests.quiet import assert_quiet

    invoke = CliRunner.invoke

    def checked(self: CliRunner, app: object, args: object = None, *rest: object, **kwargs: object) -> object:
        from fleet.cli import _keep_libraries_quiet

        if isinstance(args, list | tuple):  # as main() does, so that what is checked is what a user sees
            _keep_libraries_quiet([str(a) for a in args])
        result = invoke(self, app, args, *rest, **kwargs)  # type: ignore[arg-type]
        assert_quiet(result.stdout + result.stderr, f"fleet {args}")
        return result

    monkeypatch.setattr(CliRunner, "invoke", checked)


# BentoML reads its home once, at import, and flows called in-process build there: one home
# per test process, never the user's (tests/serving_env.py's fleets share it).
os.environ["BENTOML_HOME"] = tempfile.mkdtemp(prefix="fleet-bentoml-")
os.environ.setdefault("BENTOML_DO_NOT_TRACK", "true")

# Prefect writes ~/.prefect on import unless told otherwise; every test process gets its own home.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="fleet-prefect-home-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def _reserve_port() -> socket.socket:
    """A free port of 127.0.0.1, held (bound, not listening) so no other server gets it."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    return held


# Prefect reads its settings once, when it is first imported, and test modules import it
# while they are collected: the API URL must be in the environment before then, or a flow
# called in-process starts an ephemeral server of its own (which times out on a busy
# machine) instead of using the session's. The server itself starts only when a test asks
# for ``prefect_api``, on the port held until then; each xdist worker has its own.
_PREFECT_PORT = _reserve_port()
PREFECT_PORT = _PREFECT_PORT.getsockname()[1]
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{PREFECT_PORT}/api"


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prefect server (SQLite) on ``PREFECT_PORT``, for the whole session; stopped by PID.

    The one ``fleet up`` runs (fleet.local.up.Prefect). PREFECT_API_URL, set above, points this
    process (and the children it starts) at it.
    """
    from fleet.local.up import Prefect

    server = Prefect(tmp_path_factory.mktemp("prefect"), PREFECT_PORT)
    _PREFECT_PORT.close()  # given up only now, to the server that takes it
    server.start()
    try:
        server.wait_ready()
        assert os.environ["PREFECT_API_URL"] == f"{server.url}/api", "a test changed PREFECT_API_URL"
        yield os.environ["PREFECT_API_URL"]
    finally:
        server.stop()


@pytest.fixture
def router(store: ObjectStore, tmp_path):  # noqa: ANN201 - a fleet.catalog.routes.store.Router
    """Versions 1.0.0, 1.1.0 and 1.2.0 of model ``demo`` registered on every backend; no route yet."""
    from fleet.catalog.registry import Registry
    from fleet.catalog.routes.store import Router
    from tests.test_registry import META

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w").write_text("w")
    reg = Registry(store)
    for v in ("1.0.0", "1.1.0", "1.2.0"):
        reg.register("demo", v, tmp_path / "a", META)
    return Router(store, reg)


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Callable[[], Awaitable[None]]], None]:
    """Run a test's coroutine on a fresh event loop of the parametrized kind."""

    def run(scenario: Callable[[], Awaitable[None]]) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(WITHIN_S * 3):
                await scenario()

        factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(bounded())

    return run


def pytest_sessionfinish(session: pytest.Session) -> None:
    import shutil

    shutil.rmtree(os.environ["BENTOML_HOME"], ignore_errors=True)


# The slowest modules first (seconds each took in `make test` on the 2-core build machine
# with two CPU-bound processes beside it, from `pytest --durations`): with `make test`'s
# workers (pytest-xdist, --dist loadfile, --no-loadscope-reorder: xdist's own order is by
# number of tests, which put the two-test rollout modules last) the longest runs start at
# once instead of last, when one worker would wait on them alone. Only the order changes; a
# module missing here runs after these, in the usual order.
SLOWEST_FIRST = {
    "test_rollout_flow.py": 490,
    "test_generation_rollout.py": 310,
    "test_walkthroughs.py": 180,
    "test_bluegreen_flow.py": 115,
    "test_lazy_loading.py": 120,
    "test_up.py": 110,
    "test_generation.py": 100,
    "test_monitor_flow.py": 90,
    "test_experiment.py": 85,
    "test_gateway_fuzz.py": 75,
    "test_sequential.py": 65,
    "test_cli.py": 65,
    "test_tensor_upstream.py": 55,
    "test_serving.py": 45,
    "test_metrics_prometheus.py": 40,
    "test_key_rotation.py": 40,
    "test_tiny_lm_train.py": 35,
    "test_packaging.py": 30,
    "test_quiet_cli.py": 30,
    "test_demo.py": 30,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -SLOWEST_FIRST.get(item.path.name, 0))  # stable: the rest keep their order
