"""The inference engines, one folder each: everything specific to vLLM is in ``engines/vllm/``, to SGLang in
``engines/sglang/``.

    engines/base.py         the generation interface (EngineClient), sampling and samples, the HTTP server handle
                            both roles share (HttpServerHandle), the factory base (ServerFactory)
    engines/config.py       the simulated engine's config
    engines/registry.py     which weight client the learner's publisher uses for a server (weight_client)
    engines/simulated.py    the SIMULATED engine: no model, realistic timing (control-plane tests at scale)
    engines/vllm/           server.py (the process), handle.py (pause, resume, sleep, load from disk),
                            generation.py (the fleet's client), weights.py (the learner's client), ipc.py and
                            nccl.py (the CUDA IPC and vLLM-NCCL weight paths), plugin.py (fleetrl's weight-transfer
                            backend inside vLLM's workers), lora.py, factory.py (the fleet's servers)
    engines/sglang/         the same for SGLang; loader.py is fleetrl's weight loader inside SGLang's workers

Layers: ``rollout_fleet`` and ``learner`` import engines; engines import ``weight_sync`` and ``core``, never the
fleet or the learner (import-linter's layers contract in pyproject.toml). The role interfaces every
engine client derives from are ``weight_sync.endpoint.ServerHandle`` and ``WeightEndpoint`` (the publisher's
view, in the lower layer) and :class:`engines.base.EngineClient` (the fleet's view).
"""
