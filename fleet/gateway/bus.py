"""The change bus, gateway side: a Redis pub/sub subscription (``FLEET_REDIS_URL``) that
makes the view poll the change journal the moment a writer commits an entry.

Writers publish each journal entry (``fleet.changes.Bus``) after it is committed, so a message
is never ahead of the journal. A message is only a nudge: the view reads the journal, which
says what changed, so a lost, repeated or reordered message changes nothing but speed. While
subscribed, the view polls the journal only every ``BUS_POLL_S`` (the safety net); while the
bus is away it polls every ``POLL_S`` again and the subscription is retried with back-off.
Each (re)subscription polls at once: whatever was published while away is read then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fleet.changes import CHANNEL

log = logging.getLogger("fleet.gateway.bus")

HEALTH_CHECK_S = 2.0  # a silent connection is noticed within about this
RETRY_S = (0.25, 5.0)  # back-off between subscription attempts: first, most


async def subscribe(url: str, nudge: Callable[[], None], connected: Callable[[bool], None]) -> None:
    """Call ``nudge`` for every entry published on the bus at ``url``, forever; ``connected``
    says whether the subscription is up."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    delay = RETRY_S[0]
    said = False
    while True:
        client = aioredis.Redis.from_url(
            url, socket_connect_timeout=1.0, health_check_interval=HEALTH_CHECK_S, socket_keepalive=True
        )
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        up = False
        try:
            await pubsub.subscribe(CHANNEL)
            connected(up := True)
            nudge()  # whatever was published while the subscription was down
            if said:
                log.info("change bus at %s is back", url)
            said, delay = False, RETRY_S[0]
            while True:
                message = await pubsub.get_message(timeout=HEALTH_CHECK_S)
                if message is not None and message.get("type") == "message":
                    nudge()
        except (RedisError, OSError) as exc:
            if not said:
                log.warning("change bus at %s is away (polling the store meanwhile): %s", url, exc)
                said = True
        finally:
            if up:
                connected(False)
            try:
                await pubsub.aclose()
                await client.aclose()
            except (RedisError, OSError):
                pass
        await asyncio.sleep(delay)
        delay = min(RETRY_S[1], delay * 2)
