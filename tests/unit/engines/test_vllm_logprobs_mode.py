"""vLLM servers are started so that behaviour log-probs are those of the sampled distribution."""

from __future__ import annotations

import typing

import pytest

from engines.vllm.server import VLLMServer, VLLMServerArgs


def test_server_command_asks_for_processed_logprobs_a_real_vllm_mode(tmp_path):
    from vllm.config.model import LogprobsMode

    cmd = VLLMServer(VLLMServerArgs(model="m"), tmp_path).command()
    mode = cmd[cmd.index("--logprobs-mode") + 1]
    assert mode == "processed_logprobs" and mode in typing.get_args(LogprobsMode)


def test_a_conflicting_logprobs_mode_in_extra_args_is_refused(tmp_path):
    server = VLLMServer(VLLMServerArgs(model="m", extra_args=["--logprobs-mode", "raw_logprobs"]), tmp_path)
    with pytest.raises(ValueError, match="--logprobs-mode is set by fleetrl"):
        server.command()
