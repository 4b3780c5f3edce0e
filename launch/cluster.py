"""fleetrl's one entry point: place the learner and the rollout fleet on a Ray cluster and run.

Examples::

    python launch/cluster.py --rollout-gpus 0 --learner-gpus 0 --recipe tiny          # CPU demo
    python launch/cluster.py --rollout-gpus 32 --learner-gpus 32 --simulate \\
        --max-steps 200 --summary out.json                                            # SIMULATED scale
    python launch/cluster.py --recipe tiny broker.max_staleness=0 learner.loss.correction=none
    python launch/cluster.py scale --rollout-gpus 8 --run-dir runs/tiny                # running job
    python launch/cluster.py status --run-dir runs/tiny
    python launch/cluster.py stop --run-dir runs/tiny     # end now: final eval and summary, exit 0
    python launch/cluster.py report --run-dir runs/tiny       # PNG plots + report.md in runs/tiny/report
    python launch/cluster.py --rollout-gpus 0 --learner-gpus 0 --recipe smollm2                 # a real model
    python launch/cluster.py --colocate --recipe tiny                                 # colocated, synchronous (CPU)
    python launch/cluster.py --gpus 1 --recipe smollm2-gpu                            # colocated on one GPU
    python launch/cluster.py --gpus 1 --async --recipe smollm2-gpu broker.max_staleness=2   # shared GPU, async
    python launch/cluster.py --rollout-gpus 4 --learner-gpus 2 --reward-gpus 2 --recipe R \
        'reward.model={kind: judge, model: judge, server: {model_path: models/judge}}'    # judge servers
    python launch/cluster.py verl 'algorithm.adv_estimator=grpo data.train_batch_size=1024 ...'  # verl's keys

This module imports only the standard library at the top, so ``--help`` and config
errors answer in well under a second; Ray, torch and vLLM load in :mod:`launch.driver`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python launch/cluster.py` (not -m): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SUBCOMMANDS = ("scale", "status", "stop")
VERL_RECIPE = "verl"  # the base under a verl command line when --recipe is not given


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch/cluster.py",
        description="Run asynchronous RL: a learner pool and a rollout fleet on disjoint GPUs of a Ray cluster. "
        "Subcommands for a running job: 'scale --rollout-gpus N', 'status', 'stop' (see '<subcommand> --help'); "
        "'report --run-dir D' plots a run; "
        "'verl KEY=VALUE ...' prints what a verl command line maps to.",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted config overrides, e.g. broker.max_staleness=0 learner.optim.lr=1e-5",
    )
    p.add_argument(
        "--recipe",
        default=None,
        help=f"a recipe name in launch/recipes/ or a YAML path (default: tiny; with --verl: {VERL_RECIPE})",
    )
    p.add_argument(
        "--verl",
        default=None,
        metavar="'KEY=VALUE ...'",
        help="a verl command line's dotted keys (e.g. 'algorithm.adv_estimator=grpo "
        "data.train_batch_size=1024 ...'), mapped onto fleetrl keys; each key that has no fleetrl "
        "equivalent is refused by name with the reason ('launch/cluster.py verl ...' prints the mapping)",
    )
    p.add_argument("--rollout-gpus", type=int, default=0, help="GPUs for the rollout fleet (0: CPU servers)")
    p.add_argument("--learner-gpus", type=int, default=0, help="GPUs for the learner (0: CPU)")
    p.add_argument(
        "--reward-gpus",
        type=int,
        default=0,
        help="GPUs for reward servers (reward.model: a judge or reward model, reward.model.server says "
        "which; each server on its own GPUs); with --rollout-gpus 0 --learner-gpus 0: CPU servers",
    )
    p.add_argument(
        "--colocate",
        action="store_true",
        help="colocated synchronous mode: learner and fleet on the same devices, on-policy "
        "(broker.max_staleness=0); the engines sleep while the learner trains (vLLM sleep mode on GPU)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="colocated mode on N GPUs shared by the learner (one rank each) and the fleet (one server "
        "each); implies --colocate, excludes --rollout-gpus/--learner-gpus",
    )
    p.add_argument(
        "--async",
        dest="shared_async",
        action="store_true",
        help="with --gpus N (or --colocate on CPU): shared asynchronous mode (colocate.mode=async): engines "
        "and learner resident on the same devices at once, the fleet generating up to "
        "broker.max_staleness (>= 1) steps ahead while the learner trains; memory split checked at start",
    )
    p.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument(
        "--ray-auth",
        choices=("token", "disabled"),
        default=None,
        help="Ray token auth (default 'token': a fresh per-job token for a local cluster, "
        "the cluster's token when joining with --address)",
    )
    p.add_argument("--run-dir", default=None, help="run directory (default: run.run_dir of the recipe)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: run.max_steps)")
    p.add_argument("--summary", default=None, metavar="PATH", help="write a JSON summary here at the end")
    p.add_argument(
        "--simulate",
        action="store_true",
        help="SIMULATED engines and learner (no model): exercise placement, broker, admission, "
        "scaling and lag monitoring at full size with fake GPUs",
    )
    p.add_argument("--no-live", action="store_true", help="no live terminal view (log lines instead)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the placement and listeners for the cluster at --address (or the one --nodes describes) and exit",
    )
    p.add_argument(
        "--nodes",
        default=None,
        metavar="G,G,...",
        help="with --dry-run: describe a cluster by GPUs per node instead of reading one",
    )
    p.add_argument("--json-plan", action="store_true", help="with --dry-run: print the plan as JSON")
    return p


def control_parser(cmd: str) -> argparse.ArgumentParser:
    what = {
        "status": "print a running job's status",
        "scale": "grow or drain a running job's fleet; a grow answers at once and the new servers show as "
        "'starting' in status until they join",
        "stop": "end a running job now as if its last step were done: the learner stops after its current "
        "step, then the final evaluation and the summary (exit status 0)",
    }[cmd]
    p = argparse.ArgumentParser(prog=f"launch/cluster.py {cmd}", description=f"{what} (through its control endpoint)")
    p.add_argument("--run-dir", required=True, help="the run directory of the running job")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the job's answer")
    if cmd == "scale":
        p.add_argument("--rollout-gpus", type=int, required=True, help="the fleet's new GPU count (or servers on CPU)")
    p.add_argument("--json", action="store_true", help="print the raw JSON answer")
    return p


def _control(argv: list[str]) -> int:
    cmd, rest = argv[0], argv[1:]
    args = control_parser(cmd).parse_args(rest)
    from launch.control import ControlError, request

    body = {"op": cmd}
    if cmd == "scale":
        if args.rollout_gpus < 0:
            print(f"error: --rollout-gpus must be >= 0, got {args.rollout_gpus}", file=sys.stderr)
            return 2
        body["rollout_gpus"] = args.rollout_gpus
    try:
        answer = request(Path(args.run_dir), body, timeout_s=args.timeout)
    except ControlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json or cmd in ("scale", "stop"):
        print(json.dumps(answer, indent=2))
    else:
        from launch.monitor import format_status

        print(format_status(answer))
    return 0 if answer.get("ok", True) else 1


def _verl(rest: list[str]) -> int:
    """Print what a verl command line maps to, and the fleetrl config it gives."""
    p = argparse.ArgumentParser(
        prog="launch/cluster.py verl",
        description="Show the fleetrl keys a verl command line maps to, and the resolved config",
    )
    p.add_argument("keys", nargs="+", help="verl's key=value arguments (one quoted string or several words)")
    p.add_argument("--recipe", default=VERL_RECIPE, help=f"the fleetrl recipe underneath (default {VERL_RECIPE})")
    args = p.parse_args(rest)
    import yaml

    from core.configbase import ConfigError
    from launch.config import load_run_config, resolve_model_path
    from launch.verl import describe, translate

    try:
        m = translate(args.keys if len(args.keys) > 1 else args.keys[0])
        print(describe(m))
        cfg = load_run_config(args.recipe, m.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n# fleetrl config (--recipe %s plus the keys above):" % args.recipe)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    try:
        resolve_model_path(cfg.model.path)
    except ConfigError as exc:
        print(f"warning: a run would stop here: {exc}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return _control(argv)
    if argv and argv[0] == "verl":
        return _verl(argv[1:])
    if argv and argv[0] == "config":
        from launch.config_keys import main as config_keys

        return config_keys(argv[1:])
    if argv and argv[0] == "report":
        from launch.report import main as report

        return report(argv[1:])
    args = run_parser().parse_args(argv)
    from core.configbase import ConfigError

    try:
        cfg = resolve_config(args)
        if args.dry_run:
            from launch.dry_run import dry_run

            return dry_run(cfg, args)
        if not args.simulate:
            from launch.preflight import preflight

            preflight(cfg)
    except (ConfigError, ValueError) as exc:  # DatasetError and RewardConfigError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from launch.driver import LaunchOptions, run

    shared = args.gpus or 0  # colocated: both pools on the same GPUs
    return run(
        cfg,
        LaunchOptions(
            rollout_gpus=shared or args.rollout_gpus,
            learner_gpus=shared or args.learner_gpus,
            reward_gpus=args.reward_gpus,
            address=args.address,
            ray_auth=args.ray_auth,
            simulate=args.simulate,
            no_live=args.no_live,
            log_level=args.log_level,
            summary=args.summary,
            colocate_gpus=shared or None,
        ),
    )


def resolve_config(args: argparse.Namespace):
    """The run config from the recipe, the overrides and the flags that imply config values."""
    from core.configbase import ConfigError
    from launch.config import load_run_config, resolve_model_path

    if args.rollout_gpus < 0 or args.learner_gpus < 0:
        raise ConfigError(
            f"GPU counts must be >= 0, got --rollout-gpus {args.rollout_gpus} --learner-gpus {args.learner_gpus}"
        )
    overrides = list(args.overrides)
    recipe = args.recipe or "tiny"
    colocate = bool(getattr(args, "colocate", False) or getattr(args, "gpus", None) is not None)
    shared_async = bool(getattr(args, "shared_async", False))
    if shared_async and not colocate:
        raise ConfigError(
            "--async shares the devices between learner and fleet: give it with --gpus N (or "
            "--colocate on CPU); the disaggregated mode is asynchronous already (broker.max_staleness)"
        )
    if colocate:
        if args.gpus is not None and (args.gpus < 0 or args.rollout_gpus or args.learner_gpus):
            raise ConfigError(
                f"--gpus N shares N GPUs between learner and fleet: give it alone (N >= 0), not with "
                f"--rollout-gpus {args.rollout_gpus} --learner-gpus {args.learner_gpus}"
            )
        if args.gpus is None and (args.rollout_gpus or args.learner_gpus):
            raise ConfigError(
                "--colocate puts learner and fleet on the same devices: use --gpus N, not --rollout-gpus/--learner-gpus"
            )
        if args.simulate:
            raise ConfigError("--colocate runs real engines and a real learner; it does not combine with --simulate")
        # before the user's overrides: a contrary one is then refused by name (launch/config.py)
        mode = ["colocate.mode=async"] if shared_async else ["broker.max_staleness=0"]  # async: the recipe's k
        overrides = ["colocate.enabled=true", *mode, "weight_sync.backend=gloo"] + overrides
    if getattr(args, "verl", None):
        from launch.verl import translate

        # the verl keys first: explicit fleetrl overrides and flags win over them
        overrides = translate(args.verl).overrides + overrides
        recipe = args.recipe or VERL_RECIPE
    if args.simulate:
        overrides.append("rollout.engine=simulated")
    if args.max_steps is not None:
        overrides.append(f"run.max_steps={args.max_steps}")
    if args.run_dir is not None:
        overrides.append(f"run.run_dir={args.run_dir}")
    cfg = load_run_config(recipe, overrides)
    if cfg.colocate.weight_transport == "ipc" and (getattr(args, "gpus", None) or 1) > 1:
        raise ConfigError(
            f"colocate.weight_transport=ipc loads the weights from learner rank 0's GPU into servers on "
            f"the same GPU; with --gpus {args.gpus} servers 1.. sit on other GPUs: use 'auto' "
            "(ipc on one GPU, gloo otherwise) or 'gloo'"
        )
    if not args.simulate:  # a hub id resolves from the local HF cache, or fails here saying what to do
        cfg = cfg.model_copy(
            update={"model": cfg.model.model_copy(update={"path": resolve_model_path(cfg.model.path)})}
        )
    gpu_servers = bool(getattr(args, "gpus", None) or args.rollout_gpus) and not args.simulate
    cfg = cfg.model_copy(
        update={
            "rollout": cfg.rollout.model_copy(
                update={"max_inflight_groups": cfg.rollout.inflight_groups(gpu=gpu_servers)}
            )
        }
    )
    if cfg.colocate.shared_async and not getattr(args, "gpus", None) and not args.simulate:
        from launch.shared_gpu import host_split

        host_split(cfg)  # CPU: servers and learner ranks share the host's RAM (on GPUs: launch/colocated_placement.py)
    check_reward_servers(cfg, args)
    if cfg.rollout.engine == "simulated" and not args.simulate:
        raise ConfigError("rollout.engine=simulated needs --simulate (a simulated run is labelled as such)")
    if cfg.learner.cpu_processes != 1 and args.learner_gpus > 0 and not args.simulate:
        raise ConfigError(
            f"learner.cpu_processes={cfg.learner.cpu_processes} is for --learner-gpus 0; with "
            f"--learner-gpus {args.learner_gpus} the learner runs one rank per GPU (leave it at 1)"
        )
    if cfg.run.wandb is not None and cfg.run.wandb.mode != "disabled":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("run.wandb is set but the wandb package is not installed: pip install 'fleetrl[wandb]'")
    if cfg.learner.sequence_parallel_size > 1:  # --learner-gpus 0: the CPU ranks (gloo) are split instead
        sp_json = Path(cfg.model.path) / "config.json"
        cfg.learner.check_sequence_parallel(
            args.learner_gpus or cfg.learner.cpu_processes,
            json.loads(sp_json.read_text()) if sp_json.exists() else None,
        )
    if cfg.learner.engine == "megatron" and not args.simulate:
        model_json = Path(cfg.model.path) / "config.json"
        if not model_json.exists():
            raise ConfigError(f"model.path {cfg.model.path!r} has no config.json")
        cfg.learner.megatron.check_layout(args.learner_gpus, json.loads(model_json.read_text()))
        import importlib.util

        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise ConfigError(
                "learner.engine=megatron needs megatron-core (Python >= 3.12), which is not "
                "installed: pip install 'fleetrl[megatron]'"
            )
    return cfg


def check_reward_servers(cfg, args: argparse.Namespace) -> None:
    """``--reward-gpus`` against ``reward.model``: every way they disagree is refused here, before anything starts."""
    from core.configbase import ConfigError
    from launch.config import resolve_model_path

    n = getattr(args, "reward_gpus", 0) or 0
    rm = cfg.reward.model
    if n < 0:
        raise ConfigError(f"--reward-gpus must be >= 0, got {n}")
    if rm is None:
        if n:
            raise ConfigError(
                f"--reward-gpus {n} starts reward servers, but reward.model is not set: give "
                "reward.model={kind: judge|classifier, model: NAME, server: {model_path: DIR}}, or drop "
                "--reward-gpus (reward.function then scores)"
            )
        return
    if args.simulate:
        raise ConfigError(
            "reward.model calls a real reward server; a --simulate run scores with simulated rewards "
            "(remove reward.model and --reward-gpus)"
        )
    given = rm.all_urls()
    if n and given:
        raise ConfigError(
            f"reward.model.url(s) {given} and --reward-gpus {n}: either attach to running reward "
            "servers (url) or let the launcher start them (--reward-gpus), not both"
        )
    colocate = bool(getattr(args, "colocate", False) or getattr(args, "gpus", None) is not None)
    srv = rm.server
    if srv.colocated:
        if not colocate:
            raise ConfigError(
                "reward.model.server.colocated=true shares the colocated GPUs: it needs --gpus N (or "
                "--colocate on CPU); in the disaggregated mode give reward servers GPUs of their own "
                "(--reward-gpus N)"
            )
        if n or given:
            raise ConfigError(
                "reward.model.server.colocated=true starts the reward servers on the shared GPUs; drop "
                f"{'--reward-gpus' if n else 'reward.model.url(s)'}"
            )
        if srv.tensor_parallel_size != 1 or srv.engine != "vllm":
            raise ConfigError(
                "reward.model.server.colocated=true runs one vLLM server per shared GPU: engine vllm, "
                f"tensor_parallel_size 1 (got {srv.engine}, {srv.tensor_parallel_size})"
            )
        if getattr(args, "gpus", None) and cfg.rollout.gpu_memory_utilization + srv.gpu_memory_utilization > 0.9:
            raise ConfigError(
                f"rollout.gpu_memory_utilization {cfg.rollout.gpu_memory_utilization} + reward.model."
                f"server.gpu_memory_utilization {srv.gpu_memory_utilization} > 0.9: the reward server "
                "shares the GPU with the rollout server and the learner (give it e.g. 0.1)"
            )
        n = 1  # for the model-path check below
    elif not n and not given:
        raise ConfigError(
            "reward.model is set but has no server: give reward.model.url=http://HOST:PORT (a server "
            "you started) or --reward-gpus N (the launcher starts N/TP servers on their own GPUs; "
            "on CPU, N servers), or with --gpus N reward.model.server.colocated=true"
        )
    if not n:
        return
    if colocate and not srv.colocated:
        raise ConfigError(
            "--reward-gpus is for the disaggregated mode; with --colocate/--gpus give reward.model.url "
            "or reward.model.server.colocated=true (a reward server on each shared GPU)"
        )
    cpu = args.rollout_gpus == 0 and args.learner_gpus == 0
    if cpu and srv.engine == "sglang":
        raise ConfigError(
            "reward.model.server.engine=sglang needs GPUs (SGLang has no CPU build): use engine "
            "vllm for CPU reward servers, or run with --rollout-gpus/--learner-gpus/--reward-gpus"
        )
    if not cpu and n % srv.tensor_parallel_size:
        raise ConfigError(
            f"--reward-gpus {n} is not a multiple of reward.model.server.tensor_parallel_size "
            f"{srv.tensor_parallel_size}"
        )
    if cpu and srv.tensor_parallel_size != 1:
        raise ConfigError(
            f"reward.model.server.tensor_parallel_size={srv.tensor_parallel_size} is for GPU servers; "
            "CPU reward servers run with 1 (--reward-gpus counts servers on CPU)"
        )
    if srv.model_path is not None:
        try:
            resolve_model_path(srv.model_path)
        except ConfigError as exc:
            raise ConfigError(f"reward.model.server.model_path: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
