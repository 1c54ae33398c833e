"""One replica's link to the statistics Redis: the client, whether it answers, backoff, warnings.

Shared by the acceptance statistics and the cost-model cache (``serve_app.observability.
shared_stats``, ``serve_app.observability.cost_cache``). Clients never retry inside a call: after a
network error the caller reports ``failed``; the link is then disconnected until ``next_attempt``,
and the wait doubles per failure up to ``max_backoff_s``. Warnings are rate-limited to one per
``warn_interval_s`` (the rest go to debug), so an outage logs one warning, not one per attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from serve_app.config import StatsSettings

NETWORK_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)  # an outage: retry later


def escape(component: str) -> str:
    """A key name component with ``%`` and ``:`` %-escaped (``:`` separates components)."""
    return component.replace("%", "%25").replace(":", "%3A")


def redact(url: str) -> str:
    """The URL without its password (for log lines)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{parts.username or ''}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class RedisLink:
    """The Redis of ``settings.redis_url`` (None: local only, no client) and the link's state.

    ``log`` receives the link's messages (connected, back, unavailable, and the callers' ``warn``s)."""

    def __init__(self, settings: StatsSettings, log: logging.Logger) -> None:
        self.settings = settings
        self.log = log
        self.client: redis.Redis | None = None
        self._connected = False
        self._ever_connected = False
        self._backoff = min(settings.flush_interval_s, 1.0)
        self._next_attempt = 0.0
        self._last_warn: float | None = None
        self._suppressed = 0
        self._lock = threading.Lock()  # connection state and warning rate limit
        if settings.redis_url is not None:
            self.client = self.make_client(settings.socket_timeout_s)

    @property
    def configured(self) -> bool:
        """Whether a Redis URL is set (False: statistics stay local)."""
        return self.settings.redis_url is not None

    @property
    def connected(self) -> bool:
        """Whether the last exchange with Redis succeeded (always False without a Redis URL)."""
        return self._connected

    @property
    def next_attempt(self) -> float:
        """Monotonic time before which a disconnected link should not be tried again."""
        return self._next_attempt

    def make_client(self, timeout_s: float) -> redis.Redis:
        """A new client with connect and socket timeouts of ``timeout_s`` and no retries of its own."""
        assert self.settings.redis_url is not None
        return redis.Redis.from_url(
            self.settings.redis_url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # our own backoff; never retry inside a call
            decode_responses=True,
        )

    def succeeded(self) -> None:
        """An exchange succeeded: connected again (logged once per transition), backoff reset."""
        with self._lock:
            if self._connected:
                return
            self._connected = True
            self._backoff = min(self.settings.flush_interval_s, 1.0)
            again = self._ever_connected
            self._ever_connected = True
        url = redact(self.settings.redis_url or "")
        if again:
            self.log.info("stats: Redis at %s is back; shared statistics resumed", url)
        else:
            self.log.info("stats: connected to Redis at %s", url)

    def failed(self, exc: BaseException) -> None:
        """An exchange failed on the network: disconnected until the backoff has passed."""
        with self._lock:
            self._connected = False
            self._next_attempt = time.monotonic() + self._backoff
            delay = self._backoff
            self._backoff = min(self._backoff * 2, self.settings.max_backoff_s)
        self.warn(
            "stats: Redis at %s unavailable (%s: %s); serving on local statistics, retrying in %.1f s",
            redact(self.settings.redis_url or ""),
            type(exc).__name__,
            exc,
            delay,
        )

    def warn(self, message: str, *args: Any) -> None:
        """``log.warning`` at most once per ``warn_interval_s``; debug otherwise."""
        now = time.monotonic()
        with self._lock:
            due = self._last_warn is None or now - self._last_warn >= self.settings.warn_interval_s
            if due:
                self._last_warn, suppressed, self._suppressed = now, self._suppressed, 0
            else:
                self._suppressed += 1
        if due:
            if suppressed:
                message += f" ({suppressed} similar messages suppressed)"
            self.log.warning(message, *args)
        else:
            self.log.debug(message, *args)

    def close(self) -> None:
        """Close the client's connections; the link reads as disconnected."""
        if self.client is not None:
            self.client.close()
        self._connected = False
