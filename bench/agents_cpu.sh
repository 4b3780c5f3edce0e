#!/usr/bin/env bash
# The multi-turn CPU run (launch/recipes/agents-tiny.yaml): chain-addition episodes on the tiny model.
# Writes bench/results/agents_cpu/{command.txt,output.log,summary.json}. Run under the heavy lock.
set -u
cd "$(dirname "$0")/.."
out=bench/results/agents_cpu
mkdir -p "$out"
cmd=(.venv/bin/python launch/cluster.py --rollout-gpus 0 --learner-gpus 0 --recipe agents-tiny
     --run-dir runs/agents-tiny --summary "$out/summary.json" "$@")
{ echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse --short HEAD)"; echo "command: ${cmd[*]}"; } > "$out/command.txt"
start=$(date +%s)
"${cmd[@]}" > "$out/output.log" 2>&1
rc=$?
echo "rc: $rc, wall: $(( $(date +%s) - start )) s" >> "$out/command.txt"
exit $rc
