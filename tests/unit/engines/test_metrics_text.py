"""Reading vLLM's generated-token counter (the stall detector's progress signal) from ``/metrics``.

The text is a real vLLM 0.32.0 CPU server's, captured after one request of 16 generated tokens (see the
fixture's header); the handle is the real vLLM client against an aiohttp stand-in on loopback that serves it.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from aiohttp import web

from engines.metrics_text import counter_total
from engines.vllm.handle import GENERATION_TOKENS, VLLMHandle

REAL = (Path(__file__).resolve().parent / "vllm_metrics_0.32_cpu.txt").read_text()
SERIES = 'vllm:generation_tokens_total{engine="0",model_name="tiny-adder"} 16.0\n'

pytestmark = pytest.mark.timeout(30)


def test_the_counter_of_a_real_vllm_metrics_page():
    assert SERIES in REAL  # the fixture is what the test says it is
    # 16, not its _created gauge's 1.8e9 nor the request_generation_tokens histogram's sum
    assert counter_total(REAL, GENERATION_TOKENS) == 16


def test_every_series_is_summed():
    """Data parallelism gives one series per engine (label engine="<i>")."""
    two = REAL.replace(SERIES, SERIES + SERIES.replace('engine="0"', 'engine="1"').replace("16.0", "1.0234e+05"))
    assert counter_total(two, GENERATION_TOKENS) == 16 + 102340


def test_no_counter_or_bad_text_is_none():
    without = "".join(line for line in REAL.splitlines(keepends=True) if "vllm:generation_tokens_total" not in line)
    assert counter_total(without, GENERATION_TOKENS) is None  # e.g. a server with --disable-log-stats
    assert counter_total("", GENERATION_TOKENS) is None
    assert counter_total("<html>502 Bad Gateway</html>\n", GENERATION_TOKENS) is None
    assert counter_total(REAL.replace(SERIES, SERIES.replace("16.0", "NaN")), GENERATION_TOKENS) is None
    assert counter_total(REAL + 'vllm:generation_tokens_total{engine="0" 3\n', GENERATION_TOKENS) is None


class MetricsStandIn:
    """``/metrics`` as vLLM serves it: ``text`` (None: 404), after ``delay_s``."""

    def __init__(self, text: str | None, delay_s: float = 0.0) -> None:
        self.text, self.delay_s = text, delay_s
        self.app = web.Application()
        self.app.router.add_get("/metrics", self._metrics)

    async def _metrics(self, request):
        await asyncio.sleep(self.delay_s)
        if self.text is None:
            raise web.HTTPNotFound()
        return web.Response(text=self.text, content_type="text/plain")

    async def read(self, timeout_s: float = 5.0) -> int | None:
        runner = web.AppRunner(self.app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        handle = VLLMHandle("vllm-0", f"http://127.0.0.1:{port}", model="tiny", timeout_s=timeout_s)
        try:
            return await handle.generated_tokens()
        finally:
            await handle.close()
            await runner.cleanup()


def test_the_vllm_handle_reads_it_and_says_none_on_any_failure():
    async def main():
        rising = re.sub(r"(vllm:generation_tokens_total\{[^}]*\}) 16\.0", r"\1 40.0", REAL)
        gone = VLLMHandle("vllm-0", "http://127.0.0.1:9", model="tiny", timeout_s=1.0)  # nothing listens
        try:
            refused = await gone.generated_tokens()
        finally:
            await gone.close()
        return (
            await MetricsStandIn(REAL).read(),
            await MetricsStandIn(rising).read(),
            await MetricsStandIn(None).read(),  # no /metrics route
            await MetricsStandIn("garbage {\n").read(),
            await MetricsStandIn(REAL, delay_s=1.0).read(timeout_s=0.3),  # slower than the handle's limit
            refused,
        )

    assert asyncio.run(main()) == (16, 40, None, None, None, None)
