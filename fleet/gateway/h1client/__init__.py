"""A small HTTP/1.1 client for one origin: what the gateway needs to call a model service.

``pool.ConnectionPool`` is the interface; ``connection`` holds one connection and its
parser, and the answers (``Response``, ``StreamedResponse``); ``errors`` what it raises.

Why not aiohttp: on the gateway's hot path aiohttp's client was about 30 % of the CPU per
request, and on Python 3.11 it writes each request body from a task of its own (one more
event-loop turn per call). Here the calling task writes the request head and body with one
``transport.write``, and the answer is parsed by httptools (the parser uvicorn uses) inside
``data_received``: the caller resumes on the loop turn after the last response byte arrives.
It is an ``asyncio.Protocol``, so it runs on uvloop's transports as on asyncio's.

One ``ConnectionPool`` per origin (plain ``http://host:port``):

* at most ``limit`` connections open; a request that finds them all busy waits in a FIFO
  line for one, at most ``pool_timeout`` seconds;
* keep-alive: a connection goes back to the pool only after a complete response that
  allows keep-alive; idle connections are reused last-in first-out (the warm one first,
  so the cold ones age out) and closed after ``idle_timeout`` by one timer per pool;
* responses framed by Content-Length, chunked, or the end of the connection (HTTP/1.0 or
  ``Connection: close`` without a length); interim 1xx answers are skipped; a body larger
  than the caller's ``max_body`` is an error of its own and closes the connection;
* a stale keep-alive connection (the server closed it while idle, and the request met the
  close before any byte of an answer) is retried once on a new connection. Never after an
  answer began: a POST is not sent twice to a server that started answering it. A server
  that crashed while running the request, on a reused connection, looks the same as a
  stale close, so such a request may run twice; for inference (no side effects) that is
  the better trade than failing every request that meets a closing connection.

Errors say what the caller needs to know: ``Unreachable`` (refused, connect timeout, no
connection free in time, closed before any byte of an answer: the request got no answer
and another replica may be asked), ``ResponseError`` (the server began to answer and the
answer is broken: cut short or not HTTP), ``BodyTooLarge``.

Cancelling the awaiting task (a caller's ``asyncio.timeout``) closes the connection in
use: its state is unknown, so it is never reused. Nothing here starts tasks.

``ConnectionPool.stream`` reads an answer's body as it arrives instead (a model service's
server-sent events): it returns once the head is in, with a ``StreamedResponse`` whose
``read()`` gives the body's bytes as they come (chunked transfer-encoding decoded by the
same parser). Its connection goes back to the pool only once the body was read to its end
and allows keep-alive; ``close()`` before that drops the connection, so the server sees
the caller leave. While the reader falls behind by more than ``STREAM_HIGH_WATER`` bytes
the connection stops reading, so a slow reader never makes the body pile up here.

Not supported, because the gateway does not need them: TLS, proxies, redirects, HEAD,
request streaming, compression, ``Expect: 100-continue``, pipelining.
"""
