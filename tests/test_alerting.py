"""Operations that page someone: the Alertmanager configuration the program hands
kube-prometheus-stack, checked by Alertmanager's own ``amtool`` (Debian's
prometheus-alertmanager, 0.25), with where a critical and a warning alert of a model go; the
fleet's alert rules checked by ``promtool``, each with a severity and a runbook section that
exists; the receivers' secrets kept out of the chart's values; the chart's alerts on what
EKS hides turned off."""

from __future__ import annotations

import copy
import json
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from infra_harness import PROJECT, ROOT, Build, build, stack_config
from k8s_schemas import json_ints, validate

from fleet.errors import ConfigError
from infra import config as cfg
from infra.alerting import (
    ALERT_SECRETS,
    HEARTBEAT,
    NULL,
    PAGER,
    PAGERDUTY_KEY,
    SECRET_NAME,
    SECRETS_DIR,
    SLACK_URL_KEY,
    TEAM,
    WEBHOOK_TOKEN_KEY,
    AlertingSettings,
    alertmanager_config,
    warnings,
)
from infra.monitoring import EKS_OFF_RULES, EKS_UNSCRAPEABLE
from tests.serving_env import free_port, wait_ready

AMTOOL = shutil.which("amtool") or "/usr/bin/amtool"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"  # Debian's name
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
RUNBOOK = ROOT / "docs" / "runbook.md"
RUNBOOK_URL = "https://github.com/example/serving-fleet/blob/main/docs/runbook.md"
ALERTING = {
    "runbook_url": RUNBOOK_URL,
    "slack_channel": "#ml-fleet-alerts",
    "pagerduty": True,
    "webhook_url": "https://hooks.example.com/serving-fleet",
    "heartbeat_url": "https://hc-ping.com/0f2b2c1e",
}
KPS_VALUES = ROOT / "tests" / "fixtures" / "charts" / "kube-prometheus-stack-79.7.1" / "values.yaml"
SECRETS = {  # as `pulumi config set --secret` would hold them
    SLACK_URL_KEY: "https://hooks.slack.com/services/T000/B000/must-stay-secret-slack",
    PAGERDUTY_KEY: "MustStaySecretPagerDuty0123456ab",
    WEBHOOK_TOKEN_KEY: "must-stay-secret-webhook-bearer-token",
}


def _built(stack: str, config: dict[str, str]) -> tuple[Build, list[str]]:
    """The stack under mocks, and the warnings the program logged (Pulumi's mocks hand the
    engine's log to the root logger)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    try:
        return build(stack, config), records
    finally:
        logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def bare() -> tuple[Build, list[str]]:
    """The dev example: no receiver configured."""
    return _built("dev", stack_config("dev"))


@pytest.fixture(scope="module")
def paging() -> tuple[Build, list[str]]:
    """The prod example with every receiver and its secrets."""
    config = stack_config("prod") | {f"{PROJECT}:alerting": json.dumps(ALERTING)}
    return _built("prod", config | {f"{PROJECT}:{k}": v for k, v in SECRETS.items()})


def _defaults() -> dict:
    """kube-prometheus-stack's default values at the pinned version (tests/test_charts.py checks
    the version against infra/charts.py)."""
    return yaml.safe_load(KPS_VALUES.read_text())


def _merged(defaults: object, ours: object) -> object:
    """Helm's coalescing of a release's values over the chart's: maps merge, anything else is replaced."""
    if isinstance(defaults, dict) and isinstance(ours, dict):
        return {**copy.deepcopy(defaults), **{k: _merged(defaults.get(k), v) for k, v in ours.items()}}
    return copy.deepcopy(ours)


def _kps(stack: Build) -> dict:
    (release,) = [
        r for r in stack.of_type("kubernetes:helm.sh/v3:Release") if r.inputs["chart"] == "kube-prometheus-stack"
    ]
    return release.inputs


