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
upstream's own cost is small and what differs between rows is the protocol. The load comes
from C load generators, wrk for HTTP and h2load for gRPC (one HTTP/2 connection with up to 16
calls in flight, as one gRPC channel), so that on a 2-core machine the client does not eat
the CPU the servers need; a Python client cost more per call than the gateway, and more for
gRPC than for HTTP. Every cell is checked: no error seen by the client, and no answer but
200 counted by the gateway (h2load cannot read gRPC's status). Needs wrk and h2load
(apt-get install -y wrk nghttp2-client).

Targets (issue 13): binary HTTP and gRPC each >= 2x the throughput of JSON for 256-row
requests; gRPC's p50 over direct's at concurrency 1 at most 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench._h2load import grpc_load  # noqa: E402
from bench._wrk import Result, load  # noqa: E402
from bench.gateway import _gateway_codes  # noqa: E402
from fleet.gateway.grpc_codec import pb  # noqa: E402 - first: loads tritonclient's protos
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
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "shape": [rows, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}],
        }
    ).encode()
    grpc_request = pb.ModelInferRequest(
        model_name=MODEL,
        inputs=[pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=[rows, 4])],
        raw_input_contents=[x.tobytes()],
    )
    return {
        "direct": json.dumps({"features": x.tolist()}).encode(),
        "tensor": x.tobytes(),
        "json": json.dumps(oip).encode(),
        "binary": header + x.tobytes(),
        "binary_header": len(header),
        "grpc": grpc_request,
    }


def _failures(url: str) -> int:
    """Answers the gateway counted with a status other than 200, so far (h2load cannot read gRPC's status)."""
    return sum(n for code, n in _gateway_codes(url).items() if code != "200")


def run(url: str, grpc_address: str, stub: str, key: str, gateway_pid: int, requests: int) -> list[dict]:
    auth = {"Authorization": f"Bearer {key}"}
    results = []
    for rows in (1, 256):
        b = bodies(rows)
        infer = f"{url}/v2/models/{MODEL}/infer"
        sends: dict[str, Callable[[int, int], Result]] = {
            "direct": lambda c, n: load(f"{stub}/predict", [b["direct"]], concurrency=c, requests=n),
            "direct-t": lambda c, n: load(
                f"{stub}/predict_tensor",
                [b["tensor"]],
                concurrency=c,
                requests=n,
                headers={
                    "Content-Type": "application/octet-stream",
                    "X-Fleet-Datatype": "FP32",
                    "X-Fleet-Shape": f"{rows},4",
                },
            ),
            "json": lambda c, n: load(infer, [b["json"]], concurrency=c, requests=n, headers=auth),
            "binary": lambda c, n: load(
                infer,
                [b["binary"]],
                concurrency=c,
                requests=n,
                headers={
                    **auth,
                    "Content-Type": "application/octet-stream",
                    "Inference-Header-Content-Length": str(b["binary_header"]),
                },
            ),
            "grpc": lambda c, n: grpc_load(
                grpc_address,
                "/inference.GRPCInferenceService/ModelInfer",
                b["grpc"].SerializeToString(),
                concurrency=c,
                requests=n,
                metadata={"authorization": f"Bearer {key}"},
            ),
        }
        for concurrency in (1, 16):
            n = requests if concurrency > 1 else max(200, requests // 4)
            for name, send in sends.items():
                send(concurrency, 50)  # warm: connections, caches of every layer
                cpu0, failed0 = cpu_seconds(gateway_pid), _failures(url)
                r = send(concurrency, n)
                cpu, failed = cpu_seconds(gateway_pid) - cpu0, _failures(url) - failed0
                gateway = not name.startswith("direct")
                if r.errors or (gateway and failed):
                    raise RuntimeError(
                        f"{name}, {rows} rows, concurrency {concurrency}: {r.errors} errors seen by the "
                        f"client, {failed if gateway else 0} failures counted by the gateway"
                    )
                results.append(
                    {
                        "rows": rows,
                        "concurrency": concurrency,
                        "protocol": name,
                        "requests": r.requests,
                        "rps": r.rps,
                        "p50_ms": r.p50_ms,
                        "p99_ms": r.p99_ms,
                        "gateway_cpu_ms": cpu / r.requests * 1e3 if gateway else None,
                    }
                )
    return results


def table(results: list[dict]) -> None:
    print(f"{'rows':>4} {'conc':>4} {'protocol':<8} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'gw CPU ms/req':>13}")
    for r in results:
        cpu = "-" if r["gateway_cpu_ms"] is None else f"{r['gateway_cpu_ms']:.3f}"
        print(
            f"{r['rows']:>4} {r['concurrency']:>4} {r['protocol']:<8} {r['rps']:>8.0f} {r['p50_ms']:>7.2f} "
            f"{r['p99_ms']:>7.2f} {cpu:>13}"
        )
    by = {(r["rows"], r["concurrency"], r["protocol"]): r for r in results}
    print()
    for conc in (1, 16):
        json_rps = by[256, conc, "json"]["rps"]
        print(
            f"256 rows, concurrency {conc}: binary {by[256, conc, 'binary']['rps'] / json_rps:.2f}x JSON, "
            f"gRPC {by[256, conc, 'grpc']['rps'] / json_rps:.2f}x JSON (target >= 2x)"
        )
    for rows in (1, 256):
        added = by[rows, 1, "grpc"]["p50_ms"] - by[rows, 1, "direct-t"]["p50_ms"]
        print(
            f"{rows} row(s), concurrency 1: gRPC p50 {added:+.2f} ms over direct (the model's tensor route; "
            "target <= 1 ms)"
        )


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
        results = run(url, grpc_address, stub, key, proc.pid, args.requests)
    finally:
        env.stop()
    table(results)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
