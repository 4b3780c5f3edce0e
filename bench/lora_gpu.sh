#!/usr/bin/env bash
# LoRA on ONE GPU (vLLM: run on an H200, bench/results/lora/gpu_h200/): bench/lora_publish.py at the Qwen2-0.5B
# shape and at the Qwen2.5-7B shape (random weights, nothing downloaded). Per shape: adapter publish seconds and bytes
# (peft folder written by the learner, loaded into a LoRA-enabled vLLM server under a new name) against the
# full-weight publish from disk (merged export + reload), and the seconds and peak GPU memory of one LoRA
# training step with the vLLM server resident on the same GPU. Writes $OUT/lora_gpu/{0.5b,7b}.json and logs;
# copy them to bench/results/lora/ and the numbers into docs/lora.md.
# ENGINE=sglang (run on an H100, bench/results/lora/sglang_h100/; needs the SGLang 0.5.16 bundle on PYTHONPATH,
# bench/gpu_calls.sh lora-sglang): the same with a LoRA-enabled SGLang server (GPU_UTIL is its --mem-fraction-static)
# into $OUT/lora_sglang/, the server log beside each JSON as $SHAPE-server.log. FULL: full publishes per shape (2).
#
#   export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
#   bash bench/lora_gpu.sh                     # RANK=64 ALPHA=32 UPDATES=5 SEQS=64 by default
#
# Needs vLLM (the slim bundle in /tmp/site, as bench/e2e_gpu.sh). The 7B shape: 15 GB of bf16 weights on
# disk and in the server (GPU_UTIL 0.35 of 80 GB = 28 GB with its KV cache), the frozen base in fp32 in the
# learner (30 GB: the learner keeps fp32 master weights), activation checkpointing on; if it does not fit on
# an 80 GB H100, run it on an H200 (needs_h200) or set GPU_UTIL lower and SEQS smaller, and say so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
ENGINE=${ENGINE:-vllm}
case "$ENGINE" in
  vllm) D="$OUT/lora_gpu" ;;
  sglang) D="$OUT/lora_sglang" ;;
  *) echo "ENGINE must be vllm or sglang, got '$ENGINE'" >&2; exit 2 ;;
esac
mkdir -p "$D"
RANK=${RANK:-64}
ALPHA=${ALPHA:-32}
UPDATES=${UPDATES:-5}
SEQS=${SEQS:-64}
GPU_UTIL=${GPU_UTIL:-0.35}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
PY=${PY:-python3}
date -u +%FT%TZ > "$D/date.txt"
git rev-parse HEAD > "$D/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$D/nvidia_smi_before.csv" 2>&1
for SHAPE in ${SHAPES:-0.5b 7b}; do
  timeout "${LIMIT_S:-560}" $PY bench/lora_publish.py --engine "$ENGINE" --shape "$SHAPE" --rank "$RANK" --alpha "$ALPHA" \
    --updates "$UPDATES" --full-publishes "${FULL:-2}" --seqs "$SEQS" --gpu-memory-utilization "$GPU_UTIL" --run-dir "$D/run-$SHAPE" \
    --json "$D/$SHAPE.json" > "$D/$SHAPE.log" 2>&1
  echo "$SHAPE: rc=$? ($D/$SHAPE.log)"
  tail -3 "$D/$SHAPE.log"
  rm -rf "$D/run-$SHAPE/model" "$D/run-$SHAPE/export"   # the random weights: gigabytes, nothing to keep
  if [ "$ENGINE" = sglang ]; then   # few files back: the server log beside the JSON, no adapters (1 GB at 7B)
    [ -f "$D/run-$SHAPE/sglang_server.log" ] && grep -v "GET /health" "$D/run-$SHAPE/sglang_server.log" | tail -400 > "$D/$SHAPE-server.log"
    rm -rf "$D/run-$SHAPE"
  fi
done
