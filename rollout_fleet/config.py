"""Rollout config: the dataset, rewards, engines and how they take new weights."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from core.configbase import ConfigModel


class DataConfig(ConfigModel):
    train_files: list[str] = Field(min_length=1, description="Parquet files in verl's column layout")
    test_files: list[str] = Field(default_factory=list)
    shuffle: bool = True
    max_prompt_tokens: int = Field(1024, ge=1, description="longest prompt (chat template applied) a row may have")
    filter_overlong_prompts: bool = Field(
        False, description="skip (and count) prompts over the limit (max_prompt_tokens, and rollout.max_model_len "
        "minus rollout.sampling.max_tokens) instead of refusing the run before it starts (verl's key)")
    on_bad_row: Literal["raise", "skip"] = Field(
        "raise", description="a malformed row: stop at load naming file/row/column, or skip it and count it"
    )


BUILTIN_REWARDS = ("default", "exact_match", "gsm8k", "gsm8k_flexible", "math")


class RewardModelConfig(ConfigModel):
    """A reward server the workers call instead of ``reward.function`` (rollout_fleet/reward_models.py):
    a generative judge (chat completions, a verdict parsed from its answer) or a sequence-classifier
    reward model (vLLM ``/pooling`` or ``/classify``). Start it on its own GPUs and give its URL."""

    kind: Literal["judge", "classifier"]
    url: str = Field(description="http://host:port of the reward server (vLLM or SGLang)")
    model: str = Field(description="the served model name")
    template: str | None = Field(None, description="judge prompt with {question}, {response}, {reference}; "
                                 "None: reward_models.JUDGE_TEMPLATE")
    endpoint: Literal["pooling", "classify"] = "pooling"
    timeout_s: float = Field(30.0, gt=0, description="one call; past it the attempt counts as 'timeout'")
    retries: int = Field(2, ge=0, description="further attempts after a timeout, refused connection or 5xx")
    backoff_s: float = Field(0.5, ge=0)
    max_concurrency: int = Field(64, ge=1, description="calls in flight per worker")


class RewardConfig(ConfigModel):
    function: str = Field("default", description="a built-in ('default' routes by data_source; 'exact_match', "
                          "'gsm8k', 'gsm8k_flexible', 'math') or 'package.module:function' (fleetrl's or verl's "
                          "compute_score signature; async def functions are awaited)")
    workers: int = Field(2, ge=1, description="reward worker pool size")
    timeout_s: float = Field(30.0, gt=0, description="per-call limit; a call past it is a RewardTimeout")
    mode: Literal["thread", "process"] = Field(
        "thread", description="thread for cheap rewards; process for CPU-heavy ones (math) or ones that may hang"
    )
    batched: bool = Field(False, description="call the function once per group with lists (verl's batch signature "
                          "fn(data_sources, solution_strs, ground_truths, extra_infos) -> list of floats)")
    on_truncated: Literal["score", "penalize", "mask"] = Field(
        "score", description="responses cut at rollout.sampling.max_tokens (finish reason 'length'), always counted: "
        "'score' them like finished ones, 'penalize' (reward = truncated_reward), or 'mask' them out of the loss")
    truncated_reward: float = Field(0.0, description="the reward of a truncated response with on_truncated=penalize")
    model: RewardModelConfig | None = Field(None, description="score with a reward model or judge server instead")

    @field_validator("function")
    @classmethod
    def _function_form(cls, v: str) -> str:
        # Only the form here: importing a user's module belongs to the process that scores
        # (rollout_fleet.rewards.resolve, called when its RewardPool is built).
        if v in BUILTIN_REWARDS or re.fullmatch(r"([A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_][\w.]*", v):
            return v
        raise ValueError(f"reward function {v!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
                         "nor 'package.module:function' nor 'path/to/file.py:function'")


class SamplingConfig(ConfigModel):
    n: int = Field(8, ge=1, description="samples per prompt: the GRPO group")
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)


class SimulatedEngineConfig(ConfigModel):
    """The simulated engine (no model): token rate and response-length distribution.

    Only used with ``rollout.engine: simulated`` or ``launch/cluster.py --simulate``;
    everything it produces is labelled a simulation.
    """

    tokens_per_s: float = Field(2000.0, gt=0, description="decode rate of one sequence (tokens/s)")
    length_median: float = Field(48.0, gt=0, description="median response length (tokens) of the lognormal")
    length_sigma: float = Field(0.8, ge=0, description="lognormal sigma: larger means a longer tail")
    length_growth: float = Field(0.0, ge=0, description=(
        "the median grows by this fraction of itself per weight version the server holds: responses that "
        "lengthen as training goes on, as in reasoning RL (0: constant)"))
    vocab_size: int = Field(1024, ge=2)
    weight_bytes: float = Field(1.0e9, gt=0, description="simulated model size moved by one weight update")
    transfer_gb_per_s: float = Field(100.0, gt=0, description="simulated weight-transfer bandwidth")
    load_s: float = Field(0.005, ge=0, description="simulated time to load an export from disk (late joiner)")
    startup_s: float = Field(0.0, ge=0, description="simulated server start time")
    learner_step_s: float = Field(0.05, ge=0, description="simulated learner step time (--simulate)")


class AutoscaleConfig(ConfigModel):
    """The fleet's autoscaler (rollout_fleet/autoscale.py): off unless enabled; thresholds are fractions."""

    enabled: bool = False
    min: int = Field(1, ge=0, description="never fewer servers (below it, e.g. after a loss, add at once)")
    max: int = Field(8, ge=1, description="never more servers")
    step: int = Field(1, ge=1, description="servers added or drained per decision")
    window_s: float = Field(30.0, gt=0, description="signals are rates over this sliding window")
    sustain_s: float = Field(20.0, ge=0, description="a condition must hold this long before it acts (hysteresis)")
    cooldown_s: float = Field(60.0, ge=0, description="no decision this long after the last one")
    up_wait: float = Field(0.3, gt=0, le=1, description="add when the learner waits for data this fraction of the time")
    down_wait: float = Field(0.05, ge=0, le=1, description="drain only while the learner waits at most this fraction")
    down_fill: float = Field(0.9, gt=0, le=1, description="drain only while the broker queue is this full")
    down_idle: float = Field(0.3, gt=0, le=1, description="drain only while the fleet idles this fraction of the time")

    @model_validator(mode="after")
    def _bands(self) -> AutoscaleConfig:
        if self.min > self.max:
            raise ValueError(f"rollout.autoscale.min={self.min} > max={self.max}")
        if self.down_wait >= self.up_wait:
            raise ValueError(f"rollout.autoscale.down_wait={self.down_wait} must be below up_wait={self.up_wait}: "
                             "the gap between them is the hysteresis band that keeps the fleet from flapping")
        return self


