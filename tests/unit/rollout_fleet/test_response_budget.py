"""Length control: ``rollout.sampling.ignore_eos`` and a dataset row's own response budget (column
``max_tokens``). The column is parsed and refused with the row named; the worker asks for
``min(row, rollout.sampling.max_tokens)`` per request; the simulated engine runs every sample to its limit
under ignore_eos; the overlong penalty stays measured from the config's max_tokens; the config refuses the
combinations that would train on nothing.

Real fleet controller and (SIMULATED) engines; the broker side is an in-memory producer client; the dataset
is a real Parquet file read with the tiny model's tokenizer.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from broker_groups import MemoryProducer

from broker.protocol import Ticket
from engines.base import SamplingParams
from engines.simulated import SimulatedEngine, SimulatedFactory
from rollout_fleet.config import OverlongBufferConfig, RolloutConfig, SamplingConfig, SimulatedEngineConfig
from rollout_fleet.controller import FleetController
from rollout_fleet.data import MAX_ROW_BUDGET, DatasetError, PromptDataset, check_row_budget, load_tokenizer
from rollout_fleet.prompts_and_rewards import DatasetPrompts
from rollout_fleet.worker import AsyncProducer, Prompt, RolloutWorker

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]


# -- the dataset column -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), (1, 1), (4096, 4096), (np.int64(7), 7), (2048.0, 2048), (MAX_ROW_BUDGET, MAX_ROW_BUDGET)],
)
def test_row_budget_accepts_whole_positive_numbers_and_null(value, expected):
    got = check_row_budget(value, "f.parquet", 3)
    assert got == expected and (got is None or type(got) is int)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (0, "expected an integer in 1..2147483647, got 0"),
        (-1, "expected an integer in 1..2147483647, got -1"),
        (10**30, f"expected an integer in 1..2147483647, got {10**30}"),
        (1e30, "expected an integer in 1..2147483647, got 1000000000000000019884624838656"),
        ("x", "expected an integer >= 1, got str 'x'"),
        ("512", "expected an integer >= 1, got str '512'"),
        (True, "expected an integer >= 1, got bool True"),
        (np.bool_(False), "expected an integer >= 1, got bool False"),
        (1.5, "expected a whole number of tokens, got 1.5"),
        (math.nan, "expected a whole number of tokens, got nan"),
        (math.inf, "expected a whole number of tokens, got inf"),
        ([5], "expected an integer >= 1, got list [5]"),
    ],
)
def test_row_budget_refuses_bad_values_naming_file_row_and_column(value, needle):
    with pytest.raises(DatasetError) as err:
        check_row_budget(value, "f.parquet", 3)
    assert str(err.value) == f"f.parquet row 3, column 'max_tokens': {needle}"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(REPO / "models/tiny-adder")


def _rows(budgets: list) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "max_tokens": b,
        }
        for i, b in enumerate(budgets)
    ]


def _write(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_dataset_reads_each_rows_budget_and_the_worker_prompt_carries_it(tmp_path, tok):
    path = _write(tmp_path / "budgets.parquet", _rows([3, None, 4096]))
    ds = PromptDataset([path], tok, shuffle=False)
    assert [r.max_tokens for r in ds.rows] == [3, None, 4096]
    prompts = DatasetPrompts(ds)
    assert [prompts.next().max_tokens for _ in range(3)] == [3, None, 4096]
    # a file without the column: no row has a budget of its own
    bare = [{k: v for k, v in r.items() if k != "max_tokens"} for r in _rows([1, 2])]
    assert [r.max_tokens for r in PromptDataset([_write(tmp_path / "bare.parquet", bare)], tok).rows] == [None, None]


def test_a_bad_budget_in_a_file_names_its_row_or_is_skipped_and_counted(tmp_path, tok):
    path = _write(tmp_path / "bad.parquet", _rows([5, 0, 7, -1]))
    with pytest.raises(DatasetError) as err:
        PromptDataset([path], tok, shuffle=False)
    assert str(err.value) == f"{path} row 1, column 'max_tokens': expected an integer in 1..2147483647, got 0"
    ds = PromptDataset([path], tok, shuffle=False, on_bad_row="skip")
    assert [(r.row, r.max_tokens) for r in ds.rows] == [(0, 5), (2, 7)] and len(ds.skipped) == 2
    # a string column and a float column with a fraction: the same rule through Parquet's types
    strings = _write(tmp_path / "strings.parquet", _rows(["x", "y"]))
    with pytest.raises(DatasetError, match=r"strings.parquet row 0, column 'max_tokens': expected an integer >= 1"):
        PromptDataset([strings], tok)
    floats = _write(tmp_path / "floats.parquet", _rows([8.0, 2.5]))
    with pytest.raises(DatasetError, match=r"floats.parquet row 1, column 'max_tokens': expected a whole number"):
        PromptDataset([floats], tok)


# -- the simulated engine under ignore_eos --------------------------------------------------------------------
def test_simulated_engine_runs_every_sample_to_its_limit_under_ignore_eos():
    async def main():
        cfg = SimulatedEngineConfig(tokens_per_s=1e6, length_median=4, length_sigma=0.5)
        eng = SimulatedEngine("sim-0", cfg, seed=0)
        free = await eng.generate([1, 2], SamplingParams(n=16, max_tokens=64, seed=1))
        forced = await eng.generate([1, 2], SamplingParams(n=16, max_tokens=64, seed=1, ignore_eos=True))
        return free, forced

    free, forced = asyncio.run(main())
    assert [len(s.token_ids) for s in forced] == [64] * 16 and {s.finish_reason for s in forced} == {"length"}
    # without it the same seed gives the lognormal lengths, most of them ending before the limit
    assert sum(s.finish_reason == "stop" for s in free) > 8 and max(len(s.token_ids) for s in free) <= 64


# -- the worker: per-request limit, truncation count, overlong penalty ---------------------------------------
class Zero:
    async def score(self, prompt, samples):
        return [0.0] * len(samples)


class Requests(SimulatedFactory):
    """Simulated engines that record each request's SamplingParams."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.params: list[SamplingParams] = []

    async def start(self, index: int) -> SimulatedEngine:
        engine = SimulatedEngine(f"sim-{index}", self.cfg, seed=index)
        inner, seen = engine.generate, self.params

        async def generate(prompt_ids, params):
            seen.append(params)
            return await inner(prompt_ids, params)

        engine.generate = generate
        return engine


