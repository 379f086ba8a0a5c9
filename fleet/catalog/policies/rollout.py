"""A rollout policy (``rollout:``): its strategy (canary steps or one blue-green switch), the
gates each step is judged by, and how long and how surely."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fleet.catalog.policies.spec import Fraction, Spec, Steps


class Gates(Spec):
    max_error_rate_increase: float = Field(ge=0.0)  # absolute: 0.01 = one percentage point
    confidence: float = Field(gt=0.5, lt=1.0)  # of the statistical comparison, e.g. 0.95
    max_p99_ratio: float = Field(ge=1.0)  # canary p99 / baseline p99
    max_prediction_psi: float = Field(gt=0.0)  # drift of canary predictions vs baseline
    min_shadow_agreement: Fraction | None = None  # None: no shadow-agreement gate
    # generative models (the latency gate is then on the time to first token); None: no gate
    max_tpot_p99_ratio: float | None = Field(None, ge=1.0)  # canary / baseline p99 time per output token
    max_output_length_psi: float | None = Field(None, gt=0.0)  # drift of the canary's output lengths
    # exact-match feedback (POST /v1/feedback with the expected text): the canary's match rate may
    # fall at most this far below the stable's. Judged once both arms have min_labels labels;
    # until then (or when no labels come) it neither holds nor fails a step.
    max_exact_match_drop: float | None = Field(None, ge=0.0, le=1.0)
    min_labels: int = Field(30, ge=1)
    # At 100 % no stable serves beside the canary: its latency is judged against the stable's
    # from before, and a slowdown cannot be told from a busier hour. There an answer counts as
    # slow only above this too (ms; a generation's: its first token). None: the model's slo.p99_ms.
    bake_latency_floor_ms: float | None = Field(None, gt=0.0)


Strategy = Literal["canary", "blue-green"]


class RolloutPolicy(Spec):
    # "canary": the new version takes ``steps`` of the traffic in turn beside the stable.
    # "blue-green": the new version (green) is started at the stable's (blue's) replica count,
    # optionally shadowed, then takes 100 % in one switch and bakes for ``bake_s`` on the same
    # gates; a breach switches back to blue, which stays at full capacity until the bake ends
    # and ready for ``rollback_window_s`` after. ``steps`` is the canary's only.
    strategy: Strategy = "canary"
    steps: Steps
    bake_s: float = Field(300.0, ge=0.0)  # blue-green: how long green serves everything before promotion
    analysis_window_s: float = Field(gt=0.0)
    min_samples: int = Field(ge=1)  # per step and arm, before any verdict
    gates: Gates
    shadow_percent: float = Field(0.0, ge=0.0, le=100.0)
    shadow_duration_s: float = Field(0.0, ge=0.0)
    # a canary's 100 % step is judged against the stable's baseline before promotion, like
    # every step; rollback_window_s keeps the previous stable warm after it (both strategies)
    manual_approval: bool = False
    rollback_window_s: float = Field(600.0, ge=0.0)
    hold_deadline_s: float = Field(gt=0.0)  # "not enough data" for longer than this fails the step
    offline_tolerance: float = Field(0.01, ge=0.0)  # allowed eval-metric drop vs the champion
    # how the steps are judged: "fixed" re-tests each step at gates.confidence every tick
    # (fleet.analysis.canary); "sequential" uses always-valid tests (fleet.analysis.sequential), whose error
    # rates hold however often they are looked at
    method: Literal["fixed", "sequential"] = "fixed"
    max_false_rollback_rate: float = Field(0.01, gt=0.0, lt=0.5)  # sequential: of a canary no worse than stable
    power: float = Field(0.8, gt=0.5, lt=1.0)  # sequential: of not promoting a canary exactly at a margin
    expected_rps: float | None = Field(None, gt=0.0)  # the model's traffic, for `fleet rollout --dry-run`

    @model_validator(mode="after")
    def _bake_within_deadline(self) -> RolloutPolicy:
        # a bake may not promote before bake_s and a step still undecided at hold_deadline_s
        # rolls back: a bake as long as the deadline would switch back a good green as undecided
        if self.strategy == "blue-green" and self.bake_s >= self.hold_deadline_s:
            raise ValueError(
                f"bake_s {self.bake_s:g} is not below hold_deadline_s {self.hold_deadline_s:g}; expected a "
                "blue-green bake shorter than the deadline by which a step must be decided"
            )
        return self


def judged(policy: RolloutPolicy, strategy: str) -> RolloutPolicy:
    """The policy as a rollout of ``strategy`` is judged by: blue-green's one step is 100 %
    (the verdicts read ``steps`` to know which step decides and whether the stable serves beside)."""
    return policy.model_copy(update={"steps": [100]}) if strategy == "blue-green" else policy
