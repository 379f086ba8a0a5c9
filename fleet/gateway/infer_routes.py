"""The inference routes (OIP infer and generate, OpenAI completions and chat), answered
before Starlette's router and its middlewares.

Nearly every request is one of these; the router tries each route's pattern in turn and
two middlewares wrap every call, about a tenth of the gateway's CPU per request. This
matches the same paths Starlette's ``Route`` does (``[^/]+`` per parameter, on the decoded
path), calls the same handler and answers errors with the same handlers, so a request gets
the same answer either way; everything else goes on to the app.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.errors import FleetError

# The POST routes answered before Starlette's router: OIP infer and generate, OpenAI's completions.
_INFER = re.compile(
    r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/(?P<route>infer|generate|generate_stream)"
    r"|/v1/(?P<openai>completions|chat/completions)"
)


class InferRoutes:
    """``handlers``: the last part of the path (``infer``, ``generate``, ``generate_stream``,
    ``completions``, ``chat/completions``) → its handler; a route without one goes to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        handlers: Mapping[str, Callable[[Request], Awaitable[Response]]],
        on_error: Callable[[Request, Exception], Awaitable[Response]],
        on_unexpected: Callable[[Request, Exception], Awaitable[Response]],
    ) -> None:
        self.app, self.handlers, self.on_error, self.on_unexpected = app, dict(handlers), on_error, on_unexpected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = _INFER.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        handler = self.handlers.get(found["route"] or found["openai"]) if found is not None else None
        if handler is None:
            return await self.app(scope, receive, send)
        scope["app"] = self.app  # what Starlette's Request expects to find
        model, version = found["model"], found["version"]  # type: ignore[index]
        scope["path_params"] = (
            {} if model is None else {"model": model} if version is None else {"model": model, "version": version}
        )
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except FleetError as exc:
            response = await self.on_error(request, exc)
        except Exception as exc:  # noqa: BLE001 - answered 500 and logged, as Starlette's handler would
            response = await self.on_unexpected(request, exc)
        try:
            await response(scope, receive, send)
        except Exception as exc:  # a stream that broke after its head: logged as Starlette's outer middleware does
            await self.on_unexpected(request, exc)
            raise
