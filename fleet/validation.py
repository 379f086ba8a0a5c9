"""Validation reports that name the file, the key path, the bad value and what was expected.

Pydantic's errors are translated into lines like
``models.demo.batching.max_batch_size: got -1 — expected an integer >= 1 and <= 4096``;
the phrase comes from the field's own type and constraints. Used for policy files
(``fleet.catalog.policies``) and version metadata files (``fleet models register --meta``).
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import AfterValidator, BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from fleet.errors import ConfigError

T = TypeVar("T", bound=BaseModel)


class _Says(str):
    """Annotated marker: the "expected ..." phrase for a field whose check is a function."""


def expected(phrase: str, *, field: str | tuple = (), got: Any = None) -> PydanticCustomError:
    """An error whose message is the "expected ..." phrase; a model validator passes
    ``field``/``got`` to aim it at the wrong key rather than at the whole mapping."""
    field = (field,) if isinstance(field, str) else field
    return PydanticCustomError("expected", phrase, {"field": field, "got": got} if field else None)


def checked(tp: Any, says: str, ok: Callable[[Any], bool]) -> Any:
    """``tp`` whose values must also satisfy ``ok``; ``says`` describes a good value."""

    def check(value: Any) -> Any:
        if not ok(value):
            raise expected(says)
        return value

    return Annotated[tp, _Says(says), AfterValidator(check)]


def problem(where: Any, what: str, expected: str) -> str:
    """One report line: ``<where>: <what> — expected <expected>``."""
    return f"{where}: {what} — expected {expected}"


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key, Hashable):
                continue  # merges may override; unhashable keys are refused by the base class
            if key in seen:
                problem = f"duplicate key {key!r}"
                raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(file: Path) -> tuple[Any, str | None]:
    """Parse one YAML file; return ``(data, None)`` or ``(None, report line)``."""
    try:
        return yaml.load(file.read_text(encoding="utf-8"), Loader=_Loader), None  # noqa: S506
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{file}: line {mark.line + 1}, column {mark.column + 1}" if mark else file
        return None, f"{where}: invalid YAML — {e.problem or e.context}"
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return None, f"{file}: cannot read — {e}"


def load_yaml_file(path: str | Path, cls: type[T]) -> T:
    """Parse a YAML (or JSON) file into ``cls``; every problem is named in one ConfigError."""
    path = Path(path)
    data, bad = read_yaml(path)
    if bad:
        raise ConfigError(bad)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(f"{path}: {line}" for line in explain(exc, cls, ()))) from None


def explain(error: ValidationError, model: type[BaseModel] | None, prefix: tuple[str, ...] = ()) -> list[str]:
    """Translate pydantic's errors into report lines, each aimed at one dotted key."""
    lines = []
    for err in error.errors():
        loc, got, ctx = tuple(err["loc"]), err.get("input"), err.get("ctx") or {}
        if err["type"] == "value_error":  # a validator's own sentence says it best
            sentence = err["msg"].removeprefix("Value error, ")
            lines.append(f"{_dotted(prefix + loc)}: {sentence}" if prefix + loc else sentence)
            continue
        if err["type"] == "extra_forbidden":
            allowed = list(getattr(_type_at(model, loc[:-1])[0], "model_fields", ()))
            what, wanted = f"unknown key {loc[-1]!r}", f"one of {', '.join(allowed)}"
            wanted += hint(loc[-1], allowed)
            lines.append(problem(_dotted(prefix + loc[:-1]), what, wanted))
            continue
        if ctx.get("field"):  # a model validator aimed its error at one key
            loc, got = loc + tuple(ctx["field"]), ctx["got"]
        if err["type"] == "expected":
            wanted = err["msg"]
        else:
            tp, meta = _type_at(model, loc)
            wanted = _describe(tp, meta) if tp is not None else err["msg"].lower()
        what = "missing required key" if err["type"] == "missing" else f"got {show(got)}"
        lines.append(problem(_dotted(prefix + loc), what, wanted))
    return lines


def _unwrap(tp: Any, meta: list) -> tuple[Any, list]:
    """Strip ``Annotated``, collecting its constraints (a ``Field`` keeps them in ``.metadata``)."""
    while get_origin(tp) is Annotated:
        tp, *extra = get_args(tp)
        meta = meta + [m for x in extra for m in getattr(x, "metadata", [x])]
    return tp, meta


def _type_at(tp: Any, loc: Iterable) -> tuple[Any, list]:
    """The annotation and constraints of the value at ``loc`` below ``tp`` (None if lost)."""
    meta: list = []
    for part in loc:
        tp, _ = _unwrap(tp, [])
        if get_origin(tp) in (Union, types.UnionType):
            tp = next(a for a in get_args(tp) if a is not type(None))
        if isinstance(tp, type) and issubclass(tp, BaseModel) and part in tp.model_fields:
            field = tp.model_fields[part]
            tp, meta = field.annotation, list(field.metadata)
        elif get_origin(tp) in (list, dict):
            tp, meta = get_args(tp)[-1], []
        else:
            return None, []
    return _unwrap(tp, meta)


_BOUNDS = ((at.Gt, ">", "gt"), (at.Ge, ">=", "ge"), (at.Lt, "<", "lt"), (at.Le, "<=", "le"))


def _describe(tp: Any, meta: list) -> str:
    """A readable phrase for a good value of type ``tp`` under constraints ``meta``."""
    tp, meta = _unwrap(tp, meta)
    for m in meta:
        if isinstance(m, _Says):
            return str(m)
    bounds = " and ".join(f"{op} {getattr(m, key):g}" for m in meta for cls, op, key in _BOUNDS if isinstance(m, cls))
    non_empty = "non-empty " if any(isinstance(m, at.MinLen) and m.min_length for m in meta) else ""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return ", or ".join("null" if a is type(None) else _describe(a, meta) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a {non_empty}list (each: {_describe(args[0], [])})"
    if origin is dict:
        return f"a mapping of name -> {_describe(args[1], [])}"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "a mapping with keys " + ", ".join(tp.model_fields)
    simple = {bool: "true or false", int: "an integer", float: "a finite number"}
    simple[str] = f"a {non_empty}string"
    return f"{simple.get(tp, getattr(tp, '__name__', tp))} {bounds}".strip()


def _dotted(loc: Iterable) -> str:
    dotted = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    return dotted or "top level"


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def hint(key: Any, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
