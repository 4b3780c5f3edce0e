#!/usr/bin/env bash
# Long-tail rollout + training on ONE GPU (issue 41 item 4): a random-weight Qwen2-0.5B-shaped model with
# SmolLM2's tokenizer, prompts whose response budgets follow a lognormal long tail, every response exactly
# its budget long (rollout.sampling.ignore_eos=true + the dataset's per-row max_tokens column), trained by the
# FSDP learner with its long-context settings (activation checkpointing, chunked log-probs, varlen attention),
# through launch/cluster.py --gpus 1. Ran on one H200 on 2026-12-06 (MODE=colocated; bench/results/long_context/
# long_tail_gpu/, docs/long_context.md). Checked on CPU before: the config and preflight
# of this command line (launch/cluster.py --dry-run, the SmolLM2 tokenizer), and the same keys in real CPU runs
# on the tiny model (--colocate: every step's responses were exactly its block's budgets, finish 'length';
# and the async CPU default) collected by bench/long_tail_collect.py.
#
#   MODE=colocated  bash bench/long_tail_gpu.sh     # --gpus 1: the engine sleeps while the learner trains (k = 0)
#   MODE=shared_k1  bash bench/long_tail_gpu.sh     # --gpus 1 --async: engine and learner resident, fleet 1 ahead
#   (through bench/gpu_calls.sh: `OUT=$OUT MODE=... bash bench/gpu_calls.sh long-tail`, after stage-vllm-1,
#    stage-vllm-2 base vllm-install, ray-install, stage-smol-a, stage-smol-b smollm2)
#
# The length choice (CAP, the longest budget; default 16,384). The learner trains 262,144-token responses at
# 0.5B (docs/long_context.md), but decoding is sequential: one response of L tokens takes L times the
# engine's per-token latency, which for a 0.5B model in vLLM with CUDA graphs is a few milliseconds and grows
# with the context (each step reads the whole KV cache). At ~4-8 ms a token a 16k response takes ~65-130 s,
# a 32k one ~2-4 min and a 262k one 17+ min: more than one 10-minute device call. A synchronous step waits
# for its longest response, so the cap sets the step time. With the defaults (16 prompts x n=4 a step,
# budgets lognormal median 1,024, sigma 1.5, stratified so that every step holds the whole distribution,
# its largest budget 10k-16k) a step is ~1-2 min of generation and ~160k response tokens (~5-10 s of
# training); with ~2 min of start (Ray, vLLM, CUDA graphs, model load) three steps fit LIMIT_S=540 and the
# default STEPS=4 completes only if generation runs near the fast end. For the 32k point: CAP=32768 STEPS=2
# (a call of its own). Steps that do not finish before the limit are lost, the ones before are kept: the run is stopped
# with SIGTERM (its summary is still written) and everything below is collected whatever the exit status.
#
# Writes $OUT/long_tail/ (few files: the device tool returns a handful, two folders deep):
#   long_tail_<MODE>.json   per step: wall, generation and training seconds, tokens/s trained and generated,
#                           response length min/p50/p90/max/mean, truncated samples, learner peak GiB; totals:
#                           learner idle fraction, busy fractions, peak GPU memory (nvidia-smi, all processes),
#                           the budget distribution's quantiles (designed and drawn), settings, rc
#   <MODE>_files.tar.gz     summary.json, learner_steps.jsonl, learner.jsonl, the command, budgets.json,
#                           nvidia-smi samples, log tails
#   console.log             this script's output
#
# Knobs (environment): MODE, CAP, MEDIAN, SIGMA, NGROUPS (prompts a step), N (samples a prompt), STEPS, SEED,
# SHAPE (0.5b | 1.5b), MBT (learner.micro_batch_tokens), EAGER (vLLM --enforce-eager), LIMIT_S (the whole
# script), SMOL (SmolLM2's folder: its tokenizer), LT_WORK (machine-local work folder).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/out}
D="$OUT/long_tail"
MODE=${MODE:-colocated}
CAP=${CAP:-16384}
MEDIAN=${MEDIAN:-1024}
SIGMA=${SIGMA:-1.5}
NGROUPS=${NGROUPS:-16}
N=${N:-4}
STEPS=${STEPS:-4}
SEED=${SEED:-0}
SHAPE=${SHAPE:-0.5b}
PROMPT_MAX=256                         # data.max_prompt_tokens (the SmolLM2 chat template's prompts are ~40)
MBT=${MBT:-$((CAP + PROMPT_MAX > 32768 ? CAP + PROMPT_MAX : 32768))}  # the longest sequence fits one micro-batch
EAGER=${EAGER:-false}                  # CUDA graphs: decoding speed is what this run measures
LIMIT_S=${LIMIT_S:-540}                # the whole script, inside the device tool's 600 s
SMOL=${SMOL:-/tmp/models/smollm2-135m-instruct}
W=${LT_WORK:-/tmp/long_tail}
PY=${PY:-python3}
t_start=$(date +%s)
left() { echo $((LIMIT_S - ($(date +%s) - t_start))); }
mkdir -p "$D" "$W"
exec > >(tee -a "$D/console.log") 2>&1
export PYTHONPATH="$REPO:/tmp/site-vllm:/tmp/site-ray:/tmp/site-base${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0

