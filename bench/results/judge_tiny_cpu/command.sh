#!/usr/bin/env bash
# The tiny adder trained on the tiny judge's rewards (launch/recipes/judge-tiny.yaml), on the 2-core CPU machine:
# one vLLM CPU rollout server, one vLLM CPU judge server (--reward-gpus 1 on CPU), the FSDP learner on CPU.
# run2_logprobs: command.sh reward.model.verdict_from=logprobs; run3_text: the recipe as it is (verdict_from: text).
# Eval: greedy, 200 test problems, scored by the rule (exact_match), before and after.
cd "$(dirname "$0")/../../.."
RUN=${RUN:-runs/judge-tiny}
date -u +%FT%TZ
timeout ${LIMIT:-1800} .venv/bin/python launch/cluster.py --rollout-gpus 0 --learner-gpus 0 --reward-gpus 1 \
  --recipe judge-tiny --no-live --run-dir "$RUN" --summary "$RUN/summary.json" "$@"
echo rc=$?
date -u +%FT%TZ
