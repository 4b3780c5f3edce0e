"""The per-run token that every HTTP call to a fleetrl-started engine server must carry.

vLLM's RL endpoints (``/pause``, ``/resume``, ``/update_weights``, ``/collective_rpc``, ...) and
SGLang's weight endpoints would otherwise take orders from anything that reaches the port.
The driver makes one token per run (:func:`make_engine_token`: ``<run_dir>/engine_token``, 0600,
like the CurveZMQ keys) and puts it in its environment (:data:`TOKEN_ENV`) before Ray starts,
so every process of the job inherits it (a joined cluster gets it in the job's runtime env):

* a vLLM server started by fleetrl loads :class:`RequireEngineToken` (``--middleware``), which
  refuses any request without ``Authorization: Bearer <token>`` with 401, on every route but
  ``GET /health`` and ``GET /metrics`` (read-only: liveness probes and Prometheus scrapers
  outside the job keep working); vLLM's own key check (``VLLM_API_KEY``) guards ``/v1`` too.
  The token travels in the environment, never on the command line (``ps`` shows that);
* an SGLang server gets it as ``--api-key`` and ``--admin-api-key``;
* every client (:class:`core.http_client.HttpEngineClient`, the reward-model clients, the servers' own
  health waits) sends :func:`auth_headers`.

Without the variable (tests, attach mode to servers started without it) nothing is required
and nothing is sent. Setting it before the launch makes the run use that token instead of a
fresh one (attach mode to servers started with it).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from pathlib import Path

TOKEN_ENV = "FLEETRL_ENGINE_TOKEN"
TOKEN_FILE = "engine_token"
OPEN_PATHS = frozenset({"/health", "/metrics"})  # GET/HEAD only: they read, they cannot drive the engine


def make_engine_token(run_dir: str | os.PathLike) -> str:
    """The run's token: the one in :data:`TOKEN_ENV` if set, else the one in ``<run_dir>/engine_token``
    (a resumed run keeps its token, so servers it attaches to still accept it), else a new one.
    Written 0600; the caller exports it (``os.environ[TOKEN_ENV]``)."""
    path = Path(run_dir) / TOKEN_FILE
    token = (
        os.environ.get(TOKEN_ENV) or (path.read_text().strip() if path.exists() else "") or secrets.token_urlsafe(32)
    )
    check_token(token)
    if not path.exists() or path.read_text().strip() != token:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def check_token(token: str) -> str:
    if len(token) < 16 or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(
            f"{TOKEN_ENV} must be at least 16 printable ASCII characters without spaces (got {len(token)} characters)"
        )
    return token


def engine_token(env: dict | None = None) -> str | None:
    """The token of this process's run (``env``: another environment to read, e.g. a server's)."""
    return (env if env is not None else os.environ).get(TOKEN_ENV) or None


def auth_headers(token: str | None = None) -> dict[str, str]:
    """The header an engine call carries (none without a token)."""
    token = token if token is not None else engine_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


class RequireEngineToken:
    """ASGI middleware (vLLM ``--middleware core.engine_auth.RequireEngineToken``): every HTTP
    request needs ``Authorization: Bearer <token>``, the token read from :data:`TOKEN_ENV` when
    the server builds its app, except ``GET``/``HEAD`` of :data:`OPEN_PATHS`. It wraps the
    whole app, so routes added by dev mode or extensions are covered without a list of them.
    Without the variable it refuses to start: a server told to require a token must have one."""

    def __init__(self, app) -> None:
        self.app = app
        token = engine_token()
        if not token:
            raise RuntimeError(f"RequireEngineToken is loaded but {TOKEN_ENV} is not set in the server's environment")
        self._expected = f"Bearer {check_token(token)}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                got = v
                break
        if hmac.compare_digest(got, self._expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {"error": f"this engine server requires the run's token (Authorization: Bearer ...); see {TOKEN_ENV}"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
