"""Per-turn greedy accuracy of chain-addition episodes (transformers, fp32), before and after a run.

python bench/agents_cpu_turns.py models/tiny-adder runs/agents-tiny/export/step_00000040 --out X.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def per_turn(model_dir: str, rows: list[dict], tok) -> dict:
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def gen(ids: list[int]) -> list[int]:
        out: list[int] = []
        for _ in range(5):
            with torch.no_grad():
                nxt = int(m(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == tok.eos_token_id:
                break
        return out

    t1 = t2 = chain = 0
    for r in rows:
        ctx = tok.encode(r["prompt"][0]["content"], add_special_tokens=False)
        o = gen(ctx)
        s = tok.decode(o).split(tok.eos_token)[0].strip()
        if not s.isdigit():
            continue
        t1 += int(s) == r["extra_info"]["first"]
        c = r["extra_info"]["addends"][0]
        o2 = gen(ctx + o + tok.encode(f"{int(s)}+{c}=", add_special_tokens=False))
        s2 = tok.decode(o2).split(tok.eos_token)[0].strip()
        t2 += s2.isdigit() and int(s2) == int(s) + c
        chain += s2 == r["reward_model"]["ground_truth"]
    n = len(rows)
    return {
        "turn1_acc": t1 / n,
        "turn2_acc_in_context": t2 / n,
        "chain_acc": chain / n,
        "mean_reward": (t1 + t2) / (2 * n),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--test", default="data/chain_addition/test.parquet")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = pq.read_table(a.test).to_pylist()[: a.n]
    tok = AutoTokenizer.from_pretrained(a.models[0])
    res = {m: per_turn(m, rows, tok) for m in a.models}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"test_rows": a.n, "greedy": True, "results": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
