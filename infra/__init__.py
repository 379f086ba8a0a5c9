"""The Pulumi program of the serving fleet: ``__main__.py`` wires the components of this package."""

from __future__ import annotations

import pulumi


def waited_for(opts: pulumi.ResourceOptions | None) -> list[pulumi.Resource]:
    """What a component's ``depends_on`` names, to hand to its children: Pulumi does not pass
    a component's ``depends_on`` on to the resources it creates, so without this they would
    not wait for it (node groups for their role, charts for any node)."""
    if opts is None or opts.depends_on is None:
        return []
    if isinstance(opts.depends_on, pulumi.Resource):
        return [opts.depends_on]
    return list(opts.depends_on)  # type: ignore[arg-type]
