"""The run config: every component's config composed, loaded from a recipe plus overrides.

A recipe is a YAML file in ``launch/recipes/`` (or any path); overrides are dotted
``key=value`` strings whose values are parsed as YAML (``learner.optim.lr=1e-6``,
``broker.max_staleness=2``, ``data.train_files=[a.parquet]``).

Example::

    cfg = load_run_config("tiny", ["broker.max_staleness=0", "learner.loss.correction=none"])
    cfg.broker.max_staleness  # 0

The launcher resolves the config once and writes each process's part to the run
directory (:func:`write_subconfigs`); each process reads only its own part.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from broker.config import BrokerConfig
from core.colocate_config import ColocateConfig
from core.configbase import ConfigError, ConfigModel, ModelConfig, RunKeys, build, suggest
from core.network import NetworkConfig
from launch.monitor import WandbConfig
from learner.config import LearnerConfig
from rollout_fleet.config import DataConfig, RewardConfig, RolloutConfig, SamplingConfig
from weight_sync.config import WeightSyncConfig

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
REPO_ROOT = Path(__file__).resolve().parent.parent


class RunSection(RunKeys):
    eval_every: int = Field(
        0,
        ge=0,
        description="steps between evaluations on data.test_files during the run (besides before and after); 0: none",
    )
    eval_samples: int = Field(
        256,
        ge=0,
        description="test prompts per evaluation (before and after training, "
        "and every eval_every steps); 0: no evaluation",
    )
    eval_before_train: bool = Field(
        True,
        description="evaluate the initial policy before training (verl's "
        "trainer.val_before_train); false skips that evaluation only",
    )
    tensorboard: bool = Field(True, description="write TensorBoard events under RUN_DIR/tensorboard")
    default_spool: bool = Field(
        True,
        description="with broker.spool_dir unset, spool in RUN_DIR/spool (what a "
        "re-run on the same run_dir continues from); false: no spool unless spool_dir is set",
    )
    prometheus: bool = Field(
        True,
        description="Prometheus endpoints of the driver, the broker and the learner "
        "(addresses in RUN_DIR/metrics.json, printed at start and shown by `status`)",
    )
    wandb: WandbConfig | None = Field(None, description="Weights & Biases logging from the driver; None: off")


class RunConfig(ConfigModel):
    model: ModelConfig
    data: DataConfig
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    broker: BrokerConfig = BrokerConfig()
    learner: LearnerConfig
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    colocate: ColocateConfig = ColocateConfig()
    network: NetworkConfig = NetworkConfig()
    run: RunSection = RunSection()

    @model_validator(mode="before")
    @classmethod
    def _derived(cls, data: Any) -> Any:
        """Values one component takes from another's: reward.on_truncated=mask is carried out by the learner (its
        loss leaves those samples out); the learner scores at the temperature the fleet samples at."""
        if (
            isinstance(data, dict)
            and isinstance(data.get("reward"), dict)
            and data["reward"].get("on_truncated") == "mask"
        ):
            learner = data.setdefault("learner", {})
            if isinstance(learner, dict) and isinstance(learner.setdefault("loss", {}), dict):
                learner["loss"].setdefault("mask_truncated", True)
        if isinstance(data, dict):
            sampling = (data.get("rollout") or {}).get("sampling") if isinstance(data.get("rollout"), dict) else None
            t = sampling.get("temperature") if isinstance(sampling, dict) else None
            if isinstance(t, (int, float)) and t > 0:  # T=0 (greedy) is refused below, with its reason
                learner = data.setdefault("learner", {})
                if isinstance(learner, dict):
                    learner.setdefault("temperature", t)
        _default_loss_scale_factor(data)
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        real = self.rollout.engine != "simulated"
        # GAE's baseline is the critic's value, not the group: one sample per prompt is fine there
        if self.rollout.sampling.n < 2 and real and self.learner.loss.advantage != "gae":
            raise ValueError(
                f"rollout.sampling.n={self.rollout.sampling.n}: GRPO scores each sample against the others of its "
                "group, so with one sample per prompt every group is uniform, every step is skipped and the run "
                "trains nothing (verl refuses it too); use n >= 2"
            )
        if real and self.run.eval_samples > 0 and not self.data.test_files:
            raise ValueError(
                f"data.test_files is empty but the run evaluates before and after training (run.eval_samples="
                f"{self.run.eval_samples}): give data.test_files (verl's data.val_files) or set run.eval_samples=0 "
                "to run without evaluation"
            )
        if self.reward.model is not None and real:
            scored_by = (
                "rollout.env"
                if self.rollout.env is not None
                else "rollout.proxy.agent"
                if self.rollout.proxy is not None and self.rollout.proxy.agent
                else None
            )
            if scored_by:
                raise ValueError(
                    f"reward.model ({self.reward.model.kind}) is set but {scored_by} scores every "
                    "episode itself: the reward model would never be called; remove one of them"
                )
        _check_dapo(self)
        _check_ignore_eos(self)
        if (self.reward.on_truncated == "mask") != self.learner.loss.mask_truncated:
            raise ValueError(
                f"learner.loss.mask_truncated={self.learner.loss.mask_truncated} disagrees with "
                f"reward.on_truncated={self.reward.on_truncated!r}: set reward.on_truncated alone"
            )
        if self.learner.loss.correction == "none" and self.broker.max_staleness != 0:
            raise ValueError(
                f"learner.loss.correction='none' is only legal with broker.max_staleness=0 "
                f"(got {self.broker.max_staleness}); choose 'tis' or 'decoupled' for asynchronous training"
            )
        ws, engine = self.weight_sync, self.rollout.engine
        impl = ws.resolved_nccl_impl(engine)
        fits = {"vllm": ("torch", "vllm"), "sglang": ("torch",) if ws.staging else ("sglang",)}.get(engine)
        if fits is not None and impl not in fits:
            raise ValueError(
                f"weight_sync.nccl_impl={ws.nccl_impl!r} does not fit rollout.engine={engine!r}"
                f"{' with weight_sync.staging' if ws.staging else ''}: it takes {' or '.join(fits)!r} "
                "(leave it at 'auto')"
            )
        if ws.staging and (engine not in ("vllm", "sglang") or impl != "torch"):
            raise ValueError(
                "weight_sync.staging needs rollout.engine 'vllm' or 'sglang' with fleetrl's receivers "
                f"(weight_sync.nccl_impl 'auto' or 'torch'); got rollout.engine={engine!r}, "
                f"nccl_impl={ws.nccl_impl!r}"
            )
        if self.colocate.shared_async:
            from launch.shared_gpu import check_shared_async

            check_shared_async(self)
        elif self.colocate.enabled:
            _check_colocated(self)
        t_fleet, t_learner = self.rollout.sampling.temperature, self.learner.temperature
        if t_fleet == 0:
            raise ValueError(
                "rollout.sampling.temperature=0 samples greedily: every sample of a group is the same, "
                "every group is uniform and nothing is learned; use a temperature > 0 for training"
            )
        if self.rollout.sampling.top_p < 1:
            # The learner scores log_softmax(logits / T) over the whole vocabulary; a nucleus-truncated sampler's
            # log-probs are renormalised over the nucleus, so the ratio would compare different distributions.
            raise ValueError(
                f"rollout.sampling.top_p={self.rollout.sampling.top_p} truncates the sampling "
                "distribution, which the learner does not reproduce; use top_p=1 for training"
            )
        if self.rollout.sampling.top_k > 0:
            raise ValueError(
                f"rollout.sampling.top_k={self.rollout.sampling.top_k} truncates the sampling "
                "distribution, which the learner does not reproduce (it scores log_softmax(z / T) over "
                "the whole vocabulary); use top_k=-1 for training (rollout.eval_sampling may truncate)"
            )
        if t_fleet != t_learner:
            # The learner's log-probs must be of the distribution the fleet sampled from.
            raise ValueError(
                f"learner.temperature={t_learner} differs from rollout.sampling.temperature={t_fleet}; "
                "set both to the same value"
            )
        return self


def _check_dapo(cfg: RunConfig) -> None:
    """DAPO's dynamic sampling and overlong shaping run in the single-turn rollout worker."""
    ob, fg = cfg.reward.overlong_buffer, cfg.rollout.filter_groups
    if ob.enable and ob.len > cfg.rollout.sampling.max_tokens:
        raise ValueError(
            f"reward.overlong_buffer.len={ob.len} exceeds rollout.sampling.max_tokens="
            f"{cfg.rollout.sampling.max_tokens}: the buffer is the tail of the generation limit"
        )
    multi = (
        "rollout.env"
        if cfg.rollout.env is not None
        else "rollout.proxy.agent"
        if cfg.rollout.proxy is not None and cfg.rollout.proxy.agent
        else None
    )
    if multi and (ob.enable or fg.enable):
        raise ValueError(
            f"rollout.filter_groups / reward.overlong_buffer run in the single-turn rollout worker; "
            f"{multi} episodes are not filtered or shaped: turn them off or drop {multi}"
        )


