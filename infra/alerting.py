"""Where alerts go: the Alertmanager configuration of kube-prometheus-stack, from the stack's
``serving-fleet:alerting`` section and its optional alerting secrets.

Critical alerts page (PagerDuty) and are posted to the team (Slack and/or a webhook); warnings
are posted only; ``Watchdog``, the chart's always-firing alert, pings a heartbeat URL so an
outside service notices when the alerting pipeline itself is down. Alerts are grouped per
alert, model and namespace, and a critical alert silences the warning of the same alert and
model. Secrets never enter the chart's values: they are items of a Kubernetes Secret the
Alertmanager pods mount (``alertmanagerSpec.secrets``), and the configuration names their
files (``api_url_file``, ``routing_key_file``, ``credentials_file``).

A stack with no receiver is valid (a new dev stack has nowhere to page yet), and says so:
``warnings()`` is what the program logs as a Pulumi warning on every preview and update.
Pure functions over frozen settings, so tests render exactly what the chart is handed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from fleet.validation import checked, problem

SECRET_NAME = "alertmanager-receivers"  # in the monitoring namespace, beside the Alertmanager
SECRETS_DIR = f"/etc/alertmanager/secrets/{SECRET_NAME}"  # where the operator mounts it in the pod
NULL = "null"  # the receiver that sends nothing (the chart's own name for it)
PAGER, TEAM, HEARTBEAT = "pager", "team", "heartbeat"
RUNBOOK = "docs/runbook.md"  # the default base of every alert's runbook_url

# Stack secrets (`pulumi config set --secret KEY ...`), each optional; → its item in the Secret
SLACK_URL_KEY = "alertSlackWebhookUrl"
PAGERDUTY_KEY = "alertPagerdutyRoutingKey"
WEBHOOK_TOKEN_KEY = "alertWebhookToken"
ALERT_SECRETS = {  # key → (item in the Secret, what it is)
    SLACK_URL_KEY: ("slack-api-url", "the Slack incoming-webhook URL of alerting.slack_channel"),
    PAGERDUTY_KEY: ("pagerduty-routing-key", "the PagerDuty Events API v2 integration (routing) key"),
    WEBHOOK_TOKEN_KEY: ("webhook-token", "the bearer token alerting.webhook_url expects"),
}

# Alertmanager's timings: the first notice of a group waits group_wait for its siblings; a
# group that changes is re-sent after group_interval; one that stays the same, after
# repeat_interval (a page every hour while it lasts, a post every 4 h).
GROUP_BY = ["alertname", "model", "namespace"]
TIMING = {"group_wait": "30s", "group_interval": "5m", "repeat_interval": "4h"}
CRITICAL_REPEAT = "1h"
HEARTBEAT_EVERY = "1m"  # Watchdog is re-sent this often: the heartbeat service's period must be longer

_https = re.compile(r"https://[^\s/$.?#][^\s]*").fullmatch
HttpsUrl = checked(str, "an https:// URL", lambda v: _https(v) is not None)
SlackChannel = checked(
    str, "a Slack channel like '#ml-fleet-alerts'", re.compile(r"[#@][a-z0-9][a-z0-9._-]{0,79}").fullmatch
)
RunbookUrl = checked(
    str,
    "the runbook's address without a '#' (an https:// URL of docs/runbook.md, or that path)",
    lambda v: "#" not in v and (_https(v) is not None or v == RUNBOOK),
)


class AlertingSettings(BaseModel):
    """``serving-fleet:alerting``: the receivers (their secrets are stack secrets, see
    ``ALERT_SECRETS``) and where the runbook is read."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    runbook_url: RunbookUrl = RUNBOOK  # base of every alert's runbook_url: <it>#<alert, lowercased>
    slack_channel: SlackChannel | None = None  # criticals and warnings are posted here
    pagerduty: bool = False  # criticals page through PagerDuty
    webhook_url: HttpsUrl | None = None  # criticals and warnings POSTed as Alertmanager's webhook JSON
    heartbeat_url: HttpsUrl | None = None  # Watchdog, every minute: a dead man's switch (e.g. healthchecks.io)

    def secrets_needed(self) -> set[str]:
        """The stack secrets this section needs (the webhook's token is optional)."""
        return {k for k, on in ((SLACK_URL_KEY, self.slack_channel), (PAGERDUTY_KEY, self.pagerduty)) if on}


