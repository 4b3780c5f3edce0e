"""The run's engine token (core.engine_auth): how it is made and kept, and the ASGI middleware's verdicts.
The middleware on a real vLLM server: tests/integration/engines/test_engine_auth.py."""

from __future__ import annotations

import asyncio
import stat

import pytest

from core.engine_auth import (
    TOKEN_ENV,
    RequireEngineToken,
    auth_headers,
    check_token,
    make_engine_token,
)


def test_the_token_is_made_once_per_run_0600_and_kept_on_resume(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    t1 = make_engine_token(tmp_path)
    path = tmp_path / "engine_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(t1) >= 32
    assert make_engine_token(tmp_path) == t1  # a resumed run: the same token
    assert make_engine_token(tmp_path / "other") != t1  # another run: another
    monkeypatch.setenv(TOKEN_ENV, "operator-given-token-123")  # attach mode: the operator's token wins
    assert make_engine_token(tmp_path) == "operator-given-token-123" == path.read_text().strip()
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(ValueError, match="at least 16"):
        make_engine_token(tmp_path)
    with pytest.raises(ValueError, match="without spaces"):
        check_token("a token with spaces in it")


def _call(app, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    sent = []

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(msg):
        sent.append(msg)

    asyncio.run(app(inner)({"type": "http", "method": method, "path": path, "headers": headers}, receive, send))
    return sent[0]["status"]


def test_middleware_refuses_every_route_without_the_token_but_the_read_only_probes(monkeypatch):
    token = "t" * 32
    monkeypatch.setenv(TOKEN_ENV, token)
    good = [(b"authorization", b"Bearer " + token.encode())]
    for method, path in [
        ("POST", "/pause"),
        ("POST", "/update_weights"),
        ("POST", "/collective_rpc"),
        ("GET", "/is_paused"),
        ("POST", "/v1/completions"),
        ("POST", "/health"),
        ("GET", "/anything/new"),
    ]:
        assert _call(RequireEngineToken, method, path, []) == 401, path
        assert _call(RequireEngineToken, method, path, [(b"authorization", b"Bearer " + b"u" * 32)]) == 401
        assert _call(RequireEngineToken, method, path, [(b"authorization", token.encode())]) == 401  # no scheme
        assert _call(RequireEngineToken, method, path, good) == 200, path
    for path in ("/health", "/metrics"):
        assert _call(RequireEngineToken, "GET", path, []) == 200
    assert auth_headers() == {"Authorization": f"Bearer {token}"}
    monkeypatch.delenv(TOKEN_ENV)
    assert auth_headers() == {}
    with pytest.raises(RuntimeError, match=TOKEN_ENV):  # a server told to require a token must have one
        RequireEngineToken(lambda *a: None)
