#!/usr/bin/env bash
# bench/peers/verl.sh CASE SYSTEM - verl 0.9.1 and fleetrl (colocated, as shipped) on the same work, on one GPU,
# one system per call, in one lease (the machine keeps /tmp between calls while it stays warm). Issue 36.
# STATUS: run on one H100 for the smol case (2026-12-07: SYSTEM fleetrl, verl with the `best` and `colocate_async`
# attempts, compare) and for q15-1k (fleetrl, verl `best`; bench/results/peers/h100_2026-12-07/, and with every
# group trained in h100_2026-12-07b/). The q15-4k and q3b-1k cases have not run yet.
# Time a q15-1k call needs on a slow host (2026-12-07, fourth lease): fleetrl ~320 s for 4 steps once the Inductor
# cache is warm (LIMIT_S=260 with a cold cache ran 1 step); verl `best` ~430 s for 2 steps: give it LIMIT_S >= 520
# (a 600 s call) for 4.
# The verl command is ../shared/peers/verl/run_verl.sh (see that README).
# The device call's own limit: at least LIMIT_S + 90 s (a run gets a 30-60 s grace after LIMIT_S), plus ~60 s when
# `bench/gpu_calls.sh smollm2` runs in the same call. A call stopped at its limit returns only what bench/mirror.sh
# had copied: $OUT/fleetrl_CASE_live/learner_steps.jsonl, $OUT/verl_CASE_ATTEMPT_live/verl.log (2026-12-07: a
# `smollm2` + q15-1k fleetrl call given 335 s for LIMIT_S=280 returned nothing).
#
#   CASE    smol     SmolLM2-135M-Instruct, word problems, 32 prompts x n=8, 512-token responses (the measured work)
#           q15-1k   random Qwen2-1.5B shape (SmolLM2's tokenizer), 16 prompts x 8, 1,024-token responses
#           q15-4k   the same, 8 prompts x 8, 4,096-token responses
#           q3b-1k   random Qwen2.5-3B shape, 16 prompts x 8, 1,024 tokens (a candidate for the largest shape
#                    that fits one GPU for both; verl with gradient checkpointing)
#   SYSTEM  fleetrl  launch/cluster.py --gpus 1 (colocated, recipe smollm2-gpu, every learner "auto" as shipped),
#                    and FLEETRL_UNIFORM for the groups whose rewards are all equal (with a random-weight model
#                    nearly every group; the q15-1k figure of 2026-12-07 dropped them, bench/results/peers/README.md):
#                      train (default)  trained as verl trains them: the same compute as verl's
#                      skip             not computed, counted in the loss's mean: verl's gradient, what a verl
#                                       command runs (learner.loss.uniform_groups_in_mean, docs/verl.md)
#                      drop             not computed, not counted: fleetrl's own default
#           verl     verl's GRPO trainer, its best settings that run here first (VERL_ATTEMPTS, below); an
#                    attempt that fails before two steps is recorded with its error and the next is tried
#           compare  bench/peers/compare.py over both -> $OUT/peers_CASE.json (top-level "ratio" = fleetrl step /
#                    verl's best step; commit it as bench/results/peers/CASE.json)
#
# Before the first call of a lease (bench/gpu_calls.sh, one call each): stage-vllm-1 stage-vllm-2 base vllm-install
# ray-install stage-smol-a stage-smol-b smollm2. Carry .peers (ignored: echo /.peers/ >> .git/info/exclude):
#   bash ../shared/peers/verl/build-verl-site.sh .peers/verl-site       # where pip reaches the registry
#   mkdir -p .peers/verl && cp ../shared/peers/verl/{run_verl.sh,verl_reward.py} .peers/verl/
#
# verl's attempts (VERL_ATTEMPTS, comma-separated, default all three in this order):
#   best       dynamic batch size for the update and the log-prob passes with a larger token budget, verl's
#              torch.compile of its log-prob/entropy functions, its fused (chunked) head kernels
#   nofused    best without the fused kernels
#   as_written run_verl.sh as measured (dynamic batch size, 16,384 tokens)
#   colocate_async  not in the default list: best in verl's V1 `colocate_async` trainer mode
#              (trainer.v1.trainer_mode, verl/trainer/ppo/v1/trainer_colocate_async.py: engine and trainer on the
#              same GPU, the rollout one batch ahead with partial rollouts, sleep/wake around training), the
#              verl side of issue 37's shared-GPU comparison: VERL_ATTEMPTS=colocate_async ... smol verl
# Not tried, and why: use_remove_padding=True (verl's unpadding imports flash_attn, which has no wheel for torch
# 2.11 here), Liger kernels (not installed).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
CASE=${1:?CASE: smol | q15-1k | q15-4k | q3b-1k}
SYSTEM=${2:?SYSTEM: fleetrl | verl | compare}
OUT=${OUT:-/tmp/out}
WORK=${PEERS_WORK:-/tmp/peers}/$CASE
VERL_SITE=${VERL_SITE:-$REPO/.peers/verl-site}
VERL_FILES=${VERL_FILES:-$REPO/.peers/verl}
SMOL=${SMOL:-/tmp/models/smollm2-135m-instruct}
LIMIT_S=${LIMIT_S:-540}  # this call's whole run, inside the device tool's 600 s
DATA=$REPO/data/word_problems
PY=python3
FLEETRL_PATH="$REPO:/tmp/site-vllm:/tmp/site-ray:/tmp/site-base"  # fleetrl and the sites gpu_calls.sh installs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
mkdir -p "$OUT" "$WORK"
# shellcheck source=bench/mirror.sh
. "$REPO/bench/mirror.sh"  # mirror_start / mirror_stop: a run's files into $OUT while it runs
t_start=$(date +%s)
left() { echo $((LIMIT_S - ($(date +%s) - t_start))); }

