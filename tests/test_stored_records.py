"""The stored rollout and experiment records are a contract with runs still going: records
written by the code before the state machines were split out (``tests/fixtures/records``,
from runs of that code against fakes) read as today's models and are written back the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet import records
from fleet.catalog.experiments import ExperimentState, ExperimentStatus
from fleet.catalog.rollouts import TERMINAL, Phase, RolloutState

RECORDS = Path(__file__).parent / "fixtures" / "records"
# fields added since those records were written, as an older record reads them: a rollout begun
# before blue-green was a canary with one replica, never switched, and never waited for a
# baseline (ready_at)
ADDED = {"strategy": "canary", "replicas": 1, "switched_at": None, "ready_at": None}


@pytest.mark.parametrize(
    ("name", "phase"),
    [
        ("rollout-shadow.json", Phase.SHADOW),
        ("rollout-step.json", Phase.STEP),
        ("rollout-rolled_back.json", Phase.ROLLED_BACK),
        ("rollout-rejected.json", Phase.REJECTED),
    ],
)
def test_a_stored_rollout_reads_and_writes_back_unchanged(name: str, phase: Phase) -> None:
    data = (RECORDS / name).read_bytes()
    state = RolloutState.model_validate_json(data)
    assert state.phase is phase and state.done == (phase in TERMINAL)
    again = records.dump(state)
    assert json.loads(again) == {**json.loads(data), **ADDED}
    # the phase is written as the same string; nothing else stored changes
    assert records.dump(RolloutState.model_validate_json(again)) == again
    assert f'"phase":"{phase}"' in again.decode().replace(" ", "")


def test_a_stored_experiment_reads_and_writes_back_unchanged() -> None:
    data = (RECORDS / "experiment-winner.json").read_bytes()
    state = ExperimentState.model_validate_json(data)
    assert state.status is ExperimentStatus.WINNER and state.ticks[-1].diff is not None
    assert state.served and state.evidence
    again = records.dump(state)
    assert json.loads(again) == json.loads(data)
    assert again == data
    # one stored before the experiments kept their settled sums still reads (nothing settled yet)
    older = {k: v for k, v in json.loads(data).items() if k not in ("settled", "settled_until")}
    assert ExperimentState.model_validate(older).settled == {}


def test_the_stored_strings_of_phases_and_statuses_do_not_change() -> None:
    stored = "preflight deploy shadow step bake approval promote promoted rolled_back rejected".split()
    assert [str(p) for p in Phase] == stored
    assert [str(s) for s in ExperimentStatus] == ["running", "winner", "no_difference", "out_of_time", "stopped"]
    assert {str(p) for p in TERMINAL} == {"promoted", "rolled_back", "rejected"}
