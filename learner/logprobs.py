"""Log-probs and entropies of response tokens straight from the last hidden state, in vocabulary chunks.

The plain path (``learner.engine.logprobs_from_logits``) has the LM head produce [T, V] logits, selects
the response rows and upcasts them to fp32 for the log-softmax: with a 152k vocabulary that is three
[n, V] fp32 tensors per micro-batch (logits, log-softmax, the softmax for the entropy), and autograd keeps
the log-softmax for the backward. Here the head is applied to ``chunk`` response rows at a time; each
chunk's logits are upcast to fp32, reduced to (log-prob of the target, logsumexp, entropy) and freed. The
backward recomputes a chunk's logits and turns them into the gradient of hidden rows and head weight
(d logp / d logits = onehot(target) - softmax), so peak memory is one chunk's logits, not n rows.

Precision: the head's operands are taken in ``compute_dtype`` (default: their own dtype) and the logits
are fp32. bf16/fp16 operands on CUDA run on tensor cores with fp32 accumulation and an fp32 result
(``torch.mm(..., out_dtype=float32)``, or TF32 on the upcast operands where that is missing, which is exact
for them: TF32 keeps 10 mantissa bits, bf16 7, fp16 10), so no logit is rounded to the operands' dtype.
That is the same function as an fp32 head on the same (bf16) weights and hidden state, at tensor-core speed,
where an fp32 matmul would run on the GPU's much slower fp32 units. On fp32 operands (CPU) it is the plain
path's fp32 matmul; the two differ only by the order of fp32 sums. Entropies carry a gradient only when asked
(``entropy_grad``: the loss has an entropy bonus, learner.loss.entropy_coeff); the backward then adds
d H / d logits = -p * (log p + H) per chunk, still without keeping a chunk's logits.

Fused chunk arithmetic (``fused=True``; the FSDP engine sets it with ``learner.compile_blocks``): what
happens to a chunk's fp32 logits after the matmul (temperature, logsumexp, target gather, entropy; in the
backward softmax, one-hot and scaling into the operand dtype) is a few reading and writing passes over
[chunk, vocab] fp32 each, memory-bound and, at a 150k vocabulary, a large share of a step. ``torch.compile``
of :func:`_chunk_stats` and :func:`_chunk_grad` turns them into one or two passes (the softmax is never
stored; the gradient is written straight in the operand dtype). Same formulas, fp32 throughout; the eager
path below stays the reference (and the CPU path).

Hooked into a transformers causal LM by :func:`head_logprobs`: the model is called as usual (so FSDP's
hooks unshard and reshard the head exactly as in a normal forward), with ``logits_to_keep`` set to the
response positions and the output embedding's forward swapped, for that one call, for the chunked one.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

# 4096 rows x 151,936 vocabulary x 4 bytes = 2.5 GB of fp32 logits at a time: small against an H200's
# activations, large enough that each chunk's matmul fills the GPU.
DEFAULT_CHUNK = 4096


_HALF = (torch.bfloat16, torch.float16)
_out_dtype_mm: bool | None = None  # torch.mm(..., out_dtype=) runs here (probed at the first call)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as fp32. Half-precision CUDA operands: tensor cores, fp32 accumulation, fp32 result; on the
    CPU the same function from the upcast operands (a CPU half matmul would round its result to half)."""
    global _out_dtype_mm
    if a.dtype in _HALF and not a.is_cuda:
        return a.float() @ b.float()
    if not (a.is_cuda and a.dtype in _HALF):
        return (a @ b).float()
    if _out_dtype_mm is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _out_dtype_mm = True
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _out_dtype_mm = False
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # exact for upcast half operands (see the module docstring)
    try:
        return a.float() @ b.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, inv_t: float) -> torch.Tensor:
    logits = mm_fp32(h, weight.t())
    return logits * inv_t if inv_t != 1.0 else logits


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, inv_t: float):
    """(log-prob of the target, logsumexp, entropy) of raw fp32 logits at temperature 1/inv_t."""
    z = logits * inv_t
    lse = torch.logsumexp(z, dim=-1)
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)
    return z.gather(-1, targets.view(-1, 1)).squeeze(-1) - lse, lse, entropy


def _chunk_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    g: torch.Tensor,
    inv_t: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """d(sum g * logp) / d(raw logits) = g * inv_t * (onehot(target) - softmax), written in ``out_dtype``."""
    p = torch.exp(logits * inv_t - lse[:, None])
    hit = torch.arange(logits.shape[-1], device=logits.device)[None, :] == targets[:, None]
    return ((hit.to(p.dtype) - p) * (g * inv_t)[:, None]).to(out_dtype)


_compiled: dict[str, object] = {}


def _fused(name: str):
    """The compiled chunk function (compiled once per process, on first use). Every tensor's first dimension (a
    chunk's rows: the full chunk, or a micro-batch's remainder) is dynamic from the first call, so a remainder of
    a new size in a later step does not recompile; the vocabulary stays static."""
    fn = _compiled.get(name)
    if fn is None:
        compiled = torch.compile({"stats": _chunk_stats, "grad": _chunk_grad}[name])

        def fn(*args):
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() > 0:
                    torch._dynamo.maybe_mark_dynamic(a, 0)
            return compiled(*args)

        _compiled[name] = fn
    return fn