SHAPE="" AC=False
case "$CASE" in
    smol)   MODEL=$SMOL; PROMPTS=32; RESP=512; STEPS=8; TOK=32768 ;;
    q15-1k) SHAPE=1.5b; PROMPTS=16; RESP=1024; STEPS=4; TOK=16384 ;;
    q15-4k) SHAPE=1.5b; PROMPTS=8; RESP=4096; STEPS=3; TOK=16384 ;;
    q3b-1k) SHAPE=3b; PROMPTS=16; RESP=1024; STEPS=3; TOK=16384; AC=True ;;
    *) echo "unknown CASE $CASE" >&2; exit 2 ;;
esac
if [ -n "$SHAPE" ]; then
    MODEL=/tmp/models/qwen2-$SHAPE-random
    PYTHONPATH="$REPO:/tmp/site-base" $PY bench/peers/random_model.py --like "$SMOL" --shape "$SHAPE" --out "$MODEL" \
        || { echo "random model build failed (is $SMOL there? bench/gpu_calls.sh smollm2)" >&2; exit 2; }
fi
[ -f "$MODEL/config.json" ] || { echo "no model at $MODEL (bench/gpu_calls.sh ... smollm2)" >&2; exit 2; }
MAXLEN=$((512 + RESP))
UNIFORM=${FLEETRL_UNIFORM:-train}
case "$UNIFORM" in train | skip | drop) ;; *) echo "FLEETRL_UNIFORM: train, skip or drop, got $UNIFORM" >&2; exit 2 ;; esac
$PY - "$WORK/case.json" "$CASE" "$MODEL" "$PROMPTS" "$RESP" "$STEPS" "$UNIFORM" <<'EOF'
import json, subprocess, sys
out, case, model, prompts, resp, steps, uniform = sys.argv[1:]
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout
json.dump({"case": case, "model": model, "fleetrl_uniform_groups": uniform,
           "prompts_per_step": int(prompts), "n": 8, "response_tokens": int(resp),
           "steps": int(steps), "device": gpu.strip().splitlines()[0] if gpu.strip() else None,
           "work": "word problems (data/word_problems), GRPO, lr 5e-6, one optimizer step per batch, no KL, T=1.0"},
          open(out, "w"), indent=1)
EOF

