#!/usr/bin/env bash
# Colocated sync (k=0) against shared async (k=1, k=2) on ONE GPU with SmolLM2-135M-Instruct on vLLM (issue 37).
# Same recipe (smollm2-gpu, word problems), seed, step count and greedy evaluation at fixed steps for every
# mode; one launch/cluster.py run per mode, one at a time:
#
#   colocated   --gpus 1                      engine sleeps (level 1) while the learner trains, k = 0
#   shared_k1   --gpus 1 --async k=1          engine and learner resident at once, fleet 1 step ahead
#   shared_k2   --gpus 1 --async k=2          ... 2 steps ahead
#
# Every mode keeps rollout.gpu_memory_utilization equal (the recipe's 0.5; the shared modes check at start
# that the learner's estimate fits beside it: core/shared_gpu.py). While each run goes, `nvidia-smi pmon`
# samples every process's SM share once a second (bench/pmon.py reads it). Writes under $OUT/e2e_shared_gpu/
# (at most 5 files: the device tool returns 8 files, two folders deep):
#   e2e_shared_gpu.json  bench/e2e.py's collection (curves against steps and wall seconds, steps/s, busy
#                        fractions from the summary, time to colocated's final accuracy, the ratios) plus per
#                        mode: the pmon busy shares, the memory split, rc and wall seconds
#   e2e_shared_gpu.png   accuracy against steps and against learner wall seconds, every mode
#   runs.tar.gz          per mode: summary, learner_steps.jsonl, command, pmon samples, log tails
#   console.log          this script's output
#
#   MODES="colocated shared_k1 shared_k2" STEPS=12 EVAL_EVERY=6 EVAL_SAMPLES=100 SEED=0 LIMIT_S=170 \
#     bash bench/e2e_shared_gpu.sh [override ...]
#
# Runs go to $RUNS (default /tmp/e2e_shared: machine-local, so a second call on the same warm machine with
# other MODES adds to them and the collection covers every mode run so far; SEED=1 adds a second seed).
# Needs what bench/e2e_gpu.sh needs (vLLM 0.26 bundle, Ray, the exported model folder; bench/gpu_calls.sh
# step shared-gpu runs this with the paths of those steps). Sized for ~8 minutes on an H100 for the three
# modes: per mode ~60-90 s of start (Ray, vLLM eager, model load), 2 evaluations of EVAL_SAMPLES, STEPS steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
D="$OUT/e2e_shared_gpu"
RUNS=${RUNS:-/tmp/e2e_shared}
mkdir -p "$D" "$RUNS"
exec > >(tee -a "$D/console.log") 2>&1
MODES=${MODES-colocated shared_k1 shared_k2}   # MODES= (empty): no run, collect what $RUNS has
STEPS=${STEPS:-12}
EVAL_EVERY=${EVAL_EVERY:-6}
EVAL_SAMPLES=${EVAL_SAMPLES:-100}
SEED=${SEED:-0}
LIMIT_S=${LIMIT_S:-170}            # per mode: SIGTERM then (a clean shutdown that still writes the summary)
EAGER=${EAGER:-false}              # CUDA graphs, the same for every mode (colocated with graphs ran on an H100:
                                   # FACTS.md, 2026-12-06, 3.9-4.7 s a step); EAGER=true for eager engines
NGROUPS=${NGROUPS:-32}
CORRECTION=${CORRECTION:-decoupled}
MODEL=${MODEL:-.cache/models/smollm2-135m-instruct}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0} PYTHONUNBUFFERED=1
PY=${PY:-python3}
echo "=== $(date -u +%FT%TZ) e2e_shared_gpu: modes [$MODES] steps $STEPS seed $SEED eval every $EVAL_EVERY x $EVAL_SAMPLES"
git rev-parse --short HEAD 2>/dev/null > "$RUNS/commit.txt" || true
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$RUNS/nvidia_smi.csv"
if [ ! -f "$MODEL/config.json" ]; then echo "no model folder $MODEL (bench/gpu_calls.sh smollm2, or MODEL=DIR)"; exit 2; fi

mode_args() {
    case "$1" in
        colocated) echo "--gpus 1" ;;
        shared_k[1-9]) echo "--gpus 1 --async broker.max_staleness=${1#shared_k} learner.loss.correction=$CORRECTION" ;;
        *) echo "unknown mode $1" >&2; return 2 ;;
    esac
}

for mode in $MODES; do
    args=$(mode_args "$mode") || exit 2
    name="${mode}_s${SEED}"
    rm -rf "${RUNS:?}/$name" "$RUNS/$name.json"
    # shellcheck disable=SC2206
    CMD=($PY launch/cluster.py --recipe smollm2-gpu --max-steps "$STEPS" --no-live --run-dir "$RUNS/$name"
         --summary "$RUNS/$name.json" $args "model.path=$MODEL" "run.seed=$SEED" "run.eval_every=$EVAL_EVERY"
         "run.eval_samples=$EVAL_SAMPLES" "rollout.enforce_eager=$EAGER" "broker.groups_per_step=$NGROUPS"
         learner.checkpoint_every=0 "$@")
    echo "=== $(date -u +%FT%TZ) $name: ${CMD[*]}"
    echo "${CMD[*]}" > "$RUNS/$name.command.txt"
    nvidia-smi pmon -s um -d 1 -f "$RUNS/$name.pmon.txt" > /dev/null 2>&1 &
    pmon=$!
    t0=$(date +%s)
    timeout -s TERM -k 60 "$LIMIT_S" "${CMD[@]}" > "$RUNS/$name.cluster.log" 2>&1
    rc=$?
    t1=$(date +%s)
    kill "$pmon" 2>/dev/null; wait "$pmon" 2>/dev/null
    printf '{"case": "%s", "seed": %d, "rc": %d, "job_wall_s": %d}\n' "$mode" "$SEED" "$rc" $((t1 - t0)) \
        > "$RUNS/$name.cmd.json"
    echo "=== $(date -u +%FT%TZ) $name rc=$rc wall=$((t1 - t0))s"
    tail -3 "$RUNS/$name.cluster.log"
    rm -rf "$RUNS/$name/export" "$RUNS/$name/checkpoints" "$RUNS/$name/cache" "$RUNS/$name/spool"  # weights, not results
