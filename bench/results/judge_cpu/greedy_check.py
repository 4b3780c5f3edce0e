"""Greedy answers (24 tokens) to the first 8 test prompts from each checkpoint given:
python greedy_check.py .cache/models/smollm2-135m-instruct RUN/export/step_00000002
"""

import sys

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1])  # the tokenizer: the first checkpoint's
tok.padding_side = "left"
rows = pq.read_table("data/word_problems/test.parquet").to_pylist()[:8]
texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
for path in sys.argv[1:]:
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = m.generate(**enc, do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id)
    print("==", path)
    for r, o in zip(rows, out, strict=True):
        print(
            r["reward_model"]["ground_truth"],
            "|",
            repr(tok.decode(o[enc["input_ids"].shape[1] :], skip_special_tokens=True)),
        )
