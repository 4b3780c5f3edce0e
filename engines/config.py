"""The engines' configs that the run config holds: the simulated engine's (vLLM and SGLang are configured
through ``rollout``, :mod:`rollout_fleet.config`). Imports neither torch nor an engine: ``--help`` and config
errors stay fast.
"""

from __future__ import annotations

from pydantic import Field

from core.configbase import ConfigModel


class SimulatedEngineConfig(ConfigModel):
    """The simulated engine (no model): token rate and response-length distribution.

    Only used with ``rollout.engine: simulated`` or ``launch/cluster.py --simulate``;
    everything it produces is labelled a simulation.
    """

    tokens_per_s: float = Field(2000.0, gt=0, description="decode rate of one sequence (tokens/s)")
    length_median: float = Field(48.0, gt=0, description="median response length (tokens) of the lognormal")
    length_sigma: float = Field(0.8, ge=0, description="lognormal sigma: larger means a longer tail")
    length_growth: float = Field(
        0.0,
        ge=0,
        description=(
            "the median grows by this fraction of itself per weight version the server holds: responses that "
            "lengthen as training goes on, as in reasoning RL (0: constant)"
        ),
    )
    vocab_size: int = Field(1024, ge=2, description="token ids the simulated engine draws from")
    weight_bytes: float = Field(1.0e9, gt=0, description="simulated model size moved by one weight update")
    transfer_gb_per_s: float = Field(100.0, gt=0, description="simulated weight-transfer bandwidth")
    load_s: float = Field(0.005, ge=0, description="simulated time to load an export from disk (late joiner)")
    startup_s: float = Field(0.0, ge=0, description="simulated server start time")
    learner_step_s: float = Field(0.05, ge=0, description="simulated learner step time (--simulate)")