def _check_ignore_eos(cfg: RunConfig) -> None:
    """With ignore_eos every response ends at its limit (finish reason 'length'): masking or penalising
    truncated responses would leave nothing to learn from."""
    mode = cfg.reward.on_truncated
    if cfg.rollout.sampling.ignore_eos and mode != "score":
        effect = "mask every one out of the loss" if mode == "mask" else "give every one reward.truncated_reward"
        raise ValueError(
            f"rollout.sampling.ignore_eos=true cuts every response at its limit, and reward.on_truncated={mode} "
            f"would {effect}: set reward.on_truncated=score"
        )


def _default_loss_scale_factor(data: dict[str, Any]) -> None:
    """seq_mean_token_sum_norm divides by a constant length; verl's default is the padded response length, the
    generation limit: rollout.sampling.max_tokens."""
    if not isinstance(data, dict):
        return
    loss = (data.get("learner") or {}).get("loss") if isinstance(data.get("learner"), dict) else None
    if (
        not isinstance(loss, dict)
        or loss.get("aggregation") != "seq_mean_token_sum_norm"
        or loss.get("loss_scale_factor") is not None
    ):
        return
    sampling = (data.get("rollout") or {}).get("sampling") if isinstance(data.get("rollout"), dict) else None
    max_tokens = sampling.get("max_tokens") if isinstance(sampling, dict) else None
    loss["loss_scale_factor"] = (
        max_tokens if max_tokens is not None else SamplingConfig.model_fields["max_tokens"].default
    )


