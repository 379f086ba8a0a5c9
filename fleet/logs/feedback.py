"""Ground-truth labels for earlier requests, joined to the inference log by tenant and request id.

The feedback table (``fleet.logs.tables``): one row per label — ``ts``, ``model``,
``request_id``, ``tenant``, ``row``, ``label``; staged by the gateway as one file per
feedback request before it answers (so an acknowledged label is stored), committed by the
committer; outcomes likewise in the outcomes table. Labels are accepted only for
requests the inference log holds *of the same tenant*, and a request id is only ever
looked up within its tenant: two tenants sending the same ``X-Request-Id`` have two
requests, and neither can label, overwrite or learn of the other's. Ids not found come
back as unknown, never silently dropped. A label must be one of the model's classes.

A generative model's label is the text the answer should have been (exact match): it is
compared with the logged output's digest, and the file keeps ``version``, ``match`` and the
label's digest instead of ``label`` — never the text itself. Each comparison is counted for
the version that answered (canary analysis's ``exact_match`` gate).

``labelled(store, model, start, end)`` is the inference log of a window with a ``label``
column where feedback exists: what concept-drift monitoring and retraining read.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from fleet.errors import FleetError, InvalidInput
from fleet.logs.inference import read_window
from fleet.names import check_name
from fleet.types import ObjectStore

if TYPE_CHECKING:
    from fleet.logs.reading import Reading

LOOKBACK_H = 24  # how far back a label may point
MAX_LABELS = 10_000  # labels in one feedback request
MAX_ROW = 2**31 - 1
REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")  # what the gateway accepts as X-Request-Id
MAX_LABEL_CHARS = 32_768  # a generation's expected text


class TooManyLabels(FleetError):
    status = 413


@dataclass(frozen=True, slots=True)
class Label:
    request_id: str
    row: int
    label: int | str | None  # a class, or a generation's expected text; None: outcomes only
    outcomes: tuple[tuple[str, float], ...] = ()  # named numbers (the model's policy declares them)


MAX_OUTCOMES = 32  # outcomes in one feedback item
MAX_OUTCOME_ROWS = 20_000  # outcomes in one feedback request (each a stored row)
OUTCOME_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


def parse(body: dict) -> tuple[str, list[Label]]:
    """``{"model": m, "feedback": [{"request_id", "label"?, "outcomes"?: {name: number}, "row"?: 0}, ...]}``
    → (model, labels); each item has a label, outcomes, or both."""
    model = body.get("model")
    items = body.get("feedback")
    expected = (
        'expected {"model": "<model>", "feedback": [{"request_id": "...", "label": <int class, or the expected '
        'text of a generation>, "outcomes": {"<name>": <number>}, "row": <int, default 0>}]} with a label, '
        "outcomes or both"
    )
    if not isinstance(model, str) or not isinstance(items, list) or not items:
        raise InvalidInput(f"feedback body has no model or no feedback list; {expected}")
    check_name("model", model)
    if len(items) > MAX_LABELS:
        raise TooManyLabels(f"feedback has {len(items)} labels; at most {MAX_LABELS} per request, send the rest after")
    labels, outcome_rows = [], 0
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidInput(f"feedback[{i}] is {type(item).__name__}; {expected}")
        rid, label, row = item.get("request_id"), item.get("label"), item.get("row", 0)
        if not isinstance(rid, str) or not REQUEST_ID.fullmatch(rid):
            raise InvalidInput(
                f"feedback[{i}].request_id is {_short(rid)}; expected the X-Request-Id of an earlier answer"
            )
        outcomes = _outcomes(i, item.get("outcomes"))
        outcome_rows += len(outcomes)
        if outcome_rows > MAX_OUTCOME_ROWS:
            raise TooManyLabels(
                f"feedback has more than {MAX_OUTCOME_ROWS} outcomes; at most that many per request, "
                "send the rest after"
            )
        if label is None and not outcomes:
            raise InvalidInput(f"feedback[{i}] has neither a label nor outcomes; {expected}")
        if label is not None and (isinstance(label, bool) or not isinstance(label, int | str)):
            raise InvalidInput(
                f"feedback[{i}].label is {_short(label)}; expected the true class as an integer, "
                "or a generation's expected text"
            )
        if isinstance(label, str) and len(label) > MAX_LABEL_CHARS:
            raise InvalidInput(f"feedback[{i}].label has {len(label)} characters; expected at most {MAX_LABEL_CHARS}")
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row <= MAX_ROW:
            raise InvalidInput(
                f"feedback[{i}].row is {_short(row)}; expected the row's index in the request (0 for one row)"
            )
        labels.append(Label(rid, row, label, outcomes))
    return model, labels


def _outcomes(i: int, given: object) -> tuple[tuple[str, float], ...]:
    """An item's ``outcomes``: names as the policy spells them, finite numbers (bounds are the
    model's, checked by ``check_outcomes``)."""
    if given is None:
        return ()
    if not isinstance(given, dict) or not given:
        raise InvalidInput(
            f"feedback[{i}].outcomes is {_short(given)}; expected an object of named numbers, "
            'e.g. {"clicked": 1, "revenue": 12.5}'
        )
    if len(given) > MAX_OUTCOMES:
        raise InvalidInput(f"feedback[{i}].outcomes has {len(given)} names; expected at most {MAX_OUTCOMES}")
    found = []
    for name, value in given.items():
        if not OUTCOME_NAME.fullmatch(name):
            raise InvalidInput(
                f"feedback[{i}].outcomes names {_short(name)}; expected lowercase letters, digits and _, "
                "starting with a letter (as the model's policy declares it)"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidInput(f"feedback[{i}].outcomes.{name} is {_short(value)}; expected a finite number")
        found.append((name, float(value)))
    return tuple(sorted(found))


def check_outcomes(labels: Sequence[Label], model: str, declared: dict) -> None:
    """Every outcome must be one the model's policy declares (``outcomes:``), within its bounds."""
    for i, x in enumerate(labels):
        for name, value in x.outcomes:
            spec = declared.get(name)
            if spec is None:
                known = ", ".join(sorted(declared)) or "none (add them under the model's outcomes: in its policy)"
                raise InvalidInput(
                    f"feedback[{i}].outcomes.{name} is not an outcome of {model}; expected one of: {known}"
                )
            if (spec.min is not None and value < spec.min) or (spec.max is not None and value > spec.max):
                bounds = f"{'-inf' if spec.min is None else f'{spec.min:g}'} to {'inf' if spec.max is None else f'{spec.max:g}'}"
                raise InvalidInput(f"feedback[{i}].outcomes.{name} is {value:g}; expected {bounds}")


def check_classes(labels: Sequence[Label], classes: int) -> None:
    """Every label must be a class of the model: 0 .. classes - 1."""
    for i, x in enumerate(labels):
        if x.label is None:
            continue  # outcomes only
        if not isinstance(x.label, int):
            raise InvalidInput(f"feedback[{i}].label is {_short(x.label)}; expected the true class as an integer")
        if not 0 <= x.label < classes:
            raise InvalidInput(
                f"feedback[{i}].label is {_short(x.label)}; expected a class of this model, 0 to {classes - 1}"
            )


def check_texts(labels: Sequence[Label], model: str) -> None:
    """A generative model's labels are the expected texts of single answers (row 0)."""
    for i, x in enumerate(labels):
        if x.label is not None and not isinstance(x.label, str):
            raise InvalidInput(
                f"feedback[{i}].label is {_short(x.label)}; {model} is generative: expected the text "
                "the answer should have been (exact match)"
            )
        if x.row != 0:
            raise InvalidInput(f"feedback[{i}].row is {x.row}; a generation is one answer: expected row 0")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def write(
    store: ObjectStore,
    model: str,
    tenant: str,
    labels: Sequence[Label],
    writer: str,
    matched: Sequence[tuple[str, bool]] | None = None,
) -> str:
    """Stage accepted labels (items with one: outcomes go to ``write_outcomes``) as one file of
    the feedback table; return its key. For a generative model ``matched`` is each label's
    (version that answered, whether its output matched)."""
    import pyarrow as pa

    from fleet.logs.inference import digest

    n = len(labels)
    columns = _head(model, tenant, [x.request_id for x in labels], [x.row for x in labels])
    if matched is None:
        columns["label"] = pa.array([x.label for x in labels], pa.int64())
    else:
        columns["version"] = pa.array([v for v, _ in matched], pa.string())
        columns["match"] = pa.array([m for _, m in matched], pa.bool_())
        columns["label_digest"] = pa.array([digest(str(x.label)) for x in labels], pa.string())
    return _stage(store, "feedback", columns, n, writer)


def _head(model: str, tenant: str, ids: list[str], rows: list[int]) -> dict:
    import pyarrow as pa

    now = int(time.time() * 1e6)
    return {
        "ts": pa.array([now] * len(ids), pa.timestamp("us", tz="UTC")),
        "model": pa.array([check_name("model", model)] * len(ids), pa.string()),
        "request_id": pa.array(ids, pa.string()),
        "tenant": pa.array([tenant] * len(ids), pa.string()),
        "row": pa.array(rows, pa.int32()),
    }


def _stage(store: ObjectStore, table: str, columns: dict, n: int, writer: str) -> str:
    """Stage ``columns`` (the rest of the table's columns null) as one file; return its key."""
    import pyarrow as pa

    from fleet.logs.staging import stage
    from fleet.logs.tables import arrow_schema

    schema = arrow_schema(table)
    data = pa.Table.from_arrays(
        [columns[f.name].cast(f.type) if f.name in columns else pa.nulls(n, f.type) for f in schema], schema=schema
    )
    return stage(store, table, data, writer)


def write_outcomes(store: ObjectStore, model: str, tenant: str, labels: Sequence[Label], writer: str) -> str | None:
    """Stage the accepted items' outcomes as one file of the outcomes table, one row per
    (request, row, name). None when there are none."""
    import pyarrow as pa

    rows = [(x.request_id, x.row, name, value) for x in labels for name, value in x.outcomes]
    if not rows:
        return None
    columns = _head(model, tenant, [r[0] for r in rows], [r[1] for r in rows])
    columns["name"] = pa.array([r[2] for r in rows], pa.string())
    columns["value"] = pa.array([r[3] for r in rows], pa.float64())
    return _stage(store, "outcomes", columns, len(rows), writer)


def _read(store: ObjectStore, table: str, model: str, start: datetime, end: datetime, unreadable, reading):  # noqa: ANN001, ANN202
    from fleet.logs.reading import read

    return read(store, table, model, start, end, None, unreadable, reading).to_pandas()


def read_outcomes(  # noqa: ANN201 - DataFrame
    store: ObjectStore,
    model: str,
    start: datetime,
    end: datetime,
    unreadable: list[str] | None = None,
    reading: Reading | None = None,
):
    """Every outcome sent between ``start`` and ``end``, one row per (tenant, request id, row,
    name); the last one sent wins."""
    frame = _read(store, "outcomes", model, start, end, unreadable, reading).sort_values("ts", kind="stable")
    return frame.drop_duplicates(["tenant", "request_id", "row", "name"], keep="last").reset_index(drop=True)


OUTCOME_COLUMN = "outcome:{}"  # an outcome's column in with_outcomes: never a feature's or the log's own name


def with_outcomes(  # noqa: ANN201
    store: ObjectStore,
    model: str,
    start: datetime,
    end: datetime,
    names: Sequence[str],
    unreadable: list[str] | None = None,
):
    """The inference log of [start, end) (its ``version`` says which arm answered) with one
    column ``outcome:<name>`` per outcome in ``names``: NaN where none was sent. Joined on
    tenant, request id and row; a request id logged twice by a tenant (the caller sets
    X-Request-Id) keeps its first row only, so one outcome never counts for several requests."""
    keys = ["tenant", "request_id", "row"]
    columns = {n: OUTCOME_COLUMN.format(n) for n in names}
    window = read_window(store, model, start, end, unreadable)
    if not window.empty:
        window = _first(window, keys)
    sent = read_outcomes(store, model, start, end + timedelta(hours=LOOKBACK_H), unreadable)
    sent = sent[sent["name"].isin(list(names))] if len(sent) else sent
    if window.empty or sent.empty:
        return window.assign(**{c: float("nan") for c in columns.values()})
    wide = (
        sent.assign(name=sent["name"].map(columns))
        .pivot_table(index=keys, columns="name", values="value", aggfunc="last")
        .reset_index()
    )
    wide.columns.name = None
    merged = window.merge(wide, on=keys, how="left")
    return merged.assign(**{c: merged[c] if c in merged else float("nan") for c in columns.values()})


def read_feedback(  # noqa: ANN201 - DataFrame
    store: ObjectStore,
    model: str,
    start: datetime,
    end: datetime,
    unreadable: list[str] | None = None,
    reading: Reading | None = None,
):
    """Every label given between ``start`` and ``end`` (the last one wins for a tenant's request row)."""
    frame = _read(store, "feedback", model, start, end, unreadable, reading).sort_values("ts", kind="stable")
    return frame.drop_duplicates(["tenant", "request_id", "row"], keep="last").reset_index(drop=True)


def _first(window, keys: list[str]):  # noqa: ANN001, ANN202 - a DataFrame
    """The earliest logged row of each key (files are read in no particular order)."""
    repeated = window.duplicated(keys, keep=False)
    if not repeated.any():
        return window
    return window.sort_values("ts", kind="stable").drop_duplicates(keys, keep="first").sort_index()


def labelled(  # noqa: ANN201 - DataFrame
    store: ObjectStore, model: str, start: datetime, end: datetime, unreadable: list[str] | None = None
):
    """The inference log of [start, end) with a ``label`` column (NaN where no feedback came)."""
    window = read_window(store, model, start, end, unreadable)
    feedback = read_feedback(store, model, start, end + timedelta(hours=LOOKBACK_H), unreadable)
    if window.empty:
        return window.assign(label=[])
    # a request id logged twice by a tenant (the caller sets X-Request-Id) keeps its first row
    # only, so one label never counts for several requests (as with_outcomes)
    window = _first(window, ["tenant", "request_id", "row"])
    # a request id means something only within its tenant: the join is on all three
    # reindex: a generative model's label files have no label column (match, label_digest instead)
    columns = ["tenant", "request_id", "row", "label"]
    return window.merge(feedback.reindex(columns=columns), on=["tenant", "request_id", "row"], how="left")
