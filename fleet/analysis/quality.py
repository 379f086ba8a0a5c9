"""Data-quality suites (Great Expectations 1.x) built from a model's inputs and baseline profile.

    expectations = build_expectations(version.inputs, version.baseline_profile, policy.quality)
    result = validate(window, expectations, name="inference 14:00-15:00")
    store.put(f"reports/{model}/quality/….json", result.model_dump_json().encode())
    create_markdown_artifact(quality_markdown(result))

The suite is plain frozen data (``ExpectationSpec``) until ``validate`` hands it to GX, so it
is built and tested without GX, and GX (~4 s to import) stays out of the gateway's and the
CLI's import path: it is imported inside ``validate`` only. Per feature column:

- the column exists, with a dtype the input tensor's datatype allows;
- nulls (None, NaN) at most the baseline's null rate plus the policy's ``max_null_rate``;
- numeric: values within the baseline's [min, max] widened by ``range_margin`` of its span on
  each side, for all but the policy's ``max_out_of_range_rate`` of the non-null rows — so
  drift (which ``fleet.analysis.drift`` judges) is not mistaken for bad data, while values training
  never came near are;
- categorical: values among the baseline's categories, for all but ``max_out_of_range_rate``
  (plus the baseline's own share outside its listed categories, for high-cardinality columns).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from fleet.catalog.policies.monitoring import QualityThresholds
from fleet.catalog.profile import feature_kind
from fleet.catalog.registry import TensorSpec
from fleet.errors import InvalidInput

_FLOATS = ["float16", "float32", "float64", "Float32", "Float64"]
_INTS = [f"{u}int{b}" for u in ("", "u") for b in (8, 16, 32, 64)] + [
    f"{u}Int{b}" for u in ("", "U") for b in (8, 16, 32, 64)
]
# The inference log holds every input feature as float64, so every numeric datatype accepts
# every numeric dtype; what is refused is text or objects where numbers belong.
_NUMERIC = _FLOATS + _INTS
TYPES: dict[str, list[str]] = {
    **{t: _NUMERIC for t in ("FP16", "FP32", "FP64", "BF16")},
    **{t: _NUMERIC for t in ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")},
    "BOOL": ["bool", "boolean", *_NUMERIC],
    # "str" checks each value of an object column; "StringDtype" names pandas' string dtype
    "BYTES": ["StringDtype", "str"],
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Column(_Frozen):
    name: str
    datatype: str  # the input tensor's OIP datatype
    tensor: str


class ExpectationSpec(_Frozen):
    """One GX expectation as data: its snake_case type, column and keyword arguments."""

    expectation: str
    column: str
    kwargs: dict[str, Any] = {}
    expected: str  # what passing means, in words


class ExpectationOutcome(_Frozen):
    expectation: str
    column: str
    passed: bool
    expected: str
    observed: str
    unexpected_fraction: float | None  # of the rows the expectation looks at
    error: str | None = None  # GX could not evaluate it (e.g. the column is missing)


class QualityResult(_Frozen):
    name: str
    passed: bool
    rows: int
    evaluated: int
    failed: int
    failing_rows_fraction: float  # rows with a null, out-of-range or unknown value anywhere checked
    expectations: tuple[ExpectationOutcome, ...]

    @property
    def failures(self) -> tuple[ExpectationOutcome, ...]:
        return tuple(e for e in self.expectations if not e.passed)


def feature_columns(inputs: Sequence[TensorSpec], profile: Mapping[str, Any] | None) -> tuple[Column, ...]:
    """Input tensors → one column per feature, named as in the profile (f0, f1, … without one).

    [TensorSpec("features", FP32, [-1, 4])] with profile features income, debt_ratio, age,
    tenure → four FP32 columns with those names.
    """
    widths = []
    for spec in inputs:
        inner = spec.shape[1:]
        if any(d == -1 for d in inner):
            raise InvalidInput(f"input {spec.name!r} has shape {spec.shape}; expected fixed dimensions after the batch")
        widths.append((spec, math.prod(inner)))
    total = sum(w for _, w in widths)
    names = list((profile or {}).get("features", {})) or [f"f{i}" for i in range(total)]
    if len(names) != total:
        raise InvalidInput(
            f"the inputs hold {total} features ({', '.join(f'{s.name} {s.shape}' for s in inputs)}) "
            f"but the baseline profile names {len(names)}: {', '.join(names)}"
        )
    it = iter(names)
    return tuple(Column(name=next(it), datatype=s.datatype, tensor=s.name) for s, w in widths for _ in range(w))


def _value_set(keys: Sequence[str], datatype: str) -> list[Any]:
    # Profile keys are strings; the column holds values of the tensor's datatype.
    if datatype == "BYTES":
        return list(keys)
    if datatype == "BOOL":
        return [k == "True" for k in keys]
    return [float(k) for k in keys]


def build_expectations(
    inputs: Sequence[TensorSpec],
    profile: Mapping[str, Any] | None,
    quality: QualityThresholds,
    *,
    range_margin: float = 0.1,
) -> tuple[ExpectationSpec, ...]:
    """The suite for a model version: schema checks always, value checks where the profile has a baseline."""
    features = (profile or {}).get("features", {})
    out: list[ExpectationSpec] = []
    for col in feature_columns(inputs, profile):
        name, base = col.name, features.get(col.name, {})
        out.append(ExpectationSpec(expectation="expect_column_to_exist", column=name, expected="column present"))
        types = TYPES[col.datatype]
        out.append(
            ExpectationSpec(
                expectation="expect_column_values_to_be_in_type_list",
                column=name,
                kwargs={"type_list": types},
                expected=f"{col.datatype} data: dtype {'numeric' if types[0] == 'float16' else ' or '.join(types)}",
            )
        )
        allowed = min(1.0, float(base.get("null_rate", 0.0)) + quality.max_null_rate)
        if allowed < 1.0:
            out.append(
                ExpectationSpec(
                    expectation="expect_column_values_to_not_be_null",
                    column=name,
                    kwargs={"mostly": 1.0 - allowed},
                    expected=f"null fraction <= {allowed:.4g}",
                )
            )
        mostly = 1.0 - quality.max_out_of_range_rate
        if feature_kind(base) == "numeric" and "min" in base:
            lo, hi = float(base["min"]), float(base["max"])
            pad = range_margin * ((hi - lo) if hi > lo else max(abs(lo), 1.0))
            lo, hi = lo - pad, hi + pad
            out.append(
                ExpectationSpec(
                    expectation="expect_column_values_to_be_between",
                    column=name,
                    kwargs={"min_value": lo, "max_value": hi, "mostly": mostly},
                    expected=f"out-of-range fraction <= {1 - mostly:.4g} of non-null values, range [{lo:.6g}, {hi:.6g}]",
                )
            )
        elif feature_kind(base) == "categorical" and base.get("categories"):
            mostly = max(0.0, mostly - float(base.get("other", 0.0)))
            values = _value_set(list(base["categories"]), col.datatype)
            shown = ", ".join(map(str, values[:8])) + (", …" if len(values) > 8 else "")
            out.append(
                ExpectationSpec(
                    expectation="expect_column_values_to_be_in_set",
                    column=name,
                    kwargs={"value_set": values, "mostly": mostly},
                    expected=f"unknown-category fraction <= {1 - mostly:.4g} of non-null values, categories {{{shown}}}",
                )
            )
    return tuple(out)


# -- running it -------------------------------------------------------------------------------
def _context() -> Any:
    """A fresh ephemeral GX context (a few ms once GX is imported) with bars and analytics off."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")  # read when GX is imported
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    return context


