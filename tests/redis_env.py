"""A real ``redis-server`` for the tests: on 127.0.0.1, a free port, nothing saved to disk,
stopped by PID (and started again on the same port, for tests of Redis going away)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from tests.serving_env import free_port


class RedisServer:
    def __init__(self, root: Path) -> None:
        exe = shutil.which("redis-server")
        # make test installs it (TEST_PACKAGES); a bare pytest run on a machine without it fails here
        assert exe is not None, "redis-server is not installed; `make test` installs it (Debian package redis-server)"
        self.exe, self.root, self.port = exe, root, free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        log = self.root / f"redis-{self.port}.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    self.exe,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.root),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"redis-server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