def _check_colocated(cfg: RunConfig) -> None:
    """Colocated mode is synchronous on-policy training on shared devices (core/colocate_config.py)."""
    bad = []
    if cfg.broker.max_staleness != 0:
        bad.append(f"broker.max_staleness={cfg.broker.max_staleness} (colocated mode is synchronous: 0)")
    if cfg.rollout.engine not in ("vllm", "sglang"):
        bad.append(f"rollout.engine={cfg.rollout.engine!r} (colocated mode sleeps and wakes vLLM or SGLang servers)")
    if cfg.rollout.engine == "sglang" and cfg.colocate.weight_transport == "ipc":
        bad.append(
            "colocate.weight_transport='ipc' with rollout.engine='sglang' (SGLang takes the colocated "
            "publish over gloo; its CUDA IPC path, update_weights_from_tensor, is not wired: 'auto' or 'gloo')"
        )
    if cfg.weight_sync.staging:
        bad.append(
            "weight_sync.staging=true (a staged update overlaps generation with the publish; "
            "colocated mode has nothing to overlap)"
        )
    if cfg.weight_sync.backend == "nccl":
        bad.append(
            "weight_sync.backend='nccl' (NCCL between two processes on one GPU fails; colocated mode "
            "loads weights by CUDA IPC or gloo: colocate.weight_transport)"
        )
    if cfg.rollout.weight_update != "pause":
        bad.append(
            f"rollout.weight_update={cfg.rollout.weight_update!r} (nothing is in flight at a colocated "
            "publish: 'pause')"
        )
    if bad:
        raise ValueError("colocate.enabled=true does not fit " + "; ".join(bad))