def _gx_frame(frame: Any, expectations: Sequence[ExpectationSpec]) -> Any:
    import pandas as pd

    # GX 1.24 cannot name pandas 3's default "str" dtype (nor "category") in a type list;
    # the equivalent "string" dtype it can. Only those columns are copied.
    text = {e.column for e in expectations if "StringDtype" in e.kwargs.get("type_list", ())}
    convert = [
        c
        for c in text
        if c in frame.columns
        and (
            isinstance(frame[c].dtype, pd.CategoricalDtype)
            or (isinstance(frame[c].dtype, pd.StringDtype) and frame[c].dtype != pd.StringDtype())
        )
    ]
    return frame.assign(**{c: frame[c].astype("string") for c in convert}) if convert else frame


def _failing_rows(frame: Any, expectations: Sequence[ExpectationSpec]) -> float:
    """Share of rows that break any value expectation (or lack a column), in one vectorised pass."""
    rows = len(frame)
    if rows == 0:
        return 0.0
    bad = np.zeros(rows, dtype=bool)
    for e in expectations:
        if e.column not in frame.columns:
            return 1.0
        col = frame[e.column]
        if e.expectation == "expect_column_values_to_not_be_null":
            bad |= col.isna().to_numpy()
        elif e.expectation == "expect_column_values_to_be_between" and col.dtype.kind in "fiu":
            x = col.to_numpy(dtype=np.float64, na_value=np.nan)
            with np.errstate(invalid="ignore"):
                bad |= (x < e.kwargs["min_value"]) | (x > e.kwargs["max_value"])
        elif e.expectation == "expect_column_values_to_be_in_set":
            bad |= (~col.isin(e.kwargs["value_set"]) & col.notna()).to_numpy()
    return float(bad.mean())


