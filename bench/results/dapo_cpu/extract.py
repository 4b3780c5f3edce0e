"""Collect the numbers of bench/results/dapo_cpu/README.md from runs' summaries and learner metrics.

    python bench/results/dapo_cpu/extract.py SUMMARY_PREFIX RUN_DIR_PREFIX > results.json
reads SUMMARY_PREFIX{tiny,dapo}.json and RUN_DIR_PREFIX{tiny,dapo}/metrics/learner.jsonl.
"""

import json
import statistics as st
import sys

summary_prefix, run_prefix = sys.argv[1], sys.argv[2]
out = {}
for r in ("tiny", "dapo"):
    s = json.load(open(f"{summary_prefix}{r}.json"))
    rows = [json.loads(line.replace("NaN", "null")) for line in open(f"{run_prefix}{r}/metrics/learner.jsonl")]
    rows = [x["metrics"] for x in rows if "metrics" in x]
    frac = [m["learner/batch_samples_trained"] / m["learner/batch_samples"] for m in rows]
    out[r] = {
        k: s.get(k)
        for k in [
            "steps",
            "eval_accuracy_before",
            "eval_accuracy_after",
            "groups_produced",
            "groups_consumed",
            "groups_dropped",
            "groups_generated",
            "generation_per_pushed_group",
            "samples_overlong_penalised",
            "samples_truncated",
            "wall_s",
            "reward_per_step",
        ]
    }
    out[r]["trained_sample_fraction_mean"] = round(st.mean(frac), 4)
    out[r]["entropy_first_last"] = [rows[0].get("learner/entropy"), rows[-1].get("learner/entropy")]
json.dump(out, sys.stdout, indent=1)