case "$MODE" in
    colocated) MODE_ARGS=() ;;
    shared_k[1-9]) MODE_ARGS=(--async "broker.max_staleness=${MODE#shared_k}" learner.loss.correction=decoupled) ;;
    *) echo "unknown MODE $MODE (colocated | shared_k1 | shared_k2)" >&2; exit 2 ;;
esac
NAME=${MODE}_s${SEED}
RUN=$W/$NAME
rm -rf "$RUN" "$RUN".* && mkdir -p "$RUN"
echo "=== $(date -u +%FT%TZ) long_tail: mode $MODE shape $SHAPE cap $CAP median $MEDIAN sigma $SIGMA" \
     "groups $NGROUPS x n $N steps $STEPS seed $SEED mbt $MBT limit ${LIMIT_S}s"
git rev-parse --short HEAD > "$RUN.commit.txt" 2>/dev/null || echo unknown > "$RUN.commit.txt"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$RUN.nvidia_smi.csv"

# 1. the random model (positions for the longest prompt + response)
POS=$((CAP + 1024))
MODEL=/tmp/models/qwen2-$SHAPE-random-$POS
if [ ! -f "$MODEL/config.json" ]; then
    [ -f "$SMOL/tokenizer.json" ] || { echo "no SmolLM2 folder at $SMOL (bench/gpu_calls.sh smollm2)"; exit 2; }
    timeout 180 $PY bench/peers/random_model.py --like "$SMOL" --shape "$SHAPE" --max-positions "$POS" --out "$MODEL" \
        || { echo "random model build failed"; exit 2; }
fi

# 2. the data: enough stratified blocks for every step, and the distribution's quantiles
ROWS=$((NGROUPS * (STEPS + 2)))
timeout 60 $PY bench/long_tail_data.py --out "$RUN.train.parquet" --rows "$ROWS" --block "$NGROUPS" \
    --median "$MEDIAN" --sigma "$SIGMA" --cap "$CAP" --seed "$SEED" --summary "$RUN.budgets.json" > /dev/null \
    || { echo "data generation failed"; exit 2; }
$PY -c "import json,sys; b=json.load(open(sys.argv[1])); print('budgets', b['drawn_quantiles'], 'block max', b['per_block_max'])" \
    "$RUN.budgets.json"

