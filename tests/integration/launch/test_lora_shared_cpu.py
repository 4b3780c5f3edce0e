"""LoRA in shared asynchronous mode on CPU through launch/cluster.py (``--recipe tiny-lora --colocate --async``).

Engines that share the learner's devices asynchronously stay resident (they never sleep), so a LoRA run
publishes adapters to them as a disaggregated run does (``weight_sync.adapter_publisher.adapter_publish``):
the step's adapter folder goes out, never the merged weights. Colocated sync runs, whose engines sleep, are
the only LoRA runs that publish merged weights. Read back from the run's own records: the summary's mode and
publish counts, the learner's log (adapter publishes, no full-weight publish), the vLLM server's own log
(each version's adapter loaded, under the name the fleet's requests use) and the adapter folders on disk.
"""

from __future__ import annotations

import re

import pytest
from test_cpu_system import _run

STEPS = 6
K = 2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _run(
        tmp_path_factory.mktemp("cpu-lora-shared"),
        [f"broker.max_staleness={K}", "run.eval_samples=0"],
        steps=STEPS,
        flags=("--colocate", "--async"),
        recipe="tiny-lora",
    )


def test_shared_async_lora_run_publishes_adapters_into_the_resident_server(run):
    assert run["rc"] == 0, run["out"][-4000:]
    s = run["summary"]
    assert s["mode"] == "shared-async" and s["steps"] == STEPS, s
    assert s["publishes"] == STEPS and s["publish_errors"] == 0 and s["groups_lost"] == 0, s
    learner = (run["run_dir"] / "logs" / "learner.log").read_text()
    published = [int(v) for v in re.findall(r"published LoRA adapter v(\d+) \(\d+ bytes\) to \['vllm-0'\]", learner)]
    assert published == list(range(1, STEPS + 1)), published
    assert not re.search(r"published v\d+ to", learner), "a full-weight publish ran in a LoRA run"
    server = (run["run_dir"] / "vllm-0" / "vllm_server.log").read_text()
    loaded = [int(v) for v in re.findall(r"Loaded new LoRA adapter: name 'policy-v(\d+)'", server)]
    assert loaded == list(range(1, STEPS + 1)), loaded
    # the folders a server may still reload: the versions the staleness bound lets run, plus one
    kept = sorted(p.name for p in (run["run_dir"] / "adapters").iterdir())
    assert kept and kept[-1] == f"v{STEPS:08d}" and len(kept) <= K + 2, kept


def test_no_process_left_behind(run):
    assert not run["left"], f"processes left after the run: {run['left']}"
