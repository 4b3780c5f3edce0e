"""Process entry points of tests/gpu/test_megatron_gpu.py (spawned: one process per GPU rank, NCCL).

Each rank writes what it measured to ``{out}.rank{r}.pt`` (tensors and numbers); the test compares.
``MEGATRON_TEST_BACKEND=gloo`` runs the same code over gloo/CPU (a development aid: megatron-core
itself assumes CUDA in places, so that only works with its CUDA calls redirected).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(REPO / "tests" / "support")):
    if p not in sys.path:
        sys.path.insert(0, p)


BACKEND = os.environ.get("MEGATRON_TEST_BACKEND", "nccl")


def bf16_model(src: Path, out: Path) -> Path:
    """A copy of an HF folder with bf16 weights: Megatron holds bf16 parameters on GPU, so only a bf16
    source can round-trip bit for bit (and FSDP and Megatron then start from identical values)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    sd = load_file(str(src / "model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def learner_cfg(
    tp: int = 1,
    sp: bool = False,
    dist_opt: bool = True,
    pp: int = 1,
    kl_coef: float = 0.0,
    reference_offload: bool = True,
    attn: str = "auto",
    logprobs: str = "auto",
    temperature: float = 1.0,
    logprob_chunk: int = 4096,
):
    from learner.config import LearnerConfig

    return LearnerConfig.model_validate(
        {
            "loss": {"correction": "decoupled", "kl_coef": kl_coef},
            # eps 1e-5: as in the CPU learner tests, Adam's first step of a near-zero gradient stays smooth.
            "optim": {"lr": 1e-3, "eps": 1e-5, "grad_clip": 1.0},
            "micro_batch_tokens": 64,
            "reference_offload": reference_offload,
            "attn_implementation": attn,
            "logprobs": logprobs,
            "temperature": temperature,
            "logprob_chunk": logprob_chunk,
            "megatron": {
                "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": pp,
                "sequence_parallel": sp,
                "use_distributed_optimizer": dist_opt,
            },
        }
    )


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        NCCL_NVLS_ENABLE="0",
        NCCL_CUMEM_ENABLE="0",
    )
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s %(levelname)s %(message)s")
    from learner.run import init_distributed

    init_distributed(BACKEND, timeout_s=120)


def _plan(engine, seed: int = 0):
    from learner_testkit import make_batches

    from learner.batch import plan_step

    return plan_step(
        make_batches(1, seed=seed)[0],
        rank=engine.data_rank,
        world_size=engine.data_world_size,
        micro_batch_tokens=64,
        advantage="mean_std",
        drop_uniform=True,
        aggregation="token",
    )


