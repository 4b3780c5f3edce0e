"""bench/rollout.py's pure parts: its argument checks, the case it writes, and that both sides of a case get
the same engine settings and sampling (the engine side's settings are read off the command line fleetrl starts
its server with, and the SGLang sampling off a real request of the fleet's client)."""

from __future__ import annotations

import json

import pytest
from json_http import json_http_server
from packaging.version import Version

from bench import rollout
from bench.rollout_sglang import cli_to_kwargs, engine_kwargs, repeated, sampling_dict, server_args


def _args(*argv: str):
    return rollout.parser().parse_args(list(argv))


def test_an_unknown_engine_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        rollout.main(["--engine", "trtllm"])
    assert e.value.code == 2
    assert "invalid choice: 'trtllm'" in capsys.readouterr().err


def test_two_gpus_on_a_one_gpu_machine_is_a_clear_error(monkeypatch, capsys):
    with pytest.raises(ValueError, match="--gpus 2 needs 2 visible GPUs, this machine shows 1; use --gpus 1"):
        rollout.resolve(_args("--gpus", "2"), visible_gpus=1)
    monkeypatch.setattr(rollout, "visible_gpu_count", lambda: 1)  # what torch.cuda.device_count() says on such a box
    with pytest.raises(SystemExit) as e:
        rollout.main(["--gpus", "2", "--engine", "sglang"])
    assert e.value.code == 2
    assert "--gpus 2 needs 2 visible GPUs, this machine shows 1" in capsys.readouterr().err


def test_the_layout_defaults_to_the_visible_gpu_count():
    one, two = _args(), _args()
    rollout.resolve(one, visible_gpus=1)
    rollout.resolve(two, visible_gpus=8)
    assert (one.gpus, two.gpus) == (1, 2)
    three = _args("--gpus", "1")
    rollout.resolve(three, visible_gpus=2)
    assert three.gpus == 1


@pytest.mark.parametrize(
    ("argv", "visible", "message"),
    [
        ((), 0, "no GPU is visible"),
        (("--cpu", "--engine", "sglang"), 0, "--cpu runs the vLLM case only: sglang has no CPU build"),
        (("--cpu", "--gpus", "1"), 0, "--cpu runs on no GPU"),
        (("--gpus", "2", "--fleet-gpu", "0"), 2, "two different GPUs"),
        (("--gpus", "1", "--gpu", "3"), 2, "GPU '3' is not one of the 2 visible GPUs"),
        (("--prompt-len", "1024", "--max-tokens", "1025"), 1, "exceeds --max-model-len 2048"),
        (("--n", "0"), 1, "--n must be at least 1"),
    ],
)
def test_inconsistent_arguments_are_refused(argv, visible, message):
    with pytest.raises(ValueError, match=message):
        rollout.resolve(_args(*argv), visible)


def test_the_cpu_smoke_run_takes_the_tiny_model_and_sizes():
    a = _args("--cpu")
    rollout.resolve(a, visible_gpus=0)
    assert a.gpus == 0 and a.model.endswith("models/tiny-adder") and a.prompts == 8 and a.max_model_len == 64
    prompts = rollout.bench_prompts(a)
    assert len(prompts) == 8 and all(len(p) == 8 and max(p) < 128 for p in prompts)  # the tiny vocabulary
    batches = rollout.timed_batches(a)
    assert len(batches) == a.reps == 3 and batches[0] == prompts and batches[1] != prompts  # new prompts each batch


def test_the_child_gets_the_resolved_settings_not_the_command_line():
    a = _args("--cpu", "--json", "/tmp/x.json")
    rollout.resolve(a, visible_gpus=0)
    child = rollout.parser().parse_args(rollout.child_argv(a))
    names = ("engine", "model", "prompts", "prompt_len", "n", "max_tokens", "warmup", "reps", "max_num_seqs", "cpu")
    for name in names:
        assert getattr(child, name) == getattr(a, name), name
    assert child.json is None


def test_the_case_holds_both_rates_and_their_ratio():
    a = _args("--engine", "sglang")
    rollout.resolve(a, visible_gpus=1)
    engine = rollout.summed([(1000, 2.0), (1000, 1.0)])
    fleet = rollout.summed([(990, 2.2), (1000, 1.25)])
    assert engine["reps"][0] == {"tokens": 1000, "seconds": 2.0, "tok_per_s": 500.0}
    assert engine["tok_per_s"] == pytest.approx(2000 / 3.0, rel=1e-12)  # all tokens over all seconds
    case = rollout.build_case(a, "0.5.16", engine, fleet, "m")
    assert case["engine"] == "sglang 0.5.16"
    assert case["ratio"] == pytest.approx((1990 / 3.45) / (2000 / 3.0), rel=1e-12)
    assert case["ratio_per_rep"] == pytest.approx([0.9, 0.8], rel=1e-12)  # batch i against batch i
    assert case["workload"]["timed_batches"] == 3
    assert case["layout"].startswith("1 GPU (GPU 0): engine side, then fleet side")
    assert case["workload"]["radix_cache"] is False and case["workload"]["max_num_seqs"] == 256
    json.dumps(case)  # what the bench writes
    with pytest.raises(ValueError, match="a side generated nothing"):
        rollout.build_case(a, "0.5.16", {**engine, "tok_per_s": 0.0}, fleet, "m")


