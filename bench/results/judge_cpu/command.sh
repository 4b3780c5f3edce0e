#!/usr/bin/env bash
# SmolLM2 on CPU, colocated, scored by a colocated SmolLM2 judge (verdict_from=logprobs)
cd /work/main
STEPS=${STEPS:-2}
J='{"kind": "judge", "model": "smollm2-judge", "template": "Reference answer: {reference}\n\nStudent'"'"'s answer:\n{response}\n\nDoes the student'"'"'s answer give the reference answer as its final result? Answer YES or NO.", "verdict": "(YES|NO)", "scores": {"YES": 1.0, "NO": 0.0}, "verdict_from": "logprobs", "max_tokens": 1, "timeout_s": 60, "server": {"max_model_len": 512, "enforce_eager": true, "colocated": true, "startup_timeout_s": 600}}'
date -u +%FT%TZ
timeout ${LIMIT:-1500} .venv/bin/python launch/cluster.py --colocate --recipe smollm2 --max-steps $STEPS --no-live \
  --run-dir ${RUN:-/tmp/cpu_judge} --summary ${RUN:-/tmp/cpu_judge}.json run.eval_samples=${EVAL:-50} "reward.model=$J" "$@"
echo rc=$?
