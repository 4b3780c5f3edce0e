#!/usr/bin/env bash
# bench/gpu_calls.sh STEP... - the steps of the GPU runs behind bench/results/ (2x H200 machine, no
# network). Run from the repository root; output goes to stdout and to files under $OUT (default
# ./gpu-out). The engine wheels travel as part folders (.device-bundle/, see
# ../shared/device/README.md) and the few pure-Python deps of fleetrl as wheels in .whl/.
#
#   stage-vllm-1 stage-vllm-2 stage-sglang-1..3   copy a transported part folder into /tmp/stage
#   base            pip-install .whl/*.whl into /tmp/site-base (pydantic, msgspec, megatron-core)
#   info            GPUs, torch, NCCL
#   torch           bench/weight_sync.py + tests/gpu/test_weight_sync_gpu.py + tests/gpu/test_fsdp_gpu.py
#   vllm-install    install the vLLM 0.26 bundle into /tmp/site-vllm
#   vllm-tests      tests/gpu/test_vllm_gpu.py (TP=1, NCCL publish) and test_vllm_tp2_gpu.py (TP=2)
#   rollout         bench/rollout.py (fleet vs LLM.generate)
#   sglang-install  install the SGLang 0.5.16 bundle into /tmp/site-sglang
#   sglang          bench/sglang_flags.py alongside tests/gpu/test_sglang_gpu.py
set -uo pipefail
REPO="$(pwd)"
OUT="${OUT:-$REPO/gpu-out}"
mkdir -p "$OUT"
# NVLink multicast stays off on the shared 2-GPU host (KINDS.md), in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4 TOKENIZERS_PARALLELISM=false
export FLEETRL_GPU_RESULTS="$OUT/gpu_results.jsonl"
PY=python3

stamp() { echo "=== $(date -u +%FT%TZ) $*"; }

stage() {  # stage BUNDLE PART
    mkdir -p "/tmp/stage/$1" && cp -r "$REPO/.device-bundle/$1/$2/." "/tmp/stage/$1/" && ls /tmp/stage/$1 | wc -l
}

base() {
    [ -f /tmp/site-base/.done ] && return 0
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-base \
        "$REPO"/.whl/*.whl && touch /tmp/site-base/.done
}

with_site() {  # with_site SITE CMD...: run CMD with fleetrl, SITE and the base wheels importable
    local site="$1"; shift
    PYTHONPATH="$REPO:${site:+$site:}/tmp/site-base" "$@"
}

for step in "$@"; do
    stamp "$step"
    case "$step" in
        stage-vllm-1) stage vllm part1 ;;
        stage-vllm-2) stage vllm part2 ;;
        stage-sglang-1) stage sglang part1 ;;
        stage-sglang-2) stage sglang part2 ;;
        stage-sglang-3) stage sglang part3 ;;
        base) base ;;
        info)
            nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
            nvidia-smi topo -m || true
            with_site "" $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
            ;;
        torch)
            with_site "" timeout 300 $PY bench/weight_sync.py --reps 3 --json "$OUT/weight_sync.json"
            tests="tests/gpu/test_weight_sync_gpu.py"
            [ -f tests/gpu/test_fsdp_gpu.py ] && tests="$tests tests/gpu/test_fsdp_gpu.py"
            with_site "" timeout 240 $PY -m pytest -v -rA -p no:cacheprovider $tests
            ;;
        vllm-install)
            TARGET=/tmp/site-vllm bash /tmp/stage/vllm/install-bundle.sh /tmp/stage/vllm 2>&1 | tail -15
            ;;
        vllm-tests)
            export VLLM_USE_FLASHINFER_SAMPLER=0 FLEETRL_VLLM_RUN_DIR=/tmp/vllm-tp1 FLEETRL_VLLM_TP2_RUN_DIR=/tmp/vllm-tp2
            with_site /tmp/site-vllm $PY -m pytest -v -rA -p no:cacheprovider tests/gpu/test_vllm_gpu.py \
                tests/gpu/test_vllm_tp2_gpu.py
            for d in /tmp/vllm-tp1 /tmp/vllm-tp2; do
                [ -f $d/vllm_server.log ] && { echo "--- tail of $d/vllm_server.log"; grep -v "GET /health\|POST /v1/completions" $d/vllm_server.log | tail -25; }
            done
            ;;
        rollout)
            VLLM_USE_FLASHINFER_SAMPLER=0 with_site /tmp/site-vllm $PY bench/rollout.py --json "$OUT/rollout.json"
            tail -5 /tmp/fleetrl-bench-rollout/engine_offline.log
            ;;
        sglang-install)
            TARGET=/tmp/site-sglang bash /tmp/stage/sglang/install-bundle.sh /tmp/stage/sglang 2>&1 | tail -15
            ;;
        sglang)
            with_site /tmp/site-sglang $PY bench/sglang_flags.py --json "$OUT/sglang_flags.json" > "$OUT/sglang_flags.log" 2>&1 &
            flags=$!
            FLEETRL_SGLANG_LOG=/tmp/sglang-test.log with_site /tmp/site-sglang $PY -m pytest -v -rA -p no:cacheprovider \
                tests/gpu/test_sglang_gpu.py
            echo "--- tail of the SGLang test server log"; tail -30 /tmp/sglang-test.log
            wait $flags
            tail -12 "$OUT/sglang_flags.log"
            ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    stamp "$step done (rc=$?)"
done
