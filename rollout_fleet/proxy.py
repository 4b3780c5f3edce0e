"""An OpenAI-compatible chat endpoint in front of the fleet's engines that records every token it serves.

An agent written against the stock ``openai`` client runs unchanged: it points ``base_url`` at
``http://HOST:PORT/s/<episode id>/v1`` (one id per episode) and calls
``chat.completions.create(messages=..., tools=...)``. The proxy keeps, per episode, one token
record, token-in-token-out::

    request 1: messages -> chat template (once) -> prompt ids -> engine -> sampled ids (kept as sampled)
    request k: messages = the previous request's + the assistant message it got + new ones
               -> only the new messages are rendered (the template's text past what it rendered
                  for the conversation so far), tokenised once, appended with loss mask 0
               -> engine on the record itself (never a re-rendered history) -> sampled ids ...

Invariants: the record's sampled tokens, log-probs and versions are the engine's; a request
whose history does not extend the episode's (edited or dropped messages), or a template that
is not append-only (its render of the longer conversation does not start with its render of
the shorter one), starts a fresh record and is counted (``proxy/history_restarts``), never
silently spliced (the earlier record is discarded). A request without an episode id in its
path (``/v1/chat/completions``) is served but not recorded (``proxy/unrecorded_requests``). Tool calls are parsed in the Hermes format (``<tool_call>{json}</tool_call>``,
rollout_fleet/envs/tools.py). Bind to 127.0.0.1 or the job's private network: no auth.

Example::

    proxy = ChatProxy(generate, tokenizer, model_name="tiny-adder", stop_token_ids=[2])
    await proxy.start("127.0.0.1", 0)
    client = openai.OpenAI(base_url=f"{proxy.url}/s/ep-1/v1", api_key="none")
    ...
    record = proxy.pop("ep-1")       # prompt ids, response ids, log-probs, loss mask, versions
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from engines.base import BadRequest, EngineError, SamplingParams
from rollout_fleet.envs.episode import GenerateFn, TokenRecord
from rollout_fleet.envs.tools import ToolCallError, parse_tool_calls, strip_tool_calls

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the proxy refuses (HTTP 400); the message names the field."""


@dataclass(kw_only=True, slots=True)
class EpisodeRecord:
    """What one episode id served, in the trajectory schema's terms (response = after the first prompt)."""

    prompt_ids: list[int]
    response_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    loss_mask: np.ndarray
    segment_starts: list[int]
    segment_versions: list[int]
    turns: int
    finish_reason: str
    engine_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Session:
    prompt_ids: list[int]
    rec: TokenRecord
    messages: list[dict]  # normalised conversation so far, including the last assistant answer
    rendered: str  # the template's text of ``messages`` (no generation prompt)
    last_stopped: bool  # the last turn ended with a stop token
    turns: int = 0
    finish_reason: str = "stop"
    engines: list[str] = field(default_factory=list)


