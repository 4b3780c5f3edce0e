"""Helpers of the GPU tests and GPU benches: a random Qwen2-0.5B-shaped checkpoint and the reference forward.

The model is random (no download) but not flat: embeddings (tied with the LM head)
are scaled so the next-token distribution is peaked, which makes log-prob
comparisons discriminating (old vs new weights differ by nats, bf16 noise by
hundredths). The tokenizer is a word-level one covering all 151,936 ids, so every
id the engines sample can be detokenized.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VOCAB = 151936
EOS = 151643


SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
)  # Qwen2-0.5B


def qwen2_05b_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        **SHAPE,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        dtype="bfloat16",
        bos_token_id=EOS,
        eos_token_id=EOS,
        use_sliding_window=False,
    )


def random_qwen2_state(seed: int, embed_scale: float = 5.0) -> dict:
    """Full bf16 state dict of a random Qwen2-0.5B-shaped model (CPU), deterministic in ``seed``."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda:0" if torch.cuda.is_available() else "cpu"):  # random init on the GPU: seconds
        model = Qwen2ForCausalLM(qwen2_05b_config()).to(torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embed_scale)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # engines started next check free memory
    return state


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins with spaces; any decoder that never fails will do
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=f"<t{EOS}>", unk_token="<t0>", pad_token=f"<t{EOS}>")
    tok.save_pretrained(str(out))


def save_checkpoint(state: dict, out: Path) -> Path:
    """An HF folder (config, safetensors, tokenizer) both engines load."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = qwen2_05b_config()
    cfg.architectures = ["Qwen2ForCausalLM"]  # SGLang picks the model class from this (vLLM infers it)
    cfg.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    if not (out / "tokenizer.json").exists():
        write_tokenizer(out)
    return out


class Reference:
    """The learner's forward (transformers, bf16, on ``device``) for sampled tokens' log-probs."""

    def __init__(self, state: dict, device: str = "cuda:0") -> None:
        import torch
        from transformers import Qwen2ForCausalLM

        with torch.device(device):
            model = Qwen2ForCausalLM(qwen2_05b_config()).to(torch.bfloat16)
        self.model, self.device = model.eval(), device
        self.load(state)

    def load(self, state: dict) -> None:
        missing, unexpected = self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        self.model.tie_weights()

    def logprobs(self, prompt: list[int], response: list[int], temperature: float = 1.0) -> "np.ndarray":  # noqa: F821
        import torch

        ids = torch.tensor([prompt + response], device=self.device)
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(1, torch.tensor(response, device=self.device)[:, None])[:, 0].cpu().numpy()


def compare(samples, prompt: list[int], ref: Reference, temperature: float = 1.0):
    """Per-token |engine - reference| over every sample of a group, concatenated (the reference scores at
    ``temperature``)."""
    import numpy as np

    diffs = []
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) > 0
        want = ref.logprobs(prompt, [int(t) for t in s.token_ids], temperature)
        diffs.append(np.abs(np.asarray(s.logprobs, dtype=np.float64) - want))
    return np.concatenate(diffs)


# bf16 tolerance, justified: bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%). The
# engines and transformers run different kernels (FA3 / triton vs SDPA, fused vs unfused RMSNorm
# and rotary, different reduction orders over 24 layers), and with the embeddings scaled x5 the
# logits are ~10-20 in magnitude, so each is rounded by ~0.04-0.08 and a log-prob (a difference
# of such logits) disagrees by a few hundredths. Measured on H200 with vLLM 0.26 (2026-11-30,
# bench/results/engines_gpu.md): mean 0.049-0.061, max 0.17-0.25 nats over 128 tokens. We require
# mean < 0.1 and every token < 0.35, and check that the same comparison against the OTHER version's
# weights is far outside (measured 8.4-9.1 nats; required > 1), so the test can fail.
MEAN_TOL, MAX_TOL, OTHER_MIN = 0.1, 0.35, 1.0


def record(test: str, what: str, **kw) -> None:
    """Append one result line to $FLEETRL_GPU_RESULTS (jsonl), when set: what bench/results/ is written from."""
    path = os.environ.get("FLEETRL_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "what": what, **kw}) + "\n")


def check_logprobs(
    test: str, samples, prompt: list[int], ref_same: "Reference", ref_other: "Reference", label: str
) -> None:
    """Engine log-probs must fit the weights they were sampled with, and must not fit the other version's
    (otherwise the check could not fail)."""
    d_same = compare(samples, prompt, ref_same)
    d_other = compare(samples, prompt, ref_other)
    record(
        test,
        label,
        tokens=int(d_same.size),
        mean_abs=float(d_same.mean()),
        max_abs=float(d_same.max()),
        other_mean_abs=float(d_other.mean()),
    )
    print(
        f"{label}: log-prob |diff| mean {d_same.mean():.4f} max {d_same.max():.4f}; "
        f"other weights mean {d_other.mean():.3f}"
    )
    assert d_same.mean() < MEAN_TOL and d_same.max() < MAX_TOL, (label, d_same.mean(), d_same.max())
    assert d_other.mean() > OTHER_MIN, f"{label}: the other version's weights fit as well: the check is blind"


def vllm_server_on_gpu1(test: str, model: str, run_dir: str, weight_backend: str, **overrides):
    """Start a TP=1 vLLM server on GPU 1 (the learner side of a test keeps GPU 0); records its start-up time.

    ``overrides``: other VLLMServerArgs fields (e.g. a smaller gpu_memory_utilization when a learner rank
    shares GPU 1, enforce_eager for a faster start)."""
    import time

    import torch

    from engines.vllm.server import VLLMServer, VLLMServerArgs

    if torch.cuda.device_count() < 2:
        raise RuntimeError("the vLLM GPU tests need 2 GPUs (engine on GPU 1, learner on GPU 0)")
    srv = VLLMServer(
        VLLMServerArgs(
            model=model,
            dtype="bfloat16",
            max_model_len=2048,
            tensor_parallel_size=1,
            **{"gpu_memory_utilization": 0.5, "max_num_seqs": 256, **overrides},
            weight_backend=weight_backend,
            env={"CUDA_VISIBLE_DEVICES": "1"},
        ),
        run_dir,
    )
    t0 = time.monotonic()
    srv.start()
    record(test, "startup", seconds=time.monotonic() - t0, command=srv.command())
    return srv
