"""``fleet top``'s live view (textual): a table of versions, a line of the gateways read, the
rollouts and experiments in progress, quota refusals and the top tenants.

Keys: ``s`` the next sort, ``f`` filter by model (an input; empty shows every model),
``enter`` a version's detail (``escape`` back), ``q`` quit. It fits 80 columns (the table
is 78 wide) and works over SSH: textual draws with plain terminal escapes. Each refresh is
one ``FleetReader.read``; a refresh still running when the next is due is not doubled.
"""

from __future__ import annotations

import time
from typing import Protocol

import httpx
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static

from fleet.cli.top_merge import FleetTop, Row
from fleet.cli.top_text import (
    COLUMNS,
    SORTS,
    cells,
    detail_lines,
    headline,
    matches,
    progress_lines,
    sort_rows,
    tenant_lines,
)


class Reader(Protocol):
    """What the view reads each refresh (``fleet.cli.top.FleetReader``)."""

    match: str  # the filter, passed on to the gateways

    async def read(self, client: httpx.AsyncClient) -> FleetTop: ...


class Detail(Screen[None]):
    """One version's detail, refreshed with the view."""

    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "back"), Binding("q", "app.pop_screen", "back")]

    def __init__(self, model: str, version: str) -> None:
        super().__init__()
        self.model, self.version = model, version

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="detail")
        yield Footer()

    def show(self, top: FleetTop | None) -> None:
        row = next((r for r in top.rows if (r.model, r.version) == (self.model, self.version)), None) if top else None
        lines = detail_lines(top, row) if top and row else [f"{self.model} {self.version}: not seen this refresh"]
        self.query_one("#detail", Static).update(Text("\n".join(lines)))

    def on_mount(self) -> None:
        self.show(self.app.top)  # type: ignore[attr-defined]


class TopApp(App[None]):
    CSS = """
    #head { height: 1; background: $panel; }
    DataTable { height: 1fr; scrollbar-size-vertical: 1; }
    #progress { height: auto; max-height: 6; border-top: solid $panel; }
    #tenants { height: auto; max-height: 3; }
    #filter { display: none; }
    #filter.shown { display: block; }
    """
    BINDINGS = [
        Binding("s", "sort", "sort"),
        Binding("f", "filter", "filter"),
        Binding("q", "quit", "quit"),
        Binding("escape", "unfilter", "clear filter", show=False),
    ]
    TITLE = "fleet top"

    def __init__(
        self, reader: Reader, *, interval: float = 1.0, sort: str = "model", text: str = "", timeout_s: float = 2.0
    ) -> None:
        super().__init__()
        self.reader, self.interval, self.sort, self.text = reader, interval, sort, text
        reader.match = text
        self.timeout_s = timeout_s
        self.top: FleetTop | None = None
        self.shown: list[Row] = []
        self.error = ""
        self.refreshes = 0  # completed refreshes (tests wait on it)
        self.took, self.period = 0.0, interval  # the last refresh's seconds; the time between refreshes
        self._busy = False
        self._client: httpx.AsyncClient | None = None

    def compose(self) -> ComposeResult:
        yield Static("reading the gateways…", id="head")
        table = DataTable(id="versions", cursor_type="row", cell_padding=0, zebra_stripes=True)
        for i, (name, width) in enumerate(COLUMNS):
            table.add_column(Text(name, justify="left" if i < 2 else "right"), width=width + (i > 0), key=name)
        yield table
        yield Static(id="progress")
        yield Static(id="tenants")
        yield Input(placeholder="show models whose name holds… (enter: apply, empty: all)", id="filter")
        yield Footer()

    async def on_mount(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout_s)
        self.query_one(DataTable).focus()
        await self.refresh_now()
        self.set_timer(self.interval, self._tick)

    async def _tick(self) -> None:
        """A refresh, and the next one ``interval`` later — or twice as long as this one took,
        so that at fleet size (40 gateways × 500 models) the view takes at most half a core."""
        await self.refresh_now()
        self.period = max(self.interval, 2 * self.took)
        self.set_timer(max(0.05, self.period - self.took), self._tick)

    async def on_unmount(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def refresh_now(self) -> None:
        if self._busy or self._client is None:
            return
        self._busy, started = True, time.monotonic()
        try:
            self.top, self.error = await self.reader.read(self._client), ""
        except Exception as exc:  # the store or a gateway away: said in the head line, tried again
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._busy = False
        self.refreshes += 1
        self.redraw()
        self.took = time.monotonic() - started  # reading, merging and drawing

    def redraw(self) -> None:
        top = self.top
        stamp = time.strftime("%H:%M:%S")
        head = headline(top, self.sort, self.text) if top else "no answer yet"
        if self.period > self.interval:  # slowed down: a refresh takes more than half the interval
            head += f"  every {self.period:.1f}s"
        self.query_one("#head", Static).update(Text(f"{stamp}  {head}" + (f"  ! {self.error}" if self.error else "")))
        if top is None:
            return
        table = self.query_one(DataTable)
        keep = self.shown[table.cursor_row] if self.shown and 0 <= table.cursor_row < len(self.shown) else None
        self.shown = [r for r in sort_rows(top.rows, self.sort) if matches(r, self.text)]
        table.clear()
        for row in self.shown:
            table.add_row(
                *(Text(c, justify="left" if i < 2 else "right") for i, c in enumerate(cells(row))),
                key=f"{row.model}\0{row.version}",
            )
        if keep is not None:  # the cursor stays on its version, wherever it sorts now
            at = next((i for i, r in enumerate(self.shown) if (r.model, r.version) == (keep.model, keep.version)), 0)
            table.move_cursor(row=at, animate=False)
        self.query_one("#progress", Static).update(Text("\n".join(progress_lines(top, self.text))))
        self.query_one("#tenants", Static).update(Text("\n".join(tenant_lines(top))))
        if isinstance(self.screen, Detail):
            self.screen.show(top)

    def action_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        self.redraw()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = self.text
        box.add_class("shown")
        box.focus()

    def action_unfilter(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_class("shown"):
            box.remove_class("shown")
            self.query_one(DataTable).focus()

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        self.text = self.reader.match = event.value.strip()
        event.input.remove_class("shown")
        self.query_one(DataTable).focus()
        self.redraw()  # narrowed at once; widened at the refresh (the gateways left the others out)
        await self.refresh_now()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if 0 <= event.cursor_row < len(self.shown):
            row = self.shown[event.cursor_row]
            self.push_screen(Detail(row.model, row.version))
