#!/usr/bin/env bash
# A judge-scored task on ONE GPU in one 10-minute call: launch/cluster.py --gpus 1 --recipe smollm2-judge-1gpu.
# Learner and rollout server colocated (sleep/wake), and a SmolLM2 judge vLLM server on the same GPU
# (reward.model.server.colocated, 10% of its memory), started and healthy before the rollout server.
# Training rewards: the judge's YES/NO (structured outputs); evaluation before/after: the rule (last number).
# Writes under $OUT/judge_gpu/ (at most two folders down): command.txt, date.txt, run.json, summary.json,
# learner_steps.jsonl, per_step.json/.txt (reward per step), placement.json (where the judge ran),
# cluster.log, logs/ (driver, learner, fleet, the rollout and judge servers' tails), nvidia_smi_*.csv.
#
#   PYTHONPATH=/tmp/site-vllm:/tmp/site-ray:/tmp/site-base NCCL_CUMEM_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 \
#     MODEL=/tmp/models/smollm2-135m-instruct bash bench/judge_gpu.sh       # STEPS=15 LIMIT_S=500 by default
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
D="$OUT/judge_gpu"
mkdir -p "$D/logs"
R=${RUN_DIR:-/tmp/judge_gpu_run}   # the run directory: outside $OUT (its files lie deeper than two folders)
rm -rf "$R"
STEPS=${STEPS:-15}
LIMIT_S=${LIMIT_S:-500}  # then SIGTERM: a clean shutdown that still writes the summary
MODEL=${MODEL:-.cache/models/smollm2-135m-instruct}
TRANSPORT=${TRANSPORT:-gloo}       # colocate.weight_transport: gloo (the path seen working on the H200) | ipc | auto
RECIPE=${RECIPE:-smollm2-judge-1gpu}
# the 1-GPU recipes run the rollout server with CUDA graphs of whole decode steps, no torch.compile
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
PY=${PY:-python3}
date -u +%FT%TZ > "$D/date.txt"
git rev-parse --short HEAD > "$D/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$D/nvidia_smi_before.csv" 2>&1
# the judge is the policy's own folder (reward.model.server.model_path: null -> model.path)
CMD=($PY launch/cluster.py --gpus 1 --recipe "$RECIPE" --max-steps "$STEPS" --no-live
     --run-dir "$R" --summary "$D/summary.json" "model.path=$MODEL" "colocate.weight_transport=$TRANSPORT" "$@")
echo "${CMD[*]}" > "$D/command.txt"
( sleep 200; nvidia-smi --query-compute-apps=pid,used_memory --format=csv > "$D/nvidia_smi_apps_200s.csv" 2>&1 ) \
  > /dev/null 2>&1 &
probe=$!
t0=$(date +%s)
timeout -s TERM -k 45 "$LIMIT_S" "${CMD[@]}" > "$D/cluster.log" 2>&1
rc=$?
t1=$(date +%s)
kill "$probe" 2>/dev/null
printf '{"rc": %d, "wall_s": %d, "date_utc": "%s", "command": "%s"}\n' "$rc" $((t1 - t0)) "$(cat "$D/date.txt")" \
  "${CMD[*]}" > "$D/run.json"
cp "$R/metrics/learner_steps.jsonl" "$R/metrics/learner.jsonl" "$D/" 2>/dev/null
cp "$R/placement.json" "$D/" 2>/dev/null
cp "$R"/logs/*.log "$D/logs/" 2>/dev/null
for f in "$R"/*/vllm_server.log; do
  [ -f "$f" ] && grep -v "GET /health\|POST /v1/completions\|POST /v1/chat/completions\|POST /generate" "$f" \
    | tail -c 20000 > "$D/logs/$(basename "$(dirname "$f")")_server_tail.log"
done
$PY bench/agents_gpu_steps.py "$R/metrics/learner.jsonl" --json "$D/per_step.json" > "$D/per_step.txt" 2>&1
echo "rc=$rc wall=$((t1 - t0))s; results in $D"
cut -c1-200 "$D/per_step.txt"
grep -h "reward server\|reward model" "$D/cluster.log" "$D"/logs/*.log 2>/dev/null | grep -v "attempt" | tail -6
$PY - "$D" <<'PYEOF'
import json, sys
from pathlib import Path
try:
    s = json.loads((Path(sys.argv[1]) / "summary.json").read_text())
    print({k: s.get(k) for k in ("steps", "eval_accuracy_before", "eval_accuracy_after", "groups_lost", "error")})
    print({k: v for k, v in s.items() if "reward" in k and k != "reward_per_step"})
    print("reward per step (judge)", s.get("reward_per_step"))
except Exception as exc:
    print("no summary:", exc)
PYEOF
exit $rc
