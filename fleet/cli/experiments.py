"""``fleet experiment start|status|stop``: A/B experiments of two versions on an outcome
(``flows/experiment.py``, started through its deployment so the run shows in the Prefect UI;
its state and stop requests are ``fleet.control.experiment``'s)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from fleet.cli._output import JsonFlag, clock, console, emit_json, err_console, table
from fleet.errors import InvalidInput, NotFound

app = typer.Typer(
    help="A/B experiments: two versions compared on accuracy or a business outcome.", no_args_is_help=True
)


@app.command("start")
def start_cmd(
    model: str,
    arms: Annotated[str, typer.Option("--arms", help="The stable, then the version to compare: 1.0.0,1.1.0.")],
    split: Annotated[
        str, typer.Option("--split", help="Percent of traffic per arm, sticky by X-Fleet-Routing-Key.")
    ] = "50/50",
    metric: Annotated[
        str, typer.Option("--metric", help="accuracy (labels), or an outcome the model's policy declares.")
    ] = "accuracy",
    min_effect: Annotated[
        float,
        typer.Option(
            "--min-effect",
            min=0.0,
            help="The smallest difference worth knowing, in the metric's units: within it is 'no difference'.",
        ),
    ] = 0.01,
    max_duration: Annotated[
        str, typer.Option("--max-duration", help="Undecided after this long (7d, 12h, 30m): out of time.")
    ] = "7d",
    promote: Annotated[
        bool,
        typer.Option("--promote", help="When B wins, roll it out through the canary rollout (from its preflight on)."),
    ] = False,
    alpha: Annotated[
        float,
        typer.Option(
            "--alpha",
            help="Chance the always-valid interval misses the true difference (requests counted as independent).",
        ),
    ] = 0.05,
    tick_s: Annotated[
        float, typer.Option("--tick-s", min=0.1, help="Seconds between looks (any number of looks is allowed).")
    ] = 30.0,
    follow: Annotated[bool, typer.Option(help="Follow progress until the run ends.")] = True,
    json: JsonFlag = False,
) -> None:
    """Start an A/B experiment of MODEL's stable against another version and follow it."""
    from fleet.analysis.ab import check_min_effect, duration_of, split_of
    from fleet.cli.flows import FINAL, FlowFailed, _run_state, _start, _ui_link
    from flows.serve import EXPERIMENT

    versions = [v.strip() for v in arms.split(",") if v.strip()]
    if len(versions) != 2:
        raise InvalidInput(f"--arms {arms!r}; expected two versions, the stable first: --arms 1.0.0,1.1.0")
    try:  # refused here, in a second, rather than in a run that fails later
        split_of(split)
        duration_of(max_duration)
        if metric == "accuracy":  # an outcome's range is its policy's: the run checks that one
            check_min_effect(min_effect, 1.0, metric)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    if not min_effect > 0 or not 0 < alpha < 0.5:
        raise InvalidInput(
            f"--min-effect {min_effect:g} and --alpha {alpha:g}; expected min-effect > 0 and 0 < alpha < 0.5"
        )
    params = {
        "model": model,
        "arms": versions,
        "split": split,
        "metric": metric,
        "min_effect": min_effect,
        "max_duration": max_duration,
        "promote": promote,
        "alpha": alpha,
        "tick_s": tick_s,
    }
    run = _start(EXPERIMENT, params)
    link = _ui_link(str(run.id))
    if not json:
        err_console.print(f"experiment on {model} started: {link}")
    if not follow:
        if json:
            emit_json({"flow_run_id": str(run.id), "url": link})
        return
    seen = ""
    while True:
        state, message = _run_state(run.id)
        current = _load(model)
        if current is not None and current.run_id == str(run.id) and current.summary != seen and not json:
            err_console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {current.status}: {current.summary}")
            seen = current.summary
        if state in FINAL:
            break
        time.sleep(1.0)
    if json:
        emit_json({"flow_run_id": str(run.id), "url": link, "state": state, "message": message})
    if state != "COMPLETED":
        raise FlowFailed(f"experiment on {model} ended {state.lower()}: {message} ({link})")
    if not json:
        console.print(message)


@app.command("status")
def status_cmd(model: str, json: JsonFlag = False) -> None:
    """Where MODEL's last experiment stands: per arm, the effect and its interval."""
    state = _load(model)
    if state is None:
        raise NotFound(f"{model} has had no experiment; start one with `fleet experiment start`")
    if json:
        emit_json(state.model_dump(mode="json", exclude={"served", "evidence"}))
        return
    last = state.ticks[-1] if state.ticks else None
    rows = [
        [
            f"{v} ({'AB'[i]})",
            f"{state.split[i]:g} %",
            str(last.n[i]) if last else "0",
            f"{last.mean[i]:.4g}" if last and last.n[i] else "-",
        ]
        for i, v in enumerate(state.arms)
    ]
    table(f"{model}: {state.metric}, {state.status}", ["arm", "traffic", "outcomes", "mean"], rows)
    console.print(state.summary)
    if last is not None:
        console.print(f"last look: {clock(last.at)} (run {state.run_id})")


@app.command("stop")
def stop_cmd(
    model: str,
    reason: Annotated[str, typer.Option("--reason", "-r", help="Why, for the record.")] = "",
    json: JsonFlag = False,
) -> None:
    """Ask MODEL's running experiment to end at its next look (traffic goes back to A)."""
    from fleet import audit
    from fleet.control.experiment.effects import ask_to_stop
    from fleet.store import open_store

    state = _load(model)
    if state is None or state.status != "running":
        raise InvalidInput(
            f"{model} has no running experiment" + (f" (the last one is {state.status})" if state else "")
        )
    asked = audit.actor() + (f" ({reason})" if reason else "")
    ask_to_stop(open_store(), model, asked)
    if json:
        emit_json({"model": model, "stop_requested": asked})
    else:
        console.print(f"asked the experiment on {model} to stop at its next look")


def _load(model: str):  # noqa: ANN202
    from fleet.control.experiment.effects import load
    from fleet.store import open_store

    return load(open_store(), model)
