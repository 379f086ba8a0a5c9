"""Blue-green beside canary on the same fleet, in one run: real Bentos (the stable at two
replicas), two gateways, a real Prefect server, steady load through both gateways.

Four rollouts one after another, each a real ``canary_rollout`` flow run with the tests'
policy scaled to seconds (``tests.rollout_env.FAST``: steps 20/50/100, a look every 2 s):

- a good version by canary steps, then an identical one (same seed) blue-green;
- a bad version (30 % of its requests fail) by canary, then an identical one blue-green.

Figures per rollout:
- **to traffic**: from the flow's start to the route change that first gave the new version
  callers' requests (canary: its first step; blue-green: the switch, after green started at
  the stable's replica count);
- **propagation**: every route change the rollout made, written → served by each gateway
  (each gateway's ``/admin/stats`` ``revision``, polled every 20 ms): p50 / p99 / max;
- **to verdict**: from that first traffic to promotion, or to the rollback (switch back);
- **new version's answers / failures**: what callers got from it, and how many requests
  callers saw fail (a request the new version failed is answered again by the stable).

    .venv/bin/python bench/bluegreen.py [--bake 20] [--rps 60]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HOME = Path(tempfile.mkdtemp(prefix="fleet-bench-bluegreen-"))
os.environ.setdefault("BENTOML_HOME", str(HOME / "bentoml"))
os.environ.setdefault("PREFECT_HOME", str(HOME / "prefect-home"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bake", type=float, default=20.0, help="blue-green bake, seconds")
    parser.add_argument("--rps", type=float, default=60.0, help="load across both gateways")
    args = parser.parse_args()

    from tests.serving_env import free_port

    port = free_port()
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    from fleet.local.up import Prefect

    server = Prefect(HOME / "prefect", port)
    server.start()
    try:
        server.wait_ready()
        rows = run(args.bake, args.rps)
    finally:
        server.stop()
    print_table(rows)


def run(bake_s: float, rps: float) -> list[dict]:
    from tests.rollout_env import FAST, MODEL, rollout_watched, route_changes, serving_fleet
    from tests.serving_env import FleetEnv

    env = FleetEnv(HOME / "fleet")
    env.root.mkdir()
    rows = []
    with serving_fleet(env) as fleet:
        env.fleet("deploy", MODEL, "1.0.0", "--replicas", "2")
        fleet["urls"] = [fleet["url"], env.start_gateway()]
        cases = [
            ("good", "canary", "1.1.0", ["--seed", "11"]),
            ("good", "blue-green", "1.1.1", ["--seed", "11"]),
            ("bad", "canary", "1.2.0", ["--seed", "12", "--fault-error-rate", "0.3"]),
            ("bad", "blue-green", "1.2.1", ["--seed", "12", "--fault-error-rate", "0.3"]),
        ]
        for kind, strategy, version, training in cases:
            env.fleet("models", "train", MODEL, version, "--rows", "20000", "--epochs", "15", *training)
            before = max((r for r, _, _ in route_changes(fleet)), default=0)
            policy = {**FAST, "strategy": strategy} | ({"bake_s": bake_s} if strategy == "blue-green" else {})
            started = time.time()
            state, loads, watch = rollout_watched(fleet, version, policy, rps)
            changes = [(r, t, why) for r, t, why in route_changes(fleet) if r > before]
            first = next(t for r, t, why in changes if "switch:" in why or "step 1/" in why)
            lags = sorted(watch.seen_at(u, r) - t for r, t, _ in changes for u in fleet["urls"])
            rows.append(
                {
                    "version": f"{kind} {version}",
                    "strategy": strategy,
                    "outcome": "promoted" if state.is_completed() else "rolled back",
                    "to_traffic_s": first - started,
                    "propagation_ms": (
                        1000 * lags[len(lags) // 2],
                        1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))],
                        1000 * lags[-1],
                    ),
                    "changes": len(changes),
                    "to_verdict_s": changes[-1][1] - first,
                    "new_answers": sum(load.by_version.get(version, 0) for load in loads),
                    "failures": sum(len(load.failures) for load in loads),
                    "requests": sum(load.ok + len(load.failures) for load in loads),
                    "message": state.message,
                }
            )
            print(f"{strategy} {version}: {state.message}", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print()
    head = ("rollout", "strategy", "outcome", "to traffic s", "propagation ms p50/p99/max", "to verdict s")
    head += ("its answers", "caller failures")
    print(" | ".join(head))
    for r in rows:
        p50, p99, worst = r["propagation_ms"]
        print(
            " | ".join(
                [
                    r["version"],
                    r["strategy"],
                    r["outcome"],
                    f"{r['to_traffic_s']:.1f}",
                    f"{p50:.0f} / {p99:.0f} / {worst:.0f} ({r['changes']} changes x 2 gateways)",
                    f"{r['to_verdict_s']:.1f}",
                    str(r["new_answers"]),
                    f"{r['failures']} of {r['requests']}",
                ]
            )
        )


if __name__ == "__main__":
    main()
