"""`launch/cluster.py config --keys`: every key of the run config, each described, and docs/configuration.md
current (regenerate it with `python launch/cluster.py config --keys --markdown > docs/configuration.md`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.config_keys import all_keys, main, markdown, select

REPO = Path(__file__).resolve().parents[3]


def test_every_key_is_described():
    undescribed = [k.name for k in all_keys() if not k.description]
    assert not undescribed, f"config keys without a description (add Field(description=...)): {undescribed}"


def test_the_list_covers_nested_and_optional_sections():
    names = {k.name for k in all_keys()}
    # a nested section, an optional section's own key and a key inside it, a deep key
    for key in (
        "learner.loss.correction",
        "reward.model",
        "reward.model.kind",
        "learner.megatron.sequence_parallel",
        "rollout.sampling.top_k",
        "broker.max_staleness",
    ):
        assert key in names, key
    required = {k.name for k in all_keys() if k.default == "(required)"}
    assert "learner.loss.correction" in required and "model.path" in required


def test_docs_configuration_md_is_current():
    assert (REPO / "docs" / "configuration.md").read_text() == markdown(all_keys()), (
        "docs/configuration.md is stale: python launch/cluster.py config --keys --markdown > docs/configuration.md"
    )


def test_a_section_and_an_unknown_one(capsys):
    assert {k.name for k in select(all_keys(), "learner.loss")} >= {"learner.loss.clip_low", "learner.loss.kl_coef"}
    assert main(["--keys", "broker"]) == 0
    assert "broker.max_staleness" in capsys.readouterr().out
    assert main(["--keys", "learner.los"]) == 2
    assert "Did you mean 'learner.loss'" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["--markdown"]])
def test_without_keys_it_prints_help(argv):
    assert main(argv) == 2