def _norm(m: Any) -> dict:
    """A message as the template and the history check see it (the client's extra None fields dropped)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(f"each message needs a string 'role', got {str(m)[:120]!r}")
    out = {"role": m["role"], "content": m.get("content") or ""}
    if not isinstance(out["content"], str):  # content parts: text only
        try:
            out["content"] = "".join(p["text"] for p in out["content"] if p.get("type") == "text")
        except (TypeError, KeyError, AttributeError):
            raise RequestError("message 'content' must be a string or a list of text parts") from None
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            fn = c.get("function") or {}
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                raise RequestError(f"tool call arguments are not JSON: {str(args)[:120]!r}") from None
            calls.append({"type": "function", "function": {"name": fn.get("name"), "arguments": args}})
        out["tool_calls"] = calls
    for k in ("tool_call_id", "name"):
        if m.get(k):
            out[k] = m[k]
    return out


class ChatProxy:
    """``/v1/chat/completions`` (and ``/s/<episode>/v1/chat/completions``) plus ``/v1/models``."""

    def __init__(
        self,
        generate: GenerateFn,
        tokenizer: Any,
        *,
        model_name: str,
        stop_token_ids: list[int],
        default_max_tokens: int = 256,
        max_sessions: int = 10_000,
    ) -> None:
        if not stop_token_ids:
            raise ValueError("ChatProxy needs the model's end-of-turn token ids (stop_token_ids)")
        self.generate, self.tok, self.model_name = generate, tokenizer, model_name
        self.stop_token_ids = list(stop_token_ids)
        self.stop_texts = [tokenizer.decode([t], skip_special_tokens=False) for t in self.stop_token_ids]
        self.default_max_tokens, self.max_sessions = default_max_tokens, max_sessions
        self.sessions: dict[str, _Session] = {}
        self.floors: dict[str, int] = {}  # episode -> oldest policy version its first turn may use (admission)
        self.counts: Counter[str] = Counter()  # proxy/requests, proxy/history_restarts, proxy/errors_<kind>
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- server ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # the bound port when 0 was asked
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def pop(self, sid: str) -> EpisodeRecord:
        """The record of episode ``sid`` (removed from the proxy); KeyError if it served nothing."""
        s = self.sessions.pop(sid)
        r = s.rec
        return EpisodeRecord(
            prompt_ids=s.prompt_ids,
            response_ids=r.cat(r.ids, np.int32),
            behaviour_logprobs=r.cat(r.lps, np.float32),
            loss_mask=r.cat(r.mask, np.int8),
            segment_starts=r.starts or [0],
            segment_versions=r.versions or [0],
            turns=s.turns,
            finish_reason=s.finish_reason,
            engine_ids=s.engines,
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "fleetrl"}]}
        )

    @staticmethod
    def _error(status: int, message: str, kind: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "code": None}}, status=status)

    async def _chat(self, request: web.Request) -> web.Response:
        self.counts["proxy/requests"] += 1
        sid = request.match_info.get("sid")
        anonymous = sid is None  # no episode id in the path: served, not recorded
        if anonymous:
            sid = f"anon-{uuid.uuid4().hex}"
            self.counts["proxy/unrecorded_requests"] += 1
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            return web.json_response(await self._complete(sid, body))
        except (RequestError, json.JSONDecodeError) as e:
            self.counts["proxy/errors_bad_request"] += 1
            return self._error(400, str(e), "invalid_request_error")
        except BadRequest as e:
            self.counts["proxy/errors_engine_refused"] += 1
            return self._error(400, f"the engine refused the request: {e}", "invalid_request_error")
        except EngineError as e:
            self.counts["proxy/errors_engine"] += 1
            return self._error(502, f"engine failure: {e}", "server_error")
        finally:
            if anonymous:
                self.sessions.pop(sid, None)

    # -- one completion -------------------------------------------------------------------------
    def _render(self, messages: list[dict], tools: list | None, gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)

    def _params(self, body: dict) -> SamplingParams:
        for k in ("stop", "response_format", "stream"):
            if body.get(k):
                raise RequestError(f"'{k}' is not supported by the fleetrl proxy")
        if int(body.get("n", 1)) != 1:
            raise RequestError(f"'n' must be 1 (one episode per request), got {body.get('n')!r}")
        mt = body.get("max_completion_tokens") or body.get("max_tokens") or self.default_max_tokens
        if not isinstance(mt, int) or mt < 1:
            raise RequestError(f"'max_tokens' must be a positive integer, got {mt!r}")
        temp, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
        if not isinstance(temp, int | float) or temp < 0 or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
            raise RequestError(f"bad 'temperature' {temp!r} or 'top_p' {top_p!r}")
        seed = body.get("seed")
        return SamplingParams(
            n=1,
            max_tokens=mt,
            temperature=float(temp),
            top_p=float(top_p),
            stop_token_ids=self.stop_token_ids,
            seed=seed if isinstance(seed, int) else None,
        )

    def _after_stop(self, rendered: str, stopped: bool) -> str:
        """The template's text after the last turn's stop token (ChatML: a newline), which the engine never
        sampled; with the stop token itself when the turn was cut by its length limit."""
        cut, stop = max((rendered.rfind(t), t) for t in self.stop_texts)
        if cut < 0:
            return ""
        return rendered[cut + len(stop) :] if stopped else rendered[cut:]

    def _prompt(self, sid: str, messages: list[dict], tools: list | None) -> tuple[_Session, list[int], bool]:
        """(session, ids to append before sampling, whether they are observations (masked))."""
        full = self._render(messages, tools, gen=True)
        s = self.sessions.get(sid)
        if s is not None:
            k = len(s.messages)
            if messages[:k] == s.messages and len(messages) > k and full.startswith(s.rendered):
                tail = self._after_stop(s.rendered, s.last_stopped)
                return s, self.tok.encode(tail + full[len(s.rendered) :], add_special_tokens=False), True
            self.counts["proxy/history_restarts"] += 1
            log.warning(
                "proxy: episode %s: the request's history does not extend the recorded one (or the chat "
                "template is not append-only); its record starts again",
                sid,
            )
        if len(self.sessions) >= self.max_sessions and sid not in self.sessions:
            raise RequestError(f"the proxy holds {self.max_sessions} unfinished episodes; pop() finished ones")
        ids = self.tok.encode(full, add_special_tokens=False)
        s = _Session(prompt_ids=ids, rec=TokenRecord(), messages=[], rendered="", last_stopped=True)
        self.sessions[sid] = s
        return s, [], False

    async def _complete(self, sid: str, body: dict) -> dict:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise RequestError("'messages' must be a non-empty list")
        messages = [_norm(m) for m in raw]
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be a list of function schemas")
        params = self._params(body)
        s, delta, _ = self._prompt(sid, messages, tools)
        if delta:
            s.rec.add_observation(delta)
        context = s.prompt_ids + (s.rec.cat(s.rec.ids, np.int32).tolist() if s.rec.ids else [])
        floor = max(self.floors.get(sid, 0), s.rec.versions[-1] if s.rec.versions else 0)
        engine_id, sample = await self.generate(context, params, floor)
        s.rec.add_turn(sample)
        s.turns += 1
        s.engines.append(engine_id)
        ids = sample.token_ids.tolist()
        stopped = bool(ids) and ids[-1] in self.stop_token_ids
        text = self.tok.decode(ids, skip_special_tokens=True)
        calls = []
        if tools:
            try:
                calls = parse_tool_calls(text)
            except ToolCallError as e:
                self.counts["proxy/bad_tool_calls"] += 1
                log.info("proxy: episode %s: unparsable tool call left in the content: %s", sid, e)
        content = strip_tool_calls(text) if calls else text
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if calls else ("length" if sample.finish_reason == "length" else "stop")
        s.finish_reason = "length" if sample.finish_reason == "length" else "stop"
        s.messages = messages + [_norm(message)]
        s.rendered = self._render(s.messages, tools, gen=False)
        s.last_stopped = stopped
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": self.tok.decode([t], skip_special_tokens=False),
                        "logprob": float(lp),
                        "bytes": None,
                        "top_logprobs": [],
                    }
                    for t, lp in zip(ids, sample.logprobs.tolist(), strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(context),
                "completion_tokens": len(ids),
                "total_tokens": len(context) + len(ids),
            },
            # fleetrl's extension (clients ignore unknown fields): what the learner will train on
            "fleetrl": {"episode": sid, "token_ids": ids, "versions": list(sample.segment_versions)},
        }
