"""Length control on a real vLLM server: ``rollout.sampling.ignore_eos`` and the dataset's per-prompt
``max_tokens`` budget, through the real Parquet loader, fleet controller and rollout worker.

The session's shared vLLM CPU server (conftest) serves models/tiny-adder, which answers an addition in a
few tokens and then emits its end-of-sequence token. With ignore_eos every response must be exactly its
prompt's limit, min(row budget, rollout.sampling.max_tokens), finish reason 'length'; without it the same
prompts end early ('stop').

The same on a server started as the fleet starts its own (``--skip-tokenizer-init``: no EOS of its own), where
the stop comes from the EOS id the client adds: without it the same prompts never stop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from vllm_cpu import AttachedServerFactory, cpu_vllm_server, model_copy_with_generation_config

from broker.protocol import Ticket
from rollout_fleet.config import RolloutConfig, SamplingConfig
from rollout_fleet.controller import FleetController
from rollout_fleet.data import PromptDataset, load_tokenizer
from rollout_fleet.prompts_and_rewards import DatasetPrompts
from rollout_fleet.worker import AsyncProducer, RolloutWorker

pytestmark = pytest.mark.timeout(240)

TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"
MAX_TOKENS = 20  # rollout.sampling.max_tokens; the shared server's max_model_len is 64
BUDGETS = [3, 11, None, 40]  # the rows' own budgets: None and 40 fall back to / are capped by MAX_TOKENS


class Producer:
    def __init__(self) -> None:
        self.batches: list[pa.RecordBatch] = []

    def push(self, batch) -> None:
        self.batches.append(batch)


class Zero:
    async def score(self, prompt, samples):
        return [0.0] * len(samples)


@pytest.fixture(scope="module")
def token_only_server(tmp_path_factory):
    """The tiny model served as the fleet serves (VLLMFactory): token ids in and out, no tokenizer. Its copy's
    generation_config.json names no EOS (vLLM would stop on one listed there even without a tokenizer), as a
    model folder may: the tokenizer's EOS then reaches the server only through the client."""
    model = model_copy_with_generation_config(
        TINY_MODEL,
        tmp_path_factory.mktemp("tiny-adder-no-eos"),
        lambda gen: {k: v for k, v in gen.items() if k != "eos_token_id"},
    )
    with cpu_vllm_server(
        model,
        tmp_path_factory.mktemp("vllm_token_only"),
        max_model_len=64,
        max_num_seqs=16,
        served_model_name="tiny-adder",
        skip_tokenizer_init=True,
    ) as s:
        yield s


def _rollout(
    url: str, data: Path, ignore_eos: bool, eos: list[int] | None = None
) -> tuple[RolloutWorker, list[pa.RecordBatch]]:
    prompts = DatasetPrompts(PromptDataset([data], load_tokenizer(TINY_MODEL), shuffle=False))

    async def main():
        fleet = FleetController(
            RolloutConfig(engine="vllm", health_interval_s=30, request_timeout_s=120, startup_timeout_s=30),
            AttachedServerFactory(url, request_timeout_s=120, eos_token_ids=eos or []),
        )
        await fleet.start(1)
        producer = Producer()
        sampling = SamplingConfig(n=4, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos)
        worker = RolloutWorker(fleet, AsyncProducer(producer), prompts, Zero(), sampling, max_inflight_groups=4)
        try:
            await asyncio.gather(
                *(worker._group(Ticket(step=1, ticket_id=i), prompts.next()) for i in range(len(BUDGETS)))
            )
        finally:
            await fleet.close()
            await worker.producer.close()
        return worker, producer.batches

    return asyncio.run(main())


def _budget_rows(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{12 + i}+{34 + i}="}],
            "reward_model": {"style": "rule", "ground_truth": str(46 + 2 * i)},
            "max_tokens": b,
        }
        for i, b in enumerate(BUDGETS)
    ]
    data = tmp_path / "budgets.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    return data, {f"{12 + i}+{34 + i}=": min(b or MAX_TOKENS, MAX_TOKENS) for i, b in enumerate(BUDGETS)}


def _by_prompt(batches) -> dict[str, list[tuple[int, str]]]:
    """Each prompt's samples as (response length, finish reason)."""
    tok = load_tokenizer(TINY_MODEL)
    out = {}
    for b in batches:
        prompt = tok.decode(b.column("prompt_ids")[0].as_py())
        out[prompt] = list(
            zip(
                [len(r) for r in b.column("response_ids").to_pylist()],
                b.column("finish_reason").to_pylist(),
                strict=True,
            )
        )
    return out


def _check_lengths(url: str, tmp_path: Path, eos: list[int] | None = None) -> None:
    data, limits = _budget_rows(tmp_path)
    worker, batches = _rollout(url, data, ignore_eos=True, eos=eos)
    got = _by_prompt(batches)
    assert got == {p: [(n, "length")] * 4 for p, n in limits.items()}, got
    assert worker.samples_truncated == 16 and worker.groups_pushed == 4

    worker, batches = _rollout(url, data, ignore_eos=False, eos=eos)
    got = _by_prompt(batches)
    assert set(got) == set(limits)
    for p, samples in got.items():
        assert all(n <= limits[p] for n, _ in samples), (p, samples)
    # the tiny adder answers in a few tokens and stops: most samples end before their limit
    stopped = [n for samples in got.values() for n, reason in samples if reason == "stop"]
    assert len(stopped) >= 8, got
    assert worker.samples_truncated == 16 - len(stopped)


@pytest.mark.slow
def test_ignore_eos_and_row_budgets_give_exact_lengths_and_without_it_responses_stop(vllm_server, tmp_path):
    _check_lengths(vllm_server.url, tmp_path)


@pytest.mark.slow
def test_a_server_without_its_tokenizer_stops_at_the_eos_the_client_names(token_only_server, tmp_path):
    eos = load_tokenizer(TINY_MODEL).eos_token_id
    _check_lengths(token_only_server.url, tmp_path, eos=[eos])
    # the stop came from the client: without the id, the same prompts run to their limits
    data, limits = _budget_rows(tmp_path)
    _, batches = _rollout(token_only_server.url, data, ignore_eos=False, eos=[])
    assert _by_prompt(batches) == {p: [(n, "length")] * 4 for p, n in limits.items()}
