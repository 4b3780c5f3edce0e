"""Rollout config: the dataset, rewards, engines and how they take new weights."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from core.configbase import ConfigModel
from engines.config import SimulatedEngineConfig

CPU_INFLIGHT_GROUPS = 16  # rollout.max_inflight_groups=auto on CPU servers


class DataConfig(ConfigModel):
    train_files: list[str] = Field(min_length=1, description="Parquet files in verl's column layout")
    test_files: list[str] = Field(
        default_factory=list, description="Parquet files evaluated before, during (run.eval_every) and after training"
    )
    shuffle: bool = Field(True, description="shuffle the training rows (seeded by run.seed) each epoch")
    max_prompt_tokens: int = Field(1024, ge=1, description="longest prompt (chat template applied) a row may have")
    filter_overlong_prompts: bool = Field(
        False,
        description="skip (and count) prompts over the limit (max_prompt_tokens, and rollout.max_model_len "
        "minus rollout.sampling.max_tokens) instead of refusing the run before it starts (verl's key)",
    )
    on_bad_row: Literal["raise", "skip"] = Field(
        "raise", description="a malformed row: stop at load naming file/row/column, or skip it and count it"
    )
    truncation: Literal["error", "left", "right", "middle"] = Field(
        "error",
        description="a prompt over the limit that filter_overlong_prompts does not skip: 'error' refuses the "
        "run before it starts; 'left' keeps its last tokens, 'right' its first, 'middle' its first and last halves "
        "(verl's data.truncation)",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra arguments of the tokenizer's chat template, e.g. {enable_thinking: "
        "false} (verl's data.apply_chat_template_kwargs)",
    )


BUILTIN_REWARDS = ("default", "exact_match", "gsm8k", "gsm8k_flexible", "math")


class RewardServerConfig(ConfigModel):
    """The reward servers the launcher starts with ``--reward-gpus N`` (launch/reward_servers.py): each on
    its own GPUs (its own placement-group bundle), like the rollout servers; on CPU (``--rollout-gpus 0
    --learner-gpus 0``) N counts vLLM CPU servers. They serve ``reward.model.model`` as their model name
    and never take weight updates."""

    engine: Literal["vllm", "sglang"] = Field("vllm", description="sglang needs GPUs (no CPU build)")
    model_path: str | None = Field(None, description="the judge or reward model's folder; None: model.path")
    tokenizer_path: str | None = Field(
        None,
        description="a tokenizer folder other than the model's (vLLM "
        "--tokenizer, SGLang --tokenizer-path); None: the model's own",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per reward server (--reward-gpus is a multiple)")
    max_model_len: int = Field(2048, ge=16, description="the reward server's --max-model-len (prompt + verdict)")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="the reward server's share of its GPUs' memory")
    max_num_seqs: int = Field(256, ge=1, description="requests the reward server batches at once")
    enforce_eager: bool = Field(False, description="vLLM --enforce-eager (a faster start on small CPUs)")
    dtype: str = Field("auto", description="the reward server's weights dtype")
    extra_args: list[str] = Field(
        default_factory=list,
        description="extra server arguments, e.g. ['--runner', 'pooling'] for a classifier reward model on vLLM",
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="a reward server not healthy after this counts as failed")
    colocated: bool = Field(
        False,
        description="colocated mode (--gpus N / --colocate): one reward server on each "
        "shared GPU, beside learner rank i and rollout server i, within its own "
        "gpu_memory_utilization (it never sleeps; leave room for the others); started and healthy "
        "before the rollout servers start. On CPU (--colocate): one vLLM CPU server",
    )


class RewardModelConfig(ConfigModel):
    """A reward server the workers call instead of ``reward.function`` (rollout_fleet/reward_models.py):
    a generative judge (chat completions, a verdict parsed from its answer) or a sequence-classifier
    reward model (vLLM ``/pooling`` or ``/classify``). Either give ``url`` (a server you started) or
    let the launcher start them (``--reward-gpus N``, ``reward.model.server``)."""

    kind: Literal["judge", "classifier"] = Field(
        description="judge: a generative model whose answer holds a "
        "verdict; classifier: a sequence classifier or reward model"
    )
    url: str | None = Field(
        None,
        description="http://host:port of a running reward server (vLLM or SGLang); "
        "None: the launcher's servers (--reward-gpus)",
    )
    urls: list[str] = Field(
        default_factory=list,
        description="several running servers, called in turn (the launcher fills it from --reward-gpus)",
    )
    model: str = Field(description="the served model name")
    template: str | None = Field(
        None, description="judge prompt with {question}, {response}, {reference}; None: reward_models.JUDGE_TEMPLATE"
    )
    verdict: str | None = Field(
        None,
        description="judge: a regex whose group 1 is a key of 'scores'; "
        "None: reward_models.VERDICT (VERDICT: CORRECT|INCORRECT)",
    )
    scores: dict[str, float] | None = Field(None, description="judge: verdict -> reward; None: CORRECT 1, INCORRECT 0")
    max_tokens: int = Field(64, ge=1, description="judge: the longest answer it may give")
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="judge: further fields of each chat request, "
        "e.g. {structured_outputs: {choice: [YES, NO]}} (vLLM) so that a small judge "
        "always answers a verdict",
    )
    verdict_from: Literal["text", "logprobs"] = Field(
        "text",
        description="judge: 'text' parses the answer with 'verdict'; 'logprobs' scores the probability-"
        "weighted mean of 'scores' over the judge's first-token distribution (its top_logprobs): a graded reward "
        "from a judge too weak to answer right, whose template must make the verdict its first word",
    )
    top_logprobs: int = Field(
        20,
        ge=1,
        le=20,
        description="judge, verdict_from=logprobs: first tokens read "
        "(vLLM serves at most --max-logprobs, 20 by default)",
    )
    endpoint: Literal["pooling", "classify"] = Field(
        "pooling",
        description="classifier: vLLM's /pooling (a reward model's one score per input) or /classify "
        "(a sequence classifier's class probabilities)",
    )
    label: int = Field(0, ge=0, description="classifier, endpoint classify: the class whose probability is the reward")
    timeout_s: float = Field(30.0, gt=0, description="one call; past it the attempt counts as 'timeout'")
    retries: int = Field(2, ge=0, description="further attempts after a timeout, refused connection or 5xx")
    backoff_s: float = Field(0.5, ge=0, description="pause before a retry, doubled each time")
    max_concurrency: int = Field(64, ge=1, description="calls in flight per worker")
    server: RewardServerConfig = RewardServerConfig()

    @model_validator(mode="after")
    def _one_source(self) -> RewardModelConfig:
        if self.kind == "classifier" and self.verdict_from != "text":
            raise ValueError("reward.model.verdict_from=logprobs is a judge's setting; a classifier gives its score")
        if self.url is not None and self.urls:
            raise ValueError(f"reward.model.url={self.url!r} and reward.model.urls={self.urls}: give one of them")
        if self.template is not None:
            import string

            keys = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
            if "response" not in keys or keys - {"question", "response", "reference"}:
                raise ValueError(
                    f"reward.model.template {self.template[:80]!r} must contain {{response}} and may "
                    f"contain {{question}} and {{reference}}; it has {sorted(keys) or 'no fields'}"
                )
        if self.verdict is not None:
            try:
                if re.compile(self.verdict).groups < 1:
                    raise ValueError(f"reward.model.verdict {self.verdict!r} has no group: group 1 is the verdict")
            except re.error as e:
                raise ValueError(f"reward.model.verdict {self.verdict!r} is not a regex: {e}") from None
        return self

    def all_urls(self) -> list[str]:
        """The servers to call: ``url``, or ``urls`` (empty until the launcher's servers are up)."""
        return [self.url] if self.url is not None else list(self.urls)


class OverlongBufferConfig(ConfigModel):
    """DAPO's soft overlong punishment (verl reward_model.overlong_buffer.*): a response longer than
    ``max_tokens - len`` loses ``penalty_factor`` times the share of the buffer it ran into. ``max_tokens`` is
    rollout.sampling.max_tokens even for a dataset row with its own smaller budget (verl measures it from
    max_response_length too)."""

    enable: bool = Field(False, description="add the linear length penalty to every scored reward")
    len: int = Field(
        0,
        ge=0,
        description="the buffer: the last this-many tokens before rollout.sampling.max_tokens, "
        "over which the penalty grows from 0 to penalty_factor",
    )
    penalty_factor: float = Field(1.0, ge=0, description="the penalty at rollout.sampling.max_tokens")
    log: bool = Field(False, description="verl's flag to log the penalty; fleetrl always counts penalised samples")

    @model_validator(mode="after")
    def _positive_len(self) -> OverlongBufferConfig:
        if self.enable and self.len < 1:
            raise ValueError(
                f"reward.overlong_buffer.len must be >= 1 when enabled, got {self.len} (to turn the "
                "penalty off set reward.overlong_buffer.enable=false)"
            )
        return self


class RewardConfig(ConfigModel):
    function: str = Field(
        "default",
        description="a built-in ('default' routes by data_source; 'exact_match', "
        "'gsm8k', 'gsm8k_flexible', 'math') or 'package.module:function' (fleetrl's or verl's "
        "compute_score signature; async def functions are awaited)",
    )
    workers: int = Field(2, ge=1, description="reward worker pool size")
    timeout_s: float = Field(30.0, gt=0, description="per-call limit; a call past it is a RewardTimeout")
    mode: Literal["thread", "process"] = Field(
        "thread", description="thread for cheap rewards; process for CPU-heavy ones (math) or ones that may hang"
    )
    batched: bool = Field(
        False,
        description="call the function once per group with lists (verl's batch signature "
        "fn(data_sources, solution_strs, ground_truths, extra_infos) -> list of floats)",
    )
    on_truncated: Literal["score", "penalize", "mask"] = Field(
        "score",
        description="responses cut at their limit (rollout.sampling.max_tokens, or a dataset row's smaller "
        "max_tokens; finish reason 'length'), always counted: "
        "'score' them like finished ones, 'penalize' (reward = truncated_reward), or 'mask' them out of the loss",
    )
    truncated_reward: float = Field(0.0, description="the reward of a truncated response with on_truncated=penalize")
    model: RewardModelConfig | None = Field(None, description="score with a reward model or judge server instead")
    overlong_buffer: OverlongBufferConfig = Field(
        OverlongBufferConfig(), description="DAPO's soft overlong penalty (rollout_fleet/shaping.py)"
    )

    @field_validator("function")
    @classmethod
    def _function_form(cls, v: str) -> str:
        # Only the form here: importing a user's module belongs to the process that scores
        # (rollout_fleet.rewards.resolve, called when its RewardPool is built).
        if v in BUILTIN_REWARDS or re.fullmatch(r"([A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_][\w.]*", v):
            return v
        raise ValueError(
            f"reward function {v!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "nor 'package.module:function' nor 'path/to/file.py:function'"
        )


class SamplingConfig(ConfigModel):
    n: int = Field(8, ge=1, description="samples per prompt: the GRPO group")
    max_tokens: int = Field(256, ge=1, description="longest response; a longer one is cut (finish reason 'length')")
    temperature: float = Field(
        1.0,
        ge=0,
        description="sampling temperature; the learner scores log_softmax(z / T) at the same T (learner.temperature)",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="training must keep 1: the learner scores the whole "
        "distribution log_softmax(z / T), and no importance weight repairs a truncated support",
    )
    top_k: int = Field(-1, ge=-1, description="-1 or 0: off; training must keep it off (see top_p)")
    ignore_eos: bool = Field(
        False,
        description="decode past the end-of-sequence token, so every training response is exactly its "
        "limit long (rollout.sampling.max_tokens, or a dataset row's smaller max_tokens column), finish reason "
        "'length' (vLLM's and SGLang's ignore_eos, verl's rollout.ignore_eos). A benchmark setting for "
        "controlled response lengths (random weights, throughput runs): with a real reward the responses "
        "are never allowed to end, so do not train a model with it. Single-turn rollout only (multi-turn "
        "episodes and evaluation stop at EOS)",
    )


class EvalSamplingConfig(ConfigModel):
    """How evaluation samples (verl's ``val_kwargs``): apart from training, so it may truncate or sample."""

    temperature: float = Field(0.0, ge=0, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus of evaluation sampling (1: off)")
    top_k: int = Field(-1, ge=-1, description="-1 or 0: off")
    n: int = Field(1, ge=1, description="samples per test prompt; the accuracy is their mean")
    do_sample: bool = Field(False, description="False: greedy whatever temperature says (verl's val_kwargs.do_sample)")

    @property
    def effective_temperature(self) -> float:
        return self.temperature if self.do_sample else 0.0


class AutoscaleConfig(ConfigModel):
    """The fleet's autoscaler (rollout_fleet/autoscaler.py): off unless enabled; thresholds are fractions."""

    enabled: bool = Field(False, description="add and drain servers while the job runs, by the rules below")
    min: int = Field(1, ge=0, description="never fewer servers (below it, e.g. after a loss, add at once)")
    max: int = Field(8, ge=1, description="never more servers")
    step: int = Field(1, ge=1, description="servers added or drained per decision")
    window_s: float = Field(30.0, gt=0, description="signals are rates over this sliding window")
    sustain_s: float = Field(20.0, ge=0, description="a condition must hold this long before it acts (hysteresis)")
    cooldown_s: float = Field(60.0, ge=0, description="no decision this long after the last one")
    up_wait: float = Field(0.3, gt=0, le=1, description="add when the learner waits for data this fraction of the time")
    down_wait: float = Field(0.05, ge=0, le=1, description="drain only while the learner waits at most this fraction")
    down_fill: float = Field(
        0.5,
        gt=0,
        le=1,
        description=(
            "drain only while the broker queue is this full on average (of what the staleness bound lets it hold "
            "besides the step in training: 0.5 at max_staleness 2 is a step's groups ready ahead)"
        ),
    )
    down_idle: float = Field(0.3, gt=0, le=1, description="drain only while the fleet's slots idle this fraction")
    min_gain: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "an add must raise the fleet's groups/s by this fraction of the proportional gain (step / servers) while "
            "the learner still waits, else it is drained again and the fleet is not grown past that size (0: only an add "
            "that lowered the rate)"
        ),
    )

    @model_validator(mode="after")
    def _bands(self) -> AutoscaleConfig:
        if self.min > self.max:
            raise ValueError(f"rollout.autoscale.min={self.min} > max={self.max}")
        if self.down_wait >= self.up_wait:
            raise ValueError(
                f"rollout.autoscale.down_wait={self.down_wait} must be below up_wait={self.up_wait}: "
                "the gap between them is the hysteresis band that keeps the fleet from flapping"
            )
        return self