def _rendered(stack: Build) -> dict:
    """alertmanager.yaml as the chart writes it: our config coalesced over the chart's default."""
    defaults = _defaults()["alertmanager"]["config"]
    return _merged(defaults, _kps(stack)["values"]["alertmanager"]["config"])


def _amtool(*args: str) -> str:
    assert Path(AMTOOL).exists(), "amtool is not installed; `make system-deps` installs it (prometheus-alertmanager)"
    done = subprocess.run([AMTOOL, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"amtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def _config_file(tmp_path: Path, config: dict) -> Path:
    file = tmp_path / "alertmanager.yaml"
    file.write_text(yaml.safe_dump(config, sort_keys=False))
    return file


def _route(file: Path, **labels: str) -> set[str]:
    """The receivers an alert with ``labels`` reaches, as Alertmanager's router decides."""
    out = _amtool("config", "routes", "test", f"--config.file={file}", *(f"{k}={v}" for k, v in labels.items()))
    return set(out.strip().split(","))


# --- Alertmanager's configuration ----------------------------------------------------------


def test_the_config_with_every_receiver_passes_amtool_and_routes_by_severity(paging, tmp_path: Path) -> None:
    stack, _ = paging
    file = _config_file(tmp_path, _rendered(stack))
    assert "SUCCESS" in _amtool("check-config", str(file))
    critical = {"alertname": "FleetModelErrorRateHigh", "severity": "critical", "model": "llm-7b"}
    assert _route(file, **critical) == {PAGER, TEAM}  # paged, and the team sees it
    assert _route(file, **{**critical, "severity": "warning"}) == {TEAM}
    assert _route(file, alertname="KubePodCrashLooping", severity="warning", namespace="models") == {TEAM}
    assert _route(file, alertname="Watchdog", severity="none") == {HEARTBEAT}
    assert _route(file, alertname="InfoInhibitor", severity="none") == {NULL}
    assert _route(file, alertname="CPUThrottlingHigh", severity="info") == {NULL}


def test_a_stack_without_receivers_is_valid_sends_nothing_and_says_so(bare, tmp_path: Path) -> None:
    stack, logged = bare
    config = _rendered(stack)
    file = _config_file(tmp_path, config)
    assert "SUCCESS" in _amtool("check-config", str(file))
    assert _route(file, alertname="FleetGatewayDown", severity="critical") == {NULL}
    assert [r["name"] for r in config["receivers"]] == [NULL]
    assert any("no receiver configured: every alert goes to Alertmanager's null receiver" in m for m in logged), logged
    assert "secrets" not in _kps(stack)["values"]["alertmanager"]["alertmanagerSpec"]  # nothing to mount
    assert not [
        r for r in stack.of_type("kubernetes:core/v1:Secret") if r.inputs["metadata"].get("name") == SECRET_NAME
    ]


def test_pagerduty_alone_pages_criticals_and_drops_warnings(tmp_path: Path) -> None:
    file = _config_file(tmp_path, alertmanager_config(AlertingSettings(pagerduty=True), {PAGERDUTY_KEY}))
    _amtool("check-config", str(file))
    assert _route(file, alertname="FleetGatewayDown", severity="critical") == {PAGER}
    assert _route(file, alertname="FleetInferenceLogDropping", severity="warning") == {NULL}


def test_alerts_are_grouped_per_alert_and_model_and_a_critical_silences_its_warning(paging) -> None:
    config = _rendered(paging[0])
    route = config["route"]
    assert route["group_by"] == ["alertname", "model", "namespace"]
    assert (route["group_wait"], route["group_interval"], route["repeat_interval"]) == ("30s", "5m", "4h")
    inhibit = config["inhibit_rules"][0]
    assert inhibit["source_matchers"] == ['severity="critical"'] and "warning" in inhibit["target_matchers"][0]
    assert set(inhibit["equal"]) == {"alertname", "model", "namespace"}
    assert config["inhibit_rules"] == _kps(paging[0])["values"]["alertmanager"]["config"]["inhibit_rules"]


@pytest.fixture
def alertmanager(paging, tmp_path: Path) -> Iterator[str]:
    """A real Alertmanager on 127.0.0.1 with the program's config; the first notification
    would wait an hour, so nothing leaves the machine while a test runs."""
    config = _rendered(paging[0])
    config["route"]["group_wait"] = "1h"
    port, log = free_port(), tmp_path / "alertmanager.log"
    args = [f"--config.file={_config_file(tmp_path, config)}", f"--storage.path={tmp_path / 'data'}"]
    args += [f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]  # no gossip port
    with open(log, "wb") as out:
        proc = subprocess.Popen([ALERTMANAGER, *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}/-/ready", proc, log, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_running_alertmanager_routes_the_page_and_holds_back_the_warning_under_it(alertmanager: str) -> None:
    def alert(severity: str, model: str) -> dict:
        labels = {"alertname": "FleetModelErrorRateHigh", "severity": severity, "model": model}
        return {"labels": labels, "annotations": {"summary": f"{model} fails"}}

    sent = [alert("critical", "llm-7b"), alert("warning", "llm-7b"), alert("warning", "embed-small")]
    httpx.post(f"{alertmanager}/api/v2/alerts", json=sent, timeout=5).raise_for_status()
    deadline = time.monotonic() + 10
    while True:  # the inhibitor sees new alerts asynchronously: wait until it has
        found = httpx.get(f"{alertmanager}/api/v2/alerts", timeout=5).json()
        by = {(a["labels"]["severity"], a["labels"]["model"]): a for a in found}
        if by.get(("warning", "llm-7b"), {}).get("status", {}).get("state") == "suppressed":
            break
        assert time.monotonic() < deadline, f"the warning under a critical was never inhibited: {found}"
        time.sleep(0.05)
    page, held, other = by[("critical", "llm-7b")], by[("warning", "llm-7b")], by[("warning", "embed-small")]
    assert page["status"]["state"] == "active" and {r["name"] for r in page["receivers"]} == {PAGER, TEAM}
    assert held["status"]["inhibitedBy"] == [page["fingerprint"]]
    assert other["status"]["state"] == "active" and [r["name"] for r in other["receivers"]] == [TEAM]


def test_the_notification_templates_render_the_summary_and_the_runbook(paging, tmp_path: Path) -> None:
    receivers = {r["name"]: r for r in _rendered(paging[0])["receivers"]}
    slack = receivers[TEAM]["slack_configs"][0]
    pager = receivers[PAGER]["pagerduty_configs"][0]
    runbook = f"{RUNBOOK_URL}#fleetmodelerrorratehigh"
    alert = {
        "status": "firing",
        "labels": {"alertname": "FleetModelErrorRateHigh", "model": "llm-7b", "severity": "critical"},
        "annotations": {"summary": "llm-7b: requests fail", "runbook_url": runbook},
    }
    data = {
        "receiver": TEAM,
        "status": "firing",
        "alerts": [alert],
        "groupLabels": {"alertname": "FleetModelErrorRateHigh", "model": "llm-7b"},
        "commonLabels": alert["labels"],
        "commonAnnotations": alert["annotations"],
        "externalURL": "http://alertmanager",
    }
    (tmp_path / "data.json").write_text(json.dumps(data))
    (tmp_path / "none.tmpl").write_text("")
    glob = f"--template.glob={tmp_path / 'none.tmpl'}"

    def render(text: str) -> str:
        return _amtool(
            "template", "render", glob, f"--template.text={text}", f"--template.data={tmp_path / 'data.json'}"
        )

    assert render(slack["title"]).strip() == "[FIRING] critical: FleetModelErrorRateHigh llm-7b"
    assert render(slack["text"]).strip() == f"llm-7b: requests fail\nrunbook: {runbook}"
    assert render(slack["title_link"]).strip() == runbook == render(pager["links"][0]["href"]).strip()
    assert render(pager["description"]).strip() == "FleetModelErrorRateHigh llm-7b: llm-7b: requests fail"


# --- secrets --------------------------------------------------------------------------------


def test_receiver_secrets_reach_alertmanager_only_through_a_mounted_secret(paging) -> None:
    stack, _ = paging
    (secret,) = [
        r for r in stack.of_type("kubernetes:core/v1:Secret") if r.inputs["metadata"].get("name") == SECRET_NAME
    ]
    items = {item: SECRETS[key] for key, (item, _) in ALERT_SECRETS.items()}
    assert secret.inputs["stringData"] == items and "stringData" in secret.secret_inputs
    release = _kps(stack)
    assert secret.inputs["metadata"]["namespace"] == release["namespace"]
    validate(json_ints({**secret.inputs, "metadata": secret.state["metadata"]}))
    assert secret.urn in _release_dependencies(stack)  # the pods mount it: it exists first
    values = json.dumps(release["values"])
    assert all(value not in values for value in SECRETS.values()), "a receiver secret is in the chart's values"
    assert release["values"]["alertmanager"]["alertmanagerSpec"]["secrets"] == [SECRET_NAME]
    files = re.findall(r'"(?:api_url_file|routing_key_file|credentials_file)": "([^"]+)"', values)
    assert sorted(files) == sorted(f"{SECRETS_DIR}/{item}" for item in items)  # the operator's mount path
    for r in stack.resources:  # encrypted wherever it goes
        plain = {k: v for k, v in r.inputs.items() if k not in r.secret_inputs}
        assert all(value not in json.dumps(plain, default=str) for value in SECRETS.values()), r.name


def _release_dependencies(stack: Build) -> list[str]:
    (release,) = [
        r for r in stack.of_type("kubernetes:helm.sh/v3:Release") if r.inputs["chart"] == "kube-prometheus-stack"
    ]
    return release.dependencies


def _parse(**changes: object) -> None:
    raw = {k.removeprefix(f"{PROJECT}:"): v for k, v in stack_config("dev").items() if k.startswith(f"{PROJECT}:")}
    raw.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in changes.items() if v is not None})
    cfg.parse(raw, "dev", "us-east-1")


def test_a_receiver_without_its_secret_or_a_secret_without_its_receiver_is_refused_without_showing_it() -> None:
    with pytest.raises(ConfigError) as err:
        _parse(alerting={"slack_channel": "#ml-fleet-alerts", "pagerduty": True})
    message = str(err.value)
    assert (
        "Pulumi.dev.yaml: serving-fleet:alertSlackWebhookUrl: not set — expected the Slack incoming-webhook" in message
    )
    assert "serving-fleet:alertPagerdutyRoutingKey: not set — expected the PagerDuty Events API v2" in message
    with pytest.raises(ConfigError, match="alertWebhookToken: set, but serving-fleet:alerting.webhook_url is not"):
        _parse(alertWebhookToken="a-token-for-nobody")
    with pytest.raises(ConfigError) as err:
        _parse(alerting={"pagerduty": True}, alertPagerdutyRoutingKey="short-secret-key")
    assert "got 16 characters (value not shown), not 32 letters and digits" in str(err.value)
    assert "short-secret-key" not in str(err.value)
    with pytest.raises(ConfigError, match=r"alerting.slack_channel: got 'ml-fleet' — expected a Slack channel"):
        _parse(alerting={"slack_channel": "ml-fleet"})
    with pytest.raises(ConfigError, match=r"alerting.webhook_url: got 'http://hooks.example.com' — expected an https"):
        _parse(alerting={"webhook_url": "http://hooks.example.com"})
    _parse(alerting={"webhook_url": "https://hooks.example.com"})  # the webhook's token is optional


def test_a_stack_that_posts_but_never_pages_says_so(paging) -> None:
    """The program logs what ``warnings`` says (the bare stack's test shows it does)."""
    assert [m for m in paging[1] if m.startswith("alerting:")] == []  # every receiver and a heartbeat
    posts_only = warnings(AlertingSettings(webhook_url=ALERTING["webhook_url"]))
    assert [m.split(":")[1].strip() for m in posts_only] == ["nobody is paged", "no heartbeat_url"]


# --- the fleet's alert rules ----------------------------------------------------------------


def _rules(stack: Build) -> list[dict]:
    (rule,) = stack.of_type("kubernetes:monitoring.coreos.com/v1:PrometheusRule")
    return rule.inputs["spec"]["groups"]


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces as -."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_promtool_accepts_the_rules_the_program_renders(bare, paging, tmp_path: Path) -> None:
    for stack in (bare[0], paging[0]):
        file = tmp_path / f"{stack.stack}.rules.yaml"
        file.write_text(yaml.safe_dump({"groups": json_ints(_rules(stack))}))
        done = subprocess.run([PROMTOOL, "check", "rules", str(file)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


def test_every_alert_has_a_severity_alertmanager_routes_and_a_runbook_section_that_exists(bare, paging) -> None:
    anchors = _anchors(RUNBOOK.read_text())
    for stack, base in ((bare[0], "docs/runbook.md"), (paging[0], RUNBOOK_URL)):
        rules = [r for g in _rules(stack) for r in g["rules"]]
        assert {r["alert"] for r in rules} >= {"FleetModelErrorRateHigh", "FleetGatewayDown"}
        for rule in rules:
            assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
            url, _, anchor = rule["annotations"]["runbook_url"].partition("#")
            assert url == base, rule["annotations"]["runbook_url"]
            assert anchor in anchors, f"{rule['alert']}: docs/runbook.md has no section #{anchor}"


def test_each_model_pages_on_a_fast_burn_and_warns_at_its_slo(paging) -> None:
    groups = {g["name"]: g["rules"] for g in _rules(paging[0])}
    errors = [r for r in groups["slo-llm-7b"] if r["alert"] == "FleetModelErrorRateHigh"]
    by_severity = {r["labels"]["severity"]: r for r in errors}
    assert set(by_severity) == {"critical", "warning"} and all(r["labels"]["model"] == "llm-7b" for r in errors)
    assert by_severity["warning"]["expr"].endswith("> 0.01")  # policies/models-gpu.yaml: error_rate 0.01
    assert "[5m]" in by_severity["critical"]["expr"] and "[1h]" in by_severity["critical"]["expr"]
    assert by_severity["critical"]["expr"].count("> 0.144") == 2  # 14.4 times the SLO, both windows


def test_the_runbook_names_only_fleet_commands_that_exist() -> None:
    from typer.main import get_command

    from fleet.cli import app

    root = get_command(app)
    for line in re.findall(r"`fleet ([a-z-]+(?: [a-z-]+)?)", RUNBOOK.read_text()):
        words = line.split()
        command = root.commands.get(words[0])  # type: ignore[attr-defined]
        assert command is not None, f"docs/runbook.md names `fleet {words[0]}`, which does not exist"
        sub = getattr(command, "commands", None)
        if sub is not None and len(words) > 1:
            assert words[1] in sub, f"docs/runbook.md names `fleet {line}`, which does not exist"


# --- what EKS hides -------------------------------------------------------------------------


def test_the_charts_alerts_and_scrapes_of_what_eks_hides_are_off(bare) -> None:
    values = _kps(bare[0])["values"]
    defaults = _defaults()
    for group in EKS_OFF_RULES:
        assert defaults["defaultRules"]["rules"][group] is True  # a real key of the chart, on by default
        assert values["defaultRules"]["rules"][group] is False
    for target in EKS_UNSCRAPEABLE:
        assert defaults[target]["enabled"] is True
        assert values[target] == {"enabled": False}
    kept = {k for k, v in _merged(defaults, values)["defaultRules"]["rules"].items() if v}
    assert {"kubeApiserverAvailability", "kubelet", "node", "kubernetesApps", "general"} <= kept
