"""``experiments/<model>.json``: what a model's A/B experiment is and where it stands (the
stored record), and ``experiments/<model>.json.stop``, where ``fleet experiment stop`` asks
the running experiment to end.

``fleet.control.experiment`` decides and writes it; ``fleet experiment status`` reads it.
The statuses are stored as their string values, which must never change.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

STOP_SUFFIX = ".stop"  # experiments/<model>.json.stop: `fleet experiment stop` asks the run to end


class ExperimentStatus(StrEnum):
    """How an experiment stands. The values are stored: renaming one strands stored records."""

    RUNNING = "running"  # undecided: it looks again
    WINNER = "winner"  # the always-valid interval excludes 0: ``winner`` names the better arm
    NO_DIFFERENCE = "no_difference"  # the interval lies within ± min_effect
    OUT_OF_TIME = "out_of_time"  # max_duration_s passed undecided
    STOPPED = "stopped"  # a guardrail, `fleet experiment stop`, or an error ended it


class Tick(BaseModel):
    """One look, kept for the plot of the effect over time."""

    model_config = ConfigDict(extra="forbid")

    at: float  # unix seconds
    n: tuple[int, int]
    mean: tuple[float, float]
    diff: float | None = None
    lo: float | None = None
    hi: float | None = None


class ExperimentState(BaseModel):
    """``experiments/<model>.json``: what the experiment is and where it stands."""

    model_config = ConfigDict(extra="forbid")

    model: str
    arms: tuple[str, str]  # (A: the stable when it started, B)
    split: tuple[float, float]  # percent of the model's traffic per arm
    metric: str  # "accuracy" or an outcome the model's policy declares
    min_effect: float = Field(gt=0.0)
    span: float = Field(1.0, gt=0.0)  # the metric's range (max - min): 1 for accuracy
    alpha: float = Field(gt=0.0, lt=0.5)
    max_duration_s: float = Field(gt=0.0)
    promote: bool = False
    run_id: str
    started_at: datetime
    status: ExperimentStatus = ExperimentStatus.RUNNING
    winner: str | None = None
    summary: str = ""
    evidence: dict | None = None  # the guardrails' (fleet.analysis.sequential.Evidence)
    served: dict[str, dict] = {}  # both arms' gateway totals since the start (guardrails)
    ticked_at: float = 0.0
    ticks: list[Tick] = []
    # Requests logged before ``settled_until`` can get no new outcome (a label points at most
    # a day back): their outcomes are kept as each arm's sufficient statistics, version →
    # (n, sum, sum of squares), and the flow keeps the rest up to date a look at a time
    # (fleet.logs.increments)
    settled_until: datetime | None = None
    settled: dict[str, tuple[int, float, float]] = {}


def state_key(model: str) -> str:
    return f"experiments/{model}.json"


def stop_key(model: str) -> str:
    return state_key(model) + STOP_SUFFIX
