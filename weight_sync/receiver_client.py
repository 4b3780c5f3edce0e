"""The :class:`~weight_sync.endpoint.WeightEndpoint` of the standalone receiver (:mod:`weight_sync.receiver`).

The standalone receiver holds tensors, not a generating model, so it has no generation side;
it exists to test and benchmark weight sync with real processes and sockets.

Example::

    client = ReceiverClient("r0", "http://127.0.0.1:8123")
    await client.init_weight_transfer(group, plan)
    checksum = await client.update_weights(3, plan.plan_id)
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import socket
import threading
import urllib.parse

import httpx
import msgspec

from core.http_client import EngineError, EngineErrorCode, HttpEngineClient
from weight_sync import messages as m
from weight_sync.endpoint import WeightEndpoint
from weight_sync.messages import GroupInfo, WeightPlan


class ReceiverClient(HttpEngineClient, WeightEndpoint):
    def __init__(self, engine_id: str, url: str, timeout_s: float = 60.0) -> None:
        self.engine_id = engine_id
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._version = -1
        self._join_timeout_s = timeout_s
        # send_update's own keep-alive connection (blocking, written from the publishing thread) and the
        # thread that reads its answers; made at the first send_update
        self._sync_conn: http.client.HTTPConnection | None = None
        self._reader: cf.ThreadPoolExecutor | None = None
        self._sync_lock = threading.RLock()

    async def _post(self, path: str, msg: msgspec.Struct, timeout_s: float) -> m.Reply:
        # Errors come back as a Reply with ok=False and a 4xx/5xx status: read the body, not the status.
        r = await self._request(
            "POST",
            path,
            timeout_s=timeout_s,
            check_status=False,
            content=msgspec.json.encode(msg),
            headers={"Content-Type": "application/json"},
        )
        return self._reply(path, r.status_code, r.content)

    def _reply(self, path: str, status: int, body: bytes) -> m.Reply:
        """The receiver's answer to ``path``; a malformed one or one with ``ok=False`` raises, naming this engine."""
        try:
            reply = msgspec.json.decode(body, type=m.Reply)
        except msgspec.DecodeError as e:
            raise EngineError(f"engine {self.engine_id}: {path} answered HTTP {status} with a malformed reply") from e
        if not reply.ok:
            code = EngineErrorCode(reply.code) if reply.code in tuple(EngineErrorCode) else EngineErrorCode.UNKNOWN
            raise EngineError(f"engine {self.engine_id}: {path} failed: {reply.error}", code)
        return reply

    async def health(self) -> bool:
        try:
            r = await self.http.get(self.url + "/health", timeout=min(self.timeout_s, 5.0))
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def init_weight_transfer(self, group: GroupInfo, plan: WeightPlan) -> None:
        msg = m.InitTransfer(group=group, plan=plan, timeout_s=self._join_timeout_s)
        await self._post("/init_weight_transfer", msg, self._join_timeout_s + 5)

    async def update_weights(self, version: int, plan_id: str) -> str:
        # The server's own group timeout bounds each bucket; this bounds the whole call.
        reply = await self._post(
            "/update_weights", m.UpdateWeights(version=version, plan_id=plan_id), 10 * self.timeout_s
        )
        self._version = version
        return reply.checksum

    def send_update(self, version: int, plan_id: str) -> cf.Future:
        """Write ``/update_weights`` on a blocking keep-alive connection from this thread; its answer is read
        (bounded by the connection's timeout) on this client's reader thread. A send that fails, or a
        connection the server closed meanwhile, drops the connection: the next call opens a new one."""
        fut: cf.Future = cf.Future()
        body = msgspec.json.encode(m.UpdateWeights(version=version, plan_id=plan_id))
        with self._sync_lock:  # one request in flight on this connection at a time
            try:
                if self._sync_conn is None:
                    u = urllib.parse.urlsplit(self.url)
                    self._sync_conn = http.client.HTTPConnection(
                        u.hostname or "", u.port or 80, timeout=10 * self.timeout_s
                    )
                self._sync_conn.request(
                    "POST", "/update_weights", body=body, headers={"Content-Type": "application/json"}
                )
            except (OSError, http.client.HTTPException) as e:
                self._drop_sync_conn()
                fut.set_exception(
                    EngineError(
                        f"engine {self.engine_id}: sending /update_weights(v{version}) failed: {type(e).__name__}: {e}"
                    )
                )
                return fut
            if self._reader is None:
                self._reader = cf.ThreadPoolExecutor(1, thread_name_prefix=f"update-answers-{self.engine_id}")
            return self._reader.submit(self._read_update, self._sync_conn, version)

    def _read_update(self, conn: http.client.HTTPConnection, version: int) -> str:
        try:
            r = conn.getresponse()
            raw = r.read()
        except TimeoutError:
            self._drop_sync_conn(conn)
            raise EngineError(
                f"engine {self.engine_id}: /update_weights(v{version}) got no answer within {conn.timeout:.0f}s"
            ) from None
        except (OSError, http.client.HTTPException) as e:
            self._drop_sync_conn(conn)
            raise EngineError(
                f"engine {self.engine_id}: /update_weights(v{version}) failed: {type(e).__name__}: {e}"
            ) from e
        if r.will_close:
            self._drop_sync_conn(conn)
        reply = self._reply("/update_weights", r.status, raw)
        self._version = version
        return reply.checksum

    def _drop_sync_conn(self, conn: http.client.HTTPConnection | None = None) -> None:
        """Close ``conn`` (default: the current connection) and forget it if it is still the current one."""
        with self._sync_lock:
            if conn is None or conn is self._sync_conn:
                conn, self._sync_conn = self._sync_conn, None
        if conn is None:
            return
        if conn.sock is not None:
            try:  # wakes a reader blocked on this socket (a plain close would leave it to its timeout)
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        conn.close()

    async def close(self) -> None:
        await super().close()
        self._drop_sync_conn()
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
            self._reader = None

    supports_staging = True
    supports_group_acks = True

    async def begin_update(self, version: int, plan_id: str) -> None:
        await self._post("/stage_weights", m.StageWeights(version=version, plan_id=plan_id), self.timeout_s)

    async def commit_update(self, version: int) -> str:
        reply = await self._post("/commit_weights", m.CommitWeights(version=version), 2 * self.timeout_s)
        self._version = version
        return reply.checksum

    async def load_weights_from_path(self, path: str, version: int) -> None:
        await self._post("/load_weights_from_path", m.LoadFromPath(path=path, version=version), self.timeout_s)
        self._version = version

    async def dump(self, path: str) -> None:
        """Save the held tensors to ``path`` (safetensors); for tests."""
        await self._post("/dump", m.DumpState(path=path), self.timeout_s)

    @property
    def weight_version(self) -> int:
        return self._version
