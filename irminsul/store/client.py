"""The Redis client the store is reached through: short time-outs, no retries, a circuit breaker.

Every failure — refused connection, reset, time-out, a server restarting — is one
:class:`StoreUnavailable` to the caller, which serves as if the store were empty. Retrying is the
breaker's business, not the client's: redis-py's own retries would multiply a time-out on the
path of a request waiting for its first token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .breaker import CircuitBreaker

T = TypeVar("T")


class StoreUnavailable(RuntimeError):
    """The store did not answer (down, slow, restarting) or the breaker is open."""


class StoreClient:
    """GET many, SET many with a TTL, DELETE: one round trip each, through the breaker."""

    def __init__(self, url: str, *, timeout: float, breaker: CircuitBreaker) -> None:
        """``url``: redis://HOST:PORT[/DB]; ``timeout``: seconds per socket operation."""
        self.url, self.breaker = url, breaker
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout,
                                           socket_connect_timeout=timeout,
                                           retry=Retry(NoBackoff(), 0), health_check_interval=0)

    def available(self) -> bool:
        """False while the breaker is open: then a call would be refused anyway (no I/O)."""
        return self.breaker.state != "open"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        if not self.breaker.allow():
            raise StoreUnavailable(f"store {what}: circuit open")
        try:
            result = fn()
        except (redis.RedisError, OSError) as err:
            self.breaker.failure()
            raise StoreUnavailable(f"store {what}: {err!r}") from err
        except BaseException:
            # Anything else still ends the call: counted as a failure, so a half-open
            # breaker's trial never stays open for good.
            self.breaker.failure()
            raise
        self.breaker.success()
        return result

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` (None where absent), in one round trip."""
        if not keys:
            return []
        return self._call("get", lambda: self._redis.mget(list(keys)))

    def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        """SET each key to its value with a time to live, in one round trip."""
        if not items:
            return

        def put() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, ex=ttl_s)
            pipe.execute()

        self._call("put", put)

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            self._call("delete", lambda: self._redis.delete(*keys))

    def close(self) -> None:
        self._redis.close()
