"""The policy pack's entry point: `pulumi preview --policy-pack policies/guardrails` runs this.

Only here is ``PolicyPack`` constructed: its constructor starts the analyzer's gRPC server
and blocks, so the policies themselves live in ``fleet_guardrails`` where tests import them.
"""

from fleet_guardrails import PACK_NAME, POLICIES
from pulumi_policy import EnforcementLevel, PolicyPack

PolicyPack(name=PACK_NAME, enforcement_level=EnforcementLevel.MANDATORY, policies=POLICIES)