def recipe_path(recipe: str) -> Path:
    """A recipe by name (``tiny``) from ``launch/recipes/``, or a path to a YAML file."""
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    named = RECIPES_DIR / f"{recipe}.yaml"
    if named.exists():
        return named
    known = sorted(q.stem for q in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(f"unknown recipe '{recipe}'.{suggest(recipe, known)} Known recipes: {', '.join(known)}")


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set one dotted ``key=value`` in nested plain data (the value is parsed as YAML)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"bad override {override!r}: expected dotted.key=value, e.g. broker.max_staleness=2")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"bad value in override {override!r}: {exc}") from None
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"bad override {override!r}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Relative model and data paths in a recipe are relative to the repository root."""

    def fix(p: str) -> str:
        q = Path(p)
        return str(q if q.is_absolute() or not (base / q).exists() else base / q)

    if isinstance(data.get("model"), dict) and isinstance(data["model"].get("path"), str):
        data["model"]["path"] = fix(data["model"]["path"])
    server = data.get("reward")
    for key in ("model", "server"):  # reward.model.server: a judge or reward model of the repo
        server = server.get(key) if isinstance(server, dict) else None
    for key in ("model_path", "tokenizer_path"):
        if isinstance(server, dict) and isinstance(server.get(key), str):
            server[key] = fix(server[key])
    d = data.get("data")
    if isinstance(d, dict):
        for k in ("train_files", "test_files"):
            if isinstance(d.get(k), str):  # verl's data.train_files/val_files may be one path
                d[k] = [d[k]]
            if isinstance(d.get(k), list):
                d[k] = [fix(x) if isinstance(x, str) else x for x in d[k]]


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(path: str) -> str:
    """A local model folder as it is; a Hugging Face hub id (``org/name``) from the local HF cache,
    or a :class:`ConfigError` that says what to do (nothing here downloads)."""
    if Path(path).exists():
        if not (Path(path) / "config.json").exists():
            raise ConfigError(f"model.path {path!r} has no config.json: it must be a Hugging Face model folder")
        return path
    if _HUB_ID.fullmatch(path):
        try:
            from huggingface_hub import snapshot_download

            # the cache the environment names now (huggingface_hub reads it once, at its import)
            local = snapshot_download(path, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE"))
            if (Path(local) / "config.json").exists():
                return local
        except Exception:  # not in the cache (or no huggingface_hub): say what to do below
            pass
        raise ConfigError(
            f"model.path {path!r} is not a local folder; as a Hugging Face hub id it is not in the local HF cache "
            f"either. Download it first (`hf download {path}`, then pass the folder or keep the id), or for a "
            "model that installs offline run `python -m tools.smollm2` and use the smollm2 recipe"
        )
    raise ConfigError(f"model.path {path!r} does not exist")


def load_run_config(recipe: str, overrides: list[str] = ()) -> RunConfig:
    path = recipe_path(recipe)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    for o in overrides:
        apply_override(data, o)
    _resolve_paths(data, REPO_ROOT)
    return build(RunConfig, data)


def write_subconfigs(cfg: RunConfig, run_dir: Path) -> dict[str, Path]:
    """Write the resolved config and each component's part into ``run_dir/config``."""
    out = run_dir / "config"
    out.mkdir(parents=True, exist_ok=True)
    paths = {"run": out / "run.yaml"}
    paths["run"].write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    for name in RunConfig.model_fields:
        part = getattr(cfg, name)
        paths[name] = out / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(part.model_dump(mode="json"), sort_keys=False))
    return paths
