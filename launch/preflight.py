"""Checks that need the model's tokenizer and the data, run before any process starts.

The config checks (``launch.config``) see keys and values only; these read the files: every
prompt of every dataset, chat template applied, must leave ``rollout.sampling.max_tokens`` of
room under ``rollout.max_model_len`` (an engine would refuse it, or cut the response short
without a word), and the reward function must resolve and, for ``reward.function: default``,
know every ``data_source`` in the data. A failure names the file, the longest prompt, the
source or the function, and what to change; nothing has started yet, so nothing is lost.
"""

from __future__ import annotations

import logging
import time

from launch.config import RunConfig

log = logging.getLogger(__name__)


def preflight(cfg: RunConfig) -> dict[str, int]:
    """Raise ValueError (DatasetError, RewardConfigError) on the first problem; returns prompt counts."""
    from rollout_fleet import data as rdata
    from rollout_fleet.rewards import resolve
    from rollout_fleet.scorers import check_sources

    t0 = time.monotonic()
    resolve(cfg.reward.function)
    tok = rdata.load_tokenizer(cfg.model.path)
    splits = ["train"] + (["test"] if cfg.data.test_files and cfg.run.eval_samples > 0 else [])
    counts, sources = {}, set()
    for split in splits:
        ds = rdata.from_config(
            cfg.data,
            tok,
            seed=cfg.run.seed,
            split=split,
            max_model_len=cfg.rollout.max_model_len,
            response_tokens=cfg.rollout.sampling.max_tokens,
        )
        counts[split] = len(ds)
        counts[f"{split}_skipped_overlong"] = len(ds.overlong)
        sources |= {r.data_source for r in ds.rows}
    if cfg.reward.function == "default":
        check_sources(sources)
    log.info(
        "preflight: %s prompts fit (limit %s), reward %r, in %.1f s",
        counts,
        cfg.rollout.max_model_len,
        cfg.reward.function,
        time.monotonic() - t0,
    )
    return counts
