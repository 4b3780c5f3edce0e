"""One class per role: an engine client generates (``engines.base.EngineClient``) or receives weights
(``weight_sync.endpoint.WeightEndpoint``), never both; the members both roles have are declared once, on
``ServerHandle``; and the learner picks its weight clients from ``engines.registry``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import engines
from engines.base import EngineClient
from weight_sync.endpoint import ServerHandle, WeightEndpoint

SHARED = {"engine_id", "health", "load_weights_from_path", "weight_version", "close"}


def _engine_classes() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(engines.__path__, "engines."):
        if info.name.endswith(".plugin"):  # runs inside vLLM's workers; needs vLLM for its classes
            continue
        module = importlib.import_module(info.name)
        found += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    return found


def test_no_engine_class_both_generates_and_receives_weights():
    classes = _engine_classes()
    generation = [c for c in classes if issubclass(c, EngineClient)]
    weights = [c for c in classes if issubclass(c, WeightEndpoint)]
    assert len(generation) >= 5 and len(weights) >= 6, (generation, weights)  # the scan found the clients
    both = [c.__qualname__ for c in generation if issubclass(c, WeightEndpoint)]
    assert not both, f"classes in both roles: {both}"


def test_the_shared_members_are_declared_once_on_the_server_handle():
    for role in (EngineClient, WeightEndpoint):
        declared = set(vars(role)) | set(getattr(role, "__annotations__", {}))
        assert not declared & SHARED, f"{role.__name__} declares again {sorted(declared & SHARED)}"
        assert issubclass(role, ServerHandle)
    assert SHARED <= set(vars(ServerHandle)) | set(ServerHandle.__annotations__)


def test_the_learner_takes_its_weight_clients_from_the_registry():
    from launch.config import load_run_config
    from learner.rank import LearnerRank

    params = inspect.signature(LearnerRank.__init__).parameters
    assert "endpoint" not in params  # no client factory injected through launch
    from engines.registry import weight_client
    from engines.vllm.weights import VLLMWeightClient

    client = weight_client(load_run_config("tiny", []), "gloo", "vllm-0", "http://127.0.0.1:1")
    assert type(client) is VLLMWeightClient and not isinstance(client, EngineClient)
