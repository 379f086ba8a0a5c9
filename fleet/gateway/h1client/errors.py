"""What the HTTP/1.1 client raises: ``Unreachable`` (no answer began: another server may be
asked), ``ResponseError`` (the answer began and is broken), ``BodyTooLarge``."""

from __future__ import annotations


class HTTPClientError(Exception):
    """Anything this client raises about a request (``ValueError`` is a caller's mistake)."""


class Unreachable(HTTPClientError):
    """No byte of an answer came back: the server is not there, too slow to accept, or
    closed the connection before answering. Another server may be asked."""


class ConnectError(Unreachable):
    """The connection could not be opened (refused, unknown host, no route)."""


class ConnectTimeout(Unreachable):
    """The connection was not open within the caller's ``connect_timeout``."""


class PoolTimeout(Unreachable):
    """Every connection stayed busy for ``pool_timeout``; the request was never sent."""


class PoolClosed(Unreachable):
    """The pool was closed before or while the request waited."""


class Disconnected(Unreachable):
    """The server closed or reset the connection before any byte of an answer (on a new
    connection, or on a reused one after the one retry)."""


class ResponseError(HTTPClientError):
    """The server began to answer and the answer is broken; the request may have run."""


class ProtocolError(ResponseError):
    """The answer is not HTTP/1.x the parser accepts."""


class IncompleteResponse(ResponseError):
    """The connection ended in the middle of the answer."""


class BodyTooLarge(HTTPClientError):
    """The answer's body is over the caller's ``max_body``. ``declared`` is its
    Content-Length when it had one (refused before reading), else None."""

    def __init__(self, message: str, declared: int | None, limit: int) -> None:
        super().__init__(message)
        self.declared = declared
        self.limit = limit


class NoAnswer(Exception):
    """Within h1 only: the connection ended before any response byte; ``ConnectionPool.request``
    decides between the one retry and ``Disconnected``."""
