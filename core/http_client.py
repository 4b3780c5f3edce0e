"""Network helpers every layer may use: a free port, and the HTTP plumbing of the clients that talk
to an engine server (vLLM, SGLang, fleetrl's standalone weight receiver), for generation
(``rollout_fleet``) and for weights (``weight_sync``) alike.

Every call is bounded by a timeout, and every transport failure (refused connection, reset,
timeout) or unexpected status becomes an :class:`EngineError` that names the engine and the
call, which is what the fleet's health logic and the publisher's blame logic act on; a 4xx
answer (but 408/429) is a :class:`BadRequest`, the request's fault, never the server's.
"""

from __future__ import annotations

import enum
import socket
from typing import Any

import httpx

from core.engine_auth import auth_headers


class EngineErrorCode(enum.StrEnum):
    """Why an engine call failed, as far as the caller can tell."""

    UNKNOWN = "unknown"  # the peer said nothing structured (e.g. a foreign server's error page)
    TIMEOUT = "timeout"  # no answer within the call's limit
    UNREACHABLE = "unreachable"  # refused, reset, or another transport error of the HTTP call
    HTTP_STATUS = "http_status"  # an answer other than 200 (its text says why)
    TRANSPORT = "transport"  # the weight-sync group broke under a receiver (a receive or the acks)
    LOAD = "load"  # a receiver got the bytes but failed after them (a load, a checksum, a bad request)


class EngineError(RuntimeError):
    """An engine call failed or timed out; the message names the engine and the call, ``code`` says why."""

    def __init__(self, message: str, code: EngineErrorCode = EngineErrorCode.UNKNOWN) -> None:
        super().__init__(message)
        self.code = code


class BadRequest(EngineError):
    """The engine refused the request itself (HTTP 4xx, e.g. a prompt over its model length): the
    request is at fault, not the server, and sending it again or elsewhere gives the same answer."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


# 408 (request timeout) and 429 (too many requests) are the server's state, not the request's
_TRANSIENT_4XX = (408, 429)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (``""``: every interface), for a server or store about to bind it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class HttpEngineClient:
    """Base of the engine clients whose engine answers over HTTP at ``self.url``.

    Subclasses set ``engine_id``, ``url`` and ``timeout_s`` (the default limit of a call), and may
    call ``_keep_open(n)`` before the first call.
    """

    engine_id: str
    url: str
    timeout_s: float
    _http: httpx.AsyncClient | None = None
    _http_limits: httpx.Limits | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        # Created on first use, so the client binds to the event loop that uses it.
        if self._http is None:
            kw: dict[str, Any] = {"limits": self._http_limits} if self._http_limits is not None else {}
            # the run's engine token on every call (core.engine_auth; none outside a run)
            self._http = httpx.AsyncClient(timeout=self.timeout_s, headers=auth_headers(), **kw)
        return self._http

    def _keep_open(self, max_connections: int) -> None:
        """Up to ``max_connections`` requests open at once, each connection kept alive for the next (httpx's own
        pool: 100 open, 20 kept alive; a generation client has a request open per group in flight)."""
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._http_limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)

    async def _request(
        self, method: str, path: str, *, timeout_s: float | None = None, check_status: bool = True, **kw
    ) -> httpx.Response:
        """One call, at most ``timeout_s`` (default ``self.timeout_s``); with ``check_status`` a non-200
        answer raises too (without it the caller reads the error the body carries)."""
        limit = timeout_s or self.timeout_s
        try:
            r = await self.http.request(method, self.url + path, timeout=limit, **kw)
        except httpx.TimeoutException as e:
            raise EngineError(
                f"engine {self.engine_id}: {method} {path} got no answer within {limit:.0f}s", EngineErrorCode.TIMEOUT
            ) from e
        except httpx.HTTPError as e:
            raise EngineError(
                f"engine {self.engine_id}: {method} {path} failed: {type(e).__name__}: {e}", EngineErrorCode.UNREACHABLE
            ) from e
        if check_status and r.status_code != 200:
            msg = f"engine {self.engine_id}: {method} {path} -> HTTP {r.status_code}: {r.text[:500]}"
            if 400 <= r.status_code < 500 and r.status_code not in _TRANSIENT_4XX:
                raise BadRequest(msg, r.status_code)
            raise EngineError(msg, EngineErrorCode.HTTP_STATUS)
        return r

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
