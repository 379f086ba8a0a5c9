"""The same model over JSON, Triton's binary HTTP extension and gRPC, through the gateway and
directly to the model service, in one run.

    .venv/bin/python bench/protocols.py [--requests 1500] [--workdir DIR]

For 1-row and 256-row FP32 requests at concurrency 1 and 16, each protocol gets the same
number of requests; the table has throughput, p50 and p99 as the client saw them, and the
gateway's CPU time per request (user + system of its process, from /proc, over the cell).
"direct" is the model service's own JSON contract (``POST /predict {"features": ...}``) and
"direct-t" its tensor route (``POST /predict_tensor``, raw bytes, which the gateway uses):
the floors every protocol pays on top of.

The model is ``tests/stub_model.py`` (the demo rule in numpy behind Starlette), so the
upstream's own cost is small and what differs between rows is the protocol. The load
comes from this process (aiohttp for HTTP, grpc.aio for gRPC): on a 2-core machine it
competes with the servers, which is why the gateway's CPU per request, not only the
throughput, is in the table.

Targets (issue 13): binary HTTP and gRPC each >= 2x the throughput of JSON for 256-row
requests; gRPC's p50 over direct's at concurrency 1 at most 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from fleet.gateway.grpc_server import pb, pb_grpc  # noqa: E402 - first: loads tritonclient's protos
from tests.gateway_env import MODEL, GatewayEnv  # noqa: E402
from tests.test_grpc import start_gateway  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:  # noqa: PTH123
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def bodies(rows: int) -> dict[str, object]:
    x = np.random.default_rng(rows).uniform(-1, 1, (rows, 4)).astype(np.float32)
    oip = {"inputs": [{"name": "features", "shape": [rows, 4], "datatype": "FP32", "data": x.ravel().tolist()}]}
    header = json.dumps({"inputs": [{"name": "features", "shape": [rows, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}]}).encode()  # fmt: skip
    grpc_request = pb.ModelInferRequest(model_name=MODEL, inputs=[pb.ModelInferRequest.InferInputTensor(
        name="features", datatype="FP32", shape=[rows, 4])], raw_input_contents=[x.tobytes()])  # fmt: skip
    return {"direct": json.dumps({"features": x.tolist()}).encode(), "tensor": x.tobytes(), "json": json.dumps(oip).encode(),
            "binary": header + x.tobytes(), "binary_header": len(header), "grpc": grpc_request}  # fmt: skip


async def drive(send: Callable[[], Awaitable[None]], requests: int, concurrency: int) -> tuple[float, list[float]]:
    """``requests`` calls of ``send`` from ``concurrency`` workers: (seconds, latencies in ms)."""
    latencies: list[float] = []
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            await send()
            latencies.append((time.perf_counter() - t0) * 1e3)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


async def run(env: GatewayEnv, url: str, grpc_address: str, stub: str, key: str, gateway_pid: int, requests: int) -> list[dict]:
    import aiohttp
    import grpc

    auth = {"Authorization": f"Bearer {key}"}
    results = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http, \
            grpc.aio.insecure_channel(grpc_address) as channel:  # fmt: skip
        stub_grpc = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("authorization", f"Bearer {key}"),)
        for rows in (1, 256):
            b = bodies(rows)

            async def post(target: str, body: bytes, headers: dict[str, str]) -> None:
                async with http.post(target, data=body, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, (r.status, await r.text())

            sends = {
                "direct": lambda: post(f"{stub}/predict", b["direct"], {"Content-Type": "application/json"}),
                "direct-t": lambda: post(f"{stub}/predict_tensor", b["tensor"], {
                    "Content-Type": "application/octet-stream", "X-Fleet-Datatype": "FP32", "X-Fleet-Shape": f"{rows},4"}),
                "json": lambda: post(f"{url}/v2/models/{MODEL}/infer", b["json"], {**auth, "Content-Type": "application/json"}),
                "binary": lambda: post(f"{url}/v2/models/{MODEL}/infer", b["binary"],
                                       {**auth, "Inference-Header-Content-Length": str(b["binary_header"])}),
                "grpc": lambda: stub_grpc.ModelInfer(b["grpc"], metadata=metadata),
            }  # fmt: skip
            for concurrency in (1, 16):
                n = requests if concurrency > 1 else max(200, requests // 4)
                for name, send in sends.items():
                    await drive(send, 50, concurrency)  # warm: connections, caches of every layer
                    cpu0 = cpu_seconds(gateway_pid)
                    seconds, lat = await drive(send, n, concurrency)
                    cpu = cpu_seconds(gateway_pid) - cpu0
                    lat.sort()
                    results.append({
                        "rows": rows, "concurrency": concurrency, "protocol": name, "requests": n,
                        "rps": n / seconds, "p50_ms": statistics.median(lat), "p99_ms": lat[int(len(lat) * 0.99) - 1],
                        "gateway_cpu_ms": None if name.startswith("direct") else cpu / n * 1e3,
                    })  # fmt: skip
    return results


def table(results: list[dict]) -> None:
    print(f"{'rows':>4} {'conc':>4} {'protocol':<8} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'gw CPU ms/req':>13}")
    for r in results:
        cpu = "-" if r["gateway_cpu_ms"] is None else f"{r['gateway_cpu_ms']:.3f}"
        print(f"{r['rows']:>4} {r['concurrency']:>4} {r['protocol']:<8} {r['rps']:>8.0f} {r['p50_ms']:>7.2f} "
              f"{r['p99_ms']:>7.2f} {cpu:>13}")  # fmt: skip
    by = {(r["rows"], r["concurrency"], r["protocol"]): r for r in results}
    print()
    for conc in (1, 16):
        json_rps = by[256, conc, "json"]["rps"]
        print(f"256 rows, concurrency {conc}: binary {by[256, conc, 'binary']['rps'] / json_rps:.2f}x JSON, "
              f"gRPC {by[256, conc, 'grpc']['rps'] / json_rps:.2f}x JSON (target >= 2x)")  # fmt: skip
    for rows in (1, 256):
        added = by[rows, 1, "grpc"]["p50_ms"] - by[rows, 1, "direct-t"]["p50_ms"]
        print(f"{rows} row(s), concurrency 1: gRPC p50 {added:+.2f} ms over direct (the model's tensor route; "
              "target <= 1 ms)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests per cell at concurrency 16")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-protocols-"))
    env = GatewayEnv(work, inference_log={"sample_rate": 0.2})
    try:
        env.register("1.0.0")
        stub = env.stub("1.0.0")
        env.route(stable="1.0.0")
        key = env.tenant("bench")
        url, grpc_address, proc = start_gateway(env)
        results = asyncio.run(run(env, url, grpc_address, stub, key, proc.pid, args.requests))
    finally:
        env.stop()
    table(results)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
