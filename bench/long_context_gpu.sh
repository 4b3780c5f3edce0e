#!/usr/bin/env bash
# The longest single response (prompt 512 tokens) one GPU trains, per model shape, and tokens/s there
# (issue 41 item 4). Not run on the CPU box: for the GPU machine.
#
#   bench/long_context_gpu.sh 0.5b            # one shape per call (each fits a 10-minute device command)
#   bench/long_context_gpu.sh 1.5b
#   VARIANT=ac_offload bench/long_context_gpu.sh 1.5b    # + parameter/optimizer shards in CPU memory
#   GPUS=2 VARIANT=ac_sp2 bench/long_context_gpu.sh 1.5b # Ulysses SP=2 over 2 GPUs (the same row split in two)
#
# Each length is one bench/learner.py case: a fresh process per GPU, the random Qwen2-shaped model of
# --shape, a step batch of 2 sequences of 512 + RESPONSE tokens (one group, different rewards, so both
# train), one packed row per sequence (--micro-tokens = the sequence), activation checkpointing, chunked
# log-probs and varlen attention (variant "ac"), one warm-up step and STEPS timed steps. Lengths double
# from START until a case fails (CUDA out of memory, or the case timeout), then BISECT steps of bisection
# between the last length that trained and the first that did not. Every case writes its JSON
# (tokens_per_s, step_s, peak_mem_gib, or error) to OUT/<shape>_<variant>_<response>.json; the summary line
# per case goes to OUT/<shape>_<variant>.txt.
set -u
SHAPE=${1:?usage: $0 0.5b|1.5b}
VARIANT=${VARIANT:-ac}
GPUS=${GPUS:-1}
START=${START:-8192}
MAX=${MAX:-262144}
BISECT=${BISECT:-2}
STEPS=${STEPS:-1}
CASE_TIMEOUT=${CASE_TIMEOUT:-240}
OUT=${OUT:-bench/results/long_context}
PY=${PY:-python}
mkdir -p "$OUT"
SUMMARY="$OUT/${SHAPE}_${VARIANT}.txt"

# 0 if RESPONSE trains (the case has tokens_per_s), 1 otherwise; appends the case's line to the summary.
try() {
  local r=$1 json="$OUT/${SHAPE}_${VARIANT}_$1.json"
  "$PY" bench/learner.py --shape "$SHAPE" --cases "fsdp:1:${GPUS}:${VARIANT}" --seqs 2 --prompt 512 \
    --response "$r" --micro-tokens $((r + 512)) --steps "$STEPS" --case-timeout "$CASE_TIMEOUT" \
    --budget-s $((CASE_TIMEOUT + 300)) --json "$json" > "$OUT/${SHAPE}_${VARIANT}_$r.log" 2>&1
  "$PY" - "$json" "$r" >> "$SUMMARY" <<'EOF'
import json, sys
try:
    c = json.load(open(sys.argv[1]))["cases"][0]
except (OSError, ValueError, IndexError, KeyError) as e:
    print(f"response {sys.argv[2]}: no result ({e})"); sys.exit(1)
if c.get("tokens_per_s") is None:
    print(f"response {sys.argv[2]}: FAILED {str(c.get('error'))[:200]!r}"); sys.exit(1)
print(f"response {sys.argv[2]}: ok {c['tokens_per_s']:.0f} tokens/s, step {c['step_s']:.1f} s, "
      f"peak {c['peak_mem_gib']:.1f} GiB")
EOF
  local rc=$?
  tail -1 "$SUMMARY"
  return $rc
}

echo "# $(date -u +%FT%TZ) shape=$SHAPE variant=$VARIANT gpus=$GPUS prompt=512 seqs=2 steps=$STEPS" >> "$SUMMARY"
ok=0 bad=0 r=$START
while [ "$r" -le "$MAX" ]; do
  if try "$r"; then ok=$r; r=$((r * 2)); else bad=$r; break; fi
done
for _ in $(seq "$BISECT"); do
  [ "$bad" -gt 0 ] && [ "$ok" -gt 0 ] || break
  mid=$(( (ok + bad) / 2 / 512 * 512 ))
  [ "$mid" -gt "$ok" ] || break
  if try "$mid"; then ok=$mid; else bad=$mid; fi
done
[ "$bad" -gt 0 ] && first="$bad" || first="none up to $MAX"
echo "longest response trained: $ok tokens (0: not even $START); first that did not: $first" | tee -a "$SUMMARY"
