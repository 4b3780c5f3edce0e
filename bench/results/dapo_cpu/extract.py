import json, math, statistics as st, sys
out = {}
for r in ("tiny", "dapo"):
    try:
        s = json.load(open(f"/tmp/algos-summary-{r}.json"))
    except FileNotFoundError:
        continue
    rows = [json.loads(l.replace("NaN", "null")) for l in open(f"/tmp/algos-run-{r}/metrics/learner.jsonl")]
    rows = [x["metrics"] for x in rows if "metrics" in x]
    frac = [m["learner/batch_samples_trained"] / m["learner/batch_samples"] for m in rows]
    out[r] = {k: s.get(k) for k in ["steps", "eval_accuracy_before", "eval_accuracy_after", "groups_produced",
                                    "groups_consumed", "groups_dropped", "groups_generated",
                                    "generation_per_pushed_group", "samples_overlong_penalised", "samples_truncated",
                                    "wall_s", "reward_per_step"]}
    out[r]["trained_sample_fraction_mean"] = round(st.mean(frac), 4)
    out[r]["entropy_first_last"] = [rows[0].get("learner/entropy"), rows[-1].get("learner/entropy")]
json.dump(out, sys.stdout, indent=1)
