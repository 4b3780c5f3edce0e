"""The long-tail dataset of bench/long_tail_gpu.sh: prompts whose response budgets (the dataset's optional
``max_tokens`` column, rollout_fleet/data.py) follow a lognormal, and the benchmark's stand-in reward.

Budgets: lognormal with median ``--median`` and log-standard-deviation ``--sigma``, rounded and clipped to
``[--min, --cap]``, seeded. With ``--block G`` (the run's broker.groups_per_step, data.shuffle=false) every
``G`` consecutive rows are a stratified sample: one draw from each of the ``G`` equal-probability strata
of the distribution, in a seeded random order. Every step then holds the whole distribution, its
long tail included, instead of whatever a shuffle happens to put together (a step of 16 plain draws
misses the top 5% about 44% of the time). The quantiles of the distribution and of the drawn
budgets go to ``--summary`` (JSON)::

    python bench/long_tail_data.py --out /tmp/long_tail/train.parquet --rows 128 --block 16 \\
        --median 1024 --sigma 1.5 --cap 16384 --seed 0 --summary /tmp/long_tail/budgets.json

:func:`spread_reward` is the reward the run uses (``reward.function=<this file>:spread_reward``): random
weights solve no task, and a constant reward would make every group uniform (dropped, nothing trained).
It hashes the response text into [0, 1], so samples of one group differ and every step trains.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zlib
from pathlib import Path

import numpy as np

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


def budgets(rows: int, *, median: float, sigma: float, lo: int, cap: int, seed: int, block: int = 0) -> np.ndarray:
    """``rows`` response budgets, lognormal(log median, sigma) rounded and clipped to [lo, cap]; with
    ``block`` > 0 each block of that many rows has one draw per equal-probability stratum."""
    if rows < 1 or median <= 0 or sigma < 0 or not 1 <= lo <= cap:
        raise ValueError(f"bad budget distribution: rows={rows} median={median} sigma={sigma} min={lo} cap={cap}")
    rng = np.random.default_rng(seed)
    if block > 0:
        if rows % block:
            raise ValueError(f"--rows {rows} is not a multiple of --block {block}")
        # one uniform draw inside each stratum [i/G, (i+1)/G), shuffled within the block
        u = (np.arange(rows) % block + rng.random(rows)) / block
        u = np.concatenate([rng.permutation(u[i : i + block]) for i in range(0, rows, block)])
        from statistics import NormalDist

        z = np.array([NormalDist().inv_cdf(min(max(x, 1e-12), 1 - 1e-12)) for x in u])
    else:
        z = rng.standard_normal(rows)
    return np.clip(np.rint(median * np.exp(sigma * z)), lo, cap).astype(np.int64)


def distribution_quantiles(median: float, sigma: float, lo: int, cap: int) -> dict[str, int]:
    """The clipped lognormal's quantiles (what the budgets are drawn from)."""
    from statistics import NormalDist

    out = {}
    for q in QUANTILES:
        z = NormalDist().inv_cdf(min(max(q, 1e-12), 1 - 1e-12))
        out[f"q{q:g}"] = int(min(max(round(median * math.exp(sigma * z)), lo), cap))
    return out


def spread_reward(response_text: str, ground_truth: str, **extra) -> float:
    """A stand-in reward in [0, 1] from the response's CRC-32: no task, but samples of a group differ."""
    return (zlib.crc32(response_text.encode("utf-8", "replace")) % 1001) / 1000.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the Parquet file to write (verl's layout + max_tokens)")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--median", type=float, default=1024)
    ap.add_argument("--sigma", type=float, default=1.5)
    ap.add_argument("--min", type=int, default=16, dest="lo")
    ap.add_argument("--cap", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block", type=int, default=0, help="stratify every BLOCK rows (the run's groups_per_step)")
    ap.add_argument("--summary", help="JSON with the parameters and quantiles")
    ap.add_argument("--prompt", default="Write story number {i} as long as you can.", help="user message; {i}: row")
    a = ap.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    b = budgets(a.rows, median=a.median, sigma=a.sigma, lo=a.lo, cap=a.cap, seed=a.seed, block=a.block)
    rows = [
        {
            "data_source": "long_tail",
            "prompt": [{"role": "user", "content": a.prompt.format(i=i)}],
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": i},
            "max_tokens": int(n),
        }
        for i, n in enumerate(b)
    ]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), a.out)
    summary = {
        "file": str(a.out),
        "rows": a.rows,
        "distribution": {"kind": "lognormal", "median": a.median, "sigma": a.sigma, "min": a.lo, "cap": a.cap},
        "seed": a.seed,
        "block": a.block,
        "distribution_quantiles": distribution_quantiles(a.median, a.sigma, a.lo, a.cap),
        "drawn_quantiles": {f"q{q:g}": int(np.quantile(b, q, method="nearest")) for q in QUANTILES},
        "drawn_mean": float(b.mean()),
        "drawn_total_tokens": int(b.sum()),
        "at_cap": int((b == a.cap).sum()),
        "per_block_max": [int(b[i : i + a.block].max()) for i in range(0, a.rows, a.block)] if a.block else None,
        "per_block_sum": [int(b[i : i + a.block].sum()) for i in range(0, a.rows, a.block)] if a.block else None,
    }
    text = json.dumps(summary, indent=1)
    if a.summary:
        Path(a.summary).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
