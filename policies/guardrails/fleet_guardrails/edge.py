"""Load balancers serve HTTPS only: no listener answers in plain HTTP."""

from __future__ import annotations

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

from fleet_guardrails._common import as_list, get

LISTENERS = {"aws:lb/listener:Listener", "aws:alb/listener:Listener"}
CLASSIC = "aws:elb/loadBalancer:LoadBalancer"
ENCRYPTED = {"HTTPS", "TLS"}  # TLS: a Network Load Balancer terminating TLS


def _redirects_to_https(actions: list) -> bool:
    """An HTTP listener whose every action redirects to HTTPS serves nothing in plain text."""
    return bool(actions) and all(
        a.get("type") == "redirect" and get(a, "redirect", "protocol") == "HTTPS" for a in actions
    )


def _https_only(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type in LISTENERS:
        protocol = args.props.get("protocol") or "HTTP"  # AWS's default for an ALB listener
        if protocol not in ENCRYPTED and not _redirects_to_https(as_list(args.props.get("defaultActions"))):
            report(
                f"listener {args.name} on port {args.props.get('port')} uses {protocol}; expected HTTPS "
                "(or an HTTP listener that only redirects to HTTPS)"
            )
        elif protocol in ENCRYPTED and not args.props.get("certificateArn"):
            report(f"listener {args.name} uses {protocol} without a certificate_arn")
    elif args.resource_type == CLASSIC:
        for listener in as_list(args.props.get("listeners")):
            if str(listener.get("lbProtocol", "")).lower() not in ("https", "ssl"):
                report(
                    f"classic load balancer {args.name} listens with {listener.get('lbProtocol')} on port "
                    f"{listener.get('lbPort')}; expected https or ssl"
                )


https_only_listeners = ResourceValidationPolicy(
    name="https-only-listeners",
    description="Load-balancer listeners use HTTPS (or TLS) with a certificate.",
    validate=_https_only,
    enforcement_level=EnforcementLevel.MANDATORY,
)
