"""A random-weight Qwen2 model folder of a named shape with another model's tokenizer (bench/peers/verl.sh).

Both systems load it as a Hugging Face folder; the vocabulary is the tokenizer's, so prompts of the word
problems tokenize as for the real model. Random weights generate until the token limit: every response has
the full length, which makes the step's work the same for both systems.

    python bench/peers/random_model.py --like /tmp/models/smollm2-135m-instruct --shape 1.5b --out DIR
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

SHAPES = {  # Qwen2 / Qwen2.5 sizes (hidden, intermediate, layers, heads, kv heads)
    "0.5b": (896, 4864, 24, 14, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "3b": (2048, 11008, 36, 16, 2),
    "7b": (3584, 18944, 28, 28, 4),
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)  # not generation_config.json: sampling defaults would ride along


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--like", required=True, help="model folder whose tokenizer (and special tokens) to use")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-positions", type=int, default=8192)
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = Path(a.out)
    if (out / "config.json").exists():
        print(f"{out} exists")
        return 0
    tok = AutoTokenizer.from_pretrained(a.like)
    h, f, layers, heads, kv = SHAPES[a.shape]
    vocab = -(-len(tok) // 64) * 64  # room for every token id, padded as the engines like
    conf = Qwen2Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=a.max_positions,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=a.shape in ("0.5b", "1.5b", "3b"),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(conf).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(a.like) / name).exists():
            shutil.copy(Path(a.like) / name, out / name)
    print(f"{out}: Qwen2 {a.shape} shape, vocab {vocab}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
