"""Callers that send or read slowly hold nothing for long (a real gateway in front of a stub
model): a body that trickles in is cut at the gateway policy's ``body_read_s`` (408) and its
bytes leave the bodies' budget; answers a caller does not read are cut at ``stream_write_s``
and the connection dropped with what was buffered for it; the tenant beside it is served all
the while. Streams a caller stops reading are proved on real processes in
tests/test_generation.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.gateway_env import MODEL, GatewayEnv, infer, metric, wait_for

BODY_READ_S = 1.0
WRITE_S = 1.0


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    e = GatewayEnv(tmp_path_factory.mktemp("slow"), limits={"body_read_s": BODY_READ_S, "stream_write_s": WRITE_S})
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


def test_answers_a_caller_does_not_read_are_cut_at_the_write_deadline_and_the_connection_dropped(gw: dict) -> None:
    """One connection, many large answers pipelined and none read: once the buffers between
    are full, the answer being written waits for the caller; within ``stream_write_s`` the
    gateway gives up on it and aborts the connection (its buffered bytes dropped)."""
    host, port = urlsplit(gw["url"]).hostname, urlsplit(gw["url"]).port
    rows = 2000
    body = json.dumps(
        {"inputs": [{"name": "features", "shape": [rows, 4], "datatype": "FP32", "data": [0.5] * (rows * 4)}]}
    ).encode()
    request = (
        f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {gw['keys']['slow']}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a caller that reads nothing, with a small window
    s.connect((host, port))
    s.settimeout(30)
    before = metric(gw["url"], "fleet_callers_stalled_total", kind="answer")

    def pipeline() -> None:  # the gateway reads the next request only as answers go out: sends block
        try:
            for _ in range(200):  # about 100 KB of answer each: far past every buffer on the way
                s.sendall(request)
        except OSError:
            pass  # cut off: what the test waits for

    sender = threading.Thread(target=pipeline, daemon=True)
    sender.start()
    try:
        wait_for(
            lambda: metric(gw["url"], "fleet_callers_stalled_total", kind="answer") > before,
            timeout=WRITE_S + 20,
            what="the stalled answer to be cut",
        )
        with httpx.Client(base_url=gw["url"], timeout=10) as client:  # the tenant beside it is served meanwhile
            assert infer(client, gw["keys"]["apps"]).status_code == 200
        got, cut = 0, False
        try:
            while chunk := s.recv(65536):  # what was taken before the cut, then the end of it
                got += len(chunk)
        except ConnectionResetError:
            cut = True
        assert cut or got > 0  # the connection ended (reset, or closed after what was sent)
        assert got < 200 * rows * 2 * 10  # far less than the 200 answers asked for: the rest was dropped
        with httpx.Client(base_url=gw["url"], timeout=10) as client:  # and the stalled tenant, on a new connection
            assert infer(client, gw["keys"]["slow"]).status_code == 200
    finally:
        s.close()
        sender.join(timeout=10)


def test_a_caller_that_reads_a_large_answer_slowly_but_steadily_is_not_cut(gw: dict) -> None:
    """An answer that takes longer than ``stream_write_s`` to arrive whole is not cut while its
    caller keeps taking bytes. (Here the kernel's send buffer grows to take most of it; the
    progress rule itself is tested in tests/test_gateway_parts.py.)"""
    host, port = urlsplit(gw["url"]).hostname, urlsplit(gw["url"]).port
    rows = 10_000  # an answer of about 200 KB: past the buffers on the way, so the gateway waits on the caller
    body = json.dumps(
        {"inputs": [{"name": "features", "shape": [rows, 4], "datatype": "FP32", "data": [0.5] * (rows * 4)}]}
    ).encode()
    before = metric(gw["url"], "fleet_callers_stalled_total", kind="answer")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)  # the gateway's send buffer stays small
        s.connect((host, port))
        s.settimeout(30)
        s.sendall(
            (
                f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {gw['keys']['slow']}\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        started, data = time.monotonic(), b""
        while b"\r\n\r\n" not in data:
            data += s.recv(2048)
        head, _, got = data.partition(b"\r\n\r\n")
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        while len(got) < length:  # 4 KiB every 50 ms: 80 KiB/s, over two seconds for the whole answer
            time.sleep(0.05)
            chunk = s.recv(4096)
            assert chunk, f"cut after {len(got)} of {length} bytes"
            got += chunk
    assert head.startswith(b"HTTP/1.1 200") and len(json.loads(got)["outputs"][0]["data"]) == rows * 2
    assert time.monotonic() - started > WRITE_S  # it did take longer than the deadline
    assert metric(gw["url"], "fleet_callers_stalled_total", kind="answer") == before