# Ray and vLLM workers can outlive a run stopped by its timeout and hold the GPU: after each run, end the
# processes it started (new since the run began, ours by command line), by PID.
snapshot() { ps -eo pid= | tr -d ' ' | sort; }
ours() { cat "/proc/$1/cmdline" 2> /dev/null | tr '\0' ' ' | grep -qE "ray|vllm|verl|python"; }
end_new() {  # end_new SNAPSHOT_FILE: TERM, then KILL, the processes started since the snapshot (by PID)
    local p sig
    for sig in TERM KILL; do
        for p in $(comm -13 "$1" <(snapshot)); do
            [ "$p" != "$$" ] && ours "$p" && kill -"$sig" "$p" 2> /dev/null
        done
        [ "$sig" = TERM ] && sleep 5
    done
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
}
snapshot > "$WORK/ps_before"
used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
[ "${used:-0}" -gt 2048 ] && echo "warning: ${used} MiB of GPU memory already in use before this run"

run_fleetrl() {
    local d=$WORK/fleetrl
    rm -rf "$d" && mkdir -p "$d"
    cp "$WORK/case.json" "$d/"
    # as shipped: the recipe's work, every learner fast path and the micro-batch budget on "auto"
    local cmd=($PY launch/cluster.py --gpus 1 --recipe smollm2-gpu --max-steps "$STEPS" --no-live
               --run-dir "$d/run" --summary "$d/summary.json" "model.path=$MODEL" rollout.enforce_eager=false
               colocate.sleep=level1 run.eval_every=0 run.eval_samples=0 "broker.groups_per_step=$PROMPTS"
               "rollout.sampling.max_tokens=$RESP" "rollout.max_model_len=$MAXLEN"
               learner.micro_batch_tokens=auto learner.activation_checkpointing=auto)
    case "$UNIFORM" in
        train) cmd+=(learner.loss.drop_uniform_groups=false) ;;
        skip) cmd+=(learner.loss.drop_uniform_groups=true learner.loss.uniform_groups_in_mean=true) ;;
        drop) cmd+=(learner.loss.drop_uniform_groups=true learner.loss.uniform_groups_in_mean=false) ;;
    esac
    echo "${cmd[*]}" > "$d/command.txt"
    # the steps so far, while it runs: a call the device tool stops at its limit still returns them
    mirror_start "$OUT/fleetrl_${CASE}_live" "$d/run/metrics/learner_steps.jsonl" "$d/command.txt"
    PYTHONPATH="$FLEETRL_PATH" timeout -s TERM -k 60 "$(left)" "${cmd[@]}" \
        > "$d/cluster.log" 2>&1
    echo $? > "$d/rc"
    mirror_stop
    cp "$d/run/metrics/learner_steps.jsonl" "$d/" 2>/dev/null
    rm -rf "$d/run/export" "$d/run/checkpoints"
    cp "$d/learner_steps.jsonl" "$OUT/fleetrl_${CASE}_steps.jsonl" 2>/dev/null
    cp "$d/summary.json" "$OUT/fleetrl_${CASE}_summary.json" 2>/dev/null
    tail -c 200000 "$d/cluster.log" > "$OUT/fleetrl_${CASE}_cluster_tail.log"
    # the learner's settings and torch's reason for every recompile of its compiled blocks (learner/fastpath.py)
    grep -h "learner settings\|Recompiling\|guard failure\|  - " "$d"/run/logs/*.log 2>/dev/null | cut -c1-600 \
        | head -200 > "$OUT/fleetrl_${CASE}_compiles.log"
    # when each group began and ended generating: a late start adds to the step's generation span
    # (bench/peers/group_times.py, from the spool the broker kept)
    PYTHONPATH="$FLEETRL_PATH" $PY -m broker export "$d/run/spool" --out "$d/spool.parquet" > /dev/null 2>&1 \
        && PYTHONPATH="$FLEETRL_PATH" $PY "$REPO/bench/peers/group_times.py" "$d/spool.parquet" \
            --json "$OUT/fleetrl_${CASE}_groups.json"
    # the vLLM server's own view of generation: its resolved settings (async scheduling, CUDA graph mode, KV cache)
    # and its throughput lines every 10 s (a generation slower than verl's on the same engine is read here first)
    grep -h "non-default args\|Asynchronous scheduling\|cudagraph_mode\|KV cache size\|Maximum concurrency\|throughput\|Graph capturing\|sleep mode\|WARNING\|ERROR" \
        "$d"/run/vllm-*/vllm_server.log 2>/dev/null | cut -c1-2000 | head -400 > "$OUT/fleetrl_${CASE}_vllm.log"
    echo "fleetrl rc=$(cat "$d/rc"); $(wc -l < "$d/learner_steps.jsonl" 2>/dev/null || echo 0) steps"
}

