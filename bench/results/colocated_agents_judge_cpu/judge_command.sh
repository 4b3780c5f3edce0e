cd /work/wt-23
J='{"kind": "judge", "model": "tiny-judge", "template": "{response}+0=", "verdict": "(YES|NO)", "scores": {"YES": 0.95, "NO": 0.05}, "max_tokens": 4, "timeout_s": 30, "extra_body": {"structured_outputs": {"choice": ["YES", "NO"]}}, "server": {"max_model_len": 64, "enforce_eager": true, "colocated": true}}'
date -u +%FT%TZ
timeout 900 .venv/bin/python launch/cluster.py --colocate --recipe tiny --max-steps 3 --no-live --run-dir /tmp/wt23/coloc-judge --summary /tmp/wt23/coloc-judge.json run.eval_samples=0 "reward.model=$J"
echo rc=$?
