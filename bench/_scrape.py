"""The scrape token the benchmarks' gateways take for ``/metrics`` (``fleet.gateway.health``):
set in this process's environment, which the gateways they start inherit; ``SCRAPE`` is the
header a scrape sends (a baseline gateway of an older tree, whose /metrics is open, ignores it)."""

import os

os.environ.setdefault("FLEET_METRICS_TOKEN", "bench-scrape-token")
SCRAPE = {"Authorization": f"Bearer {os.environ['FLEET_METRICS_TOKEN']}"}
