"""A step's count of graphs torch.compile made (learner/busy.py): non-zero where a step met a new shape."""

from __future__ import annotations

import torch

from learner.busy import StepTimer


def test_compiled_graphs_counts_the_compiles_of_each_step():
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)  # static: a new length is a new graph

    def step(*lengths: int) -> float:
        timer = StepTimer()
        for n in lengths:
            f(torch.ones(n))
        return timer.stop()["learner/compiled_graphs"]

    assert step(8) == 1  # the first compile
    assert step(8, 8) == 0  # nothing new
    assert step(8, 9, 10) == 2  # two new lengths
    assert step(9, 10) == 0
