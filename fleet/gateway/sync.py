"""The gateway's copy of the records it serves from (``routes/``, ``tenants/``), kept current
through the change journal (``fleet.changes``) in O(1) store requests per poll.

- **A poll** is one conditional GET of the journal. Unchanged (S3: a 304 with no body), it
  costs nothing else, whatever the number of tenants and models. Changed, the keys its new
  entries name are read, each once, and only when the ETag the entry names is not the one
  this copy already has.
- **A full read** (the first poll, a journal of another epoch, or a reader that fell more
  than ``changes.KEEP`` entries behind) lists each prefix once and reads the records with
  ``READERS`` requests in flight, so 10,000 tenants at 10 ms a request load in about 2 s.
  The journal is read first: whatever is committed while the records are read is applied
  by the next poll.
- **A comparison** every ``RESYNC_S`` lists each prefix (one request per 1,000 keys, no
  GETs) and reads only keys whose listing changed: the safety net for a writer that died
  between its record and its journal entry, or a record written by hand.

One bad record never takes the gateway down: a record that does not parse is skipped (or, if
it was good before, its last good copy kept) and reported in ``bad``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter
from collections.abc import Iterable

from fleet import changes, records
from fleet.errors import IntegrityError, NotFound
from fleet.types import ObjectStore

READERS = 64  # store reads in flight during a full read or a burst of changes
RESYNC_S = 300.0  # how often the listings are compared with this copy (the safety net)


class RecordSync:
    def __init__(self, store: ObjectStore, kinds: dict[str, type], *, resync_s: float = RESYNC_S) -> None:
        self.store, self.kinds, self.resync_s = store, dict(kinds), resync_s
        self.records: dict[str, object] = {}  # key → the parsed record served
        self.bad: dict[str, records.BadRecord] = {}  # key → why it is skipped (or its last good copy kept)
        self.requests: Counter[str] = Counter()  # store requests made, by kind: get, list (for benches)
        self._etags: dict[str, str] = {}  # key → ETag of the bytes last read (good or bad)
        self._tokens: dict[str, str] = {}  # key → its listing token at the last full read or comparison
        self._epoch: str | None = None
        self._seq = 0
        self._journal_etag: str | None = None
        self._compared_at = 0.0

    def poll(self) -> set[str]:
        """Bring the copy up to date; the prefixes whose records changed."""
        self.requests["get"] += 1
        journal, etag = changes.read(self.store, self._journal_etag)
        due = time.monotonic() - self._compared_at >= self.resync_s
        if journal is None:  # unchanged since the last poll
            return self._compare() if due else set()
        entries = journal.since(self._seq) if journal.epoch == self._epoch else None
        if entries is None or due:
            changed = self._compare()
        else:
            latest = {c.key: c.etag for c in entries if c.key.startswith(tuple(self.kinds))}
            changed = self._read([k for k, e in latest.items() if e is None or e != self._etags.get(k)])
        self._epoch, self._seq, self._journal_etag = journal.epoch, journal.seq, etag
        return changed

    def _compare(self) -> set[str]:
        """List every prefix; read what is new or changed since the last listing, drop what is gone."""
        listed: dict[str, str] = {}
        for prefix in self.kinds:
            self.requests["list"] += 1
            listed.update((i.key, i.token) for i in self.store.scan(prefix) if i.key.endswith(".json"))
        changed = self._read([k for k, token in listed.items() if self._tokens.get(k) != token])
        self._tokens = listed
        gone = [k for k in self._etags if k not in listed]
        changed |= self._forget(gone)
        self._compared_at = time.monotonic()
        return changed

    def _read(self, keys: Iterable[str]) -> set[str]:
        """Read ``keys`` (in parallel when there are several); the prefixes that changed."""
        keys = list(keys)
        if not keys:
            return set()
        self.requests["get"] += len(keys)
        if len(keys) == 1:
            got = [self._get(keys[0])]
        else:
            with concurrent.futures.ThreadPoolExecutor(min(READERS, len(keys))) as pool:
                got = list(pool.map(self._get, keys))
        changed: set[str] = set()
        gone = []
        for key, obj in zip(keys, got, strict=True):
            if obj is _GONE:
                gone.append(key)
            elif obj is not None and self._parse(key, obj.data, obj.etag):  # type: ignore[union-attr]
                changed.add(self._prefix(key))
        return changed | self._forget(gone)

    def _get(self, key: str) -> object:
        try:
            return self.store.get_if_changed(key, self._etags.get(key))
        except NotFound:
            return _GONE

    def _parse(self, key: str, data: bytes, etag: str) -> bool:
        self._etags[key] = etag
        cls = self.kinds[self._prefix(key)]
        try:
            self.records[key] = records.parse(self.store, key, data, cls)
        except IntegrityError as exc:
            bad = records.BadRecord(key, str(exc), cls.__name__)
            if key in self.records:
                bad = records.BadRecord(key, f"{exc}; serving its last good copy", cls.__name__)
            records.report(bad)
            self.bad[key] = bad
            return False
        self.bad.pop(key, None)
        return True

    def _forget(self, keys: Iterable[str]) -> set[str]:
        changed = set()
        for key in keys:
            if self._etags.pop(key, None) is not None or key in self.records:
                changed.add(self._prefix(key))
            self.records.pop(key, None)
            self.bad.pop(key, None)
            self._tokens.pop(key, None)
        return changed

    def _prefix(self, key: str) -> str:
        return next(p for p in self.kinds if key.startswith(p))

    def of(self, prefix: str) -> dict[str, object]:
        """The parsed records under ``prefix``, by key."""
        return {k: r for k, r in self.records.items() if k.startswith(prefix)}


_GONE = object()
