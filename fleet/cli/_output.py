"""Output helpers shared by every command group."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Annotated, Any, NoReturn

import typer
from pydantic import BaseModel
from rich.cells import cell_len
from rich.console import Console
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from fleet.catalog.registry import Registry
from fleet.catalog.routes.store import Router
from fleet.catalog.tenants import Tenants
from fleet.store import open_store

console = Console()
err_console = Console(stderr=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
Reason = Annotated[str, typer.Option("--reason", "-r", help="Why: recorded in the audit log.")]


def fail(message: str, code: int = 1) -> NoReturn:
    # one line, so scripts and logs keep each error whole; several problems join with "; "
    sys.stderr.write(
        "error: " + "; ".join(" ".join(line.split()) for line in message.splitlines() if line.strip()) + "\n"
    )
    raise SystemExit(code)


def emit_json(value: Any) -> None:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    """Print rows as a table that stays readable at the terminal's width (80 columns too).

    Rich left to itself squeezes every column alike and folds names mid-word. Here each column
    gets at least its longest word (a model name, version, hash or URL is one word), and prose
    at least a few words' width; the room left goes to the columns still short of one line per
    cell. Text then wraps only at spaces. When even those minimums do not fit, each row is
    printed as a record, one ``column  value`` line per field (psql's ``\\x auto``), rather
    than split a name. Cells are plain text: a reason with ``[...]`` in it prints as typed.
    """
    cells = [["" if v is None else str(v) for v in r] for r in rows]
    if title:
        console.print(Text(title, style="table.title"), overflow="fold")
    widths = _column_widths(columns, cells, console.width)
    if widths is None:
        _records(columns, cells)
        return
    t = Table()
    for c, w in zip(columns, widths, strict=True):
        t.add_column(c, width=w, overflow="fold")  # fold only a word wider than the whole column
    for r in cells:
        t.add_row(*(Text(v) for v in r))
    console.print(t)


_PROSE_MIN = 12  # narrower than this, a sentence becomes a column of single words


def _column_widths(columns: list[str], cells: list[list[str]], width: int) -> list[int] | None:
    """Each column's text width so that no word is split and the table fits ``width``, or None.

    Minimum: the column's longest word (its header's too), and ``_PROSE_MIN`` for columns with
    longer text; ``_share`` hands out the room left.
    """
    lengths = [[cell_len(v) for v in col] for col in zip(columns, *cells, strict=True)]
    wants = [max(col) for col in lengths]
    longest_words = [max(_longest_word(v) for v in col) for col in zip(columns, *cells, strict=True)]
    needs = [max(word, min(want, _PROSE_MIN)) for word, want in zip(longest_words, wants, strict=True)]
    room = width - _table_frame(len(columns))
    if sum(needs) > room:
        return None
    return _share(room - sum(needs), needs, wants)


def _table_frame(n: int) -> int:
    """Cells the frame of ``Table()`` (rich's default box, padding 0 1) takes around ``n`` columns:
    n + 1 rules and a space either side of each column."""
    return 3 * n + 1


def _longest_word(value: str) -> int:
    return max((cell_len(w) for w in value.split()), default=0)


def _share(spare: int, widths: list[int], wants: list[int]) -> list[int]:
    """Give ``spare`` cells to the columns narrower than their longest cell.

    Whole shortfalls first, smallest first: a date or a short phrase on one line reads better
    than a sentence a few cells wider. What cannot close a shortfall goes to the rest in
    proportion to what each still lacks, most of it to the long prose.
    """
    widths = list(widths)
    short = sorted((i for i, w in enumerate(widths) if wants[i] > w), key=lambda i: wants[i] - widths[i])
    while short and wants[short[0]] - widths[short[0]] <= spare:
        i = short.pop(0)
        spare -= wants[i] - widths[i]
        widths[i] = wants[i]
    lacking = sum(wants[i] - widths[i] for i in short)
    grants = [spare * (wants[i] - widths[i]) // lacking for i in short]
    for i, grant in zip(short, grants, strict=True):
        widths[i] += grant
    if short:
        widths[short[-1]] += spare - sum(grants)  # the rounding's leftovers to the longest
    return widths


def _records(columns: list[str], cells: list[list[str]]) -> None:
    """Print each row as a record: ``column  value`` lines, with a rule between records.

    A value with a word too long to sit beside the names starts on the line below its name,
    so a URL or hash stays whole unless it is wider than the terminal itself.
    """
    width = console.width
    name_width = max(cell_len(c) for c in columns)
    for n, row in enumerate(cells):
        if n:
            console.print(Rule(style="dim"))
        for column, value in zip(columns, row, strict=True):
            for line in _field(column, value, name_width, width):
                console.print(line, no_wrap=True, crop=False)


def _field(column: str, value: str, name_width: int, width: int) -> list[Text]:
    """One field of a record as lines no wider than ``width``: beside its name when its words fit there."""
    gutter = name_width + 2
    longest = _longest_word(value)
    if longest <= width - gutter:
        first, *rest = _wrapped(value, width - gutter)
        name = Text(column + " " * (gutter - cell_len(column)), style="table.header")
        return [Text.assemble(name, first), *(Text.assemble(" " * gutter, line) for line in rest)]
    indent = 2 if longest <= width - 2 else 0
    below = [Text.assemble(" " * indent, line) for line in _wrapped(value, width - indent)]
    return [Text(column, style="table.header"), *below]


def _wrapped(value: str, width: int) -> list[Text]:
    """``value`` wrapped at spaces to ``width``; a word wider than that folds. At least one line."""
    lines = list(Text(value).wrap(console, width, overflow="fold")) or [Text()]
    for line in lines:
        line.rstrip()  # in place: wrapping leaves the space after each line's last word
    return lines


def registry() -> Registry:
    return Registry(open_store())


def router() -> Router:
    return Router(open_store())


def tenants() -> Tenants:
    return Tenants(open_store())


def when(value: datetime | None) -> str:
    """A stored time as a UTC clock time with its zone named: "2026-12-01 14:02:00 UTC".

    Records keep aware datetimes; printed as they are, without a zone, a reader takes them for
    local time. A naive value is taken as UTC, which is what the store writes.
    """
    if value is None:
        return ""
    utc = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return utc.strftime(_CLOCK)


def clock(epoch_seconds: float | None) -> str:
    """Unix seconds (a deadline, a window's end) as ``when`` prints times: nobody reads 1796142359."""
    return "" if epoch_seconds is None else when(datetime.fromtimestamp(epoch_seconds, UTC))


_CLOCK = "%Y-%m-%d %H:%M:%S UTC"
