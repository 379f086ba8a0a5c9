"""The base of every policy model, and the field types several sections share."""

from __future__ import annotations

import re
from typing import Annotated

import semver
from pydantic import BaseModel, ConfigDict, Field

from fleet.validation import checked

_CRON_ITEM = re.compile(r"(\*|(\d+)(?:-(\d+))?)(?:/(\d+))?")


def _is_cron(value: str) -> bool:
    """Five fields of comma-separated items: ``*``, ``N`` or ``N-M``, each optionally ``/step``."""
    fields = value.split()
    limits = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))  # minute hour day month weekday
    if len(fields) != 5:
        return False
    for field, (lo, hi) in zip(fields, limits):
        for item in field.split(","):
            m = _CRON_ITEM.fullmatch(item)
            if m is None:
                return False
            start, end, step = m.group(2), m.group(3), m.group(4)
            numbers = [int(n) for n in (start, end) if n is not None]
            if any(not lo <= n <= hi for n in numbers) or (end is not None and int(start) > int(end)):
                return False
            if step is not None and int(step) == 0:
                return False
    return True


def _is_canary_ramp(steps: list[int]) -> bool:
    return all(a < b for a, b in zip(steps, steps[1:])) and steps[-1] == 100


SEMVER = "a semver version like '1.2.3'"
VersionOrAny = checked(str, f"'*' (any version) or {SEMVER}", lambda v: v == "*" or semver.Version.is_valid(v))
Cron = checked(
    str,
    "a 5-field cron expression like '*/15 * * * *' (minute 0-59, hour 0-23, day 1-31, "
    "month 1-12, weekday 0-7; only the characters 0-9 * / , -)",
    _is_cron,
)
Percent = Annotated[int, Field(ge=1, le=100)]
Steps = checked(
    Annotated[list[Percent], Field(min_length=1)],
    "strictly increasing canary weights (percent of traffic) ending at 100, e.g. [10, 50, 100]",
    _is_canary_ramp,
)
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class Spec(BaseModel):
    # strict: YAML already yields typed values, so "yes" or "10" in a number field is a typo
    # to report, not a value to coerce.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)