verl_overrides() {  # verl_overrides ATTEMPT: the keys added to run_verl.sh's command
    local common=("data.train_batch_size=$PROMPTS" "data.max_response_length=$RESP"
                  "actor_rollout_ref.actor.ppo_mini_batch_size=$PROMPTS" "trainer.total_training_steps=$STEPS"
                  "actor_rollout_ref.model.enable_gradient_checkpointing=$AC")
    case "$1" in
        best) echo "${common[*]} actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$TOK" \
                   "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True" \
                   "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((2 * TOK))" \
                   "actor_rollout_ref.actor.use_torch_compile=True actor_rollout_ref.model.use_fused_kernels=True" ;;
        nofused) echo "${common[*]} actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$TOK" \
                      "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True" \
                      "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((2 * TOK))" \
                      "actor_rollout_ref.actor.use_torch_compile=True" ;;
        as_written) echo "${common[*]}" ;;
        colocate_async)  # issue 37: verl's own asynchronous mode on one GPU, with the best attempt's settings
            verl_overrides best && echo "trainer.use_v1=True trainer.v1.trainer_mode=colocate_async" \
                "trainer.v1.colocate_async.num_warmup_batches=1" ;;
        *) echo "unknown verl attempt $1" >&2; return 2 ;;
    esac
}

run_verl() {
    [ -f "$VERL_FILES/run_verl.sh" ] && [ -d "$VERL_SITE/verl" ] \
        || { echo "carry .peers: $VERL_FILES/run_verl.sh and $VERL_SITE/verl are needed (header)" >&2; exit 2; }
    local d=$WORK/verl
    mkdir -p "$d"
    cp "$WORK/case.json" "$d/"
    local n=0
    for attempt in $(echo "${VERL_ATTEMPTS:-best,nofused,as_written}" | tr , ' '); do
        if [ "$(left)" -lt 240 ]; then
            echo "verl $attempt: not started, $(left) s left of this call (run it in the next: VERL_ATTEMPTS=$attempt)"
            break
        fi
        local a=$d/attempt_$attempt
        rm -rf "$a" && mkdir -p "$a"
        local over
        over=$(verl_overrides "$attempt") || exit 2
        echo "$over" > "$a/overrides.txt"
        mirror_start "$OUT/verl_${CASE}_${attempt}_live" "$a/verl.log" "$a/overrides.txt"  # as the run goes
        # shellcheck disable=SC2086  # the overrides are whitespace-separated key=value words
        timeout -s TERM -k 30 "$(left)" bash "$VERL_FILES/run_verl.sh" "$VERL_SITE" "$MODEL" "$DATA" \
            trainer.default_local_dir=/tmp/verl_ckpt_$CASE $over > "$a/verl.log" 2>&1
        echo $? > "$a/rc"
        mirror_stop
        local steps
        steps=$(grep -c "timing_s/step" "$a/verl.log")
        grep -m1 -E "Error|error:|Traceback" "$a/verl.log" > "$a/error.txt"
        tail -c 150000 "$a/verl.log" > "$OUT/verl_${CASE}_${attempt}_tail.log"
        echo "verl $attempt: rc=$(cat "$a/rc"), $steps steps"
        n=$((n + 1))
        [ "$steps" -ge 2 ] && break  # the best that runs: later attempts are the fallbacks
    done
    [ "$n" -gt 0 ]
}

case "$SYSTEM" in
    fleetrl) run_fleetrl ;;
    verl) run_verl ;;
    compare) ;;
    *) echo "unknown SYSTEM $SYSTEM" >&2; exit 2 ;;
esac
rc=$?
[ "$SYSTEM" = compare ] || end_new "$WORK/ps_before"
# the comparison as far as the two runs got (either may still be missing: its part says so)
PYTHONPATH="$REPO" $PY bench/peers/compare.py --case "$CASE" --fleetrl "$WORK/fleetrl" --verl "$WORK/verl" \
    --json "$OUT/peers_$CASE.json" || true
exit $rc