def test_physical_gpu_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert (rollout.physical_gpu("0"), rollout.physical_gpu("1")) == ("3", "5")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert rollout.physical_gpu("1") == "1"


def test_vllm_engine_side_gets_the_fleet_servers_engine_settings(tmp_path):
    from engines.vllm.server import VLLMServer

    a = _args("--max-num-seqs", "64", "--gpu-memory-utilization", "0.5", "--model", "/m")
    rollout.resolve(a, visible_gpus=1)
    sargs = rollout.vllm_server_args(a, "0")
    cmd = VLLMServer(sargs, tmp_path).command()
    flags = cli_to_kwargs(cmd[cmd.index("vllm.entrypoints.openai.api_server") + 1 :])
    kw = rollout.vllm_engine_kwargs(a, sargs)
    for k, v in kw.items():
        if k == "enforce_eager":
            assert flags.get(k, False) is v
        else:
            assert flags[k] == str(v), k
    assert kw["max_num_seqs"] == 64 and kw["gpu_memory_utilization"] == 0.5


def test_sglang_engine_side_gets_the_fleet_servers_arguments(tmp_path):
    from engines.sglang.server import SGLangServer

    a = _args("--engine", "sglang", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.6", "--model", "/m")
    rollout.resolve(a, visible_gpus=1)
    version = Version("0.5.16")
    cmd = SGLangServer(server_args(a, "0", tmp_path)).command(version)
    flags = cli_to_kwargs(cmd[cmd.index("sglang.launch_server") + 1 :])
    kw = engine_kwargs(a, version)
    for k, v in kw.items():
        if v is True or v is False:
            assert flags.get(k, False) is v, k
        else:
            assert flags[k] == str(v), k
    # what the server has that the offline engine does not: where it listens, and the weight loader of updates
    assert set(flags) - set(kw) <= {"host", "port", "custom_weight_loader", "api_key"}
    assert kw["mem_fraction_static"] == 0.6 and kw["max_running_requests"] == 64 and kw["disable_radix_cache"] is True
    assert kw["attention_backend"] == "triton" and kw["disable_cuda_graph"] is True  # 0.5.16's compatibility flags


def test_cli_to_kwargs():
    assert cli_to_kwargs(["--a-b", "--c", "x", "--d=y", "--e"]) == {"a_b": True, "c": "x", "d": "y", "e": True}
    with pytest.raises(ValueError, match="expected a --flag at position 0"):
        cli_to_kwargs(["x"])


def test_sglang_sampling_is_what_the_fleets_client_sends():
    """A real request of SGLangGenerationClient to a local HTTP server: its sampling_params equal sampling_dict."""
    import asyncio

    from engines.sglang.generation import SGLangGenerationClient

    bodies: list[dict] = []
    n = 3

    def answer(method, path, body):
        bodies.append(body)
        out = [
            {
                "output_ids": [5, 6],
                "meta_info": {
                    "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
                    "finish_reason": {"type": "length"},
                },
            }  # fmt: skip
            for _ in range(n)
        ]
        return out, 200

    a = _args("--engine", "sglang", "--n", str(n), "--max-tokens", "2")
    rollout.resolve(a, visible_gpus=1)
    params = rollout.sampling(a)

    async def one(url):
        client = SGLangGenerationClient("t", url, radix_cache=False, timeout_s=30)  # as the fleet starts its servers
        try:
            return await client.generate([1, 2, 3], params)
        finally:
            await client.close()

    with json_http_server(answer) as url:
        samples = asyncio.run(one(url))
    assert len(samples) == n
    assert bodies[0]["return_logprob"] is True and bodies[0]["input_ids"] == repeated([[1, 2, 3]], n)
    assert bodies[0]["sampling_params"] == [sampling_dict(params)] * n
    assert "n" not in sampling_dict(params)


def test_a_sides_result_is_kept_when_its_process_hangs_on_exit_and_a_failure_names_its_log(tmp_path):
    import subprocess
    import sys

    a = _args("--side-timeout", "30")
    out, log_path = tmp_path / "engine.json", tmp_path / "engine.log"
    hang = f"import json, time; open({str(out)!r}, 'w').write(json.dumps({{'tok_per_s': 1.0}})); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", hang])
    assert rollout.finish_side(a, "engine", proc, out, log_path, exit_grace_s=1.0) == {"tok_per_s": 1.0}
    assert proc.poll() is not None  # killed, not left behind
    out.unlink()
    log_path.write_text("Traceback ...\nRuntimeError: CUDA out of memory\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=r"the engine side exited with 3; tail of .*\n(.|\n)*CUDA out of memory"):
        rollout.finish_side(a, "engine", proc, out, log_path)