# secret key → the setting that uses it: a secret without it would be silently ignored
_USED_BY = {SLACK_URL_KEY: "slack_channel", PAGERDUTY_KEY: "pagerduty", WEBHOOK_TOKEN_KEY: "webhook_url"}


def _set_secret(key: str) -> str:
    example = {SLACK_URL_KEY: "https://hooks.slack.com/services/...", PAGERDUTY_KEY: "<32-character key>"}
    return f"`pulumi config set --secret {key} '{example.get(key, '<token>')}'`"


def _value_problem(key: str, value: str) -> str | None:
    """What is wrong with a set secret, never saying what it is."""
    if key == SLACK_URL_KEY and not _https(value):
        return "not an https:// URL (value not shown)"
    if key == PAGERDUTY_KEY and not re.fullmatch(r"[A-Za-z0-9]{32}", value):
        return f"got {len(value)} characters (value not shown), not 32 letters and digits"
    if not value.strip() or value != value.strip():
        return "empty or with surrounding whitespace (value not shown)"
    return None


def secret_problems(settings: AlertingSettings, raw: Mapping[str, Any], where: str) -> list[str]:
    """Report lines for the alerting secrets of ``raw`` (config key → value): a receiver without
    its secret, a secret no setting uses, a malformed one; values are never shown."""
    found = []
    for key, (_, what) in ALERT_SECRETS.items():
        at, value = f"{where}: serving-fleet:{key}", raw.get(key)
        if value is None:
            if key in settings.secrets_needed():
                found.append(problem(at, "not set", f"{what}, as a secret: {_set_secret(key)}"))
        elif not getattr(settings, _USED_BY[key]):
            found.append(
                problem(
                    at,
                    f"set, but serving-fleet:alerting.{_USED_BY[key]} is not",
                    f"alerting.{_USED_BY[key]} set too, or the secret removed: `pulumi config rm {key}`",
                )
            )
        elif not isinstance(value, str) or (bad := _value_problem(key, value)):
            found.append(problem(at, bad if isinstance(value, str) else "not text", f"{what}: {_set_secret(key)}"))
    return found


def _file(key: str) -> str:
    return f"{SECRETS_DIR}/{ALERT_SECRETS[key][0]}"


_SUMMARY = "{{ range .Alerts }}{{ .Annotations.summary }}\n{{ end }}"
_RUNBOOK = "{{ .CommonAnnotations.runbook_url }}"


def _receivers(s: AlertingSettings, token: bool) -> list[dict]:
    receivers: list[dict] = [{"name": NULL}]
    if s.pagerduty:
        pager = {
            "routing_key_file": _file(PAGERDUTY_KEY),
            "send_resolved": True,
            "severity": "critical",
            "description": "{{ .CommonLabels.alertname }} {{ .CommonLabels.model }}: {{ .CommonAnnotations.summary }}",
            "links": [{"href": _RUNBOOK, "text": "runbook"}],
        }
        receivers.append({"name": PAGER, "pagerduty_configs": [pager]})
    team: dict[str, Any] = {}
    if s.slack_channel:
        slack = {
            "api_url_file": _file(SLACK_URL_KEY),
            "channel": s.slack_channel,
            "send_resolved": True,
            "title": "[{{ .Status | toUpper }}] {{ .CommonLabels.severity }}: {{ .GroupLabels.alertname }} "
            "{{ .GroupLabels.model }}",
            "title_link": _RUNBOOK,
            "text": _SUMMARY + "runbook: " + _RUNBOOK,
        }
        team["slack_configs"] = [slack]
    if s.webhook_url:
        hook: dict[str, Any] = {"url": s.webhook_url, "send_resolved": True}
        if token:
            hook["http_config"] = {"authorization": {"type": "Bearer", "credentials_file": _file(WEBHOOK_TOKEN_KEY)}}
        team["webhook_configs"] = [hook]
    if team:
        receivers.append({"name": TEAM, **team})
    if s.heartbeat_url:
        receivers.append({"name": HEARTBEAT, "webhook_configs": [{"url": s.heartbeat_url, "send_resolved": False}]})
    return receivers