def _error(info: Mapping[str, Any] | None) -> str | None:
    if not info:
        return None
    if "raised_exception" in info:  # one exception, or one per metric keyed by metric id
        return str(info.get("exception_message")) if info["raised_exception"] else None
    messages = [
        str(v.get("exception_message")) for v in info.values() if isinstance(v, Mapping) and v.get("raised_exception")
    ]
    return messages[0] if messages else None


def _observed(spec: ExpectationSpec, result: Mapping[str, Any], error: str | None) -> tuple[str, float | None]:
    if error is not None:
        return (f"could not be evaluated: {error.splitlines()[0]}", None)
    if spec.expectation == "expect_column_to_exist":
        return ("present", None)
    if "unexpected_percent" in result:
        fraction = (result["unexpected_percent"] or 0.0) / 100.0
        n = result.get("element_count", 0) - (result.get("missing_count") or 0)
        what = {
            "expect_column_values_to_not_be_null": "null",
            "expect_column_values_to_be_between": "out of range",
            "expect_column_values_to_be_in_set": "unknown",
            "expect_column_values_to_be_in_type_list": "other type",
        }
        if spec.expectation == "expect_column_values_to_not_be_null":
            n = result.get("element_count", 0)
        return (
            f"{what.get(spec.expectation, 'unexpected')} fraction {fraction:.4g} ({result['unexpected_count']} of {n})",
            fraction,
        )
    if "observed_value" in result:
        return (f"dtype {result['observed_value']}", None)
    return ("no values", None)


def validate(frame: Any, expectations: Sequence[ExpectationSpec], *, name: str = "batch") -> QualityResult:
    """Run the suite on a pandas DataFrame (inference-log window or training data)."""
    context = _context()  # first: it switches analytics off before GX is imported
    import great_expectations as gx
    import great_expectations.expectations as gxe

    batch = (
        context.data_sources.add_pandas("frame")
        .add_dataframe_asset("frame")
        .add_batch_definition_whole_dataframe("all")
    )
    # Built whole, then added: suite.add_expectation on a stored suite re-serialises the
    # suite every time (quadratic: 3 of the 5 s of an 80-expectation run).
    configs = [
        getattr(gxe, "".join(part.title() for part in e.expectation.split("_")))(column=e.column, **e.kwargs)
        for e in expectations
    ]
    suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=configs))
    definition = context.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite))
    run = definition.run(batch_parameters={"dataframe": _gx_frame(frame, expectations)}, result_format="BASIC")
    # GX returns results in its own order; match them back by expectation id
    by_id = {r.expectation_config.id: r for r in run.results}
    missing = {e.column for e in expectations} - set(frame.columns)
    outcomes = []
    for e, config in zip(expectations, suite.expectations, strict=True):
        r = by_id[config.id]
        error = _error(r.exception_info)
        observed, fraction = _observed(e, r.result or {}, error)
        if e.column in missing:
            observed = "column missing"  # GX's own message here is an IndexError or a metric error
        outcomes.append(
            ExpectationOutcome(
                expectation=e.expectation,
                column=e.column,
                passed=bool(r.success),
                expected=e.expected,
                observed=observed,
                unexpected_fraction=fraction,
                error=error,
            )
        )
    failed = sum(not o.passed for o in outcomes)
    return QualityResult(
        name=name,
        passed=failed == 0,
        rows=len(frame),
        evaluated=len(outcomes),
        failed=failed,
        failing_rows_fraction=_failing_rows(frame, expectations),
        expectations=tuple(outcomes),
    )


# -- showing it -------------------------------------------------------------------------------
def quality_table(result: QualityResult) -> list[dict[str, Any]]:
    """Rows for a Prefect table artifact: one per expectation, failures first."""
    ordered = sorted(result.expectations, key=lambda o: o.passed)
    return [
        {
            "column": o.column,
            "check": o.expectation.removeprefix("expect_"),
            "passed": o.passed,
            "expected": o.expected,
            "observed": o.observed,
        }
        for o in ordered
    ]


def quality_markdown(result: QualityResult) -> str:
    """A Prefect markdown artifact: verdict, then a table of the expectations (failures first)."""
    verdict = "passed" if result.passed else f"**failed** ({result.failed} of {result.evaluated} expectations)"
    lines = [
        f"## Data quality: {result.name}",
        "",
        f"{result.rows} rows, {result.evaluated} expectations: {verdict}. "
        f"Rows failing any check: {result.failing_rows_fraction:.2%}.",
        "",
        "| column | check | result | expected | observed |",
        "|---|---|---|---|---|",
    ]
    for row in quality_table(result):
        mark = "ok" if row["passed"] else "**FAIL**"
        cells = [row["column"], row["check"], mark, row["expected"], row["observed"]]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
