#!/usr/bin/env bash
# SmolLM2-135M-Instruct learns to call a calculator tool (multi-turn episodes, rollout_fleet/envs/tools.py)
# colocated on ONE GPU, in one 10-minute call: launch/cluster.py --gpus 1 --recipe smollm2-tools-1gpu
# (learner and one vLLM server share the GPU; the server sleeps while the learner trains). Writes under
# $OUT/agents_gpu/ (at most two folders down): command.txt, date.txt, run.json (rc, wall), summary.json (eval
# before / after: mean episode reward on 200 test problems, greedy), learner_steps.jsonl, per_step.json
# (per step: reward, turns per episode, the fraction of episodes with a tool response, and from the
# decoded samples the tool calls and the valid ones), cluster.log and logs/.
#
#   PYTHONPATH=/tmp/site-vllm:/tmp/site-ray:/tmp/site-base NCCL_CUMEM_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 \
#     MODEL=/tmp/models/smollm2-135m-instruct bash bench/agents_gpu.sh      # STEPS=50 LIMIT_S=500 by default
#
# Extra arguments go to launch/cluster.py as overrides (e.g. learner.optim.lr=2e-5 broker.groups_per_step=24).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
D="$OUT/agents_gpu"
mkdir -p "$D/logs"
R=${RUN_DIR:-/tmp/agents_gpu_run}   # the run directory: outside $OUT (its files lie deeper than two folders)
rm -rf "$R"
STEPS=${STEPS:-50}
LIMIT_S=${LIMIT_S:-500}           # the driver gets SIGTERM then (a clean shutdown that still writes the summary)
MODEL=${MODEL:-.cache/models/smollm2-135m-instruct}
TRANSPORT=${TRANSPORT:-gloo}       # colocate.weight_transport: gloo (the path seen working on the H200) | ipc | auto
DATA=${DATA:-data/tool_word_problems}
RECIPE=${RECIPE:-smollm2-tools-1gpu}
# the 1-GPU recipes run the rollout server with CUDA graphs of whole decode steps, no torch.compile
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
PY=${PY:-python3}
date -u +%FT%TZ > "$D/date.txt"
git rev-parse --short HEAD > "$D/commit.txt" 2>/dev/null
[ -f "$DATA/train.parquet" ] || $PY -m rollout_fleet.envs.tool_tasks --out "$DATA" > "$D/data.log" 2>&1 \
  || { echo "tool-task data failed: $D/data.log"; tail -5 "$D/data.log"; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$D/nvidia_smi_before.csv" 2>&1
CMD=($PY launch/cluster.py --gpus 1 --recipe "$RECIPE" --max-steps "$STEPS" --no-live
     --run-dir "$R" --summary "$D/summary.json" "model.path=$MODEL" "colocate.weight_transport=$TRANSPORT"
     "data.train_files=[$DATA/train.parquet]" "data.test_files=[$DATA/test.parquet]" "$@")
echo "${CMD[*]}" > "$D/command.txt"
t0=$(date +%s)
timeout -s TERM -k 45 "$LIMIT_S" "${CMD[@]}" > "$D/cluster.log" 2>&1
rc=$?
t1=$(date +%s)
printf '{"rc": %d, "wall_s": %d, "date_utc": "%s", "command": "%s"}\n' "$rc" $((t1 - t0)) "$(cat "$D/date.txt")" \
  "${CMD[*]}" > "$D/run.json"
cp "$R/metrics/learner_steps.jsonl" "$R/metrics/learner.jsonl" "$D/" 2>/dev/null
cp "$R"/logs/*.log "$D/logs/" 2>/dev/null
for f in "$R"/*/vllm_server.log; do
  [ -f "$f" ] && grep -v "GET /health\|POST /v1/completions\|POST /generate" "$f" | tail -c 20000 \
    > "$D/logs/$(basename "$(dirname "$f")")_server_tail.log"
done
$PY bench/agents_gpu_steps.py "$R/metrics/learner.jsonl" --json "$D/per_step.json" > "$D/per_step.txt" 2>&1
echo "rc=$rc wall=$((t1 - t0))s; results in $D"
cat "$D/per_step.txt"
$PY - "$D" <<'PYEOF'
import json, sys
from pathlib import Path
try:
    s = json.loads((Path(sys.argv[1]) / "summary.json").read_text())
    print({k: s.get(k) for k in ("steps", "eval_accuracy_before", "eval_accuracy_after", "max_staleness_seen",
                                 "groups_lost", "error")})
except Exception as exc:
    print("no summary:", exc)
PYEOF
exit $rc