def _routes(s: AlertingSettings, team: bool) -> list[dict]:
    every = {"group_wait": "0s", "group_interval": HEARTBEAT_EVERY, "repeat_interval": HEARTBEAT_EVERY}
    routes = [
        {"matchers": ['alertname="Watchdog"'], "receiver": HEARTBEAT if s.heartbeat_url else NULL, **every},
        # the chart's helper alert that exists to inhibit info alerts: never sent
        {"matchers": ['alertname="InfoInhibitor"'], "receiver": NULL},
    ]
    if s.pagerduty:
        # continue: the team sees the page too
        routes.append(
            {
                "matchers": ['severity="critical"'],
                "receiver": PAGER,
                "continue": team,
                "repeat_interval": CRITICAL_REPEAT,
            }
        )
    if team:
        routes.append({"matchers": ['severity="critical"'], "receiver": TEAM, "repeat_interval": CRITICAL_REPEAT})
    routes.append({"matchers": ['severity=~"info|none"'], "receiver": NULL})  # context for other alerts only
    return routes


def alertmanager_config(settings: AlertingSettings, secrets: set[str]) -> dict:
    """Alertmanager's configuration (alertmanager.yaml) for ``settings``, ``secrets`` being the
    alerting secret keys the stack has. Warnings and any other severity fall through to the
    root route: the team, or ``null`` when there is no team receiver."""
    receivers = _receivers(settings, WEBHOOK_TOKEN_KEY in secrets)
    team = any(r["name"] == TEAM for r in receivers)
    same = ["alertname", "namespace", "model"]
    return {
        "global": {"resolve_timeout": "5m"},
        "route": {
            "receiver": TEAM if team else NULL,
            "group_by": GROUP_BY,
            **TIMING,
            "routes": _routes(settings, team),
        },
        "inhibit_rules": [
            # a critical alert silences the warning (and info) of the same alert and model
            {
                "source_matchers": ['severity="critical"'],
                "target_matchers": ['severity=~"warning|info"'],
                "equal": same,
            },
            {"source_matchers": ['severity="warning"'], "target_matchers": ['severity="info"'], "equal": same},
            # the chart's InfoInhibitor: info alerts matter only beside a warning or critical one
            {
                "source_matchers": ['alertname="InfoInhibitor"'],
                "target_matchers": ['severity="info"'],
                "equal": ["namespace"],
            },
        ],
        "receivers": receivers,
        "templates": ["/etc/alertmanager/config/*.tmpl"],  # the chart's templateFiles (none today)
    }


def alertmanager_values(settings: AlertingSettings, secrets: set[str], node_selector: Mapping[str, str]) -> dict:
    """kube-prometheus-stack's ``alertmanager`` values: the config, and the Secret to mount
    when the stack has alerting secrets."""
    spec: dict[str, Any] = {"nodeSelector": dict(node_selector)}
    if secrets:
        spec["secrets"] = [SECRET_NAME]
    return {"config": alertmanager_config(settings, secrets), "alertmanagerSpec": spec}


def secret_items(secrets: Mapping[str, Any]) -> dict[str, Any]:
    """The Secret's items (item → value) of the alerting secrets ``secrets`` (key → value)."""
    return {ALERT_SECRETS[k][0]: v for k, v in secrets.items() if k in ALERT_SECRETS}


def warnings(settings: AlertingSettings) -> list[str]:
    """What a stack's alerting leaves unsent, one line each: logged as Pulumi warnings."""
    fix = "set serving-fleet:alerting (slack_channel, pagerduty, webhook_url) and its secrets, see docs/runbook.md"
    if not (settings.slack_channel or settings.pagerduty or settings.webhook_url):
        return [f"alerting: no receiver configured: every alert goes to Alertmanager's null receiver; {fix}"]
    found = []
    if not settings.pagerduty:
        found.append("alerting: nobody is paged: critical alerts are only posted (alerting.pagerduty is false)")
    if not settings.heartbeat_url:
        found.append(
            "alerting: no heartbeat_url: nothing outside the cluster notices when Prometheus or Alertmanager stops"
        )
    return found