# 3. the run, with GPU memory sampled every second (all processes: engine + learner)
# (the stall detector stays on at its default: a vLLM server decoding minutes-long responses answers nothing
# for minutes, but its generated-token count rises, which the fleet takes as progress; rollout_fleet/progress.py)
CMD=($PY launch/cluster.py --gpus 1 --recipe smollm2-gpu --max-steps "$STEPS" --no-live
     --run-dir "$RUN/run" --summary "$RUN.summary.json" "${MODE_ARGS[@]}"   # options first: then only KEY=VALUE
     "model.path=$MODEL" "data.train_files=[$RUN.train.parquet]" "data.test_files=[]" data.shuffle=false
     "data.max_prompt_tokens=$PROMPT_MAX" "reward.function=$REPO/bench/long_tail_data.py:spread_reward"
     reward.on_truncated=score rollout.sampling.ignore_eos=true "rollout.sampling.max_tokens=$CAP"
     "rollout.sampling.n=$N" "rollout.max_model_len=$((CAP + PROMPT_MAX))" "rollout.enforce_eager=$EAGER"
     rollout.request_timeout_s=900 "broker.groups_per_step=$NGROUPS"
     run.eval_every=0 run.eval_samples=0 "run.seed=$SEED"
     learner.activation_checkpointing=true learner.logprobs=chunked learner.attn_implementation=varlen
     "learner.micro_batch_tokens=$MBT" learner.checkpoint_every=0 learner.log_samples_every=0 "$@")
echo "${CMD[*]}" > "$RUN.command.txt"
echo "=== $(date -u +%FT%TZ) $NAME: ${CMD[*]}"
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -l 1 \
    > "$RUN.smi.csv" 2> /dev/null &
smi=$!
# Ray and vLLM workers can outlive a run stopped by its timeout and hold the GPU: afterwards the processes
# started since this snapshot (ours by command line) are ended by PID.
ps -eo pid= | tr -d ' ' | sort > "$RUN.ps_before"
t0=$(date +%s)
budget=$(( $(left) - 75 ))             # room for the TERM grace (-k 60) and the collection
timeout -s TERM -k 60 "$budget" "${CMD[@]}" > "$RUN.cluster.log" 2>&1
rc=$?
t1=$(date +%s)
kill "$smi" 2> /dev/null; wait "$smi" 2> /dev/null
echo "=== $(date -u +%FT%TZ) $NAME rc=$rc wall=$((t1 - t0))s (limit ${budget}s)"
grep -v "GET /health\|POST /v1/completions" "$RUN.cluster.log" | tail -5
for sig in TERM KILL; do
    for p in $(comm -13 "$RUN.ps_before" <(ps -eo pid= | tr -d ' ' | sort)); do
        [ "$p" != "$$" ] && cat "/proc/$p/cmdline" 2> /dev/null | tr '\0' ' ' | grep -qE "ray|vllm|launch/cluster" \
            && kill -"$sig" "$p" 2> /dev/null
    done
    [ "$sig" = TERM ] && sleep 3
done
printf '{"bench_mode": "%s", "rc": %d, "job_wall_s": %d, "limit_s": %d}\n' "$MODE" "$rc" $((t1 - t0)) "$budget" > "$RUN.rc.json"

# 4. collect (whatever the run got to)
timeout 60 $PY bench/long_tail_collect.py "$RUN" "$D/long_tail_$MODE.json"
echo "collect rc=$?"

# 5. pack the run's own files (one archive; weights and spool left out)
P=$W/pack_$NAME
rm -rf "$P" && mkdir -p "$P"
cp "$RUN".{summary.json,command.txt,budgets.json,smi.csv,rc.json,commit.txt,nvidia_smi.csv} "$P/" 2> /dev/null
cp "$RUN"/run/metrics/learner_steps.jsonl "$RUN"/run/metrics/learner.jsonl "$P/" 2> /dev/null
for f in "$RUN".cluster.log "$RUN"/run/logs/*.log "$RUN"/run/*/vllm_server.log; do
    [ -f "$f" ] && grep -v "GET /health\|POST /v1/completions" "$f" | tail -300 > "$P/$(basename "$f").tail"
done
tar czf "$D/${MODE}_files.tar.gz" -C "$P" . && rm -rf "$P"
ls -la "$D"
echo "=== $(date -u +%FT%TZ) done in $(($(date +%s) - t_start)) s"
