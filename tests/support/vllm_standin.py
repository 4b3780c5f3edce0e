"""The base of the unit tests' vLLM stand-ins: an aiohttp server on loopback with vLLM's pause state
(``/is_paused``, ``/pause``, ``/resume``) as fleetrl's client uses it; each test adds the routes it plays."""

from __future__ import annotations

from aiohttp import web


class PausableStandIn:
    def __init__(self) -> None:
        self.paused = False
        self.url = ""
        self.app = web.Application()
        self.app.router.add_get("/is_paused", self._is_paused)
        self.app.router.add_post("/pause", self._pause)
        self.app.router.add_post("/resume", self._resume)

    async def _is_paused(self, request):
        return web.json_response({"is_paused": self.paused})

    async def _pause(self, request):
        self.paused = True
        return web.json_response({})

    async def _resume(self, request):
        self.paused = False
        return web.json_response({})

    async def serve(self) -> web.AppRunner:
        """Listen on a free loopback port (``self.url``); the runner's ``cleanup`` stops it. A client that
        goes away ends its handler (``handler_cancellation``), as a closed connection ends vLLM's request."""
        runner = web.AppRunner(self.app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return runner