done

# every mode and seed run so far on this machine: one collection, one figure
cases=$(ls "$RUNS" | sed -n 's/^\(colocated\|shared_k[0-9]*\)_s[0-9]*\.json$/\1/p' | sort -u | paste -sd,)
seeds=$(ls "$RUNS" | sed -n 's/^\(colocated\|shared_k[0-9]*\)_s\([0-9]*\)\.json$/\2/p' | sort -un | paste -sd,)
$PY bench/e2e.py --out-dir "$RUNS" --collect-only --cases "$cases" --seeds "$seeds" --steps "$STEPS" --gpus 1 \
    --recipe smollm2-gpu --eval-every "$EVAL_EVERY" --eval-samples "$EVAL_SAMPLES" \
    --json "$RUNS/e2e.json" --png "$D/e2e_shared_gpu.png"
$PY - "$RUNS" "$D/e2e_shared_gpu.json" <<'EOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from pmon import busy_by_process, parse
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
res = json.loads((runs / "e2e.json").read_text()) if (runs / "e2e.json").exists() else {}
per = {}
for f in sorted(runs.glob("*.cmd.json")):
    name = f.name[:-len(".cmd.json")]
    s = json.loads((runs / f"{name}.json").read_text()) if (runs / f"{name}.json").exists() else {}
    pm = runs / f"{name}.pmon.txt"
    st = runs / name / "metrics" / "learner_steps.jsonl"
    rows = [json.loads(x) for x in st.read_text().splitlines() if x.strip()] if st.exists() else []
    peak = max((r["gpu_max_reserved_gib"] for r in rows if "gpu_max_reserved_gib" in r), default=None)
    per[name] = {**json.loads(f.read_text()), "mode": s.get("mode"), "busy": s.get("busy"),
                 "memory_split": s.get("memory_split"), "groups_lost": s.get("groups_lost"),
                 "max_staleness_seen": s.get("max_staleness_seen"), "error": s.get("error"),
                 "eval_before": s.get("eval_accuracy_before"), "eval_after": s.get("eval_accuracy_after"),
                 "eval_history": s.get("eval_history"), "learner_peak_reserved_gib": peak,
                 "pmon": busy_by_process(parse(pm.read_text(errors="replace"))) if pm.exists() else None}
res["per_run"] = per
res["commit"] = (runs / "commit.txt").read_text().strip() if (runs / "commit.txt").exists() else None
res["gpu"] = (runs / "nvidia_smi.csv").read_text() if (runs / "nvidia_smi.csv").exists() else None
out.write_text(json.dumps(res, indent=2))
for name, r in per.items():
    b = r["busy"] or {}
    print(name, "rc", r["rc"], "mode", r["mode"], "acc", r["eval_before"], "->", r["eval_after"],
          "steps/s", b.get("steps_per_s"), "gen busy", b.get("generation_busy_fraction"),
          "train busy", b.get("training_busy_fraction"), "train gpu", b.get("training_gpu_busy_fraction"),
          "overlap", b.get("overlap_fraction"), "learner peak GiB", r["learner_peak_reserved_gib"],
          "lost", r["groups_lost"], "error", r["error"])
    for proc, p in (r["pmon"] or {}).items():
        print("   pmon", proc, p["sm_mean_pct"], "% sm mean,", p["sm_active_fraction"], "of samples active")
print("headline (colocated time to its final accuracy / best shared):", res.get("headline"))
print("per-step speedup over colocated:", {k: v.get("per_step_speedup_over_colocated") for k, v in res.get("per_seed", {}).items()})
EOF
# per run: summary, steps, command, pmon, log tails (two folders down at most when unpacked)
(cd "$RUNS" && for n in $(ls | sed -n 's/\.cmd\.json$//p'); do
     mkdir -p "pack/$n"
     cp "$n.json" "$n.cmd.json" "$n.command.txt" "$n.pmon.txt" "pack/$n/" 2>/dev/null
     cp "$n/metrics/learner_steps.jsonl" "pack/$n/" 2>/dev/null
     for f in "$n"/logs/*.log "$n"/vllm-0/vllm_server.log "$n.cluster.log"; do
         [ -f "$f" ] && grep -v "GET /health\|POST /v1/completions" "$f" | tail -200 > "pack/$n/$(basename "$f").tail"
     done
 done; cp e2e.json commit.txt nvidia_smi.csv pack/ 2>/dev/null; tar czf "$D/runs.tar.gz" -C pack . && rm -rf pack)
ls -la "$D"
