"""How much of the stable's traffic before a rollout a first step at 100 % needs.

At 100 % nothing serves on the stable beside the new version (blue-green's switch, or a
canary policy with ``steps: [100]``), so the stable's answers before the step are the only
reference its gates have. A reference short of what they wait for would keep the step
undecided until its deadline: the rollout machine takes such a step only once the baseline
holds ``needed(policy)`` answers of its last ``BASELINE_S`` (``short``), and
the dry run says when it would wait (``fleet.analysis.simulate.switch_waits``).
"""

from __future__ import annotations

from fleet.analysis.gates import stable_needed
from fleet.analysis.sequential import STABLE_P99_ANSWERS
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.types import ArmWindow

BASELINE_S = 300  # the stable's traffic before the rollout that a 100 % step is judged against


def needed(policy: RolloutPolicy) -> int:
    """The stable answers the latency gates wait for at 100 % (the other gates wait for
    ``min_samples``): by the policy's method, as ``fleet.analysis.sequential._tail`` and
    ``fleet.analysis.gates.latency`` count them."""
    if policy.method == "sequential":
        return max(policy.min_samples, STABLE_P99_ANSWERS)
    return stable_needed(policy.min_samples, 1.0 - policy.gates.confidence)


def counted(policy: RolloutPolicy, baseline: ArmWindow) -> int:
    """What of ``baseline`` those gates count: its answers (a failed request has no latency),
    and for a generative policy's time-per-token gate only the answers that have one."""
    answered = int(sum(baseline.latency_ms))
    if policy.gates.max_tpot_p99_ratio is not None:
        return min(answered, int(sum(baseline.tpot_ms)))
    return answered


def short(policy: RolloutPolicy, baseline: ArmWindow | None) -> int:
    """How many more of the stable's answers the baseline needs (0: enough)."""
    return max(0, needed(policy) - (counted(policy, baseline) if baseline is not None else 0))
