"""Callers that send or read slowly hold nothing for long (a real gateway in front of a stub
model): a body that trickles in is cut at the gateway policy's ``body_read_s`` (408) and its
bytes leave the bodies' budget; the tenant beside it is served all the while. Streams a
caller stops reading are proved on real processes in tests/test_generation.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.gateway_env import MODEL, GatewayEnv, infer, metric, wait_for

BODY_READ_S = 1.0


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    e = GatewayEnv(tmp_path_factory.mktemp("slow"), limits={"body_read_s": BODY_READ_S})
    try:
        e.register("1.0.0")
        e.stub("1.0.0")
        e.route(stable="1.0.0")
        keys = {name: e.tenant(name) for name in ("slow", "apps")}
        url, _ = e.gateway()
        yield {"url": url, "keys": keys}
    finally:
        e.stop()


def whole_answer(s: socket.socket) -> str:
    """One HTTP answer read whole from ``s``: its head, then Content-Length bytes of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(4096) or b"\r\n\r\n"
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"), 0
    )
    while len(body) < length and (more := s.recv(4096)):
        body += more
    return (head + b"\r\n\r\n" + body).decode()


def test_a_body_that_trickles_in_is_cut_at_the_policys_deadline_and_frees_its_bytes(gw: dict) -> None:
    host, port = urlsplit(gw["url"]).hostname, urlsplit(gw["url"]).port
    held = []
    try:
        for _ in range(4):  # four slow bodies of one tenant, each promising 60 KiB and sending 100 bytes
            s = socket.create_connection((host, port), timeout=10)
            s.sendall(
                (
                    f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Authorization: Bearer {gw['keys']['slow']}\r\nContent-Length: 61440\r\n\r\n"
                ).encode()
                + b" " * 100
            )
            held.append(s)
        started = time.monotonic()
        wait_for(
            lambda: metric(gw["url"], "fleet_buffer_bytes", buffer="request_bodies") >= 400, what="the bodies held"
        )
        with httpx.Client(base_url=gw["url"], timeout=10) as client:  # the tenant beside it is served meanwhile
            assert infer(client, gw["keys"]["apps"]).status_code == 200
        for s in held:
            answer = whole_answer(s)
            assert answer.startswith("HTTP/1.1 408"), answer
            assert f"did not arrive within {BODY_READ_S:g} s (100 bytes came)" in answer
        assert time.monotonic() - started < BODY_READ_S + 5  # the deadline, not the caller, ended it
        wait_for(lambda: metric(gw["url"], "fleet_buffer_bytes", buffer="request_bodies") == 0, what="bytes freed")
    finally:
        for s in held:
            s.close()
