"""Model-based rewards: a generative judge and a sequence-classifier reward model, called over HTTP.

Both are clients of a reward server (vLLM or SGLang on its own GPUs, ``--reward-gpus``), called
asynchronously by rollout workers, off the generation path::

    worker --score(prompt, samples)--> ModelRewardScorer --n concurrent requests--> reward server
            <-- one float per sample, or RewardFailed (the group is dropped and counted) --

Every call has a timeout and bounded retries with backoff (timeouts, refused connections and 5xx
are retried; 4xx are not); every failure is counted by reason (``timeout``, ``unreachable``,
``http_status``, ``bad_response``, ``unparsable_verdict``) in ``failures``, and a call that
fails for good raises :class:`RewardModelError`: a judge that hangs never scores 0.

Example::

    judge = JudgeClient("http://10.0.0.5:8001", model="judge", template=JUDGE_TEMPLATE, timeout_s=20, retries=2)
    r = await judge.score(question="2+2?", response="4", reference="4")   # 1.0, 0.0 or RewardModelError
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import httpx

from core.engine_auth import auth_headers
from rollout_fleet.envs.base import Codec
from rollout_fleet.worker import Prompt, RewardFailed

log = logging.getLogger(__name__)

JUDGE_TEMPLATE = (
    "You are grading an answer. Question:\n{question}\n\nReference answer:\n{reference}\n\n"
    "Candidate answer:\n{response}\n\nIs the candidate answer correct? Reply with one line, "
    "VERDICT: CORRECT or VERDICT: INCORRECT."
)
VERDICT = re.compile(r"VERDICT:\s*(CORRECT|INCORRECT)\b", re.I)
_RETRIED_STATUS = (408, 429, 500, 502, 503, 504)


class RewardModelError(RewardFailed):
    """A reward-model call failed for good; ``reason`` names why (the failure counters' key)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"reward model {reason}: {message}")
        self.reason = reason


@dataclass(kw_only=True, slots=True)
class _Try:
    reason: str
    message: str
    retry: bool


class _ServerStats:
    """One reward server's requests as its client saw them: answers, failed attempts by reason, latency,
    and answers per second over the last ``window_s``."""

    def __init__(self, t0: float, window_s: float = 30.0) -> None:
        self.t0, self.window_s = t0, window_s
        self.ok = 0
        self.failures: Counter[str] = Counter()
        self.inflight = 0
        self.latency_sum = 0.0
        self.recent: deque[tuple[float, float]] = deque(maxlen=4096)  # (end time, latency) of answers

    def add_ok(self, now: float, latency: float) -> None:
        self.ok += 1
        self.latency_sum += latency
        self.recent.append((now, latency))

    def status(self, now: float) -> dict[str, Any]:
        window = [lat for t, lat in self.recent if now - t <= self.window_s]
        lats = sorted(lat for _, lat in self.recent)
        span = min(self.window_s, now - self.t0)  # a young client: answers over its age so far
        return {
            "requests_ok": self.ok,
            "failures": dict(self.failures),
            "inflight": self.inflight,
            "requests_per_s": round(len(window) / max(span, 1e-9), 3),
            "latency_s_mean": round(self.latency_sum / self.ok, 4) if self.ok else None,
            "latency_s_p50": round(lats[len(lats) // 2], 4) if lats else None,
            "latency_s_p95": round(lats[min(len(lats) - 1, int(0.95 * len(lats)))], 4) if lats else None,
        }


class _HttpRewardClient:
    """Timeouts, retries, load balancing over the servers and per-reason, per-server counters, shared by
    both clients. Each attempt goes to the server with the fewest requests in flight (a retry prefers
    another server than the one that just failed)."""

    def __init__(
        self,
        url: str | list[str],
        *,
        model: str,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        max_concurrency: int,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_concurrency < 1:
            raise ValueError(
                f"need timeout_s > 0, retries >= 0, backoff_s >= 0, max_concurrency >= 1; got "
                f"{timeout_s}, {retries}, {backoff_s}, {max_concurrency}"
            )
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("a reward-model client needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.url, self.model = self.urls[0], model
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._sem = asyncio.Semaphore(max_concurrency)
        self._http: httpx.AsyncClient | None = None
        self.failures: Counter[str] = Counter()  # every failed attempt, by reason
        self.calls_failed = 0  # calls that raised after their retries
        self.calls_ok = 0
        self.seconds = 0.0  # wall time of successful calls (throughput: calls_ok / seconds per slot)
        t0 = time.monotonic()
        self.servers = {u: _ServerStats(t0) for u in self.urls}
        self._turn = 0

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.timeout_s, headers=auth_headers())  # core.engine_auth
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every server answers ``GET /health`` with 200 (vLLM and SGLang both serve it); raises
        :class:`RewardModelError` ('unreachable') naming the servers still down after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        down = list(self.urls)
        while down:
            still = []
            for u in down:
                try:
                    r = await self.http.get(u + "/health", timeout=min(5.0, self.timeout_s))
                    if r.status_code != 200:
                        still.append(u)
                except httpx.HTTPError:
                    still.append(u)
            down = still
            if down and time.monotonic() > deadline:
                raise RewardModelError(
                    "unreachable", f"reward server(s) {down} did not answer /health within {timeout_s:g} s"
                )
            if down:
                await asyncio.sleep(1.0)

    async def down(self) -> list[str]:
        """The servers that do not answer ``GET /health`` with 200 now (one probe each, short timeout)."""
        out = []
        for u in self.urls:
            try:
                r = await self.http.get(u + "/health", timeout=min(5.0, self.timeout_s))
                if r.status_code != 200:
                    out.append(u)
            except httpx.HTTPError:
                out.append(u)
        return out

    def _pick(self, avoid: str | None) -> str:
        self._turn += 1
        order = self.urls[self._turn % len(self.urls) :] + self.urls[: self._turn % len(self.urls)]
        if avoid is not None and len(order) > 1:
            order = [u for u in order if u != avoid]
        return min(order, key=lambda u: self.servers[u].inflight)

    async def _post(self, path: str, body: dict, parse) -> Any:
        """POST with retries; ``parse(json)`` returns the value or raises ValueError (bad answer)."""
        last: _Try | None = None
        failed: str | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            async with self._sem:
                url = self._pick(failed)
                st = self.servers[url]
                st.inflight += 1
                t0 = time.monotonic()
                try:
                    r = await asyncio.wait_for(self.http.post(url + path, json=body), self.timeout_s)
                except (TimeoutError, httpx.TimeoutException):
                    last = _Try(
                        reason="timeout", message=f"no answer from {url}{path} in {self.timeout_s:g} s", retry=True
                    )
                except httpx.TransportError as e:
                    last = _Try(reason="unreachable", message=f"{url}{path}: {type(e).__name__}: {e}", retry=True)
                else:
                    if r.status_code != 200:
                        last = _Try(
                            reason="http_status",
                            message=f"{url}{path} -> HTTP {r.status_code}: {r.text[:200]}",
                            retry=r.status_code in _RETRIED_STATUS,
                        )
                    else:
                        try:
                            value = parse(r.json())
                        except _Unparsable as e:
                            last = _Try(reason="unparsable_verdict", message=str(e), retry=e.retry)
                        except (ValueError, KeyError, IndexError, TypeError) as e:
                            last = _Try(
                                reason="bad_response", message=f"{url}{path}: {type(e).__name__}: {e}", retry=False
                            )
                        else:
                            now = time.monotonic()
                            self.calls_ok += 1
                            self.seconds += now - t0
                            st.add_ok(now, now - t0)
                            return value
                finally:
                    st.inflight -= 1
            self.failures[last.reason] += 1
            st.failures[last.reason] += 1
            failed = url
            log.warning(
                "reward model: attempt %d of %d failed (%s): %s",
                attempt + 1,
                self.retries + 1,
                last.reason,
                last.message,
            )
            if not last.retry:
                break
        self.calls_failed += 1
        raise RewardModelError(last.reason, last.message)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "calls_ok": self.calls_ok,
            "calls_failed": self.calls_failed,
            "failures": dict(self.failures),
            "calls_per_s": round(self.calls_ok / self.seconds, 3) if self.seconds else None,
            "servers": {u: st.status(now) for u, st in self.servers.items()},
        }


class _Unparsable(ValueError):
    def __init__(self, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry  # a sampled answer may hold a verdict next time; a greedy distribution will not


class JudgeClient(_HttpRewardClient):
    """A generative judge behind an OpenAI-compatible ``/v1/chat/completions`` (vLLM, SGLang). The
    template gets ``{question}``, ``{response}``, ``{reference}``; ``verdict`` (a regex whose group 1
    is in ``scores``) maps the judge's text to a reward. An answer without a verdict is a failure
    (``unparsable_verdict``, retried: sampling may give a verdict next time), never a 0.

    ``verdict_from="logprobs"`` reads the judge's distribution instead of its sampled text: one token
    is generated with its ``top_logprobs``, each top token that starts exactly one verdict of ``scores``
    (case and surrounding space ignored: SmolLM2 writes ``YES`` as ``Y`` + ``ES``) adds its probability
    to that verdict, and the reward is the probability-weighted mean score over the verdicts found.
    A small judge that would answer YES to everything still ranks the answers it is surer of higher,
    and that ranking is what a group-relative advantage uses. The template must make the verdict the
    judge's first word. No verdict among the top tokens is ``unparsable_verdict``, not retried (the
    same prompt gives the same distribution)."""

    def __init__(
        self,
        url: str | list[str],
        *,
        model: str,
        template: str = JUDGE_TEMPLATE,
        verdict: re.Pattern = VERDICT,
        scores: dict[str, float] | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        max_concurrency: int = 64,
        extra_body: dict[str, Any] | None = None,
        verdict_from: str = "text",
        top_logprobs: int = 20,
    ) -> None:
        super().__init__(
            url, model=model, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s, max_concurrency=max_concurrency
        )
        if "{response}" not in template:  # a reference-based judge may leave the question out
            raise ValueError(f"judge template must contain {{response}}, got {template[:80]!r}")
        if verdict_from not in ("text", "logprobs"):
            raise ValueError(f"verdict_from must be 'text' or 'logprobs', got {verdict_from!r}")
        self.template, self.verdict = template, verdict
        self.scores = {k.upper(): v for k, v in (scores or {"CORRECT": 1.0, "INCORRECT": 0.0}).items()}
        self.max_tokens, self.temperature = max_tokens, temperature
        self.extra_body = dict(extra_body or {})  # e.g. vLLM's structured_outputs: a verdict the judge must choose
        self.verdict_from, self.top_logprobs = verdict_from, top_logprobs
        self.verdict_mass = 0.0  # logprobs: the summed probability of the verdict tokens, over the calls scored

    def _parse(self, body: dict) -> float:
        text = body["choices"][0]["message"]["content"] or ""
        m = self.verdict.search(text)
        if m is None or m.group(1).upper() not in self.scores:
            raise _Unparsable(f"judge answer holds no verdict matching {self.verdict.pattern!r}: {text[:120]!r}")
        return self.scores[m.group(1).upper()]

    def _verdict_of(self, token: str) -> str | None:
        t = token.strip().upper()
        keys = [k for k in self.scores if t and k.startswith(t)]
        return keys[0] if len(keys) == 1 else None  # a token that starts two verdicts says nothing

    def _parse_logprobs(self, body: dict) -> float:
        top = body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        mass: dict[str, float] = {}
        for entry in top:
            lp = float(entry["logprob"])
            if not lp <= 0.0:  # NaN or above 0: the server's numbers are wrong (and exp would overflow)
                raise ValueError(f"top logprob {entry['logprob']!r} is not a log-probability")
            p = math.exp(lp)
            key = self._verdict_of(str(entry["token"]))
            if key is not None:
                mass[key] = mass.get(key, 0.0) + p
        total = sum(mass.values())
        if total <= 0.0:
            tokens = [e.get("token") for e in top[:8]]
            raise _Unparsable(
                f"no verdict of {sorted(self.scores)} among the judge's top {len(top)} first tokens "
                f"(the first: {tokens})",
                retry=False,
            )
        self.verdict_mass += total
        return sum(self.scores[k] * p for k, p in mass.items()) / total

    async def score(self, *, question: str, response: str, reference: str = "") -> float:
        prompt = self.template.format(question=question, response=response, reference=reference)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            **self.extra_body,
        }
        if self.verdict_from == "logprobs":
            # temperature 1: the first-token distribution itself, also from a server that returns the log-probs
            # after sampling's processing (fleetrl's vLLM servers: processed_logprobs); the sampled token is unused
            body.update(max_tokens=1, temperature=1.0, logprobs=True, top_logprobs=self.top_logprobs)
            return await self._post("/v1/chat/completions", body, self._parse_logprobs)
        return await self._post("/v1/chat/completions", body, self._parse)

    def status(self) -> dict[str, Any]:
        out = super().status()
        if self.verdict_from == "logprobs":  # how sure the judge is of any verdict at all
            out["verdict_mass_mean"] = round(self.verdict_mass / self.calls_ok, 4) if self.calls_ok else None
        return out


class ClassifierClient(_HttpRewardClient):
    """A sequence-classifier reward model on vLLM: ``/pooling`` of a reward model (the raw score:
    ``data[i].data``, a float or a one-element list) or ``/classify`` (``probs[label]``). The input
    is the conversation text as the reward model's chat template renders it (the caller's job)."""

    def __init__(
        self,
        url: str | list[str],
        *,
        model: str,
        endpoint: str = "pooling",
        label: int = 0,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        max_concurrency: int = 64,
    ) -> None:
        if endpoint not in ("pooling", "classify"):
            raise ValueError(f"endpoint must be 'pooling' or 'classify', got {endpoint!r}")
        super().__init__(
            url, model=model, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s, max_concurrency=max_concurrency
        )
        self.endpoint, self.label = endpoint, label

    def _parse(self, body: dict, n: int) -> list[float]:
        data = sorted(body["data"], key=lambda d: d["index"])
        if len(data) != n:
            raise ValueError(f"{len(data)} scores for {n} inputs")
        if self.endpoint == "classify":
            if any(self.label >= len(d["probs"]) for d in data):
                raise ValueError(f"label {self.label} asked of a classifier with {len(data[0]['probs'])} classes")
            out = [float(d["probs"][self.label]) for d in data]
        else:
            out = []
            for d in data:
                v = d["data"]
                if isinstance(v, list) and len(v) != 1:  # a classifier's probabilities, not one reward
                    raise ValueError(
                        f"/pooling gave {len(v)} values per input, a reward model gives 1: for a "
                        f"classifier use endpoint 'classify' and its label"
                    )
                out.append(float(v[0] if isinstance(v, list) else v))
        if not all(x == x and abs(x) != float("inf") for x in out):
            raise ValueError(f"non-finite reward in {out}")
        return out

    async def score_texts(self, texts: list[str]) -> list[float]:
        body = {"model": self.model, "input": list(texts)}
        return await self._post(f"/{self.endpoint}", body, lambda b: self._parse(b, len(texts)))


class ModelRewardScorer:
    """The worker's ``RewardScorer`` over a judge or a classifier: the group's samples scored
    concurrently; one failed sample fails the group (RewardFailed: dropped and counted). With
    ``tokenizer`` the texts are decoded without special tokens (a judge never sees the policy's EOS).

    A reward server that is down (killed, restarting: launch/reward_servers.py restarts a launched one
    on its address) is waited for: a group whose scoring failed for a reason a dead server gives
    (unreachable, timeout, 5xx) while some server does not answer ``/health`` waits up to
    ``outage_wait_s`` for every server to answer, then is scored again, at most ``MAX_OUTAGES`` times.
    Its samples are kept, so the outage costs time, not the group (a long one may make it stale:
    the broker drops it as such, counted). ``outage_wait_s`` 0: fail at once, as before."""

    MAX_OUTAGES = 3
    _OUTAGE_REASONS = ("unreachable", "timeout", "http_status")

    def __init__(
        self, model: JudgeClient | ClassifierClient, codec: Codec, tokenizer: Any = None, outage_wait_s: float = 0.0
    ) -> None:
        self.model, self.codec, self.tokenizer = model, codec, tokenizer
        self.outage_wait_s = outage_wait_s
        self.outage_waits = 0  # groups that waited for a reward server to come back

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.codec.decode(ids)

    async def score(self, prompt: Prompt, samples: list) -> list[float]:
        question = self._text(list(prompt.prompt_ids))
        answers = [self._text(list(s.token_ids)) for s in samples]
        for outage in range(self.MAX_OUTAGES + 1):
            try:
                return await self._score_once(question, answers, prompt.ground_truth)
            except RewardModelError as exc:
                if exc.reason not in self._OUTAGE_REASONS or not self.outage_wait_s or outage == self.MAX_OUTAGES:
                    raise
                down = await self.model.down()
                if not down:  # every server answers: the failure was the call's, not an outage
                    raise
                self.outage_waits += 1
                log.warning(
                    "reward model: %s while %s do(es) not answer /health: waiting up to %g s for it, "
                    "then scoring the group again",
                    exc.reason,
                    down,
                    self.outage_wait_s,
                )
                await self.model.wait_ready(self.outage_wait_s)  # raises RewardModelError if it stays down
        raise AssertionError("unreachable")  # the loop returns or raises

    async def _score_once(self, question: str, answers: list[str], reference: str) -> list[float]:
        if isinstance(self.model, ClassifierClient):
            return await self.model.score_texts([question + a for a in answers])
        out = await asyncio.gather(
            *(self.model.score(question=question, response=a, reference=reference) for a in answers),
            return_exceptions=True,
        )
        for r in out:  # every call has ended (none left running unobserved); the first failure fails the group
            if isinstance(r, BaseException):
                raise r
        return list(out)


def from_config(cfg: Any, model_path: str) -> ModelRewardScorer:
    """The scorer of ``reward.model`` (rollout_fleet.config.RewardModelConfig) for the policy at ``model_path``."""
    from rollout_fleet.envs.base import HFCodec

    urls = cfg.all_urls()
    if not urls:
        raise ValueError(
            "reward.model has no server: give reward.model.url, or start reward servers with "
            "launch/cluster.py --reward-gpus N"
        )
    common = {
        "model": cfg.model,
        "timeout_s": cfg.timeout_s,
        "retries": cfg.retries,
        "backoff_s": cfg.backoff_s,
        "max_concurrency": cfg.max_concurrency,
    }
    if cfg.kind == "judge":
        client = JudgeClient(
            urls,
            template=cfg.template or JUDGE_TEMPLATE,
            verdict=re.compile(cfg.verdict) if cfg.verdict else VERDICT,
            scores=cfg.scores,
            max_tokens=cfg.max_tokens,
            extra_body=cfg.extra_body,
            verdict_from=cfg.verdict_from,
            top_logprobs=cfg.top_logprobs,
            **common,
        )
    else:
        client = ClassifierClient(urls, endpoint=cfg.endpoint, label=cfg.label, **common)
    codec = HFCodec.from_pretrained(model_path)
    # a server down mid-run is waited for as long as one may take to start (a launched one is restarted)
    return ModelRewardScorer(client, codec, tokenizer=codec.tokenizer, outage_wait_s=cfg.server.startup_timeout_s)