def _run(prompts: list[Prompt], sampling: SamplingConfig, overlong=None):
    async def main():
        sim = SimulatedEngineConfig(tokens_per_s=1e6, length_median=3, length_sigma=0.2)
        factory = Requests(sim)
        fleet = FleetController(RolloutConfig(engine="simulated", health_interval_s=0.1, simulated=sim), factory)
        await fleet.start(1)
        producer = MemoryProducer()
        worker = RolloutWorker(
            fleet, AsyncProducer(producer), None, Zero(), sampling, max_inflight_groups=4, overlong=overlong
        )
        for i, p in enumerate(prompts):
            await worker._group(Ticket(step=1, ticket_id=i), p)
        await fleet.close()
        await worker.producer.close()
        return worker, producer.batches, factory.params

    return asyncio.run(main())


def test_worker_caps_each_request_at_the_rows_budget_and_counts_the_cut_ones():
    prompts = [Prompt(prompt_ids=[5, 6], max_tokens=b) for b in (5, None, 40, 16)]
    sampling = SamplingConfig(n=3, max_tokens=16, ignore_eos=True)
    worker, batches, params = _run(prompts, sampling)
    assert [(p.max_tokens, p.ignore_eos) for p in params] == [(5, True), (16, True), (16, True), (16, True)]
    lengths = [[len(r) for r in b.column("response_ids").to_pylist()] for b in batches]
    assert lengths == [[5] * 3, [16] * 3, [16] * 3, [16] * 3]
    assert all(set(b.column("finish_reason").to_pylist()) == {"length"} for b in batches)
    assert worker.samples_truncated == 12 and worker.status()["samples_truncated"] == 12
    assert worker.limit(Prompt(prompt_ids=[1], max_tokens=1)) == 1


def test_without_ignore_eos_the_budget_is_only_a_cap():
    _, batches, params = _run([Prompt(prompt_ids=[5], max_tokens=40)], SamplingConfig(n=8, max_tokens=64))
    assert [(p.max_tokens, p.ignore_eos) for p in params] == [(40, False)]
    reasons = batches[0].column("finish_reason").to_pylist()
    assert "stop" in reasons and all(len(r) <= 40 for r in batches[0].column("response_ids").to_pylist())


def test_overlong_penalty_is_measured_from_the_configs_max_tokens_not_the_rows():
    """Buffer 8 before max_tokens=16: a 16-token response loses the whole factor; a response cut at its row's
    budget of 6 (under 16 - 8) loses nothing, though its finish reason is 'length' too."""
    overlong = OverlongBufferConfig(enable=True, len=8, penalty_factor=1.0)
    sampling = SamplingConfig(n=2, max_tokens=16, ignore_eos=True)
    worker, batches, _ = _run([Prompt(prompt_ids=[5], max_tokens=6), Prompt(prompt_ids=[5])], sampling, overlong)
    assert [b.column("reward").to_pylist() for b in batches] == [[0.0, 0.0], [-1.0, -1.0]]
    assert worker.samples_overlong_penalised == 2


def test_the_rows_budget_survives_the_workers_checkpoint():
    worker = RolloutWorker(None, None, None, None, SamplingConfig(), max_inflight_groups=1)
    worker._replay = [Prompt(prompt_ids=[1, 2], max_tokens=7), Prompt(prompt_ids=[3])]

    class Position:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    worker.prompts = Position()
    state = worker.state_dict()
    again = RolloutWorker(None, None, Position(), None, SamplingConfig(), max_inflight_groups=1)
    again.load_state_dict(state)
    assert [p.max_tokens for p in again._replay] == [7, None]
    # a checkpoint written before the column existed has no key: no budget of its own
    del state["replay"][0]["max_tokens"]
    again.load_state_dict(state)
    assert again._replay[0].max_tokens is None


# -- configuration ---------------------------------------------------------------------------------------------
def _cfg(*overrides: str):
    from launch.config import load_run_config

    return load_run_config("tiny", list(overrides))


def test_ignore_eos_defaults_off_and_refuses_what_would_train_on_nothing():
    assert SamplingConfig().ignore_eos is False
    assert _cfg("rollout.sampling.ignore_eos=true").rollout.sampling.ignore_eos is True
    with pytest.raises(Exception, match="reward.on_truncated=mask would mask every one out of the loss"):
        _cfg("rollout.sampling.ignore_eos=true", "reward.on_truncated=mask", "learner.loss.mask_truncated=true")
    with pytest.raises(Exception, match="on_truncated=penalize would give every one reward.truncated_reward"):
        _cfg("rollout.sampling.ignore_eos=true", "reward.on_truncated=penalize")
    with pytest.raises(Exception, match="ignore_eos=true applies to single-turn rollout only; rollout.env"):
        RolloutConfig(
            sampling=SamplingConfig(ignore_eos=True),
            env={"name": "calculator", "max_turns": 2, "max_tokens": 32, "turn_max_tokens": 8},
        )
