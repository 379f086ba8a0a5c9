"""moto's threaded S3 server, with S3's atomic conditional writes.

S3 evaluates ``If-Match`` / ``If-None-Match`` on a PUT or DELETE and commits the write as one
step: of two writers that read the same ETag, exactly one wins. moto checks the condition and
then writes, in whatever request thread it is in, with nothing between: two writers can both
pass the check and the second overwrites the first. The change journal's writer storm
(``tests/test_changes.py``) hit that once — an entry lost that S3 would have refused to
overwrite. The server runs in the test process, so a lock around moto's writes gives it S3's
guarantee; reads are left concurrent.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_lock = threading.Lock()
_patched = False


def _atomic(method: Any) -> Any:  # noqa: ANN401
    @functools.wraps(method)
    def locked(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        with _lock:
            return method(*args, **kwargs)

    return locked


def atomic_conditional_writes() -> None:
    """Serialise moto's object writes and deletes in this process (idempotent)."""
    global _patched
    if _patched:
        return
    from moto.s3.responses import S3Response

    for name in ("put_object", "delete_object"):  # the store's writes (it never copies or uploads in parts)
        method = getattr(S3Response, name, None)
        assert method is not None, f"moto's S3Response has no {name} any more: lock its writes anew (tests/moto_s3.py)"
        setattr(S3Response, name, _atomic(method))
    _patched = True


def start_server() -> Any:  # noqa: ANN401
    """A started ``ThreadedMotoServer`` on a free port of 127.0.0.1 (stop it with ``.stop()``)."""
    from moto.server import ThreadedMotoServer

    atomic_conditional_writes()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server