def megatron_grads(engine, plan) -> dict:
    """One forward/backward through Megatron's schedule; the reduced fp32 main grads in HF names of this rank's
    pipeline stage (full over TP): with PP > 1 the test merges the stages' dicts."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from learner.losses import policy_loss
    from learner.megatron import convert as cv
    from learner.megatron.weights import global_name

    engine.model.train()
    engine.model.zero_grad_buffer()

    def loss_of(logp, ent, mb):
        return policy_loss(
            logp,
            mb.behaviour_logp,
            mb.advantages,
            mb.weights,
            engine.loss,
            prox_logp=mb.prox_logp,
            ref_logp=mb.ref_logp,
            entropy=ent,
        )

    engine._run(plan.micro_batches, loss_of, forward_only=False)
    params = {global_name(n, engine.layers[0]): p for n, p in engine.gpt.named_parameters()}
    out = {}
    for mname in cv.megatron_names(
        engine.shape, layers=engine.layers, pre_process=engine.pre, post_process=engine.post
    ):
        g = params[mname].main_grad.detach().float()
        shards = [g]
        if engine.tp > 1 and cv.tp_dim(mname) is not None:
            shards = [torch.empty_like(g) for _ in range(engine.tp)]
            dist.all_gather(shards, g.contiguous(), group=ps.get_tensor_model_parallel_group())
        for n, t in cv.to_hf(mname, shards, engine.shape):
            out[n] = t.detach().cpu().clone()  # clone: on CPU .cpu() would alias the grad buffer
    engine.model.zero_grad_buffer()
    return out


def megatron_rank(rank: int, world: int, port: int, kw: dict) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from learner.megatron.engine import MegatronEngine

    t0 = time.time()
    _init(rank, world, port)
    res: dict = {}
    for i, model in enumerate(kw["models"]):
        engine = MegatronEngine(
            learner_cfg(
                kw["tp"],
                kw.get("sp", False),
                kw.get("dist_opt", True),
                kw.get("pp", 1),
                kw.get("kl_coef", 0.0),
                kw.get("reference_offload", True),
                kw.get("attn", "auto"),
                kw.get("logprobs", "auto"),
                kw.get("temperature", 1.0),
                kw.get("logprob_chunk", 4096),
            ),
            model,
            total_steps=3,
            seed=0,
        )
        res[f"build_s_{i}"] = time.time() - t0
        res["chunked"] = engine.chunked
        if engine.post:  # the dtype the output layer's logits come out in (fp32: learner/megatron/engine.py;
            # never called with chunked log-probs, whose head takes the output layer's weight instead)
            engine.gpt.output_layer.register_forward_hook(
                lambda _m, _i, out: res.__setitem__("head_dtype", str(out[0].dtype))
            )
        if kw.get("roundtrip"):
            full = {n: t.detach().cpu().clone() for n, t in engine.full_tensors()}
            engine.export_hf(Path(kw["out"] + f".export{i}"))
            if rank == 0:
                res[f"hf_{i}"] = load_file(str(Path(model) / "model.safetensors"))
                res[f"full_{i}"] = full
                res[f"export_{i}"] = load_file(str(Path(kw["out"] + f".export{i}") / "model.safetensors"))
        if kw.get("grads") or kw.get("step"):
            plan = _plan(engine)
            engine.prepare_logprobs(plan)
            if kw.get("logp") and engine.pp == 1:  # per-token log-probs of the plan, before any step
                with torch.no_grad():
                    res["logp"] = torch.cat([engine.forward_logprobs(mb)[0].float().cpu() for mb in plan.micro_batches])
            if kw.get("grads"):  # needs DP=1 or no distributed optimizer (else main_grad is reduce-scattered)
                res["grads"] = megatron_grads(engine, plan)
            res["metrics"] = engine.train_step(plan)
            res["after"] = {n: t.detach().float().cpu().clone() for n, t in engine.full_tensors()}
        if kw.get("kl"):
            res["kl"] = _kl_steps(engine)
        if kw.get("ckpt"):
            res["ckpt"] = _checkpoint_resume(engine, Path(kw["out"] + ".ckpt"))
        if kw.get("publish"):
            res.update(_publish(engine, kw, rank))
    res["total_s"] = time.time() - t0
    torch.save(res, kw["out"] + f".rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _checkpoint_resume(engine, path: Path) -> dict:
    """Save, take step 2, load, take step 2 again: the resumed step must equal the straight one."""
    engine.save_checkpoint(path, {"version": 1})

    def step2():
        plan = _plan(engine, seed=1)
        engine.prepare_logprobs(plan)
        return engine.train_step(plan)

    straight = step2()
    extra = engine.load_checkpoint(path)
    resumed = step2()
    return {"straight": straight, "resumed": resumed, "extra": extra}


def _kl_steps(engine) -> dict:
    """KL against the frozen reference: step 1 (policy == reference) and step 2 (after an optimizer step).

    Plan B's reference and proximal log-probs are taken before step 1 and again before step 2: the
    reference's must not move (frozen), the policy's must (the step changed the weights). Log-prob
    tensors exist on the last pipeline stage only (elsewhere the lists stay empty)."""
    import torch

    def logps(plan, attr):
        return [
            getattr(mb, attr).detach().float().cpu().clone()
            for mb in plan.micro_batches
            if getattr(mb, attr) is not None
        ]

    plan_a, plan_b = _plan(engine, seed=0), _plan(engine, seed=1)
    engine.prepare_logprobs(plan_b)
    ref_b0, prox_b0 = logps(plan_b, "ref_logp"), logps(plan_b, "prox_logp")
    engine.prepare_logprobs(plan_a)
    ref_a, prox_a = logps(plan_a, "ref_logp"), logps(plan_a, "prox_logp")
    m1 = engine.train_step(plan_a)
    engine.prepare_logprobs(plan_b)
    ref_b1, prox_b1 = logps(plan_b, "ref_logp"), logps(plan_b, "prox_logp")
    m2 = engine.train_step(plan_b)

    def max_diff(xs, ys):
        return max(((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True)), default=None)

    def mean_diff(xs, ys):
        return torch.cat([(x - y).abs() for x, y in zip(xs, ys, strict=True)]).mean().item() if xs else None

    return {
        "m1": m1,
        "m2": m2,
        "last_stage": engine.post,
        "n_logp": sum(x.numel() for x in ref_a),
        "ref_vs_policy_step1": max_diff(ref_a, prox_a),
        "ref_moved": max_diff(ref_b0, ref_b1),
        "policy_moved": max_diff(prox_b0, prox_b1),
        "ref_moved_mean": mean_diff(ref_b0, ref_b1),
        "policy_moved_mean": mean_diff(prox_b0, prox_b1),
        "ref_on": str(next(engine.ref.parameters()).device),
        "gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
    }


def _publish(engine, kw: dict, rank: int) -> dict:
    """Rank 0 publishes the TP-gathered HF state to the pipe-driven receiver; every rank drains in lockstep."""
    import torch

    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    bench = __import__("bench.weight_sync", fromlist=["PipeEngine"])
    out: dict = {}
    pub = None
    if rank == 0:
        rx = bench.PipeEngine("megatron-rx", kw["conn"])
        plan = build_plan(engine.param_plan(torch.bfloat16), 1 << 20)  # small buckets: several per publish
        pub = Publisher(
            WeightSyncConfig(backend=BACKEND, nccl_impl="torch", bucket_mb=1, timeout_s=120),
            plan,
            rank=0,
            engines=[rx],
            device=str(engine.device),
        )
    try:
        for version in (1, 2):
            if version == 2:
                plan_ = _plan(engine, seed=1)
                engine.prepare_logprobs(plan_)
                engine.train_step(plan_)
            t = time.perf_counter()
            if rank == 0:
                report = pub.publish(version, engine.full_tensors(torch.bfloat16))
                out[f"publish_s_{version}"] = time.perf_counter() - t
                out[f"report_{version}"] = (report.bytes, report.checksum, report.per_engine_checksums)
                path = kw["out"] + f".rx_v{version}.safetensors"
                rx.call("dump", path)
                out[f"dump_{version}"] = path
                out[f"want_{version}"] = {n: x.detach().cpu().clone() for n, x in engine.full_tensors(torch.bfloat16)}
            else:
                for _ in engine.full_tensors(torch.bfloat16):  # the TP all-gathers are collectives
                    pass
                for _ in engine.full_tensors(torch.bfloat16):
                    pass
    finally:
        if pub is not None:
            pub.close()
    return out


def one_sequence(prompt: list[int], response: list[int]):
    """A micro-batch of one prompt + response (the learner's packed layout with a single sequence)."""
    import torch

    from learner.batch import MicroBatch

    n = len(response)
    z = torch.zeros(n)
    return MicroBatch(
        input_ids=torch.tensor([prompt + response]),
        position_ids=torch.arange(len(prompt) + n).view(1, -1),
        target_index=torch.arange(len(prompt) - 1, len(prompt) + n - 1),
        targets=torch.tensor(response),
        behaviour_logp=z,
        advantages=z,
        weights=z,
        seq_lens=torch.tensor([n]),
    )


def megatron_vllm_rank(rank: int, world: int, port: int, kw: dict) -> None:
    """Megatron TP=2 takes one optimizer step, publishes (version 1) into the vLLM server at ``kw["url"]`` over
    NCCL (fleetrl's backend), rank 0 samples from the server, and both ranks compute the learner's forward
    log-probs of the sampled tokens. Rank 0 writes the engine's and the learner's log-probs."""
    import asyncio
    import random

    import torch
    import torch.distributed as dist

    from engines.base import SamplingParams
    from learner.megatron.engine import MegatronEngine

    _init(rank, world, port)
    engine = MegatronEngine(learner_cfg(tp=world), kw["model"], total_steps=3, seed=0)
    wire = getattr(torch, kw.get("dtype", "bfloat16"))  # the server's dtype
    out: dict = {}
    pub = sampler = loop = None
    if rank == 0:
        from engines.vllm.generation import VLLMGenerationClient
        from engines.vllm.weights import VLLMWeightClient
        from weight_sync.config import WeightSyncConfig
        from weight_sync.plan import build_plan
        from weight_sync.publisher import Publisher

        plan = build_plan(engine.param_plan(wire), 256 << 20)
        target = VLLMWeightClient("vllm-megatron", kw["url"], model=kw["model_name"], weight_backend="fleetrl")
        # staged publishes: the first (the server's own v0 weights again) records the engine's copy plan,
        # the second (Megatron's) is replayed from it (weight_sync/copy_plan.py), so the comparison below
        # also checks that a replayed commit loads every weight
        pub = Publisher(
            WeightSyncConfig(backend=BACKEND, nccl_impl="torch", bucket_mb=256, timeout_s=120, staging=True),
            plan,
            rank=0,
            engines=[target],
            device=str(engine.device),
        )
        if kw.get("v0"):
            from safetensors.torch import load_file

            v0 = load_file(str(Path(kw["v0"]) / "model.safetensors"))
            missing = [n for n in plan.names if n not in v0]
            if missing:
                raise KeyError(f"the v0 checkpoint lacks {missing[:3]} of Megatron's plan")
            pub.publish(1, ((n, v0[n].to(engine.device, wire)) for n in plan.names))
            out["replayed_after_v0"] = target.last_update_steps.get("commit_replayed", -1.0)
            del v0
        sampler = VLLMGenerationClient("vllm-megatron-gen", kw["url"], model=kw["model_name"])
        loop = asyncio.new_event_loop()
    try:
        # the learner's own weights, not the checkpoint's: one optimizer step before the publish
        step_plan = _plan(engine)
        engine.prepare_logprobs(step_plan)
        out["metrics"] = engine.train_step(step_plan)
        tensors = engine.full_tensors(wire)
        if rank == 0:
            t = time.perf_counter()
            rep = pub.publish(2, tensors)
            out["publish_s"] = time.perf_counter() - t
            out["replayed"] = target.last_update_steps.get("commit_replayed", -1.0)
            out["update_steps"] = dict(target.last_update_steps)
            out["checksums"] = (rep.checksum, dict(rep.per_engine_checksums))
            hi = min(100000, engine.shape.vocab)
            prompt = random.Random(1).sample(range(min(1000, hi // 4), hi), 16)
            samples = loop.run_until_complete(
                sampler.generate(prompt, SamplingParams(n=4, max_tokens=32, temperature=1.0))
            )
            box = [(prompt, [(s.token_ids.tolist(), s.logprobs.tolist()) for s in samples])]
        else:
            for _ in tensors:  # the TP all-gathers are collectives
                pass
            box = [None]
        dist.broadcast_object_list(box, src=0)
        prompt, gen = box[0]
        learner_logp = []
        for tokens, _ in gen:  # TP collectives: every rank runs the same forwards
            logp, _ = engine.forward_logprobs(one_sequence(prompt, tokens))
            learner_logp.append(logp.float().cpu().numpy())
        out.update(prompt=prompt, samples=gen, learner_logp=learner_logp)
    finally:
        if pub is not None:
            pub.close()
        if sampler is not None:
            loop.run_until_complete(sampler.close())
            loop.close()
    torch.save(out, kw["out"] + f".rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def fsdp_rank(rank: int, world: int, port: int, kw: dict) -> None:
    """The FSDP2 reference on one GPU: the same plan, its gradients (before the step), metrics, weights after."""
    import torch

    from learner.fsdp import FSDPEngine
    from learner.losses import policy_loss

    _init(rank, world, port)
    engine = FSDPEngine(learner_cfg(), kw["models"][0], total_steps=3, seed=0)
    plan = _plan(engine)
    engine.prepare_logprobs(plan)
    with torch.no_grad():
        logp = torch.cat([engine.forward_logprobs(mb)[0].float().cpu() for mb in plan.micro_batches])
    engine.model.train()
    for mb in plan.micro_batches:
        logp, ent = engine.forward_logprobs(mb, grad=True)
        loss, _ = policy_loss(
            logp,
            mb.behaviour_logp,
            mb.advantages,
            mb.weights,
            engine.loss,
            prox_logp=mb.prox_logp,
            ref_logp=mb.ref_logp,
            entropy=ent,
        )
        (loss * engine.world_size).backward()
    grads = {n: p.grad.full_tensor().float().cpu() for n, p in engine.model.named_parameters()}
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.train_step(plan)
    after = {n: t.detach().float().cpu().clone() for n, t in engine.full_tensors()}
    torch.save({"grads": grads, "metrics": metrics, "after": after, "logp": logp}, kw["out"] + f".rank{rank}.pt")
    torch.distributed.destroy_process_group()