ENGINES = ("vllm", "sglang", "simulated")  # the engines rollout.engine may name


class EnvConfig(ConfigModel):
    """Multi-turn episodes (rollout_fleet/envs): each sample of a group is an episode of this environment,
    its reward the environment's (``reward.function`` is then not called)."""

    name: Literal["chain_addition", "calculator"] = Field(
        description="chain_addition: the tiny CPU task (a+b= then S+c= ...); calculator: tool calls (ChatML models)"
    )
    max_turns: int = Field(ge=1, description="model turns per episode at most (then finish reason 'length')")
    max_tokens: int = Field(ge=1, description="tokens after the prompt per episode, turns and observations together")
    turn_max_tokens: int = Field(ge=1, description="sampling limit of one turn")
    wall_time_s: float = Field(
        120.0, gt=0, description="one episode, end to end; past it the group fails ('wall_time')"
    )
    env_timeout_s: float = Field(30.0, gt=0, description="one environment reset or step")


class ProxyConfig(ConfigModel):
    """The OpenAI-compatible proxy in front of the fleet (rollout_fleet/proxy.py), started by the fleet on
    its node's address. Requests to ``<url>/s/<episode>/v1`` are recorded token-in-token-out; with
    ``agent`` set the fleet runs that agent once per sample against it (rollout_fleet/envs/agent_worker.py)
    and trains on the records; without, it serves outside clients (plain ``<url>/v1`` requests are not
    recorded)."""

    agent: str | None = Field(
        None,
        description="'package.module:function': async (base_url, prompt) -> reward, "
        "run once per sample of a group; None: no agent, the proxy serves outside clients",
    )
    port: int = Field(0, ge=0, le=65535, description="0: a free port")
    max_sessions: int = Field(10_000, ge=1, description="episodes recorded at once (unfinished ones refuse more)")
    max_tokens: int = Field(256, ge=1, description="a request's max_tokens when it gives none")

    @field_validator("agent")
    @classmethod
    def _agent_form(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", v):
            raise ValueError(f"rollout.proxy.agent {v!r} is not 'package.module:function'")
        return v


class FilterGroupsConfig(ConfigModel):
    """DAPO's dynamic sampling (verl algorithm.filter_groups.*): a group whose metric is the same for all of its
    samples never reaches a step; the worker samples a new prompt on the same ticket instead."""

    enable: bool = Field(
        False,
        description="DAPO dynamic sampling: a group whose metric is uniform never counts "
        "toward a step; the worker samples another prompt on the same ticket",
    )
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = Field(
        "acc",
        description="acc / score: the reward function's score; seq_reward / seq_final_reward: the reward "
        "after shaping (overlong penalty); the fleet has no KL-in-reward term, so the two are the same",
    )
    max_num_gen_batches: int = Field(
        0,
        ge=0,
        description="generations per ticket before a uniform group is pushed "
        "anyway (logged, counted; the learner's drop_uniform_groups leaves it out); "
        "0: no limit",
    )


class RolloutConfig(ConfigModel):
    engine: Literal["vllm", "sglang", "simulated"] = Field(
        "vllm", description="the rollout engine; simulated: no model, for control-plane runs at scale (--simulate)"
    )
    filter_groups: FilterGroupsConfig = Field(FilterGroupsConfig(), description="DAPO dynamic sampling")
    sampling: SamplingConfig = SamplingConfig()
    eval_sampling: EvalSamplingConfig = Field(
        EvalSamplingConfig(), description="sampling of evaluations (default greedy, one sample per prompt)"
    )
    weight_update: Literal["pause", "inflight"] = Field(
        "pause",
        description="pause: a publish waits for running requests to pause; inflight: requests keep running "
        "and finish under the new weights (their tokens carry both versions)",
    )
    servers: int = Field(1, ge=0, description="engine servers when no GPUs are given (CPU)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine server (--rollout-gpus is a multiple)")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="an engine's share of its GPUs' memory")
    max_num_seqs: int = Field(256, ge=1, description="sequences an engine batches at once")
    urls: list[str] = Field(default_factory=list, description="attach to running servers instead of starting them")
    max_inflight_groups: int | Literal["auto"] = Field(
        "auto",
        description="groups a worker keeps in flight per server. auto: on GPU servers enough to fill the "
        "engine's batch, ceil(max_num_seqs / sampling.n); on CPU servers 16",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="limit of one generation request")
    health_interval_s: float = Field(5.0, gt=0, description="seconds between health probes of each server")
    health_timeout_s: float = Field(10.0, gt=0, description="limit of one health probe (a loaded CPU server is slow)")
    health_failures: int = Field(3, ge=1, description="consecutive failed probes before a live process counts as dead")
    stall_timeout_s: float | None = Field(
        120.0,
        ge=0,
        description="a server that answers its health probe but has held requests this long without "
        "answering any is stalled (a hung scheduler, a server left paused): its requests are cancelled and their "
        "groups re-run elsewhere, and it is restarted as a dead one is (counted in server_stalls). The clock runs "
        "only while requests are in flight and starts again at every answer, so a slow server that finishes some "
        "is not stalled; with continuous batching give it more than a full batch takes to generate max_tokens. A "
        "timeout is no answer: a value above request_timeout_s catches a server whose every request times out. "
        "The fleet's own weight updates and colocated sleep stop the clock; a server that says it is paused (a "
        "weight update loading) gets this long again. Tokens are progress too: a silent server whose generated-"
        "token count (vLLM's /metrics vllm:generation_tokens_total) rose in the silence is decoding long responses, "
        "not hung; its clock starts again (counted in servers_kept_generating; SGLang cannot say, so it is judged by "
        "answers alone). 0 or None: off",
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="a server not healthy after this counts as failed")
    max_model_len: int = Field(2048, ge=16, description="vLLM --max-model-len (prompt + response)")
    enforce_eager: bool = Field(
        False, description="vLLM --enforce-eager: no torch.compile (faster start on small CPUs)"
    )
    restart_dead_servers: bool = Field(True, description="restart a server that died; False drops it")
    vllm_server_args: list[str] = Field(
        default_factory=list, description="extra command-line arguments for every vLLM server (rollout.engine=vllm)"
    )
    sglang_server_args: list[str] = Field(
        default_factory=list, description="extra command-line arguments for every SGLang server (rollout.engine=sglang)"
    )
    simulated: SimulatedEngineConfig = SimulatedEngineConfig()
    env: EnvConfig | None = Field(None, description="multi-turn episodes instead of single completions")
    proxy: ProxyConfig | None = Field(None, description="start the OpenAI-compatible proxy in front of the fleet")
    autoscale: AutoscaleConfig = AutoscaleConfig()

    def inflight_groups(self, *, gpu: bool = False) -> int:
        """``max_inflight_groups`` as a number. The launcher resolves ``auto`` once it knows the servers' kind
        (launch/cluster.py). On a GPU, fewer groups in flight than fill ``max_num_seqs`` leave the engine's batch
        part empty, and a synchronous step then generates in waves, each ending on its longest response
        (docs/fast_default.md). An ``auto`` that reaches a fleet unresolved counts as CPU."""
        if self.max_inflight_groups != "auto":
            return self.max_inflight_groups
        return max(1, -(-self.max_num_seqs // self.sampling.n)) if gpu else CPU_INFLIGHT_GROUPS

    @model_validator(mode="after")
    def _one_episode_kind(self) -> RolloutConfig:
        if self.env is not None and self.proxy is not None and self.proxy.agent is not None:
            raise ValueError(
                f"rollout.env ({self.env.name}) and rollout.proxy.agent ({self.proxy.agent}) both make "
                "the episodes of a group: give one of them"
            )
        if self.sampling.ignore_eos and (self.env is not None or (self.proxy is not None and self.proxy.agent)):
            kind = (
                f"rollout.env ({self.env.name})"
                if self.env is not None
                else f"rollout.proxy.agent ({self.proxy.agent})"
            )
            raise ValueError(
                f"rollout.sampling.ignore_eos=true applies to single-turn rollout only; {kind} makes multi-turn "
                "episodes, whose turns end at their stop tokens: drop one of them"
            )
        return self

    @field_validator("max_inflight_groups")
    @classmethod
    def _at_least_one_group(cls, v: int | str) -> int | str:
        if v != "auto" and v < 1:
            raise ValueError(f"expected 'auto' or at least 1 group in flight per server, got {v}")
        return v

    @field_validator("stall_timeout_s")
    @classmethod
    def _zero_is_off(cls, v: float | None) -> float | None:
        return v or None

    @field_validator("engine", mode="before")
    @classmethod
    def _known_engine(cls, v):
        if v not in ENGINES:
            raise ValueError(
                f"expected one of {', '.join(repr(e) for e in ENGINES[:-1])} or {ENGINES[-1]!r} "
                "(the learner publishes to 'vllm' or 'sglang'; 'simulated' runs with --simulate)"
            )
        return v
