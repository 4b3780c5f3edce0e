"""Engine clients behind one interface: vllm, sglang, local (transformers, CPU) and simulated."""