ENGINES = ("vllm", "sglang", "simulated")  # the engines rollout.engine may name


class EnvConfig(ConfigModel):
    """Multi-turn episodes (rollout_fleet/envs): each sample of a group is an episode of this environment,
    its reward the environment's (``reward.function`` is then not called)."""

    name: Literal["chain_addition", "calculator"] = Field(
        description="chain_addition: the tiny CPU task (a+b= then S+c= ...); calculator: tool calls (ChatML models)")
    max_turns: int = Field(ge=1, description="model turns per episode at most (then finish reason 'length')")
    max_tokens: int = Field(ge=1, description="tokens after the prompt per episode, turns and observations together")
    turn_max_tokens: int = Field(ge=1, description="sampling limit of one turn")
    wall_time_s: float = Field(120.0, gt=0, description="one episode, end to end; past it the group fails ('wall_time')")
    env_timeout_s: float = Field(30.0, gt=0, description="one environment reset or step")


class RolloutConfig(ConfigModel):
    engine: Literal["vllm", "sglang", "simulated"] = "vllm"
    sampling: SamplingConfig = SamplingConfig()
    weight_update: Literal["pause", "inflight"] = "pause"
    servers: int = Field(1, ge=0, description="engine servers when no GPUs are given (CPU)")
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    max_num_seqs: int = Field(256, ge=1)
    urls: list[str] = Field(default_factory=list, description="attach to running servers instead of starting them")
    max_inflight_groups: int = Field(16, ge=1, description="groups a worker keeps in flight per server")
    request_timeout_s: float = Field(600.0, gt=0)
    health_interval_s: float = Field(5.0, gt=0)
    health_timeout_s: float = Field(10.0, gt=0, description="limit of one health probe (a loaded CPU server is slow)")
    health_failures: int = Field(3, ge=1, description="consecutive failed probes before a live process counts as dead")
    startup_timeout_s: float = Field(600.0, gt=0)
    max_model_len: int = Field(2048, ge=16, description="vLLM --max-model-len (prompt + response)")
    enforce_eager: bool = Field(False, description="vLLM --enforce-eager: no torch.compile (faster start on small CPUs)")
    restart_dead_servers: bool = Field(True, description="restart a server that died; False drops it")
    vllm_server_args: list[str] = Field(
        default_factory=list, description="extra command-line arguments for every vLLM server (rollout.engine=vllm)")
    sglang_server_args: list[str] = Field(
        default_factory=list, description="extra command-line arguments for every SGLang server (rollout.engine=sglang)")
    simulated: SimulatedEngineConfig = SimulatedEngineConfig()
    env: EnvConfig | None = Field(None, description="multi-turn episodes instead of single completions")
    autoscale: AutoscaleConfig = AutoscaleConfig()

    @field_validator("engine", mode="before")
    @classmethod
    def _known_engine(cls, v):
        if v not in ENGINES:
            raise ValueError(f"expected one of {', '.join(repr(e) for e in ENGINES[:-1])} or {ENGINES[-1]!r} "
                             "(the learner publishes to 'vllm' or 'sglang'; 'simulated' runs with --simulate)")
        return v