class _ChunkedHeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        inv_t: float,
        chunk: int,
        compute_dtype,
        fused: bool = False,
        entropy_grad: bool = False,
    ):
        n = hidden.shape[0]
        cd = compute_dtype or hidden.dtype
        h_c, w_c = hidden.to(cd), weight.to(cd)  # no copy when they are in it already
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp)
        stats = _fused("stats") if fused else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if stats is not None:
                logp[s:e], lse[s:e], ent[s:e] = stats(mm_fp32(h_c[s:e], w_c.t()), targets[s:e], inv_t)
                continue
            logits = _chunk_logits(h_c[s:e], w_c, inv_t)
            z = torch.logsumexp(logits, dim=-1)
            lse[s:e] = z
            logp[s:e] = logits.gather(-1, targets[s:e].view(-1, 1)).squeeze(-1) - z
            # entropy = logsumexp - E_p[logits]; p computed in place over the chunk's logits buffer
            expected = (torch.softmax(logits, dim=-1) * logits).sum(-1)
            ent[s:e] = z - expected
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_t, ctx.chunk, ctx.cd, ctx.fused = inv_t, chunk, cd, fused
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not a zero tensor
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        inv_t, chunk, cd = ctx.inv_t, ctx.chunk, ctx.cd
        h_c, w_c = hidden.to(cd), weight.to(cd)
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        if g_logp is None:
            g_logp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        rows = torch.arange(chunk, device=hidden.device)
        fused_grad = _fused("grad") if ctx.fused else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if fused_grad is not None and g_ent is None:
                logits = mm_fp32(h_c[s:e], w_c.t())
                grad = fused_grad(logits, lse[s:e], targets[s:e], g_logp[s:e].float(), inv_t, cd)
            else:
                logits = _chunk_logits(h_c[s:e], w_c, inv_t)
                # d logp / d logits = onehot(target) - softmax; times the incoming gradient and 1/T
                logits.sub_(lse[s:e, None])  # log-softmax, in place
                if g_ent is not None:
                    # d H / d logits = -p * (log p + H): the softmax-weighted coefficient folds into one buffer
                    coef = logits.add(ent[s:e, None]).mul_(-g_ent[s:e, None].float()).sub_(g_logp[s:e, None].float())
                    grad = torch.exp_(logits).mul_(coef)
                    del coef
                else:
                    grad = torch.exp_(logits).mul_(-g_logp[s:e, None].float())
                grad[rows[: e - s], targets[s:e]] += g_logp[s:e].float()
                if inv_t != 1.0:
                    grad.mul_(inv_t)
                grad = grad.to(cd)
            if need_h:
                g_h[s:e] = mm_fp32(grad, w_c)
            if need_w:
                g_w += mm_fp32(grad.t(), h_c[s:e])  # accumulated over chunks in fp32
            del logits, grad
        return g_h, (g_w.to(weight.dtype) if need_w else None), None, None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    compute_dtype: torch.dtype | None = None,
    fused: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] fp32 log-probs of ``targets`` and [n] fp32 entropies under softmax(hidden @ weight.T / temperature).

    ``hidden`` [n, h] and ``weight`` [V, h]; the head's operands are cast to ``compute_dtype`` (default:
    ``hidden``'s dtype), the logits are fp32 (module docstring). Gradients flow to both in their own dtypes,
    from the entropy too when ``entropy_grad``. ``fused``: the per-chunk arithmetic compiled (module docstring;
    the entropy's backward runs the eager path).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [n, h] and weight [V, h] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [n={hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if hidden.shape[0] == 0:
        z = hidden.new_zeros(0, dtype=torch.float32)
        tie = (hidden.sum() + weight.sum()) * 0  # keeps both in the graph (empty gradients, no special case)
        return z + tie, (z + tie if entropy_grad else z.clone())
    return _ChunkedHeadLogProbs.apply(
        hidden, weight, targets, 1.0 / temperature, chunk, compute_dtype, fused, entropy_grad
    )


@contextmanager
def _swapped_head(head: torch.nn.Module, fn):
    head.forward = fn  # instance attribute: shadows the class's forward for this call only
    try:
        yield
    finally:
        del head.forward


def head_logprobs(
    model: torch.nn.Module,
    mb,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    compute_dtype: torch.dtype | None = None,
    fused: bool = False,
    entropy_grad: bool = False,
    **forward_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of one packed micro-batch through a transformers causal LM, chunked.

    The LM head must be a bias-free linear layer (``get_output_embeddings()``: every Llama/Qwen2-family
    model); ``forward_kwargs`` go to the model (e.g. varlen attention metadata). ``compute_dtype``: the head's
    operand dtype (FSDP on GPU passes bf16: with an fp32 root the head would otherwise run on fp32 units);
    ``fused``: compiled per-chunk arithmetic.
    """
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__}: chunked log-probs need a bias-free linear output layer")

    def forward(h: torch.Tensor) -> torch.Tensor:
        # h: [1, n, hidden] (logits_to_keep selected the response positions); the head's weight here is
        # the unsharded one FSDP gathered for this forward.
        logp, ent = chunked_logprobs(
            h[0], head.weight, mb.targets, temperature, chunk, compute_dtype, fused, entropy_grad
        )
        # Returned as the model's "logits" [1, n, 2], so the result leaves through the model's output (FSDP
        # hooks its backward on the outputs).
        return torch.stack([logp, ent], dim=-1).unsqueeze(0)

    with _swapped_head(head, forward):
        out = model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            use_cache=False,
            logits_to_keep=mb.target_index,
            **forward_kwargs,
        )
    ent = out.logits[0, :, 1]
    return out.logits[0, :, 0], (ent if entropy_grad else ent.detach())
