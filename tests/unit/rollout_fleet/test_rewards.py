"""Reward functions, name resolution, and the reward pool's errors and timeouts."""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest

from rollout_fleet.rewards import (
    RewardConfigError,
    RewardError,
    RewardPool,
    RewardTimeout,
    exact_match,
    math_answer,
    resolve,
)

pytestmark = pytest.mark.timeout(120)

CUSTOM = textwrap.dedent(
    """
    import time

    def length_bonus(response_text, ground_truth, **extra):
        return 0.5 * extra.get("scale", 1.0) if response_text.strip() == ground_truth else 0.0

    def explodes(response_text, ground_truth, **extra):
        raise KeyError("no such field")

    def says_yes(response_text, ground_truth, **extra):
        return "yes"

    def slow(response_text, ground_truth, **extra):
        time.sleep(float(extra.get("sleep", 30)))
        return 1.0

    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture()
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "fleetrl_test_custom_rewards.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fleetrl_test_custom_rewards"


def test_exact_match_strips_whitespace():
    assert exact_match("432", "432") == 1.0
    assert exact_match(" 432\n", "432 ") == 1.0
    assert exact_match("431", "432") == 0.0
    assert exact_match("4320", "432") == 0.0
    assert exact_match("", "432") == 0.0


@pytest.mark.parametrize(
    ("response", "truth", "want"),
    [
        ("She sold 48 in April and 24 in May, 72 in all.\n#### 72", "72", 1.0),
        ("The answer is 72.", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("#### 71", "72", 0.0),
        ("#### 72\nQuestion: what is 5+5? It is 10.", "72", 1.0),
        ("#### 10\nNext: 72", "72", 0.0),
        ("I do not know", "72", 0.0),
    ],
)
def test_math_answer_gsm8k_style(response, truth, want):
    assert math_answer(response, truth) == want


def test_math_answer_rejects_unparsable_ground_truth():
    with pytest.raises(ValueError, match="no parsable answer"):
        math_answer("72", "#### ")


def test_resolve_builtins_and_custom(custom_module):
    assert resolve("exact_match") is exact_match
    assert resolve("math") is math_answer
    fn = resolve(f"{custom_module}:length_bonus")
    assert fn("7", "7", scale=2.0) == 1.0


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("exact-match", "neither a built-in"),
        ("no_such_module_fleetrl:fn", "cannot import module 'no_such_module_fleetrl'"),
        ("json:no_such_function", "has no attribute 'no_such_function'"),
        ("json:", "neither a built-in"),
    ],
)
def test_resolve_bad_names_fail_naming_the_function(name, fragment):
    with pytest.raises(RewardConfigError) as err:
        resolve(name)
    assert repr(name) in str(err.value) and fragment in str(err.value)


def test_resolve_non_callable(custom_module):
    with pytest.raises(RewardConfigError, match="not callable"):
        resolve(f"{custom_module}:NOT_A_FUNCTION")


def test_pool_fails_at_construction_for_a_bad_name():
    with pytest.raises(RewardConfigError, match="nope.module:fn"):
        RewardPool("nope.module:fn")


def test_config_checks_the_form_and_the_pool_resolves_it(custom_module):
    from core.configbase import ConfigError, build
    from rollout_fleet.config import RewardConfig

    with pytest.raises(ConfigError, match="'reward.function': 'exact-match'"):
        build(RewardConfig, {"function": "exact-match"}, "reward.")
    cfg = build(RewardConfig, {"function": f"{custom_module}:length_bonus", "workers": 1, "timeout_s": 5})
    with RewardPool.from_config(cfg) as pool:
        assert (pool.name, pool.workers, pool.timeout_s, pool.mode) == (cfg.function, 1, 5.0, "thread")
    with pytest.raises(RewardConfigError, match="no_such_fn"):
        RewardPool.from_config(build(RewardConfig, {"function": f"{custom_module}:no_such_fn"}))


def test_pool_scores_and_passes_extra(custom_module):
    async def go():
        with RewardPool(f"{custom_module}:length_bonus", workers=2, timeout_s=10) as pool:
            a = await pool.score("5", "5", where="row 0", extra={"scale": 4.0})
            b = await pool.score("6", "5", where="row 1")
            return a, b

    assert asyncio.run(go()) == (2.0, 0.0)


def test_raising_reward_names_function_and_row(custom_module):
    name = f"{custom_module}:explodes"

    async def go():
        with RewardPool(name, workers=1, timeout_s=10) as pool:
            await pool.score("1", "1", where="train.parquet row 12, sample 3")

    with pytest.raises(RewardError) as err:
        asyncio.run(go())
    msg = str(err.value)
    assert name in msg and "train.parquet row 12, sample 3" in msg and "KeyError" in msg
    assert err.value.function == name and err.value.where == "train.parquet row 12, sample 3"


def test_non_numeric_reward_is_an_error(custom_module):
    async def go():
        with RewardPool(f"{custom_module}:says_yes", workers=1) as pool:
            await pool.score("1", "1", where="trajectory abc")

    with pytest.raises(RewardError, match=r"returned 'yes' on trajectory abc; expected a finite float"):
        asyncio.run(go())


def test_score_many_returns_errors_in_place(custom_module):
    async def go():
        with RewardPool("exact_match", workers=2) as pool:
            ok = await pool.score_many([("12", "12", "s0", None), ("13", "12", "s1", None)])
        with RewardPool(f"{custom_module}:explodes", workers=2) as pool:
            bad = await pool.score_many([("12", "12", "s0", None)])
            return ok, bad, pool.errors

    ok, bad, errors = asyncio.run(go())
    assert ok == [1.0, 0.0]
    assert isinstance(bad[0], RewardError) and "s0" in str(bad[0]) and errors == 1


def test_thread_pool_timeout_names_function_and_limit(custom_module):
    name = f"{custom_module}:slow"

    async def go():
        pool = RewardPool(name, workers=1, timeout_s=0.2)
        t0 = time.monotonic()
        try:
            await pool.score("1", "1", where="sample 9", extra={"sleep": 1.0})
        finally:
            elapsed = time.monotonic() - t0
            pool.close()
        return elapsed

    with pytest.raises(RewardTimeout) as err:
        asyncio.run(go())
    assert name in str(err.value) and "0.2 s" in str(err.value) and "sample 9" in str(err.value)


def test_process_pool_timeout_replaces_stuck_workers(custom_module):
    """A hung reward in process mode is stopped; a call that shared its pool is re-run; scoring goes on."""
    name = f"{custom_module}:slow"

    async def go():
        with RewardPool(name, workers=2, timeout_s=8.0, mode="process") as pool:
            # The first calls pay for spawning the workers: let them finish.
            warm = [("1", "1", f"warm-up {i}", {"sleep": 0.5}) for i in range(2)]
            assert await pool.score_many(warm) == [1.0, 1.0]
            t0 = time.monotonic()
            stuck = asyncio.create_task(pool.score("1", "1", where="stuck sample", extra={"sleep": 600}))
            await asyncio.sleep(6.0)
            # Still running when the stuck call's processes are ended: it must be re-run, not failed.
            innocent = await pool.score("1", "1", where="innocent sample", extra={"sleep": 3.0})
            with pytest.raises(RewardTimeout, match="timed out after 8 s on stuck sample"):
                await stuck
            assert time.monotonic() - t0 < 30
            assert await pool.score("1", "1", where="after", extra={"sleep": 0}) == 1.0
            return innocent, pool.timeouts, pool.errors, pool.reruns

    assert asyncio.run(go()) == (1.0, 1, 0, 1)


def test_process_pool_error_crosses_the_process_boundary(custom_module):
    name = f"{custom_module}:explodes"

    async def go():
        with RewardPool(name, workers=1, timeout_s=60, mode="process") as pool:
            await pool.score("1", "1", where="row 4 sample 0")

    with pytest.raises(RewardError) as err:
        asyncio.run(go())
    assert err.value.function == name and err.value.where == "row 4 sample 0" and "KeyError" in str(err.value)


# ---- rewards as verl users write them (issue 19) ---------------------------------------------------

VERL_STYLE = textwrap.dedent(
    """
    import asyncio

    SEEN = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # verl's custom reward signature, unchanged
        SEEN.append((data_source, extra_info))
        if data_source != "openai/gsm8k":
            return 0.0
        return {"score": 1.0 if solution_str.strip().endswith(ground_truth) else 0.0, "acc": 1.0}

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(s == g) + 0.1 * e["index"] for s, g, e in zip(solution_strs, ground_truths, extra_infos)]

    def short_batch(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    async def judge(response_text, ground_truth, **extra):
        await asyncio.sleep(0.01)  # a judge over the network
        return 1.0 if response_text == ground_truth else 0.0

    async def slow_judge(response_text, ground_truth, **extra):
        await asyncio.sleep(30)
        return 1.0

    def fleetrl_style(response_text, ground_truth, data_source=None):
        # takes data_source only: it must not get extra_info
        return 1.0 if data_source == "addition" else 0.0
    """
)


@pytest.fixture()
def verl_module(tmp_path, monkeypatch):
    (tmp_path / "fleetrl_test_verl_rewards.py").write_text(VERL_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fleetrl_test_verl_rewards"


def test_verl_compute_score_works_unchanged_and_sees_data_source_and_extra_info(verl_module):
    import importlib

    from rollout_fleet.rewards import signature_of

    mod = importlib.import_module(verl_module)
    assert signature_of(mod.compute_score) == "verl" and signature_of(exact_match) == "fleetrl"
    extra = {"data_source": "openai/gsm8k", "extra_info": {"split": "test", "index": 7}}
    with RewardPool(f"{verl_module}:compute_score", workers=1, timeout_s=5) as pool:
        assert asyncio.run(pool.score("so the answer is 72", "72", where="r0", extra=extra)) == 1.0
        assert asyncio.run(pool.score("71", "72", where="r1", extra=extra)) == 0.0
    assert mod.SEEN[0] == ("openai/gsm8k", {"split": "test", "index": 7})


def test_a_reward_file_path_as_verl_gives_it(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_STYLE)
    with RewardPool(f"{path}:compute_score", workers=1, timeout_s=5, mode="process") as pool:
        got = asyncio.run(pool.score("= 5", "5", where="r0", extra={"data_source": "openai/gsm8k"}))
    assert got == 1.0
    with pytest.raises(RewardConfigError, match="cannot import module"):
        resolve(f"{tmp_path}/missing.py:compute_score")


def test_fleetrl_style_function_gets_only_the_keywords_it_names(verl_module):
    with RewardPool(f"{verl_module}:fleetrl_style", workers=1, timeout_s=5) as pool:
        extra = {"data_source": "addition", "extra_info": {"x": 1}}
        assert asyncio.run(pool.score("1", "1", where="r0", extra=extra)) == 1.0


def test_async_reward_is_awaited_with_the_limit(verl_module):
    with RewardPool(f"{verl_module}:judge", workers=2, timeout_s=5) as pool:
        assert pool.is_async
        assert asyncio.run(pool.score("a", "a", where="r0")) == 1.0
    with RewardPool(f"{verl_module}:slow_judge", workers=1, timeout_s=0.2) as pool:
        with pytest.raises(RewardTimeout, match="timed out after 0.2 s on r9"):
            asyncio.run(pool.score("a", "a", where="r9"))


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_batched_reward_scores_a_group_in_one_call(verl_module, mode):
    items = [(s, "4", f"sample {i}", {"data_source": "x", "extra_info": {"index": i}}) for i, s in enumerate("434")]
    with RewardPool(f"{verl_module}:batch_score", workers=1, timeout_s=10, mode=mode, batched=True) as pool:
        got = asyncio.run(pool.score_batch(items))
    assert got == pytest.approx([1.0, 0.1, 1.2])  # exact sums of 0/1 and tenths, within float rounding


def test_batched_reward_with_a_wrong_length_names_the_function(verl_module):
    with RewardPool(f"{verl_module}:short_batch", workers=1, timeout_s=5, batched=True) as pool:
        with pytest.raises(RewardError, match=r"short_batch' returned \[1.0\] on s0 .. s1; expected a list of 2"):
            asyncio.run(pool.score_batch([("4", "4", "s0", None), ("3", "4", "s1", None)]))


@pytest.mark.parametrize(
    ("source", "response", "truth", "want"),
    [
        ("openai/gsm8k", "... so she has 18 eggs.\n#### 18", "18", 1.0),
        ("openai/gsm8k", "she has 18 eggs", "18", 0.0),  # strict: GSM8K's #### marker is required
        ("openai/gsm8k", "#### 1,234", "1234", 1.0),
        ("fleetrl/word_problems", "Mia has 14 + 5 = 19 shells.", "19", 1.0),  # flexible: the last number
        ("fleetrl/word_problems", "19 shells, or 20", "19", 0.0),
        ("addition", "432", "432", 1.0),
        ("lighteval/MATH", "the answer is $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
    ],
)
def test_default_scorer_routes_by_data_source(source, response, truth, want):
    from rollout_fleet.scorers import default

    assert default(response, truth, data_source=source) == want


def test_default_scorer_names_an_unknown_data_source():
    from rollout_fleet.scorers import check_sources

    with pytest.raises(ValueError, match=r"'default' has no scorer for data_source 'my/task'.*Set reward.function"):
        check_sources({"my/task", "openai/gsm8k"})
    with RewardPool("default", workers=1, timeout_s=5) as pool:
        with pytest.raises(RewardError, match="no scorer for data_source 'my/task'"):
            asyncio.run(pool.score("1", "1", where="r0", extra={"data_source": "my/task"}))
